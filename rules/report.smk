# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# report: plots and tables


# report: plots and tables: tau per phase vs projected tok/s, per-position acceptance, loss, comparison
rule report:
    input:
        compare="artifacts/compare/metrics.json",
        world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
        decision="artifacts/decision/metrics.json",
        eval_curves=branch(CFG["curves"]["enabled"], then="artifacts/eval_curves/metrics.json"),
        eval_phase0="artifacts/eval_phase0/metrics.json",
        eval_phase1_scratch="artifacts/eval_phase1_scratch/metrics.json",
        eval_phase1="artifacts/eval_phase1/metrics.json",
        eval_phase2="artifacts/eval_phase2/metrics.json",
        drift=branch(CFG["drift"]["enabled"], then="artifacts/drift/metrics.json"),
        train_phase1_scratch="artifacts/train_phase1_scratch/metrics.json",
        train_phase1="artifacts/train_phase1/metrics.json",
        train_phase2="artifacts/train_phase2/metrics.json",
        online_phase0=branch(CFG["online"]["enabled"], then="artifacts/online_phase0/metrics.json"),
        online_phase1=branch(CFG["online"]["enabled"], then="artifacts/online_phase1/metrics.json"),
        code=code("report"),
    output:
        "artifacts/report/metrics.json",
        report("artifacts/report/summary.html", caption="../report/summary.rst", category="1. Summary"),
        report("artifacts/report/tau.png", caption="../report/tau.rst", category="2. Phases"),
        report("artifacts/report/positions.png", caption="../report/positions.rst", category="2. Phases"),
        report("artifacts/report/loss.png", caption="../report/loss.rst", category="2. Phases"),
        report("artifacts/report/phases.csv", caption="../report/phases.rst", category="2. Phases"),
        report("artifacts/report/compare.html", caption="../report/compare.rst", category="3. Compare"),
    params:
        values=values("profile", "costmodel", "eval.k", "online.enabled"),
        cmd=command("report"),
    conda:
        ENV
    log:
        "logs/report.log",
    threads: RES["report"]["threads"]
    resources:
        gpu=RES["report"]["gpu"],
        mem_mb=RES["report"]["mem_mb"],
        runtime=RES["report"]["runtime"],
    shell:
        "{params.cmd}"
