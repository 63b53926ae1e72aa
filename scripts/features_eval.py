"""Step features_eval: held-out sets answered by each target (the new one; the old one, the source's
home) (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("features_eval"))
