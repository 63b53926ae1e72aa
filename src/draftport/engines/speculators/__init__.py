"""speculators (vLLM's training library), run in its own venv: a published drafter converted by
`speculators convert` and its forward compared with draftport's (draftport.evaluation.roundtrip).

speculators lives in `.venv-speculators` (`make speculators-venv`: speculators 0.9.0 pins
transformers <= 5.19), never imported by the main environment. The script run there,
`runners/forward_speculators.py`, imports only speculators, torch, safetensors and the standard
library; the round trip runs it by path (RUNNERS)."""

from pathlib import Path

RUNNERS = Path(__file__).resolve().parent / "runners"  # scripts run inside the speculators venv, by path
