# Plots and tables for `snakemake --report report.html` (and `dvc plots show`).
rule report:
    input:
        "scripts/report.py",
        world_done(),
        done("compare", "phase0", "phase1_scratch", "phase1", "phase2"),
        online_done(),
    output:
        pl.done("report"),
        report(pl.art("report", "summary.html"), caption="../report/summary.rst", category="1. Summary"),
        report(pl.art("report", "tau.png"), caption="../report/tau.rst", category="2. Phases"),
        report(pl.art("report", "positions.png"), caption="../report/positions.rst", category="2. Phases"),
        report(pl.art("report", "loss.png"), caption="../report/loss.rst", category="2. Phases"),
        report(pl.art("report", "phases.csv"), caption="../report/phases.rst", category="2. Phases"),
        report(pl.art("report", "compare.html"), caption="../report/compare.rst", category="3. Compare"),
    params:
        values=values("report"),
        extra=extra("report"),
    conda:
        ENV
    log:
        "logs/report.log",
    resources:
        gpu=res("report", "gpu"),
        mem_mb=res("report", "mem_mb"),
        runtime=res("report", "runtime"),
    threads: res("report", "threads")
    shell:
        "python scripts/report.py{params.extra} --logfile {log}"
