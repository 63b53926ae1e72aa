"""Step online_phase0: the phase0 drafter served by vLLM (EAGLE-3, greedy) next to the offline evaluator
on the same sequences; both tau into metrics.json and phase0's MLflow run (draftport.pipeline.online_phase)."""

from draftport.pipeline import online_phase, run_step

if __name__ == "__main__":
    raise SystemExit(run_step("online_phase0", lambda s: online_phase(s, "phase0")))
