# Phase 2: Phase 1's drafter continued on the scaled data.
rule phase2:
    input:
        "scripts/phase2.py",
        world_done(),
        done("fetch", "features_eval", "features_phase2", "vocab_new", "phase1"),
    output:
        pl.done("phase2"),
    params:
        values=values("phase2"),
        extra=extra("phase2"),
        launch=launch("phase2"),
    conda:
        ENV
    log:
        "logs/phase2.log",
    threads: res("phase2", "threads")
    resources:
        gpu=res("phase2", "gpu"),
        mem_mb=res("phase2", "mem_mb"),
        runtime=res("phase2", "runtime"),
    shell:
        "{params.launch} scripts/phase2.py{params.extra} --logfile {log}"
