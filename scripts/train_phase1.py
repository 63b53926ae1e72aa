"""Step train_phase1: fine-tune the source drafter on the new target's data (lm_head moved onto the new
map) (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("train_phase1"))
