"""Drafter checkpoints: header-only inspection, loading and atomic saving.

A drafter folder holds config.json and one or more *.safetensors files. The flat format names
the decoder layer `midlayer.*`; the speculators format names it `layers.0.*`. Everything a user
may point us at is validated from the header before a byte of tensor data is read, and pickle
files (.bin/.pt/.pth) are refused outright.

The header functions never import torch (safetensors' own reader, a small Rust extension, is
all they use): `draftport compare` reads two multi-GB checkpoints in well under a second.

Every safetensors file draftport writes goes through `save_safetensors`, which writes the same
bytes for the same tensors in every process (safetensors' own writer orders `__metadata__` by a
per-process hash seed).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from draftport.errors import DraftportError
from draftport.files import (  # noqa: F401 - their old home, re-exported
    atomic_dir,
    atomic_write_bytes,
    atomic_write_text,
    disk_full_error,
    sha256,
)
from draftport.model.config import DrafterConfig, read_config

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
NP_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_HEADER = 100 * 1024 * 1024

# Tensors every EAGLE-3 drafter holds (flat names). embed_tokens is optional: frozen, from the target.
LAYER_KEYS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
REQUIRED_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d") + tuple(
    f"midlayer.{k}" for k in LAYER_KEYS
)
OPTIONAL_KEYS = ("embed_tokens.weight",)


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the data in file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class DrafterInfo:
    """What a drafter folder holds, read from headers only."""

    folder: Path
    config: DrafterConfig
    raw_config: dict
    tensors: dict[str, TensorInfo]  # flat names
    format: str
    files: list[Path] = field(default_factory=list)

    def read_small(self, name: str) -> np.ndarray:
        return read_tensor_np(self.tensors[name])


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict]:
    """Parse and validate a safetensors header without reading tensor data.

    safetensors' own reader (safe_open, which validates the header and requires the tensors to
    tile the data section exactly) gives the names, dtypes, shapes and metadata; the offsets
    follow from its offset_keys(). Our checks stay where its words would replace ours: the
    first 8 bytes, and, for a file it refuses, `_explain_header`, which gives the one-line reason
    naming the tensor (its text, e.g. "invalid JSON in header: ... at line 1 column 17", names
    none). A refusal our checks cannot explain is reported with its text.
    """
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise DraftportError(path, "pickle checkpoints are refused (they can run code); convert to safetensors")
    # Kept by hand: on a file shorter than 8 bytes or with an absurd length field, safetensors
    # says only "HeaderTooSmall" / "InvalidHeaderLength", without the sizes.
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise DraftportError(path, f"cannot read ({e.strerror})") from None
    if len(head) < 8:
        raise DraftportError(path, f"truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        # Random bytes land here too: the first 8 bytes read as an absurd header length.
        raise DraftportError(
            path, f"not a safetensors file or truncated: header length field says {n} bytes, the file has {size}"
        )

    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as sf:
            meta = sf.metadata() or {}
            entries = []
            for name in sf.offset_keys():
                sl = sf.get_slice(name)
                entries.append((name, sl.get_dtype(), tuple(sl.get_shape())))
    except SafetensorError as e:
        _explain_header(path, n, size)
        raise DraftportError(path, f"safetensors refused the file ({e})") from None
    except OSError as e:
        raise DraftportError(path, f"cannot read ({e.strerror})") from None
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    offset = 0
    for name, dtype, shape in entries:
        # safetensors knows dtypes we can neither size nor read (F4, F8_E8M0, complex, ...)
        if dtype not in DTYPE_BYTES:
            raise DraftportError(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
        out[name] = TensorInfo(name, dtype, shape, path, base + offset, base + offset + nbytes)
        offset += nbytes
    if base + offset != size:  # safe_open checked this; a mismatch would mean our sizes are wrong
        raise DraftportError(path, f"header describes {offset} data bytes but the file holds {size - base}")
    return out, meta


def _explain_header(path: Path, n: int, size: int) -> None:
    """Raise the DraftportError that says, in our words, what is wrong with a header safetensors
    refused; return if none of these checks finds the fault."""
    try:
        with open(path, "rb") as f:
            f.seek(8)
            blob = f.read(n)
    except OSError as e:
        raise DraftportError(path, f"cannot read ({e.strerror})") from None
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DraftportError(path, "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise DraftportError(path, "not a safetensors file (header is not a JSON object)")
    meta = header.pop("__metadata__", None)
    base = 8 + n
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (s, e) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise DraftportError(path, f"malformed header entry for tensor {name!r}") from None
        if dtype not in DTYPE_BYTES:
            raise DraftportError(path, f"tensor {name!r} has unknown dtype {dtype!r}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise DraftportError(path, f"tensor {name!r} has a bad shape {list(shape)}")
        if not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in (s, e)):
            raise DraftportError(path, f"tensor {name!r} has bad data_offsets {[s, e]}")
        # math.prod: Python ints cannot overflow, so a huge lying shape cannot wrap around.
        want = math.prod(shape) * DTYPE_BYTES[dtype]
        if e - s != want:
            raise DraftportError(
                path,
                f"header lies about tensor {name!r}: {dtype}{list(shape)} needs {want} bytes, offsets give {e - s}",
            )
        if base + e > size:
            raise DraftportError(path, f"truncated: tensor {name!r} ends at byte {base + e} but the file has {size}")
        spans.append((s, e, name))
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise DraftportError(path, f"header lies: tensors {n0!r} and {n1!r} overlap")
        if s1 > e0:
            raise DraftportError(path, f"header lies: {s1 - e0} undescribed bytes between tensors {n0!r} and {n1!r}")
    if spans and spans[0][0] != 0:
        raise DraftportError(path, f"header lies: {spans[0][0]} undescribed bytes before tensor {spans[0][2]!r}")
    data_end = spans[-1][1] if spans else 0
    if base + data_end != size:
        raise DraftportError(path, f"header describes {data_end} data bytes but the file holds {size - base}")
    # Checked last: older readers let it pass, so a file with other faults keeps its message.
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise DraftportError(path, "not a safetensors file (__metadata__ is not a map of strings)")


def _decode(buf: bytes, info: TensorInfo) -> np.ndarray:
    """Raw little-endian bytes of (part of) a tensor as a flat numpy array; bf16 as float32."""
    if info.dtype == "BF16":
        u = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32)
    if info.dtype not in NP_DTYPES:
        raise DraftportError(info.file, f"cannot read tensor {info.name!r} of dtype {info.dtype} without torch")
    return np.frombuffer(buf, dtype=NP_DTYPES[info.dtype])


def read_tensor_np(info: TensorInfo) -> np.ndarray:
    """Read one (small) tensor's bytes into numpy; bf16 comes back as float32."""
    with open(info.file, "rb") as f:
        f.seek(info.start)
        buf = f.read(info.nbytes)
    if len(buf) != info.nbytes:
        raise DraftportError(info.file, f"truncated while reading tensor {info.name!r}")
    return _decode(buf, info).reshape(info.shape)


