"""Step drift: beside Phase 0: the old and the new target on the same tokens, how far the states moved
(its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("drift"))
