"""Step online_phase1: the phase1 drafter served by vLLM (EAGLE-3, greedy) next to the offline evaluator
on the same sequences; both tau into metrics.json and phase1's MLflow run (draftport.pipeline.online_phase)."""

from draftport.pipeline import online_phase, run_step

if __name__ == "__main__":
    raise SystemExit(run_step("online_phase1", lambda s: online_phase(s, "phase1")))