def iter_tensor_bytes(info: TensorInfo, block: int = 1 << 20):
    """A tensor's raw bytes in blocks of at most `block` bytes, read by byte range (no torch, no
    more than one block in memory)."""
    with open(info.file, "rb") as f:
        f.seek(info.start)
        left = info.nbytes
        while left:
            buf = f.read(min(block, left))
            if not buf:
                raise DraftportError(info.file, f"truncated while reading tensor {info.name!r}")
            left -= len(buf)
            yield buf


def tensor_sha256(info: TensorInfo) -> str:
    """sha256 (hex) of one tensor's raw bytes as stored (dtype and layout included), read by byte
    range from its safetensors file: two tensors of one dtype and shape are equal bit for bit
    exactly when these agree."""
    h = hashlib.sha256()
    for buf in iter_tensor_bytes(info):
        h.update(buf)
    return h.hexdigest()


def tensors_equal_values(a: TensorInfo, b: TensorInfo, rows: int = 4096) -> bool:
    """Same shape and the same values (compared as float32, or exactly for integers), read a
    block of rows at a time: for two tensors stored in different dtypes."""
    if tuple(a.shape) != tuple(b.shape):
        return False
    if not a.shape or math.prod(a.shape) == 0:
        return np.array_equal(read_tensor_np(a), read_tensor_np(b))
    row = math.prod(a.shape[1:])
    blocks = [iter_tensor_bytes(t, block=rows * row * DTYPE_BYTES[t.dtype]) for t in (a, b)]
    for x, y in zip(*blocks):
        if not np.array_equal(_decode(x, a).astype(np.float64), _decode(y, b).astype(np.float64)):
            return False
    return True


