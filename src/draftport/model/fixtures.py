"""Drafter folders whose big tensors are file holes: full-size checkpoints for tests and benchmarks.

A Kimi-K2 drafter is 2.4 GB (4.7 GB with embed_tokens). `write_header_only_drafter` writes a
real safetensors header, the real d2t/t2d bytes at the start of the data section, and then
truncates the file to its full length: every other tensor reads as zeros, costs no disk, and
the file is byte-for-byte what the safetensors loader accepts. No torch here.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from draftport.model.config import DrafterConfig
from draftport.model.formats import (
    DTYPE_BYTES,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    expected_shapes,
    speculators_config_dict,
    to_speculators_name,
)

ST_DTYPES = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.uint8): "U8",
}


def kimi_k2_config(**overrides) -> DrafterConfig:
    """The public Kimi-K2 EAGLE-3 drafter's architecture (head_dim 128, not 7168 / 64)."""
    base = dict(
        hidden_size=7168,
        intermediate_size=18432,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
        vocab_size=163840,
        draft_vocab_size=32000,
        aux_layer_ids=[2, 30, 58],
        max_position_embeddings=131072,
        rope_theta=50000.0,
    )
    base.update(overrides)
    return DrafterConfig(**base)


def small_config(**overrides) -> DrafterConfig:
    """A drafter small enough to write densely, shaped like the real thing (head_dim != H / heads)."""
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        draft_vocab_size=200,
        aux_layer_ids=[1, 3, 5],
        max_position_embeddings=4096,
    )
    base.update(overrides)
    return DrafterConfig(**base)


def frequency_maps(cfg: DrafterConfig, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) as a frequency count over some data would build them."""
    from draftport.model.vocab import build_maps

    return build_maps(zipf_counts(cfg.vocab_size, seed), cfg.draft_vocab_size)


def zipf_counts(vocab_size: int, seed: int = 0, exponent: float = 1.1) -> np.ndarray:
    """Token counts with a Zipf tail over shuffled ids, so the hot set is spread across the vocab."""
    rng = np.random.default_rng(seed)
    ranks = rng.permutation(vocab_size)
    return (1e12 / (ranks + 1.0) ** exponent).astype(np.int64)


def swap_hot_ids(d2t: np.ndarray, vocab_size: int, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A map that differs from `d2t` by n ids out and n other ids in, rebuilt sorted (delta, t2d).

    This is what a re-run of the frequency count on slightly different data produces.
    """
    rng = np.random.default_rng(seed)
    hot = np.arange(d2t.shape[0], dtype=np.int64) + np.asarray(d2t, dtype=np.int64)
    cold = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), hot)
    out = rng.choice(hot, size=n, replace=False)
    new = np.sort(np.concatenate([np.setdiff1d(hot, out), rng.choice(cold, size=n, replace=False)]))
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[new] = True
    return new - np.arange(new.size, dtype=np.int64), t2d


def write_header_only_drafter(
    folder: str | Path,
    cfg: DrafterConfig,
    d2t: np.ndarray | None,
    t2d: np.ndarray | None,
    with_embed: bool = False,
    fmt: str = "flat",
    *,
    dtype: str = "BF16",
    shapes: dict[str, tuple[int, ...]] | None = None,
    drop: Iterable[str] = (),
    config_patch: dict | None = None,
) -> Path:
    """Write config.json + a sparse model.safetensors for `cfg`; returns the folder.

    d2t / t2d: written with their real bytes (None leaves the tensor out). The weights get
    `dtype` and the shapes config implies; `shapes` overrides some (flat names), `drop` leaves
    some out, `config_patch` edits config.json keys (value None deletes the key): the knobs
    the bad-input tests need.
    """
    if fmt not in ("flat", "speculators"):
        raise ValueError(f"fmt must be 'flat' or 'speculators', got {fmt!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    exp = expected_shapes(cfg)
    shapes = shapes or {}
    drop = set(drop)

    # The real bytes go first so the rest of the data section can stay one hole.
    entries: list[tuple[str, str, tuple[int, ...], bytes | None]] = []
    for name, arr in (("d2t", d2t), ("t2d", t2d)):
        if arr is not None and name not in drop:
            arr = np.ascontiguousarray(arr)
            entries.append((name, ST_DTYPES[arr.dtype], tuple(arr.shape), arr.tobytes()))
    big = [n for n in REQUIRED_KEYS if n not in ("d2t", "t2d")]
    if with_embed:
        big += list(OPTIONAL_KEYS)
    for name in big:
        if name not in drop:
            entries.append((name, dtype, tuple(shapes.get(name, exp[name])), None))

    rename = to_speculators_name if fmt == "speculators" else (lambda n: n)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dt, shape, _ in entries:
        nbytes = math.prod(shape) * DTYPE_BYTES[dt]
        header[rename(name)] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the safetensors writer aligns the data section to 8 bytes

    path = folder / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for *_, data in entries:
            if data is None:
                break
            f.write(data)
        f.truncate(8 + len(blob) + offset)

    conf = cfg.to_flat_dict() if fmt == "flat" else speculators_config_dict(cfg)
    for key, val in (config_patch or {}).items():
        if val is None:
            conf.pop(key, None)
        else:
            conf[key] = val
    (folder / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return folder
