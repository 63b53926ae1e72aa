"""Step features_new: the new target's answers to Phase 1's prompts and its hidden states (its registry
row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("features_new"))
