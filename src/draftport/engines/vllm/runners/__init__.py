"""Scripts run INSIDE the vLLM venv as files (`python <path> ...`), never imported by draftport:
`online_vllm.py` (serving with an EAGLE-3 drafter, vLLM's counters) and `features_vllm.py`
(hidden states through extract_hidden_states). draftport.engines.vllm.venv finds and runs them."""