# Where a target stores its input embedding: a causal LM (Llama: model.embed_tokens.weight), a bare
# decoder, a multimodal wrapper (Kimi-K2.5: language_model.model.embed_tokens.weight), newer
# transformers' wrapper layout (model.language_model.embed_tokens.weight). draftport.data.capture reads
# the same names through its TEXT_PREFIXES.
TARGET_EMBED_NAMES = (
    "model.embed_tokens.weight",
    "embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)


def find_target_embedding(target_dir: str | Path) -> TensorInfo:
    """The target's embed_tokens tensor (header only: name, dtype, shape, byte range), found by
    model.safetensors.index.json's weight_map when there is one, else in each shard's header."""
    folder = Path(target_dir)
    files = weight_files(folder, kind="target")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        from draftport.model.config import load_json

        wmap = load_json(index, "missing")
        wmap = wmap.get("weight_map") if isinstance(wmap, dict) else None
        for name in TARGET_EMBED_NAMES:
            if isinstance(wmap, dict) and isinstance(wmap.get(name), str) and (folder / wmap[name]).is_file():
                table, _ = read_header(folder / wmap[name])
                if name in table:
                    return table[name]
    for f in files:
        table, _ = read_header(f)
        for name in TARGET_EMBED_NAMES:
            if name in table:
                return table[name]
    raise DraftportError(folder, f"target has no input embedding (none of {', '.join(TARGET_EMBED_NAMES)})")


def to_flat_name(name: str) -> str:
    """speculators -> flat naming (layers.0.* -> midlayer.*); strips a leading 'model.'."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0.") :]
    return name


def to_speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name


def weight_files(folder: str | Path, kind: str = "drafter") -> list[Path]:
    """A drafter's (or a target's: kind) safetensors files, sorted; pickle weights refused, one
    line naming the file."""
    folder = Path(folder)
    if kind == "drafter" and folder.is_file():
        if folder.suffix in PICKLE_SUFFIXES:
            raise DraftportError(folder, "pickle checkpoints are refused (they can run code); convert to safetensors")
        raise DraftportError(folder, "expected a drafter folder (config.json + *.safetensors), got a file")
    if not folder.is_dir():
        raise DraftportError(folder, f"no such {kind} folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise DraftportError(
                folder / pickles[0], "pickle checkpoints are refused (they can run code); convert to safetensors"
            )
        raise DraftportError(folder, f"no *.safetensors weights in the {kind} folder")
    return files


def inspect_drafter(folder: str | Path) -> DrafterInfo:
    """Config + tensor table of a drafter folder, from headers only."""
    folder = Path(folder)
    files = weight_files(folder)
    cfg, raw = read_config(folder)
    tensors: dict[str, TensorInfo] = {}
    fmt = cfg.format
    for f in files:
        table, _ = read_header(f)
        for name, info in table.items():
            flat = to_flat_name(name)
            if name.startswith("layers.0."):
                fmt = "speculators"
            if flat in tensors:
                raise DraftportError(f, f"tensor {flat!r} appears twice in the checkpoint")
            info.name = flat
            tensors[flat] = info
    return DrafterInfo(folder, cfg, raw, tensors, fmt, files)


def check_keys(info: DrafterInfo, *, require_vocab_maps: bool = True) -> None:
    """Missing or unexpected keys are an error listing them (embed_tokens may be absent)."""
    required = set(REQUIRED_KEYS) if require_vocab_maps else set(REQUIRED_KEYS) - {"d2t", "t2d"}
    names = set(info.tensors)
    missing = sorted(required - names)
    unexpected = sorted(names - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append("missing " + ", ".join(missing))
        if unexpected:
            parts.append("unexpected " + ", ".join(unexpected))
        raise DraftportError(info.folder, "checkpoint keys do not match an EAGLE-3 drafter: " + "; ".join(parts))


def inspect_report(folder: str | Path) -> dict[str, Any]:
    """`draftport inspect`: names, shapes, dtypes and config from headers, plus what looks wrong.

    Problems are listed rather than raised: inspect is for looking at a drafter, broken or not.
    Only an unreadable file (bad header, pickle) stops it.
    """
    from draftport.model.vocab import check_maps

    info = inspect_drafter(folder)
    problems = []
    for check in (check_keys, check_shapes):
        try:
            check(info)
        except DraftportError as e:
            problems.append(e.problem)
    if "d2t" in info.tensors and not any("d2t" in p or "t2d" in p for p in problems):
        try:
            t2d = info.read_small("t2d") if "t2d" in info.tensors else None
            check_maps(info.read_small("d2t"), t2d, info.config.vocab_size, info.config.draft_vocab_size)
        except DraftportError as e:
            problems.append(e.problem)
    frozen = ("embed_tokens.weight", "d2t", "t2d")
    return {
        "folder": str(info.folder),
        "format": info.format,
        "files": [f.name for f in info.files],
        "config": info.config.summary(),
        "tensors": [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "nbytes": t.nbytes, "file": t.file.name}
            for t in info.tensors.values()
        ],
        "trainable_params": sum(math.prod(t.shape) for n, t in info.tensors.items() if n not in frozen),
        "total_bytes": sum(t.nbytes for t in info.tensors.values()),
        "problems": problems,
    }


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    m = "midlayer."
    return {
        "fc.weight": (h, cfg.fc_in),
        m + "input_layernorm.weight": (h,),
        m + "hidden_norm.weight": (h,),
        m + "post_attention_layernorm.weight": (h,),
        m + "self_attn.q_proj.weight": (q, 2 * h),
        m + "self_attn.k_proj.weight": (kv, 2 * h),
        m + "self_attn.v_proj.weight": (kv, 2 * h),
        m + "self_attn.o_proj.weight": (h, q),
        m + "mlp.gate_proj.weight": (i, h),
        m + "mlp.up_proj.weight": (i, h),
        m + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
        "embed_tokens.weight": (cfg.vocab_size, h),
    }


def check_shapes(info: DrafterInfo) -> None:
    """Tensor shapes must agree with config.json (head_dim x heads vs q_proj and the like)."""
    exp = expected_shapes(info.config)
    for name, t in info.tensors.items():
        want = exp.get(name)
        if want is not None and tuple(t.shape) != want:
            cfg = info.config
            hint = ""
            if "q_proj" in name:
                hint = f" (num_attention_heads {cfg.num_attention_heads} x head_dim {cfg.head_dim} = {want[0]})"
            elif name in ("d2t", "lm_head.weight"):
                hint = f" (draft_vocab_size {cfg.draft_vocab_size})"
            elif name in ("t2d", "embed_tokens.weight"):
                hint = f" (vocab_size {cfg.vocab_size})"
            raise DraftportError(
                t.file, f"tensor {name} has shape {list(t.shape)}, config.json implies {list(want)}{hint}"
            )


def load_drafter_state(folder: str | Path, *, require_vocab_maps: bool = True):
    """Validated (DrafterConfig, {flat_name: torch.Tensor}) from a drafter folder.

    Keys, shapes and the vocab maps are all checked before the state is handed out: a drafter
    with mismatched keys would otherwise load partly random, and a broken d2t scrambles tokens.
    """
    from safetensors import SafetensorError, safe_open

    from draftport.model.vocab import check_maps

    info = inspect_drafter(folder)
    check_keys(info, require_vocab_maps=require_vocab_maps)
    check_shapes(info)
    if "d2t" in info.tensors:
        d2t = info.tensors["d2t"]
        t2d = info.read_small("t2d") if "t2d" in info.tensors else None
        check_maps(read_tensor_np(d2t), t2d, info.config.vocab_size, info.config.draft_vocab_size, where=d2t.file)
    state = {}
    for f in info.files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    state[to_flat_name(name)] = sf.get_tensor(name)
        except SafetensorError as e:
            raise DraftportError(f, f"safetensors refused the file ({e})") from None
    return info.config, state


# safetensors dtype codes, in the order of safetensors' Dtype enum: its writer lays the data out
# by this rank, largest first, then by name, so every tensor stays aligned to its element size.
ST_RANK = {
    "BOOL": 0,
    "U8": 1,
    "I8": 2,
    "F8_E5M2": 3,
    "F8_E4M3": 4,
    "I16": 5,
    "U16": 6,
    "F16": 7,
    "BF16": 8,
    "I32": 9,
    "U32": 10,
    "F32": 11,
    "F64": 12,
    "I64": 13,
    "U64": 14,
}
# numpy: by kind and size (any byte order); by name for ml_dtypes' bfloat16 / float8, if present
_NP_CODES = {
    ("b", 1): "BOOL",
    ("u", 1): "U8",
    ("i", 1): "I8",
    ("i", 2): "I16",
    ("u", 2): "U16",
    ("f", 2): "F16",
    ("i", 4): "I32",
    ("u", 4): "U32",
    ("f", 4): "F32",
    ("f", 8): "F64",
    ("i", 8): "I64",
    ("u", 8): "U64",
}
_NP_NAMED = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
TORCH_CODES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fn": "F8_E4M3",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
}


def _tensor_bytes(name: str, value) -> tuple[str, list[int], memoryview]:
    """(dtype code, shape, the raw little-endian bytes) of a torch tensor or numpy array, without
    a copy where the value is already contiguous CPU memory."""
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported; never import it here
    if torch is not None and isinstance(value, torch.Tensor):
        code = TORCH_CODES.get(str(value.dtype).removeprefix("torch."))
        if code is None:
            raise TypeError(f"save_safetensors: tensor {name!r} has dtype {value.dtype}, which safetensors cannot hold")
        t = value.detach().cpu().contiguous()
        shape = list(t.shape)
        # Viewed as bytes, so bf16/fp8 need no numpy dtype. torch is little-endian on every host
        # it supports, as safetensors is.
        arr = t.reshape(-1).view(torch.uint8).numpy()
        return code, shape, memoryview(arr).cast("B")
    arr = np.asarray(value)
    code = _NP_NAMED.get(arr.dtype.name) or _NP_CODES.get((arr.dtype.kind, arr.dtype.itemsize))
    if code is None:
        raise TypeError(f"save_safetensors: array {name!r} has dtype {arr.dtype}, which safetensors cannot hold")
    shape = list(arr.shape)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    return code, shape, memoryview(arr.reshape(-1).view(np.uint8))


def safetensors_bytes_layout(
    tensors: dict[str, Any], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[memoryview]]:
    """(8-byte length + header, the data buffers in file order) of a safetensors file: tensors
    ordered as safetensors' writer orders them (dtype rank descending, then name), `__metadata__`
    first with its keys sorted, compact JSON, the header padded with spaces to a multiple of 8."""
    if metadata is not None:
        bad = [(k, v) for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise TypeError(f"save_safetensors: metadata keys and values must be str, got {bad[0][0]!r}: {bad[0][1]!r}")
    items = []
    for name in tensors:
        if not isinstance(name, str):
            raise TypeError(f"save_safetensors: tensor names must be str, not {name!r}")
        if name == "__metadata__":
            raise ValueError("save_safetensors: '__metadata__' is not a tensor name")
        items.append((name, *_tensor_bytes(name, tensors[name])))
    head, order = layout_header([(name, code, shape, buf.nbytes) for name, code, shape, buf in items], metadata)
    bufs = {name: buf for name, _, _, buf in items}
    return head, [bufs[name] for name in order]


def layout_header(
    items: list[tuple[str, str, list[int], int]], metadata: dict[str, str] | None
) -> tuple[bytes, list[str]]:
    """(8-byte length + header, the tensor names in file order) for (name, dtype code, shape,
    nbytes) items, laid out as safetensors' writer lays them out (see safetensors_bytes_layout)."""
    items = sorted(items, key=lambda it: (-ST_RANK[it[1]], it[0]))
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name, code, shape, nbytes in items:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)
    return struct.pack("<Q", len(blob)) + blob, [it[0] for it in items]


