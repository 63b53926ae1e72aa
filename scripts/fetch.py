"""Step fetch: the source drafter at its pinned revision (and targets given as hub ids, the reference)
(its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("fetch"))
