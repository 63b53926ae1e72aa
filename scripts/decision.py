"""Step decision: the recommendation with evidence: init, data, Phase 2, drift; bootstrap CIs and rules
R1-R6 (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("decision"))
