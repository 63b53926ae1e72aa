# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# data: the source drafter, the targets' answers and hidden states, the new draft map


# fetch: the source drafter at its pinned revision (and targets given as hub ids, the reference)
rule fetch:
    input:
        world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
        code=code("fetch"),
    output:
        "artifacts/fetch/metrics.json",
    params:
        values=values(
            "source", "reference", "targets.new", "targets.old", "targets.trust_remote_code",
            "world.build",
        ),
        cmd=command("fetch"),
    conda:
        ENV
    log:
        "logs/fetch.log",
    threads: RES["fetch"]["threads"]
    resources:
        gpu=RES["fetch"]["gpu"],
        mem_mb=RES["fetch"]["mem_mb"],
        runtime=RES["fetch"]["runtime"],
    shell:
        "{params.cmd}"


# features_new: the new target's answers to Phase 1's prompts and its hidden states
rule features_new:
    input:
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(new=True, besides=["fetch", "world"]),
        world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
        code=code("features_new"),
    output:
        "artifacts/features_new/metrics.json",
    params:
        values=values(
            "targets.new", "targets.trust_remote_code", "features.aux_layer_ids",
            "features.aux_convention", "features.max_new_tokens", "features.batch_size",
            "features.dtype", "features.device", "features.engine", "features.tensor_parallel_size",
            "features.regenerate", "features.base_url", "features.served_model", "features.compile",
            "features.storage", "targets.prompts_train", "phase1.n_samples",
        ),
        cmd=command("features_new"),
    conda:
        ENV
    log:
        "logs/features_new.log",
    threads: RES["features_new"]["threads"]
    resources:
        gpu=RES["features_new"]["gpu"],
        mem_mb=RES["features_new"]["mem_mb"],
        runtime=RES["features_new"]["runtime"],
    shell:
        "{params.cmd}"


# features_eval: held-out sets answered by each target (the new one; the old one, the source's home)
rule features_eval:
    input:
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(
            new=True, old=CFG["targets"]["old"] and CFG["targets"]["prompts_eval_old"],
            besides=["fetch", "world"],
        ),
        world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
        code=code("features_eval"),
    output:
        "artifacts/features_eval/metrics.json",
    params:
        values=values(
            "targets.new", "targets.trust_remote_code", "features.aux_layer_ids",
            "features.aux_convention", "features.max_new_tokens", "features.batch_size",
            "features.dtype", "features.device", "features.engine", "features.tensor_parallel_size",
            "features.regenerate", "features.base_url", "features.served_model", "features.compile",
            "targets.old", "targets.prompts_eval_new", "targets.prompts_eval_old",
            "features.eval_samples", "targets.eval_sets", "targets.prompts_train",
        ),
        cmd=command("features_eval"),
    conda:
        ENV
    log:
        "logs/features_eval.log",
    threads: RES["features_eval"]["threads"]
    resources:
        gpu=RES["features_eval"]["gpu"],
        mem_mb=RES["features_eval"]["mem_mb"],
        runtime=RES["features_eval"]["runtime"],
    shell:
        "{params.cmd}"


# features_monitor: the held-out set of tau during training: the last training prompts, answered by the new target
rule features_monitor:
    input:
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(new=True, besides=["fetch", "world"]),
        world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
        code=code("features_monitor"),
    output:
        "artifacts/features_monitor/metrics.json",
    params:
        values=values(
            "targets.new", "targets.trust_remote_code", "features.aux_layer_ids",
            "features.aux_convention", "features.max_new_tokens", "features.batch_size",
            "features.dtype", "features.device", "features.engine", "features.tensor_parallel_size",
            "features.regenerate", "features.base_url", "features.served_model", "features.compile",
            "targets.prompts_train", "monitor.n_samples",
        ),
        cmd=command("features_monitor"),
    conda:
        ENV
    log:
        "logs/features_monitor.log",
    threads: RES["features_monitor"]["threads"]
    resources:
        gpu=RES["features_monitor"]["gpu"],
        mem_mb=RES["features_monitor"]["mem_mb"],
        runtime=RES["features_monitor"]["runtime"],
    shell:
        "{params.cmd}"


# vocab_new: the new target's draft map (top-N ids of its own answers) and its overlap with the source's
rule vocab_new:
    input:
        features_new="artifacts/features_new/metrics.json",
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(new=True, besides=["features_new", "fetch"]),
        code=code("vocab_new"),
    output:
        "artifacts/vocab_new/metrics.json",
    params:
        values=values("targets.new", "vocab_new"),
        cmd=command("vocab_new"),
    conda:
        ENV
    log:
        "logs/vocab_new.log",
    threads: RES["vocab_new"]["threads"]
    resources:
        gpu=RES["vocab_new"]["gpu"],
        mem_mb=RES["vocab_new"]["mem_mb"],
        runtime=RES["vocab_new"]["runtime"],
    shell:
        "{params.cmd}"


