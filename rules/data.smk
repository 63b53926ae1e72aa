# The new target's data: its own answers, its hidden states; the eval sets; the new draft map.
rule features_new:
    input:
        "scripts/features_new.py",
        world_done(),
        done("fetch"),
    output:
        pl.done("features_new"),
    params:
        values=values("features_new"),
        extra=extra("features_new"),
    conda:
        ENV
    log:
        "logs/features_new.log",
    resources:
        gpu=res("features_new", "gpu"),
        mem_mb=res("features_new", "mem_mb"),
        runtime=res("features_new", "runtime"),
    threads: res("features_new", "threads")
    shell:
        "python scripts/features_new.py{params.extra} --logfile {log}"


rule features_eval:
    input:
        "scripts/features_eval.py",
        world_done(),
        done("fetch"),
    output:
        pl.done("features_eval"),
    params:
        values=values("features_eval"),
        extra=extra("features_eval"),
    conda:
        ENV
    log:
        "logs/features_eval.log",
    resources:
        gpu=res("features_eval", "gpu"),
        mem_mb=res("features_eval", "mem_mb"),
        runtime=res("features_eval", "runtime"),
    threads: res("features_eval", "threads")
    shell:
        "python scripts/features_eval.py{params.extra} --logfile {log}"


rule vocab_new:
    input:
        "scripts/vocab_new.py",
        done("fetch", "features_new"),
    output:
        pl.done("vocab_new"),
    params:
        values=values("vocab_new"),
        extra=extra("vocab_new"),
    conda:
        ENV
    log:
        "logs/vocab_new.log",
    resources:
        gpu=res("vocab_new", "gpu"),
        mem_mb=res("vocab_new", "mem_mb"),
        runtime=res("vocab_new", "runtime"),
    threads: res("vocab_new", "threads")
    shell:
        "python scripts/vocab_new.py{params.extra} --logfile {log}"


rule features_phase2:
    input:
        "scripts/features_phase2.py",
        world_done(),
        done("fetch"),
    output:
        pl.done("features_phase2"),
    params:
        values=values("features_phase2"),
        extra=extra("features_phase2"),
    conda:
        ENV
    log:
        "logs/features_phase2.log",
    resources:
        gpu=res("features_phase2", "gpu"),
        mem_mb=res("features_phase2", "mem_mb"),
        runtime=res("features_phase2", "runtime"),
    threads: res("features_phase2", "threads")
    shell:
        "python scripts/features_phase2.py{params.extra} --logfile {log}"
