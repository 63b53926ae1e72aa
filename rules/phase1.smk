# Phase 1: the from-scratch control, then the fine-tune measured against it and Phase 0.
rule phase1_scratch:
    input:
        "scripts/phase1_scratch.py",
        world_done(),
        done("fetch", "features_new", "features_eval", "vocab_new"),
    output:
        pl.done("phase1_scratch"),
    params:
        values=values("phase1_scratch"),
        extra=extra("phase1_scratch"),
    conda:
        ENV
    log:
        "logs/phase1_scratch.log",
    threads: 2
    shell:
        "python scripts/phase1_scratch.py{params.extra} --log {log}"


rule phase1:
    input:
        "scripts/phase1.py",
        world_done(),
        done("fetch", "features_new", "features_eval", "vocab_new", "compare", "phase0", "phase1_scratch"),
    output:
        pl.done("phase1"),
    params:
        values=values("phase1"),
        extra=extra("phase1"),
    conda:
        ENV
    log:
        "logs/phase1.log",
    threads: 2
    shell:
        "python scripts/phase1.py{params.extra} --log {log}"
