"""Step train_phase1_scratch: the control: Phase 1's architecture, data and budget from a random init
on the new map (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("train_phase1_scratch"))
