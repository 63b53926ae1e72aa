"""Step online_phase0: phase0's drafter served by vLLM next to the offline evaluator on the same
sequences (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("online_phase0"))
