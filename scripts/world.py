"""Step world: the embedded K2 -> K2.5 analog: corpus, tokenizer, two targets, the source drafter in a
hub cache (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("world"))
