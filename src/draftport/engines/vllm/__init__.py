"""vLLM, run in its own venv: the venv and its scripts (`venv`), tau read from vLLM's counters next
to the offline evaluator (`serve`), hidden states through extract_hidden_states (`hidden_states`).

The scripts that run inside the vLLM venv live in `runners/` (they import only vLLM, torch,
safetensors and the standard library: draftport is not installed there)."""
