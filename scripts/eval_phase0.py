"""Step eval_phase0: phase0: the source drafter as fetched on the new target (and on the old one; the
reference) (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("eval_phase0"))
