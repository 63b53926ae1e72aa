# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# decision: the recommendation, and the chosen drafter as a hub-ready folder


# decision: the recommendation with evidence: init, recipe, answers, data, Phase 2, hours, serving; bootstrap CIs, R1-R11
rule decision:
    input:
        eval_curves=branch(CFG["curves"]["enabled"], then="artifacts/eval_curves/metrics.json"),
        eval_phase0="artifacts/eval_phase0/metrics.json",
        eval_phase1_scratch="artifacts/eval_phase1_scratch/metrics.json",
        eval_phase1="artifacts/eval_phase1/metrics.json",
        eval_phase2="artifacts/eval_phase2/metrics.json",
        features_new="artifacts/features_new/metrics.json",
        budget=branch(CFG["data"]["budget"] == "adaptive", then="artifacts/budget/metrics.json"),
        features_phase2=branch(
            CFG["data"]["budget"] == "fixed", then="artifacts/features_phase2/metrics.json",
        ),
        features_dataset=branch(
            CFG["curves"]["answers"] and CFG["curves"]["arms_n_samples"] and CFG["curves"]["enabled"],
            then="artifacts/features_dataset/metrics.json",
        ),
        train_phase1_scratch="artifacts/train_phase1_scratch/metrics.json",
        train_phase1="artifacts/train_phase1/metrics.json",
        train_phase2="artifacts/train_phase2/metrics.json",
        drift=branch(CFG["drift"]["enabled"], then="artifacts/drift/metrics.json"),
        fetch="artifacts/fetch/metrics.json",
        code=code("decision"),
    output:
        "artifacts/decision/metrics.json",
    params:
        values=values(
            "costmodel", "eval.k", "decision", "serving", "resources", "phase1.n_samples",
            "phase2.n_samples", "phase1.train.ttt_steps", "publish.repo_id", "publish.folder",
            "source.repo_id", "targets.prompts_train", "targets.new", "world.build",
        ),
        cmd=command("decision"),
    conda:
        ENV
    log:
        "logs/decision.log",
    threads: RES["decision"]["threads"]
    resources:
        gpu=RES["decision"]["gpu"],
        mem_mb=RES["decision"]["mem_mb"],
        runtime=RES["decision"]["runtime"],
    shell:
        "{params.cmd}"


# publish: the chosen drafter as a hub-ready folder: flat config, the new target's embed_tokens, a model card; checked
# only when publish.enabled
if CFG["publish"]["enabled"]:

    rule publish:
        input:
            decision="artifacts/decision/metrics.json",
            targets=target_steps(
                new=True,
                besides=["decision", "features_eval", "fetch", "features_new", "budget", "features_phase2", "train_phase1_scratch", "train_phase1", "train_phase2", "eval_phase1_scratch", "eval_phase1", "eval_phase2"],
            ),
            features_eval="artifacts/features_eval/metrics.json",
            fetch="artifacts/fetch/metrics.json",
            features_new="artifacts/features_new/metrics.json",
            budget=branch(
                CFG["data"]["budget"] == "adaptive", then="artifacts/budget/metrics.json",
            ),
            features_phase2=branch(
                CFG["data"]["budget"] == "fixed", then="artifacts/features_phase2/metrics.json",
            ),
            train_phase1_scratch="artifacts/train_phase1_scratch/metrics.json",
            train_phase1="artifacts/train_phase1/metrics.json",
            train_phase2="artifacts/train_phase2/metrics.json",
            eval_phase1_scratch="artifacts/eval_phase1_scratch/metrics.json",
            eval_phase1="artifacts/eval_phase1/metrics.json",
            eval_phase2="artifacts/eval_phase2/metrics.json",
            online_phase1=branch(
                CFG["online"]["enabled"], then="artifacts/online_phase1/metrics.json",
            ),
            code=code("publish"),
        output:
            "artifacts/publish/metrics.json",
        params:
            values=values(
                "targets.new", "eval.k", "eval.batch_size", "eval.max_samples", "eval.device",
                "eval.context_buckets", "costmodel", "decision", "publish",
            ),
            cmd=command("publish"),
        conda:
            ENV
        log:
            "logs/publish.log",
        threads: RES["publish"]["threads"]
        resources:
            gpu=RES["publish"]["gpu"],
            mem_mb=RES["publish"]["mem_mb"],
            runtime=RES["publish"]["runtime"],
        shell:
            "{params.cmd}"
