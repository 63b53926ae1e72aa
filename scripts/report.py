"""Step report: plots and tables for `snakemake --report` and `dvc plots`: tau per phase next to
the cost model's projected tok/s and break-even line, per-position acceptance, loss curves, the
comparison tables."""

from draftport.pipeline import run_step
from draftport.report import build_report


def report(s):
    return build_report(s.dir, s.p)


if __name__ == "__main__":
    raise SystemExit(run_step("report", report))