def copy_tensors_safetensors(
    tensors: dict[str, TensorInfo], path: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """Write a safetensors file whose tensors are byte ranges of other safetensors files (the
    TensorInfo of each, under the name given here), copied bit for bit and streamed a block at a
    time (no torch, never a whole tensor in memory): a checkpoint with a tensor dropped, renamed
    or taken from another model. The layout is save_safetensors' (the same bytes for the same
    tensors), written atomically."""
    path = Path(path)
    for name, info in tensors.items():
        if info.dtype not in ST_RANK:
            raise DraftportError(info.file, f"tensor {info.name!r} has dtype {info.dtype}, which cannot be copied")
    head, order = layout_header([(n, t.dtype, list(t.shape), t.nbytes) for n, t in tensors.items()], metadata)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(head)
            for name in order:
                for buf in iter_tensor_bytes(tensors[name]):
                    f.write(buf)

    atomic_write_bytes(path, write)
    return path


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    """Write `tensors` (torch tensors or numpy arrays; bf16/fp8 torch tensors included) as a
    safetensors file whose bytes depend only on the tensors and metadata: the same input gives
    the same file in every process (safetensors' own writer does not: its `__metadata__` order
    follows a per-process hash seed). Loadable by safetensors.safe_open / load_file.

    Written to a temp name and renamed (checkpoint.atomic_write_bytes): a killed write leaves no
    file under `path`, and a full disk is a DraftportError 'disk full (...)'.
    """
    path = Path(path)
    head, bufs = safetensors_bytes_layout(tensors, metadata)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(head)
            for b in bufs:
                f.write(b)

    atomic_write_bytes(path, write)
    return path


def save_drafter(
    folder: str | Path,
    cfg: DrafterConfig,
    state: dict[str, Any],
    *,
    fmt: str = "flat",
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write config.json + model.safetensors into a fresh folder, atomically (temp dir + rename).

    `state` holds exactly the tensors that were loaded or trained; nothing is invented here, so
    an untrained embed_tokens can never be exported by accident (pass it only if it was loaded).
    """
    folder = Path(folder)
    missing = sorted(set(REQUIRED_KEYS) - set(state))
    if missing:
        raise DraftportError(folder, f"refusing to save a drafter without {', '.join(missing)}")
    unexpected = sorted(set(state) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS))
    if unexpected:
        raise DraftportError(folder, f"refusing to save unexpected tensors {', '.join(unexpected)}")
    with atomic_dir(folder) as tmp:
        if fmt == "flat":
            tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
            conf = cfg.to_flat_dict()
        elif fmt == "speculators":
            tensors = {to_speculators_name(k): v.detach().contiguous().cpu() for k, v in state.items()}
            conf = speculators_config_dict(cfg)
        else:
            raise DraftportError(folder, f"unknown checkpoint format {fmt!r} (flat or speculators)")
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt", **(metadata or {})})
        (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return folder


def speculators_config_dict(cfg: DrafterConfig) -> dict[str, Any]:
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
    }
    out = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "norm_before_residual": cfg.norm_before_residual,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids or []),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.extra.get("verifier"), "architectures": []},
        },
    }
    if cfg.aux_convention:
        out["draftport_aux_convention"] = cfg.aux_convention
    return out
