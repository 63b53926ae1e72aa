"""The vLLM venv: its interpreter, the package's scripts that run in it, and running one there.

vLLM lives in its own venv (`make vllm-venv`), never imported by the main environment. Its
interpreter is the argument, else $DRAFTPORT_VLLM_PYTHON, else `.venv-vllm/bin/python` under the
current directory (the pipeline runs at the repository root; an installed draftport has no
repository to look in). The scripts run there ship inside this package (`runners/`), found next
to this file, so an installed wheel carries and finds them.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

from draftport.engines import require_interpreter
from draftport.errors import DraftportError

VENV_DIR = ".venv-vllm"
RUNNERS = Path(__file__).resolve().parent / "runners"


def default_vllm_python() -> Path:
    """$DRAFTPORT_VLLM_PYTHON, else .venv-vllm/bin/python under the current directory."""
    env = os.environ.get("DRAFTPORT_VLLM_PYTHON")
    return Path(env) if env else Path.cwd() / VENV_DIR / "bin" / "python"


def vllm_python(path: str | os.PathLike | None = None) -> Path:
    """The vLLM venv's interpreter: argument, else $DRAFTPORT_VLLM_PYTHON, else .venv-vllm."""
    return require_interpreter(Path(path) if path else default_vllm_python(), "DRAFTPORT_VLLM_PYTHON", VENV_DIR, "vLLM")


def runner(name: str) -> Path:
    """A script of runners/ (online_vllm.py, features_vllm.py), as a file the venv can run."""
    script = RUNNERS / name
    if not script.is_file():
        raise DraftportError(script, "the vLLM runner script is missing")
    return script


def run_in_vllm_venv(
    cmd: list[str], log_path, result: Path, *, where, what: str, timeout: float | None = 3600
) -> float:
    """Run a script under the vLLM venv's interpreter (cmd[0]), its output to log_path; the wall
    seconds. Fails, naming `where`, unless it exits 0 having written `result`: the message
    quotes the root cause, the first exception line (the engine's own wrap-ups come later)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the CPU engine: a small KV cache (GiB)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("PYTHONPATH", None)  # the vLLM venv must not see the project's packages
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log_path, "w") as lf:
        try:
            rc = subprocess.run(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not Path(result).is_file():
        lines = log_path.read_text(errors="replace").strip().splitlines()
        errs = [ln for ln in lines if re.search(r"\b\w*(Error|Exception): ", ln)]
        why = errs[0] if errs else (lines[-1] if lines else "no output")
        raise DraftportError(where, f"{what} failed (exit {rc}): {why.strip()[-400:]} [log: {log_path}]")
    return time.time() - t0


def run_runner(
    name: str,
    args: list[str],
    log_path,
    result: Path,
    *,
    where,
    what: str,
    vllm_python_path=None,
    timeout: float | None = 3600,
) -> float:
    """Run runners/<name> with `args` in the vLLM venv (see run_in_vllm_venv); the wall seconds."""
    cmd = [str(vllm_python(vllm_python_path)), str(runner(name)), *map(str, args)]
    return run_in_vllm_venv(cmd, log_path, result, where=where, what=what, timeout=timeout)
