"""Step features_monitor: the held-out set of tau during training: the last training prompts, answered
by the new target (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("features_monitor"))
