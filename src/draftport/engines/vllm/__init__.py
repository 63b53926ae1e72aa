"""vLLM, run in its own venv: the venv and its scripts (`venv`). draftport.data.vllm_capture takes
hidden states through extract_hidden_states there, draftport.evaluation.online reads tau from
vLLM's counters next to the offline evaluator.

The scripts that run inside the vLLM venv live in `runners/` (they import only vLLM, torch,
safetensors and the standard library: draftport is not installed there)."""
