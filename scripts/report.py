"""Step report: plots and tables: tau per phase vs projected tok/s, per-position acceptance, loss, comparison (its registry row: src/draftport/steps/registry.py)."""

from draftport.steps.runner import main

if __name__ == "__main__":
    raise SystemExit(main("report"))
