"""Step vocab_new: the new target's draft map (top-N ids of its own answers) and its overlap with the
source's (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("vocab_new"))
