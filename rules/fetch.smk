# The source drafter at its pinned revision, through the hub cache (and a hub-id target).
rule fetch:
    input:
        "scripts/fetch.py",
        world_done(),
    output:
        pl.done("fetch"),
    params:
        values=values("fetch"),
        extra=extra("fetch"),
    conda:
        ENV
    log:
        "logs/fetch.log",
    shell:
        "python scripts/fetch.py{params.extra} --log {log}"
