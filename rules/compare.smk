# The fetched source against the layout the team will train for the new target.
rule compare:
    input:
        "scripts/compare.py",
        world_done(),
        done("fetch", "vocab_new"),
    output:
        pl.done("compare"),
    params:
        values=values("compare"),
        extra=extra("compare"),
    conda:
        ENV
    log:
        "logs/compare.log",
    resources:
        gpu=res("compare", "gpu"),
        mem_mb=res("compare", "mem_mb"),
        runtime=res("compare", "runtime"),
    threads: res("compare", "threads")
    shell:
        "python scripts/compare.py{params.extra} --logfile {log}"
