"""Fetch a drafter or target: a hub id at a pinned revision, or a local folder.

Only config.json and *.safetensors (plus tokenizer files for targets) are taken: nothing that
can run code. Two explicit exceptions, both off by default: `allow_pickle` takes .bin/.pt weights
when a repo has no safetensors and converts them on the spot (torch.load(weights_only=True),
which refuses anything but tensors and plain containers), so every later step still reads
safetensors only; `trust_remote_code` also takes the repo's *.py (its own model/tokenizer code).
A branch or tag is resolved to its commit and recorded; every file's sha256 goes
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
from fnmatch import fnmatch
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from draftport.errors import DraftportError
from draftport.files import atomic_dir, atomic_write_text, sha256
from draftport.model.formats import PICKLE_SUFFIXES, save_safetensors

DRAFTER_PATTERNS = ["config.json", "*.safetensors", "*.safetensors.index.json"]
TARGET_PATTERNS = DRAFTER_PATTERNS + [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "*.tiktoken",
    "draftport_target.json",
]


PICKLE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "pytorch_model.bin.index.json"]
CODE_PATTERNS = ["*.py"]
PICKLE_HINT = "set source.allow_pickle: true to convert them with torch.load(weights_only=True)"


def place(src: Path, dst: Path) -> None:
    """Hard-link when on the same filesystem (multi-GB weights, no second copy), else copy."""
    try:
        os.link(os.path.realpath(src), dst)
    except OSError:
        shutil.copyfile(src, dst)


def _match(name: str, patterns) -> bool:
    return any(fnmatch(name, p) for p in patterns)


def convert_pickles(src: Path, pickles: list[Path], out: Path) -> dict[str, str]:
    """Pickle weights -> safetensors in out (allowed by params only). torch.load(weights_only=True)
    unpickles tensors and plain containers and refuses any other object, so no code runs.
    -> {pickle name: safetensors name}."""
    names = {}
    for p in pickles:
        try:
            obj = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle.UnpicklingError for anything but tensors
            raise DraftportError(
                p, f"refused by torch.load(weights_only=True): {str(e).splitlines()[0][:200]}"
            ) from None
        if isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), dict):
            obj = next(iter(obj.values()))  # {"state_dict": {...}} / {"model": {...}}
        if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise DraftportError(p, "not a state dict of tensors: cannot convert it to safetensors")
        seen, tensors = set(), {}
        for k, v in obj.items():  # tied weights share storage, which safetensors refuses
            ptr = v.untyped_storage().data_ptr()
            tensors[k] = v.contiguous().clone() if ptr in seen else v.contiguous()
            seen.add(ptr)
        name = p.with_suffix(".safetensors").name
        save_safetensors(tensors, out / name, metadata={"format": "pt", "converted_from": p.name})
        names[p.name] = name
    index = src / "pytorch_model.bin.index.json"
    if index.is_file():
        idx = json.loads(index.read_text())
        idx["weight_map"] = {k: names.get(v, v) for k, v in idx.get("weight_map", {}).items()}
        (out / "model.safetensors.index.json").write_text(json.dumps(idx, indent=2) + "\n")
    return names


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


def resolve(
    source: str, revision: str | None, cache_dir=None, patterns=DRAFTER_PATTERNS, offline: bool | None = None
) -> tuple[Path, str]:
    """(folder holding the files, commit) for a hub id or a local folder."""
    local = Path(source)
    if local.exists():
        if not local.is_dir():
            raise DraftportError(local, "expected a model folder")
        return local, "local"
    if "/" not in source or source.count("/") > 1:
        raise DraftportError(source, "neither an existing folder nor a hub id like org/name")

    if offline is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        path = snapshot_download(
            repo_id=source,
            revision=revision or "main",
            cache_dir=cache_dir,
            allow_patterns=patterns,
            local_files_only=offline,
        )
    except LocalEntryNotFoundError:
        raise DraftportError(
            source,
            f"revision {revision or 'main'} is not in the hub cache {cache_dir or '(default)'} and the hub is offline",
        ) from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise DraftportError(source, f"cannot fetch revision {revision or 'main'}: {str(e).splitlines()[0]}") from None
    path = Path(path)
    return path, path.name  # snapshot folders are named by commit


def fetch(
    source: str,
    out_dir,
    *,
    revision: str | None = None,
    cache_dir=None,
    patterns=DRAFTER_PATTERNS,
    lock_file=None,
    offline: bool | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
) -> dict:
    """Copy the allowed files of `source` into out_dir (atomically) and write out_dir/fetch.lock.json.

    lock_file: a lock kept outside the outputs (e.g. next to params.yaml); when it exists for the
    same source and commit, every file must hash the same or the fetch fails.
    allow_pickle: with no safetensors in the repo, fetch its pickle weights and convert them.
    trust_remote_code: also fetch the repo's *.py (only for a repo the params name).
    """
    patterns = list(patterns) + (CODE_PATTERNS if trust_remote_code else [])
    src, commit = resolve(source, revision, cache_dir, patterns, offline)
    files = sorted(p for p in src.iterdir() if p.is_file() and _match(p.name, patterns))
    if allow_pickle and not any(p.suffix == ".safetensors" for p in files):
        src, commit = resolve(source, revision, cache_dir, patterns + PICKLE_PATTERNS, offline)
        files = sorted(p for p in src.iterdir() if p.is_file() and _match(p.name, patterns + PICKLE_PATTERNS))
    refused = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
    pickles = [p for p in files if p.suffix in PICKLE_SUFFIXES]
    if not any(p.suffix == ".safetensors" for p in files) and not pickles:
        what = (
            f" (only pickle files: {', '.join(refused)}, refused because they can run code; {PICKLE_HINT})"
            if refused
            else f" (pickle weights are refused unless allowed: {PICKLE_HINT})"
        )
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
            if p.suffix in PICKLE_SUFFIXES or p.name == "pytorch_model.bin.index.json":
                continue
            place(p, tmp / p.name)  # resolves the cache's symlinks
        if pickles:
            lock["converted"] = convert_pickles(src, pickles, tmp)
        (tmp / "fetch.lock.json").write_text(json.dumps(lock, indent=2) + "\n")
    if lock_file is not None:
        atomic_write_text(lock_file, json.dumps(lock, indent=2) + "\n")
    return lock
