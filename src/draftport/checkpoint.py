"""Drafter checkpoints: header-only inspection, loading and atomic saving.

A drafter folder holds config.json and one or more *.safetensors files. The flat format names
the decoder layer `midlayer.*`; the speculators format names it `layers.0.*`. Everything a user
may point us at is validated from the header before a byte of tensor data is read, and pickle
files (.bin/.pt/.pth) are refused outright.

The header functions import neither torch nor safetensors: `draftport compare` reads two
multi-GB checkpoints in well under a second.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import DrafterConfig, read_config
from .errors import DraftportError

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
NP_DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
             "I64": np.int64, "F16": np.float16, "F32": np.float32, "F64": np.float64}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
MAX_HEADER = 100 * 1024 * 1024

# Tensors every EAGLE-3 drafter holds (flat names). embed_tokens is optional: frozen, from the target.
LAYER_KEYS = (
    "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
REQUIRED_KEYS = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d") + tuple(
    f"midlayer.{k}" for k in LAYER_KEYS)
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
    """Parse and validate a safetensors header without reading tensor data."""
    path = Path(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise DraftportError(path, "pickle checkpoints are refused (they can run code); convert to safetensors")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DraftportError(path, f"truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                # Random bytes land here too: the first 8 bytes read as an absurd header length.
                raise DraftportError(path, f"not a safetensors file or truncated: header length field says {n} bytes, the file has {size}")
            blob = f.read(n)
    except OSError as e:
        raise DraftportError(path, f"cannot read ({e.strerror})") from None
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DraftportError(path, "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise DraftportError(path, "not a safetensors file (header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    base = 8 + n
    out: dict[str, TensorInfo] = {}
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
            raise DraftportError(path, f"header lies about tensor {name!r}: {dtype}{list(shape)} needs {want} bytes, offsets give {e - s}")
        if base + e > size:
            raise DraftportError(path, f"truncated: tensor {name!r} ends at byte {base + e} but the file has {size}")
        spans.append((s, e, name))
        out[name] = TensorInfo(name, dtype, shape, path, base + s, base + e)
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise DraftportError(path, f"header lies: tensors {n0!r} and {n1!r} overlap")
        if s1 > e0:
            raise DraftportError(path, f"header lies: {s1 - e0} undescribed bytes between tensors {n0!r} and {n1!r}")
    # The safetensors loader demands that the tensors tile the data section exactly; check it here
    # so a file that passes `compare` also loads.
    if spans and spans[0][0] != 0:
        raise DraftportError(path, f"header lies: {spans[0][0]} undescribed bytes before tensor {spans[0][2]!r}")
    data_end = spans[-1][1] if spans else 0
    if base + data_end != size:
        raise DraftportError(path, f"header describes {data_end} data bytes but the file holds {size - base}")
    return out, meta


def read_tensor_np(info: TensorInfo) -> np.ndarray:
    """Read one (small) tensor's bytes into numpy; bf16 comes back as float32."""
    with open(info.file, "rb") as f:
        f.seek(info.start)
        buf = f.read(info.nbytes)
    if len(buf) != info.nbytes:
        raise DraftportError(info.file, f"truncated while reading tensor {info.name!r}")
    if info.dtype == "BF16":
        u = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16
        return u.view(np.float32).reshape(info.shape)
    if info.dtype not in NP_DTYPES:
        raise DraftportError(info.file, f"cannot read tensor {info.name!r} of dtype {info.dtype} without torch")
    return np.frombuffer(buf, dtype=NP_DTYPES[info.dtype]).reshape(info.shape)


def to_flat_name(name: str) -> str:
    """speculators -> flat naming (layers.0.* -> midlayer.*); strips a leading 'model.'."""
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def to_speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def weight_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    if folder.is_file():
        if folder.suffix in PICKLE_SUFFIXES:
            raise DraftportError(folder, "pickle checkpoints are refused (they can run code); convert to safetensors")
        raise DraftportError(folder, "expected a drafter folder (config.json + *.safetensors), got a file")
    if not folder.is_dir():
        raise DraftportError(folder, "no such drafter folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise DraftportError(folder / pickles[0], "pickle checkpoints are refused (they can run code); convert to safetensors")
        raise DraftportError(folder, "no *.safetensors weights in the drafter folder")
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
    from .vocab import check_maps

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
        "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "nbytes": t.nbytes,
                     "file": t.file.name} for t in info.tensors.values()],
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
        m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,),
        m + "post_attention_layernorm.weight": (h,),
        m + "self_attn.q_proj.weight": (q, 2 * h), m + "self_attn.k_proj.weight": (kv, 2 * h),
        m + "self_attn.v_proj.weight": (kv, 2 * h), m + "self_attn.o_proj.weight": (h, q),
        m + "mlp.gate_proj.weight": (i, h), m + "mlp.up_proj.weight": (i, h),
        m + "mlp.down_proj.weight": (h, i),
        "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
        "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
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
            raise DraftportError(t.file, f"tensor {name} has shape {list(t.shape)}, config.json implies {list(want)}{hint}")


def load_drafter_state(folder: str | Path, *, require_vocab_maps: bool = True):
    """Validated (DrafterConfig, {flat_name: torch.Tensor}) from a drafter folder.

    Keys, shapes and the vocab maps are all checked before the state is handed out: a drafter
    with mismatched keys would otherwise load partly random, and a broken d2t scrambles tokens.
    """
    from safetensors import SafetensorError, safe_open

    from .vocab import check_maps

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


_FULL_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file size limit exceeded"}
# safetensors (Rust) reports the OS error inside its own message
_FULL_TEXTS = (("no space left", "no space left on device"), ("storagefull", "no space left on device"),
               ("os error 28", "no space left on device"), ("quota exceeded", "disk quota exceeded"),
               ("filetoolarge", "file size limit exceeded"), ("file too large", "file size limit exceeded"),
               ("os error 27", "file size limit exceeded"))


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


def save_drafter(folder: str | Path, cfg: DrafterConfig, state: dict[str, Any], *,
                 fmt: str = "flat", metadata: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors into a fresh folder, atomically (temp dir + rename).

    `state` holds exactly the tensors that were loaded or trained; nothing is invented here, so
    an untrained embed_tokens can never be exported by accident (pass it only if it was loaded).
    """
    from safetensors.torch import save_file

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
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", **(metadata or {})})
        (tmp / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    return folder


def speculators_config_dict(cfg: DrafterConfig) -> dict[str, Any]:
    layer = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": 1, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "rms_norm_eps": cfg.rms_norm_eps, "hidden_act": cfg.hidden_act,
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
