# The online check: a phase's drafter served by vLLM's EAGLE-3 speculative decoding (greedy), tau
# read from vLLM's counters, next to the offline evaluator on the same sequences. `snakemake online`
# runs it; params online.enabled adds it to `all` and the report. Snakemake only: DVC has no stage
# for it, so `dvc repro` never needs the vLLM venv (`make vllm-venv`).
rule online_phase0:
    input:
        "scripts/online_phase0.py",
        "scripts/online_vllm.py",
        world_done(),
        done("fetch", "phase0"),
    output:
        pl.done("online_phase0"),
    params:
        values=values("online_phase0"),
        extra=extra("online_phase0"),
    conda:
        ENV
    log:
        "logs/online_phase0.log",
    resources:
        gpu=res("online_phase0", "gpu"),
        mem_mb=res("online_phase0", "mem_mb"),
        runtime=res("online_phase0", "runtime"),
    threads: res("online_phase0", "threads")
    shell:
        "python scripts/online_phase0.py{params.extra} --logfile {log}"


rule online_phase1:
    input:
        "scripts/online_phase1.py",
        "scripts/online_vllm.py",
        world_done(),
        done("phase1"),
    output:
        pl.done("online_phase1"),
    params:
        values=values("online_phase1"),
        extra=extra("online_phase1"),
    conda:
        ENV
    log:
        "logs/online_phase1.log",
    resources:
        gpu=res("online_phase1", "gpu"),
        mem_mb=res("online_phase1", "mem_mb"),
        runtime=res("online_phase1", "runtime"),
    threads: res("online_phase1", "threads")
    shell:
        "python scripts/online_phase1.py{params.extra} --logfile {log}"


rule online:
    input:
        done(*pl.ONLINE),

