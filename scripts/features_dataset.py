"""Step features_dataset: the regenerate-or-not arm's data: the prompts' own answers, teacher-forced
through the new target (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("features_dataset"))
