"""Scripts run INSIDE the speculators venv as files (`python <path> ...`), never imported by
draftport: `forward_speculators.py` (a speculators-format drafter's teacher-forced forward).
draftport.evaluation.roundtrip finds and runs them."""
