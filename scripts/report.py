"""Step report: plots and tables: tau per phase vs projected tok/s, per-position acceptance, loss,
comparison (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("report"))
