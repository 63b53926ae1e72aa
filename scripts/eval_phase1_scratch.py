"""Step eval_phase1_scratch: phase1_scratch: its drafter's offline accept length on the new target's
held-out set (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("eval_phase1_scratch"))
