"""The programs draftport talks to, and nothing of the plan's: vLLM in its own venv and the scripts
run there (`engines.vllm`), any OpenAI-compatible completions server (`engines.openai`),
speculators in its own venv (`engines.speculators`), and the flat folder a serving engine loads
(`engines.export`). What computes with them lives above: the vLLM capture in data, the serving
check and the speculators round trip in evaluation."""

from pathlib import Path

from draftport.errors import DraftportError


def require_interpreter(p: Path, env: str, venv_dir: str, what: str) -> Path:
    """An engine venv's interpreter, or a one-line error naming its make target and variable."""
    if not p.exists():
        target = venv_dir.lstrip(".").removeprefix("venv-")
        raise DraftportError(p, f"no {what} interpreter: run `make {target}-venv` (or set {env})")
    return p