# features_phase2: Phase 2's scaled data: the next prompts after Phase 1's, answered by the new target
# only when data.budget=fixed
if CFG["data"]["budget"] == "fixed":

    rule features_phase2:
        input:
            fetch="artifacts/fetch/metrics.json",
            targets=target_steps(new=True, besides=["fetch", "world"]),
            world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
            code=code("features_phase2"),
        output:
            "artifacts/features_phase2/metrics.json",
        params:
            values=values(
                "targets.new", "targets.trust_remote_code", "features.aux_layer_ids",
                "features.aux_convention", "features.max_new_tokens", "features.batch_size",
                "features.dtype", "features.device", "features.engine",
                "features.tensor_parallel_size", "features.regenerate", "features.base_url",
                "features.served_model", "features.compile", "features.storage",
                "targets.prompts_train", "phase1.n_samples", "phase2.n_samples",
            ),
            cmd=command("features_phase2"),
        conda:
            ENV
        log:
            "logs/features_phase2.log",
        threads: RES["features_phase2"]["threads"]
        resources:
            gpu=RES["features_phase2"]["gpu"],
            mem_mb=RES["features_phase2"]["mem_mb"],
            runtime=RES["features_phase2"]["runtime"],
        shell:
            "{params.cmd}"


# budget: the adaptive data budget: Phase 2's data in rounds of n x data.factor, each trained and scored, until more data stops paying
# only when data.budget=adaptive
if CFG["data"]["budget"] == "adaptive":

    rule budget:
        input:
            features_new="artifacts/features_new/metrics.json",
            features_eval="artifacts/features_eval/metrics.json",
            vocab_new="artifacts/vocab_new/metrics.json",
            fetch="artifacts/fetch/metrics.json",
            targets=target_steps(
                new=True, besides=["features_new", "features_eval", "vocab_new", "fetch", "world"],
            ),
            features_monitor=branch(
                CFG["curves"]["train"]["eval_every"],
                then="artifacts/features_monitor/metrics.json",
            ),
            world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
            code=code("budget"),
        output:
            "artifacts/budget/metrics.json",
        params:
            values=values(
                "targets.new", "targets.trust_remote_code", "features.aux_layer_ids",
                "features.aux_convention", "features.max_new_tokens", "features.batch_size",
                "features.dtype", "features.device", "features.engine",
                "features.tensor_parallel_size", "features.regenerate", "features.base_url",
                "features.served_model", "features.compile", "features.storage",
                "targets.prompts_train", "phase1.n_samples", "phase2.n_samples", "data",
                "curves.epochs", "curves.min_steps", "curves.train", "eval.k", "eval.batch_size",
                "eval.max_samples", "eval.device", "eval.context_buckets", "decision.n_boot",
                "decision.level", "decision.seed", "decision.min_gain", "resources", "profile",
                "monitor.k", "monitor.batch_size", "targets.trust_remote_code", "features.spool_gb",
                "features.spool_dir",
            ),
            cmd=command("budget"),
        conda:
            ENV
        log:
            "logs/budget.log",
        threads: RES["budget"]["threads"]
        resources:
            gpu=RES["budget"]["gpu"],
            mem_mb=RES["budget"]["mem_mb"],
            runtime=RES["budget"]["runtime"],
        shell:
            "{params.cmd}"


# features_dataset: the regenerate-or-not arm's data: the prompts' own answers, teacher-forced through the new target
# only when curves.enabled and curves.answers and curves.arms_n_samples
if CFG["curves"]["enabled"] and CFG["curves"]["answers"] and CFG["curves"]["arms_n_samples"]:

    rule features_dataset:
        input:
            fetch="artifacts/fetch/metrics.json",
            targets=target_steps(new=True, besides=["fetch", "world"]),
            world=branch(CFG["world"]["build"], then="artifacts/world/metrics.json"),
            code=code("features_dataset"),
        output:
            "artifacts/features_dataset/metrics.json",
        params:
            values=values(
                "targets.new", "targets.trust_remote_code", "features.aux_layer_ids",
                "features.aux_convention", "features.max_new_tokens", "features.batch_size",
                "features.dtype", "features.device", "features.engine",
                "features.tensor_parallel_size", "features.regenerate", "features.base_url",
                "features.served_model", "features.compile", "features.storage",
                "targets.prompts_train", "curves.arms_n_samples",
            ),
            cmd=command("features_dataset"),
        conda:
            ENV
        log:
            "logs/features_dataset.log",
        threads: RES["features_dataset"]["threads"]
        resources:
            gpu=RES["features_dataset"]["gpu"],
            mem_mb=RES["features_dataset"]["mem_mb"],
            runtime=RES["features_dataset"]["runtime"],
        shell:
            "{params.cmd}"
