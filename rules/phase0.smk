# Phase 0 (probe): the source drafter as fetched, on the new target.
rule phase0:
    input:
        "scripts/phase0.py",
        world_done(),
        done("fetch", "features_eval"),
    output:
        pl.done("phase0"),
    params:
        values=values("phase0"),
        extra=extra("phase0"),
    conda:
        ENV
    log:
        "logs/phase0.log",
    resources:
        gpu=res("phase0", "gpu"),
        mem_mb=res("phase0", "mem_mb"),
        runtime=res("phase0", "runtime"),
    threads: res("phase0", "threads")
    shell:
        "python scripts/phase0.py{params.extra} --logfile {log}"
