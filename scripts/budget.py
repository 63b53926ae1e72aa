"""Step budget: the adaptive data budget: Phase 2's data in rounds, each trained and scored, until more
data stops paying (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("budget"))
