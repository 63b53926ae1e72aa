# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# phase1: fine-tune the source on the new target's data, and the control from scratch


# train_phase1_scratch: the control: Phase 1's architecture, data and budget from a random init on the new map
rule train_phase1_scratch:
    input:
        features_new="artifacts/features_new/metrics.json",
        vocab_new="artifacts/vocab_new/metrics.json",
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(new=True, besides=["features_new", "vocab_new", "fetch"]),
        features_monitor=branch(
            CFG["phase1"]["train"]["eval_every"], then="artifacts/features_monitor/metrics.json",
        ),
        code=code("train_phase1_scratch"),
    output:
        "artifacts/train_phase1_scratch/metrics.json",
    params:
        values=values(
            "profile", "targets.new", "phase1.train", "monitor.k", "monitor.batch_size",
            "targets.trust_remote_code", "features.spool_gb", "features.spool_dir",
        ),
        cmd=command("train_phase1_scratch"),
    conda:
        ENV
    log:
        "logs/train_phase1_scratch.log",
    threads: RES["train_phase1_scratch"]["threads"]
    resources:
        gpu=RES["train_phase1_scratch"]["gpu"],
        mem_mb=RES["train_phase1_scratch"]["mem_mb"],
        runtime=RES["train_phase1_scratch"]["runtime"],
    shell:
        "{params.cmd}"


# eval_phase1_scratch: phase1_scratch: its drafter's offline accept length on the new target's held-out set
rule eval_phase1_scratch:
    input:
        train_phase1_scratch="artifacts/train_phase1_scratch/metrics.json",
        targets=target_steps(new=True, besides=["train_phase1_scratch", "features_eval"]),
        features_eval="artifacts/features_eval/metrics.json",
        code=code("eval_phase1_scratch"),
    output:
        "artifacts/eval_phase1_scratch/metrics.json",
    params:
        values=values("targets.new", "eval", "costmodel", "serving.ms_per_draft_token"),
        cmd=command("eval_phase1_scratch"),
    conda:
        ENV
    log:
        "logs/eval_phase1_scratch.log",
    threads: RES["eval_phase1_scratch"]["threads"]
    resources:
        gpu=RES["eval_phase1_scratch"]["gpu"],
        mem_mb=RES["eval_phase1_scratch"]["mem_mb"],
        runtime=RES["eval_phase1_scratch"]["runtime"],
    shell:
        "{params.cmd}"


# train_phase1: fine-tune the source drafter on the new target's data (lm_head moved onto the new map)
rule train_phase1:
    input:
        features_new="artifacts/features_new/metrics.json",
        vocab_new="artifacts/vocab_new/metrics.json",
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(new=True, besides=["features_new", "vocab_new", "fetch", "compare"]),
        compare="artifacts/compare/metrics.json",
        features_monitor=branch(
            CFG["phase1"]["train"]["eval_every"], then="artifacts/features_monitor/metrics.json",
        ),
        code=code("train_phase1"),
    output:
        "artifacts/train_phase1/metrics.json",
    params:
        values=values(
            "profile", "targets.new", "phase1.train", "phase1.vocab_policy", "monitor.k",
            "monitor.batch_size", "targets.trust_remote_code", "features.spool_gb",
            "features.spool_dir",
        ),
        cmd=command("train_phase1"),
    conda:
        ENV
    log:
        "logs/train_phase1.log",
    threads: RES["train_phase1"]["threads"]
    resources:
        gpu=RES["train_phase1"]["gpu"],
        mem_mb=RES["train_phase1"]["mem_mb"],
        runtime=RES["train_phase1"]["runtime"],
    shell:
        "{params.cmd}"


# eval_phase1: phase1: its drafter's offline accept length on the new target's held-out set
rule eval_phase1:
    input:
        train_phase1="artifacts/train_phase1/metrics.json",
        targets=target_steps(
            new=True,
            besides=["train_phase1", "features_eval", "eval_phase0", "eval_phase1_scratch"],
        ),
        features_eval="artifacts/features_eval/metrics.json",
        eval_phase0="artifacts/eval_phase0/metrics.json",
        eval_phase1_scratch="artifacts/eval_phase1_scratch/metrics.json",
        code=code("eval_phase1"),
    output:
        "artifacts/eval_phase1/metrics.json",
    params:
        values=values("targets.new", "eval", "costmodel", "serving.ms_per_draft_token"),
        cmd=command("eval_phase1"),
    conda:
        ENV
    log:
        "logs/eval_phase1.log",
    threads: RES["eval_phase1"]["threads"]
    resources:
        gpu=RES["eval_phase1"]["gpu"],
        mem_mb=RES["eval_phase1"]["mem_mb"],
        runtime=RES["eval_phase1"]["runtime"],
    shell:
        "{params.cmd}"
