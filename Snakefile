"""draftport's game plan: port an EAGLE-3 drafter to a new version of its target.

    snakemake --cores 8 phase1     world, fetch, compare, Phase 0 probe, data, Phase 1 + control
    snakemake --cores 8 phase2     + scaled data, continued training
    snakemake --cores 8 curves     + learning curves: fine-tune and scratch by sample count and seed
    snakemake --cores 8 decision   + the decision (artifacts/decision/decision.json; draftport decide)
    snakemake --cores 8 all        + the report (the decision first);  snakemake --report report.html
    snakemake --cores 8 online     vLLM serves the Phase 0 / Phase 1 drafters (make vllm-venv first)
    snakemake --cores 8 publish    the chosen drafter as a hub-ready folder (publish.enabled: true)
    snakemake --configfile=configs/micro.yaml ...   another profile layered on params.yaml

The steps are the rows of src/draftport/plan/registry.py. rules/<stage>.smk (world, data, phase0,
phase1, phase2, curves, decision, report, online) write each row out as a plain rule: its inputs,
output, params, log, threads, resources and command; rules/common.smk holds their helpers. Both
they and dvc.yaml are generated from the table (python -m draftport.pipeline.bridge smk-rules,
... dvc-yaml; --check fails on drift). params.yaml is the only parameter file; it is validated
before any job.
"""

import os

from draftport.pipeline import bridge
from draftport.plan import registry as R

# Jobs inherit this: waiting OpenMP threads sleep instead of spinning on cores other jobs share.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


configfile: "params.yaml"


CFG, BASE = bridge.configure(config)
bridge.clear_stale_locks()  # left by a killed snakemake: the same command resumes, no --unlock


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/world.smk"
include: "rules/data.smk"
include: "rules/phase0.smk"
include: "rules/phase1.smk"
include: "rules/phase2.smk"
include: "rules/curves.smk"
include: "rules/decision.smk"
include: "rules/report.smk"
include: "rules/online.smk"


localrules:
    all,
    phase0,
    phase1,
    phase2,
    curves,
    online,


rule all:
    default_target: True
    input:
        bridge.done("report"),
        bridge.done("decision"),
        [bridge.done(s) for s in R.target_steps("online", CFG)] if CFG["online"]["enabled"] else [],
        [bridge.done("publish")] if CFG["publish"]["enabled"] else [],


rule phase0:
    input:
        [bridge.done(s) for s in R.target_steps("phase0", CFG)],


rule phase1:
    input:
        [bridge.done(s) for s in R.target_steps("phase1", CFG)],


rule phase2:
    input:
        [bridge.done(s) for s in R.target_steps("phase2", CFG)],


rule curves:
    input:
        [bridge.done(s) for s in R.target_steps("curves", CFG)],


rule online:
    input:
        [bridge.done(s) for s in R.target_steps("online", CFG)],


onstart:
    on_start()


onsuccess:
    on_success()
