# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# curves: learning curves: fine-tune and scratch by sample count and seed


# train_curves: learning curves: fine-tune and scratch at each curves.n_samples x seed, one budget rule
# only when curves.enabled
if CFG["curves"]["enabled"]:

    rule train_curves:
        input:
            features_new="artifacts/features_new/metrics.json",
            budget=branch(
                CFG["data"]["budget"] == "adaptive", then="artifacts/budget/metrics.json",
            ),
            features_phase2=branch(
                CFG["data"]["budget"] == "fixed", then="artifacts/features_phase2/metrics.json",
            ),
            features_dataset=branch(
                CFG["curves"]["answers"] and CFG["curves"]["arms_n_samples"],
                then="artifacts/features_dataset/metrics.json",
            ),
            vocab_new="artifacts/vocab_new/metrics.json",
            fetch="artifacts/fetch/metrics.json",
            targets=target_steps(
                new=True,
                besides=["features_new", "budget", "features_phase2", "features_dataset", "vocab_new", "fetch"],
            ),
            features_monitor=branch(
                CFG["curves"]["train"]["eval_every"],
                then="artifacts/features_monitor/metrics.json",
            ),
            code=code("train_curves"),
        output:
            "artifacts/train_curves/metrics.json",
        params:
            values=values(
                "profile", "targets.new", "curves.n_samples", "curves.seeds", "curves.inits",
                "curves.arms_n_samples", "curves.answers", "curves.recipes", "curves.epochs",
                "curves.min_steps", "curves.train", "monitor.k", "monitor.batch_size",
                "targets.trust_remote_code", "features.spool_gb", "features.spool_dir",
            ),
            cmd=command("train_curves"),
        conda:
            ENV
        log:
            "logs/train_curves.log",
        threads: RES["train_curves"]["threads"]
        resources:
            gpu=RES["train_curves"]["gpu"],
            mem_mb=RES["train_curves"]["mem_mb"],
            runtime=RES["train_curves"]["runtime"],
        shell:
            "{params.cmd}"


# eval_curves: every learning-curve point's drafter on the new target's held-out set (per-prompt counts)
# only when curves.enabled
if CFG["curves"]["enabled"]:

    rule eval_curves:
        input:
            train_curves="artifacts/train_curves/metrics.json",
            targets=target_steps(new=True, besides=["train_curves", "features_eval"]),
            features_eval="artifacts/features_eval/metrics.json",
            code=code("eval_curves"),
        output:
            "artifacts/eval_curves/metrics.json",
        params:
            values=values(
                "targets.new", "eval.k", "eval.batch_size", "eval.max_samples", "eval.device",
                "eval.context_buckets", "eval.k_max", "curves.n_samples", "curves.seeds",
                "curves.inits", "curves.arms_n_samples", "curves.answers", "curves.recipes",
            ),
            cmd=command("eval_curves"),
        conda:
            ENV
        log:
            "logs/eval_curves.log",
        threads: RES["eval_curves"]["threads"]
        resources:
            gpu=RES["eval_curves"]["gpu"],
            mem_mb=RES["eval_curves"]["mem_mb"],
            runtime=RES["eval_curves"]["runtime"],
        shell:
            "{params.cmd}"
