"""draftport's game plan: port an EAGLE-3 drafter to a new version of its target.

    snakemake --cores 8 phase1     world, fetch, compare, Phase 0 probe, data, Phase 1 + control
    snakemake --cores 8 phase2     + scaled data, continued training
    snakemake --cores 8 all        + the report;  snakemake --report report.html
    snakemake --cores 8 online     vLLM serves the Phase 0 / Phase 1 drafters (make vllm-venv first)
    snakemake --configfile=configs/micro.yaml ...   another profile layered on params.yaml

params.yaml is the only parameter file; it is validated before any job. dvc.yaml is generated
from this file (python -m draftport.pipeline dvc-yaml): stage = rule, same command.
"""

import os

from draftport import pipeline as pl

# Jobs inherit this: OpenMP threads that wait sleep instead of spinning. On shared cores the
# spinning made a 2-thread step 8x slower than 1 thread; sleeping, 2 threads beat 1 (measured).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


configfile: "params.yaml"


CFG, BASE = pl.configure(config)
pl.clear_stale_locks()  # left by a killed snakemake: the same command resumes, no --unlock


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/world.smk"
include: "rules/fetch.smk"
include: "rules/data.smk"
include: "rules/compare.smk"
include: "rules/phase0.smk"
include: "rules/phase1.smk"
include: "rules/phase2.smk"
include: "rules/report.smk"
include: "rules/online.smk"


localrules:
    all,
    online,


rule all:
    default_target: True
    input:
        pl.done("report"),
        online_done(),


onstart:
    on_start()


onsuccess:
    on_success()
