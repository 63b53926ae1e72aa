"""Expensive things several test files only read (a micro world, a micro copy with its upstream
steps run), built once per test run: under pytest-xdist once for all workers (a file lock in the
run's base folder, above every worker's), serially once for the session."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock

DONE = ".shared-complete"


def shared_dir(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `build(folder)` fills, built by the first test that asks for it; a build that
    failed (no completion mark) is started again from nothing by the next one."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-N/: each worker's basetemp is a folder in it
    out = root / f"shared-{name}"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not (out / DONE).is_file():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / DONE).write_text("")
    return out
