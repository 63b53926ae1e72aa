"""Step compare: the source drafter against the layout the new target needs: config, weights, vocab,
verdict (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("compare"))
