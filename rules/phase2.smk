# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# phase2: continue Phase 1's drafter on the scaled data


# train_phase2: continue Phase 1's drafter (its map kept) on the scaled data
rule train_phase2:
    input:
        budget=branch(CFG["data"]["budget"] == "adaptive", then="artifacts/budget/metrics.json"),
        features_phase2=branch(
            CFG["data"]["budget"] == "fixed", then="artifacts/features_phase2/metrics.json",
        ),
        vocab_new="artifacts/vocab_new/metrics.json",
        train_phase1="artifacts/train_phase1/metrics.json",
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(
            new=True, besides=["budget", "features_phase2", "vocab_new", "train_phase1", "fetch"],
        ),
        features_monitor=branch(
            CFG["phase2"]["train"]["eval_every"], then="artifacts/features_monitor/metrics.json",
        ),
        code=code("train_phase2"),
    output:
        "artifacts/train_phase2/metrics.json",
    params:
        values=values(
            "profile", "targets.new", "phase2.train", "monitor.k", "monitor.batch_size",
            "targets.trust_remote_code", "features.spool_gb", "features.spool_dir",
        ),
        cmd=command("train_phase2"),
    conda:
        ENV
    log:
        "logs/train_phase2.log",
    threads: RES["train_phase2"]["threads"]
    resources:
        gpu=RES["train_phase2"]["gpu"],
        mem_mb=RES["train_phase2"]["mem_mb"],
        runtime=RES["train_phase2"]["runtime"],
    shell:
        "{params.cmd}"


# eval_phase2: phase2: its drafter's offline accept length on the new target's held-out set
rule eval_phase2:
    input:
        train_phase2="artifacts/train_phase2/metrics.json",
        targets=target_steps(new=True, besides=["train_phase2", "features_eval", "eval_phase1"]),
        features_eval="artifacts/features_eval/metrics.json",
        eval_phase1="artifacts/eval_phase1/metrics.json",
        code=code("eval_phase2"),
    output:
        "artifacts/eval_phase2/metrics.json",
    params:
        values=values("targets.new", "eval", "costmodel", "serving.ms_per_draft_token"),
        cmd=command("eval_phase2"),
    conda:
        ENV
    log:
        "logs/eval_phase2.log",
    threads: RES["eval_phase2"]["threads"]
    resources:
        gpu=RES["eval_phase2"]["gpu"],
        mem_mb=RES["eval_phase2"]["mem_mb"],
        runtime=RES["eval_phase2"]["runtime"],
    shell:
        "{params.cmd}"
