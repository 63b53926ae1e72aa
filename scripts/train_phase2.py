"""Step train_phase2: continue Phase 1's drafter (its map kept) on the scaled data (its registry row:
src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("train_phase2"))
