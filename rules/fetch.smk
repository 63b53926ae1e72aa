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
    resources:
        gpu=res("fetch", "gpu"),
        mem_mb=res("fetch", "mem_mb"),
        runtime=res("fetch", "runtime"),
    threads: res("fetch", "threads")
    shell:
        "python scripts/fetch.py{params.extra} --logfile {log}"
