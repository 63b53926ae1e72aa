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
    shell:
        "python scripts/features_new.py{params.extra} --log {log}"


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
    shell:
        "python scripts/features_eval.py{params.extra} --log {log}"


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
    shell:
        "python scripts/vocab_new.py{params.extra} --log {log}"


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
    shell:
        "python scripts/features_phase2.py{params.extra} --log {log}"
