# The embedded analog world: targets old/new, corpus, and the source drafter in a hub cache.
if CFG["world"]["build"]:

    rule world:
        input:
            "scripts/world.py",
            "src/draftport/world.py",
        output:
            pl.done("world"),
        params:
            values=values("world"),
            extra=extra("world"),
        conda:
            ENV
        log:
            "logs/world.log",
        threads: CFG["world"]["threads"]
        resources:
            gpu=res("world", "gpu"),
            mem_mb=res("world", "mem_mb"),
            runtime=res("world", "runtime"),
        shell:
            "python scripts/world.py{params.extra} --logfile {log}"
