"""The serving engines draftport talks to: vLLM in its own venv (`engines.vllm`) and any
OpenAI-compatible completions server (`engines.openai`)."""
