"""Step publish: the chosen drafter as a hub-ready folder: flat config, the new target's embed_tokens,
a model card; checked (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("publish"))
