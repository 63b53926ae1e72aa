"""Step eval_curves: every learning-curve point's drafter on the new target's held-out set (per-prompt
counts) (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("eval_curves"))
