# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# phase0: the source drafter as fetched, against the new target


# compare: the source drafter against the layout the new target needs: config, weights, vocab, verdict
rule compare:
    input:
        fetch="artifacts/fetch/metrics.json",
        vocab_new="artifacts/vocab_new/metrics.json",
        targets=target_steps(new=True, besides=["fetch", "vocab_new"]),
        code=code("compare"),
    output:
        "artifacts/compare/metrics.json",
    params:
        values=values("targets.new"),
        cmd=command("compare"),
    conda:
        ENV
    log:
        "logs/compare.log",
    threads: RES["compare"]["threads"]
    resources:
        gpu=RES["compare"]["gpu"],
        mem_mb=RES["compare"]["mem_mb"],
        runtime=RES["compare"]["runtime"],
    shell:
        "{params.cmd}"


# eval_phase0: phase0: the source drafter as fetched on the new target (and on the old one; the reference)
rule eval_phase0:
    input:
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(
            new=True, old=CFG["targets"]["old"] and CFG["targets"]["prompts_eval_old"],
            besides=["fetch", "features_eval"],
        ),
        features_eval="artifacts/features_eval/metrics.json",
        code=code("eval_phase0"),
    output:
        "artifacts/eval_phase0/metrics.json",
    params:
        values=values(
            "profile", "targets.new", "targets.old", "targets.prompts_eval_old", "reference",
            "eval", "costmodel", "serving.ms_per_draft_token",
        ),
        cmd=command("eval_phase0"),
    conda:
        ENV
    log:
        "logs/eval_phase0.log",
    threads: RES["eval_phase0"]["threads"]
    resources:
        gpu=RES["eval_phase0"]["gpu"],
        mem_mb=RES["eval_phase0"]["mem_mb"],
        runtime=RES["eval_phase0"]["runtime"],
    shell:
        "{params.cmd}"


# drift: beside Phase 0: the old and the new target on the same tokens, how far the states moved
# only when drift.enabled
if CFG["drift"]["enabled"]:

    rule drift:
        input:
            fetch="artifacts/fetch/metrics.json",
            targets=target_steps(
                new=True, old=True, besides=["fetch", "features_eval", "eval_phase0"],
            ),
            features_eval="artifacts/features_eval/metrics.json",
            eval_phase0="artifacts/eval_phase0/metrics.json",
            code=code("drift"),
        output:
            "artifacts/drift/metrics.json",
        params:
            values=values(
                "targets.new", "targets.old", "targets.trust_remote_code", "eval.k",
                "eval.batch_size", "eval.max_samples", "eval.device", "features.batch_size",
                "features.dtype", "features.device", "features.engine",
                "features.tensor_parallel_size", "drift",
            ),
            cmd=command("drift"),
        conda:
            ENV
        log:
            "logs/drift.log",
        threads: RES["drift"]["threads"]
        resources:
            gpu=RES["drift"]["gpu"],
            mem_mb=RES["drift"]["mem_mb"],
            runtime=RES["drift"]["runtime"],
        shell:
            "{params.cmd}"
