"""Fetch a drafter or target: a hub id at a pinned revision, or a local folder.

Only config.json and *.safetensors (plus tokenizer files for targets) are taken: nothing that
can run code. A branch or tag is resolved to its commit and recorded; every file's sha256 goes
into a lock file, and a later fetch that finds a different file at the same commit fails.

`publish_to_cache` lays a folder out as a Hugging Face hub cache entry (blobs/, snapshots/<commit>/,
refs/<branch>) so the embedded world's source drafter is fetched by the very code that fetches
AQ-MedAI's from the hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .checkpoint import PICKLE_SUFFIXES, atomic_dir, atomic_write_text
from .errors import DraftportError

DRAFTER_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]
TARGET_PATTERNS = DRAFTER_PATTERNS + ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                      "generation_config.json", "tokenizer.model", "*.tiktoken", "draftport_target.json"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def place(src: Path, dst: Path) -> None:
    """Hard-link when on the same filesystem (multi-GB weights, no second copy), else copy."""
    try:
        os.link(os.path.realpath(src), dst)
    except OSError:
        shutil.copyfile(src, dst)


def _match(name: str, patterns) -> bool:
    from fnmatch import fnmatch
    return any(fnmatch(name, p) for p in patterns)


def publish_to_cache(folder, cache_dir, repo_id: str, branch: str = "main") -> str:
    """Copy a local model folder into a hub-cache layout; returns the commit id (40 hex)."""
    folder, cache_dir = Path(folder), Path(cache_dir)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    digest = hashlib.sha1()
    for p in files:
        digest.update(p.name.encode() + b"\0" + sha256(p).encode())
    commit = digest.hexdigest()
    root = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for p in files:
        blob = root / "blobs" / sha256(p)
        if not blob.exists():
            place(p, blob)
        link = snap / p.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir(exist_ok=True)
    atomic_write_text(root / "refs" / branch, commit)
    return commit


def resolve(source: str, revision: str | None, cache_dir=None, patterns=DRAFTER_PATTERNS,
            offline: bool | None = None) -> tuple[Path, str]:
    """(folder holding the files, commit) for a hub id or a local folder."""
    local = Path(source)
    if local.exists():
        if not local.is_dir():
            raise DraftportError(local, "expected a model folder")
        return local, "local"
    if "/" not in source or source.count("/") > 1:
        raise DraftportError(source, "neither an existing folder nor a hub id like org/name")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        path = snapshot_download(repo_id=source, revision=revision or "main", cache_dir=cache_dir,
                                 allow_patterns=patterns, local_files_only=offline)
    except LocalEntryNotFoundError:
        raise DraftportError(source, f"revision {revision or 'main'} is not in the hub cache {cache_dir or '(default)'} and the hub is offline") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise DraftportError(source, f"cannot fetch revision {revision or 'main'}: {str(e).splitlines()[0]}") from None
    path = Path(path)
    return path, path.name  # snapshot folders are named by commit


def fetch(source: str, out_dir, *, revision: str | None = None, cache_dir=None,
          patterns=DRAFTER_PATTERNS, lock_file=None, offline: bool | None = None) -> dict:
    """Copy the allowed files of `source` into out_dir (atomically) and write out_dir/fetch.lock.json.

    lock_file: a lock kept outside the outputs (e.g. next to params.yaml); when it exists for the
    same source and commit, every file must hash the same or the fetch fails.
    """
    src, commit = resolve(source, revision, cache_dir, patterns, offline)
    files = sorted(p for p in src.iterdir() if p.is_file() and _match(p.name, patterns))
    refused = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not any(p.suffix == ".safetensors" for p in files):
        what = f" (only pickle files: {', '.join(refused)} are refused)" if refused else ""
        raise DraftportError(src, f"no *.safetensors weights to fetch{what}")
    if not any(p.name == "config.json" for p in files):
        raise DraftportError(src, "no config.json to fetch")
    hashes = {p.name: sha256(p) for p in files}
    lock = {"source": source, "requested_revision": revision, "commit": commit, "files": hashes}
    if lock_file is not None and Path(lock_file).is_file():
        old = json.loads(Path(lock_file).read_text())
        if old.get("source") == source and old.get("commit") == commit and old.get("files") != hashes:
            changed = sorted(k for k in set(old["files"]) | set(hashes) if old["files"].get(k) != hashes.get(k))
            raise DraftportError(lock_file, f"files changed at the same revision {commit}: {', '.join(changed)}")
    with atomic_dir(out_dir) as tmp:
        for p in files:
            place(p, tmp / p.name)  # resolves the cache's symlinks
        (tmp / "fetch.lock.json").write_text(json.dumps(lock, indent=2) + "\n")
    if lock_file is not None:
        atomic_write_text(lock_file, json.dumps(lock, indent=2) + "\n")
    return lock
