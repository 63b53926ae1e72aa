"""Files every step writes and reads, whatever it computes: atomic writes (a temp name, then a
rename, so a killed write leaves no trusted file), a file's sha256, JSON with one-line errors, and
what a full disk looks like. Plumbing, not a step's code dependency (draftport.plan.registry
PLUMBING_MODULES): editing it reruns no step."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from draftport.errors import DraftportError

_FULL_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded",
}
# safetensors (Rust) reports the OS error inside its own message
_FULL_TEXTS = (
    ("no space left", "no space left on device"),
    ("storagefull", "no space left on device"),
    ("os error 28", "no space left on device"),
    ("quota exceeded", "disk quota exceeded"),
    ("filetoolarge", "file size limit exceeded"),
    ("file too large", "file size limit exceeded"),
    ("os error 27", "file size limit exceeded"),
)


def disk_full_error(e: BaseException, where) -> str | None:
    """'disk full (<why>, <n> KiB free)' when e is a write that ran out of space, else None."""
    if isinstance(e, DraftportError) and e.problem.startswith("disk full ("):
        return e.problem.split(";")[0]  # already said by a nested atomic write
    what = _FULL_ERRNOS.get(getattr(e, "errno", None))
    if what is None:
        text = str(e).lower().replace(" ", "") if not isinstance(e, OSError) else ""
        what = next((w for t, w in _FULL_TEXTS if t.replace(" ", "") in text), None)
    if what is None:
        return None
    try:
        free = shutil.disk_usage(Path(where).parent if not Path(where).is_dir() else where).free
        free_s = f", {free // 1024} KiB free"
    except OSError:
        free_s = ""
    return f"disk full ({what}{free_s})"


def sha256(path: Path) -> str:
    """A file's sha256 (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, writer) -> None:
    """Call writer(tmp_path), then rename onto path: a killed write leaves no trusted file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        writer(Path(tmp))
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        full = disk_full_error(e, path)
        if full is not None:
            raise DraftportError(path, f"{full}; not written (an older file of that name is unchanged)") from None
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(Path(path), lambda p: p.write_text(text))


@contextmanager
def atomic_dir(folder: str | Path):
    """Yield a temporary sibling folder; on success it replaces `folder` (the old one is moved
    aside first, then removed), on any error it is deleted. A killed write never leaves a
    half-written folder under the final name."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield tmp
        if folder.exists():
            old = folder.with_name(f".{folder.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_json(path: str | Path, missing: str, where=None) -> Any:
    """A JSON file; one-line errors: `where` (default the file) + `missing` when it is absent,
    the file + the parser's complaint when it is not JSON."""
    path = Path(path)
    if not path.is_file():
        raise DraftportError(path if where is None else where, missing)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DraftportError(path, f"not valid JSON ({e.__class__.__name__}: {e})") from None
