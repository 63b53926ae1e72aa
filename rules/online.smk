# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
# online: vLLM serves the Phase 0 / Phase 1 drafters (make vllm-venv first)


# online_phase0: phase0's drafter served by vLLM next to the offline evaluator on the same sequences
rule online_phase0:
    input:
        fetch="artifacts/fetch/metrics.json",
        targets=target_steps(new=True, besides=["fetch", "eval_phase0"]),
        eval_phase0="artifacts/eval_phase0/metrics.json",
        code=code("online_phase0"),
    output:
        "artifacts/online_phase0/metrics.json",
    params:
        values=values(
            "targets.new", "targets.prompts_eval_new", "targets.eval_sets", "targets.prompts_train",
            "features.aux_convention", "eval.k", "online.n_prompts", "online.max_new_tokens",
            "online.max_num_seqs", "online.tolerance", "online.dtype", "online.vllm_python",
            "online.tensor_parallel_size", "online.embed_tokens",
        ),
        cmd=command("online_phase0"),
    conda:
        ENV
    log:
        "logs/online_phase0.log",
    threads: RES["online_phase0"]["threads"]
    resources:
        gpu=RES["online_phase0"]["gpu"],
        mem_mb=RES["online_phase0"]["mem_mb"],
        runtime=RES["online_phase0"]["runtime"],
    shell:
        "{params.cmd}"


# online_phase1: phase1's drafter served by vLLM next to the offline evaluator on the same sequences
rule online_phase1:
    input:
        train_phase1="artifacts/train_phase1/metrics.json",
        targets=target_steps(new=True, besides=["train_phase1", "eval_phase1"]),
        eval_phase1="artifacts/eval_phase1/metrics.json",
        code=code("online_phase1"),
    output:
        "artifacts/online_phase1/metrics.json",
    params:
        values=values(
            "targets.new", "targets.prompts_eval_new", "targets.eval_sets", "targets.prompts_train",
            "features.aux_convention", "eval.k", "online.n_prompts", "online.max_new_tokens",
            "online.max_num_seqs", "online.tolerance", "online.dtype", "online.vllm_python",
            "online.tensor_parallel_size", "online.embed_tokens",
        ),
        cmd=command("online_phase1"),
    conda:
        ENV
    log:
        "logs/online_phase1.log",
    threads: RES["online_phase1"]["threads"]
    resources:
        gpu=RES["online_phase1"]["gpu"],
        mem_mb=RES["online_phase1"]["mem_mb"],
        runtime=RES["online_phase1"]["runtime"],
    shell:
        "{params.cmd}"
