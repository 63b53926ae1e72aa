"""The serving engines draftport talks to: vLLM in its own venv (`engines.vllm`) and any
OpenAI-compatible completions server (`engines.openai`); and speculators, in its own venv, that
peers convert a published drafter with (`engines.speculators`)."""
