"""Step features_phase2: Phase 2's scaled data: the next prompts after Phase 1's, answered by the new
target (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("features_phase2"))
