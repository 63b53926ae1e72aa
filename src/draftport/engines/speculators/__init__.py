"""speculators (vLLM's training library), run in its own venv: a published drafter converted by
`speculators convert` and its forward compared with draftport's (`roundtrip`).

speculators lives in `.venv-speculators` (`make speculators-venv`: speculators 0.9.0 pins
transformers <= 5.19), never imported by the main environment. The script run there,
`runners/forward_speculators.py`, imports only speculators, torch, safetensors and the standard
library; `roundtrip` finds it next to this file and runs it by path."""
