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
    shell:
        "python scripts/phase0.py{params.extra} --log {log}"
