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
        launch=launch("phase1_scratch"),
    conda:
        ENV
    log:
        "logs/phase1_scratch.log",
    threads: res("phase1_scratch", "threads")
    resources:
        gpu=res("phase1_scratch", "gpu"),
        mem_mb=res("phase1_scratch", "mem_mb"),
        runtime=res("phase1_scratch", "runtime"),
    shell:
        "{params.launch} scripts/phase1_scratch.py{params.extra} --logfile {log}"


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
        launch=launch("phase1"),
    conda:
        ENV
    log:
        "logs/phase1.log",
    threads: res("phase1", "threads")
    resources:
        gpu=res("phase1", "gpu"),
        mem_mb=res("phase1", "mem_mb"),
        runtime=res("phase1", "runtime"),
    shell:
        "{params.launch} scripts/phase1.py{params.extra} --logfile {log}"
