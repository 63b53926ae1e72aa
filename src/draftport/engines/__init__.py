"""The serving engines draftport talks to: vLLM in its own venv (`engines.vllm`) and any
OpenAI-compatible completions server (`engines.openai`); and speculators, in its own venv, that
peers convert a published drafter with (`engines.speculators`)."""

from pathlib import Path

from draftport.errors import DraftportError


def require_interpreter(p: Path, env: str, venv_dir: str, what: str) -> Path:
    """An engine venv's interpreter, or a one-line error naming its make target and variable."""
    if not p.exists():
        target = venv_dir.lstrip(".").removeprefix("venv-")
        raise DraftportError(p, f"no {what} interpreter: run `make {target}-venv` (or set {env})")
    return p
