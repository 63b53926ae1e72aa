"""The report step: plots and tables for `snakemake --report` and `dvc plots` (draftport.outputs.report)."""

from __future__ import annotations

from draftport.outputs.report import build_report
from draftport.pipeline.runner import StepContext


def report(s: StepContext) -> dict:
    """tau per phase next to the cost model's projected tok/s and break-even line, per-position
    acceptance, loss curves, the comparison tables."""
    return build_report(s.dir, s.p, {k: s.input(k) for k in s.inputs})
