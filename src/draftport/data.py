"""Feature shards: what the target computed on each training sample.

A feature folder holds shard_NNNNN.safetensors files and index.json. Per shard, samples are
concatenated along the token axis:
    tokens [N] int32, loss_mask [N] bool (assistant tokens), aux [N, 3H], final [N, H],
    offsets [n+1] int64 (sample i = rows offsets[i]:offsets[i+1]), response_start [n] int64,
    target_arg [N] int32 (optional): the target's full-vocab greedy choice at each position, taken
    from the full-precision forward. Training then needs only the draft-vocab rows of the target
    head, and evaluation compares drafts with exactly what the target chose (bf16 storage of
    `final` can flip near-tied argmaxes).
index.json records sample/token counts, dtype, hidden size, aux layer ids and their convention,
the target's id and revision, and each shard's sha256 (checked before a shard is trusted).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import atomic_dir, atomic_write_text, save_safetensors
from .checkpoint import sha256 as sha256_file
from .errors import DraftportError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Batch:
    aux: torch.Tensor        # [B, T, 3*Ht]
    final: torch.Tensor      # [B, T, Ht] target's last hidden state after its final norm
    tokens: torch.Tensor     # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool: token t is an assistant token
    valid: torch.Tensor      # [B, T] bool: not padding
    # [B, T] long, optional: the target's full-vocab argmax at each position, when the capture
    # stored it; the fused loss then needs only the draft-vocab rows of the target head.
    target_arg: torch.Tensor | None = None

    def to(self, device, dtype=None):
        f = (lambda t: t.to(device=device, dtype=dtype)) if dtype else (lambda t: t.to(device))
        return Batch(f(self.aux), f(self.final), self.tokens.to(device), self.loss_mask.to(device),
                     self.valid.to(device),
                     None if self.target_arg is None else self.target_arg.to(device))


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", n_aux: int = 3) -> int:
    """(3 aux + final) states x H x element size, + token id and mask."""
    return (n_aux + 1) * hidden_size * DTYPES[dtype].itemsize + 4 + 1


def check_disk(folder: Path, need: int, log=print) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    log(f"storage: need ~{human(need)}, free {human(free)} at {folder}")
    if need * 1.05 > free:
        raise DraftportError(folder, f"not enough disk for the features: need ~{human(need)}, {human(free)} free")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n}"


@dataclass
class Sequence:
    tokens: list[int]
    response_start: int


def write_features(out_dir: str | Path, sequences: list[Sequence], featurize, *, meta: dict,
                   shard_samples: int = 256, batch_size: int = 16, dtype: str = "bfloat16",
                   progress=None) -> dict:
    """Run featurize(batch_of_sequences) -> (aux [B,T,3H], final [B,T,H][, target_arg [B,T]])
    and write shards.

    Everything is written into a temporary sibling folder that replaces out_dir at the end, so
    an interrupted run never leaves a folder a later step would trust.
    """
    out_dir = Path(out_dir)
    if not sequences:
        raise DraftportError(out_dir, "no samples to featurize (empty dataset)")
    td = DTYPES[dtype]
    try:
        return _write_shards(out_dir, sequences, featurize, meta, shard_samples, batch_size, dtype, td, progress)
    except Exception as e:
        from .checkpoint import disk_full_error

        full = disk_full_error(e, out_dir)
        if full is None:
            raise
        raise DraftportError(out_dir, f"{full}; no features written (the folder is as it was before)") from None


def _write_shards(out_dir: Path, sequences, featurize, meta, shard_samples, batch_size, dtype, td, progress) -> dict:
    with atomic_dir(out_dir) as tmp:
        shards, total_tokens, hidden = [], 0, None
        for s0 in range(0, len(sequences), shard_samples):
            chunk = sequences[s0: s0 + shard_samples]
            parts = {"aux": [], "final": [], "tokens": [], "loss_mask": [], "target_arg": []}
            for b0 in range(0, len(chunk), batch_size):
                bseq = chunk[b0: b0 + batch_size]
                aux, final, *arg = featurize(bseq)
                for i, sq in enumerate(bseq):
                    n = len(sq.tokens)
                    if arg:
                        parts["target_arg"].append(arg[0][i, :n].to(torch.int32).cpu())
                    parts["aux"].append(aux[i, :n].to(td).cpu())
                    parts["final"].append(final[i, :n].to(td).cpu())
                    parts["tokens"].append(torch.tensor(sq.tokens, dtype=torch.int32))
                    m = torch.zeros(n, dtype=torch.bool)
                    m[sq.response_start:] = True
                    parts["loss_mask"].append(m)
                if progress is not None:
                    progress(len(bseq))
            lens = torch.tensor([len(sq.tokens) for sq in chunk], dtype=torch.int64)
            tensors = {k: torch.cat(v) for k, v in parts.items() if v}
            tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            tensors["response_start"] = torch.tensor([sq.response_start for sq in chunk], dtype=torch.int64)
            hidden = tensors["final"].shape[1]
            name = f"shard_{len(shards):05d}.safetensors"
            save_safetensors(tensors, tmp / name)
            shards.append({"file": name, "samples": len(chunk), "tokens": int(lens.sum()),
                           "sha256": sha256_file(tmp / name)})
            total_tokens += int(lens.sum())
        index = dict(meta)
        index.update(samples=len(sequences), tokens=total_tokens, dtype=dtype, hidden_size=hidden,
                     bytes_per_token=bytes_per_token(hidden, dtype), shards=shards)
        atomic_write_text(tmp / "index.json", json.dumps(index, indent=2) + "\n")
    return index


class FeatureSet:
    """Random access to the samples of a feature folder (shards opened lazily)."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        idx_path = self.folder / "index.json"
        if not idx_path.is_file():
            raise DraftportError(self.folder, "not a feature folder (no index.json)")
        try:
            self.index = json.loads(idx_path.read_text())
        except json.JSONDecodeError as e:
            raise DraftportError(idx_path, f"corrupt index ({e})") from None
        if not self.index.get("samples"):
            raise DraftportError(idx_path, "feature folder holds no samples (empty dataset)")
        self.shards = []
        self.where = []  # sample -> (shard, local index)
        for si, sh in enumerate(self.index["shards"]):
            path = self.folder / sh["file"]
            if not path.is_file():
                raise DraftportError(path, "feature shard listed in index.json is missing")
            if verify and sha256_file(path) != sh["sha256"]:
                raise DraftportError(path, "feature shard is corrupted (sha256 differs from index.json)")
            self.shards.append(None)
            self.where.extend((si, i) for i in range(sh["samples"]))

    def __len__(self):
        return len(self.where)

    def _shard(self, si):
        if self.shards[si] is None:
            from safetensors.torch import load_file
            path = self.folder / self.index["shards"][si]["file"]
            try:
                self.shards[si] = load_file(str(path))
            except Exception as e:  # safetensors raises its own error types
                raise DraftportError(path, f"cannot read feature shard ({e})") from None
        return self.shards[si]

    def sample(self, i: int) -> dict:
        si, li = self.where[i]
        sh = self._shard(si)
        a, b = int(sh["offsets"][li]), int(sh["offsets"][li + 1])
        out = {"tokens": sh["tokens"][a:b].long(), "loss_mask": sh["loss_mask"][a:b],
               "aux": sh["aux"][a:b], "final": sh["final"][a:b],
               "response_start": int(sh["response_start"][li])}
        if "target_arg" in sh:
            out["target_arg"] = sh["target_arg"][a:b].long()
        return out


class FeatureChain:
    """The first `n` samples of several feature folders read one after another (a prefix of one
    capture split over steps: Phase 1's samples, then Phase 2's), as one FeatureSet. The folders
    must be captures of the same prompt file in order (each one's offset = where the one before
    ended) with the same layers, convention and hidden size: the chain is then exactly the
    capture of the first n prompts, and `prompts` says which ([offset, offset + n))."""

    META = ("aux_layer_ids", "aux_convention", "hidden_size")

    def __init__(self, sets: list[FeatureSet], n: int | None = None):
        if not sets:
            raise DraftportError("features", "no feature folders to chain")
        first = sets[0].index
        for prev, fs in zip(sets, sets[1:]):
            for key in self.META:
                if fs.index.get(key) != first.get(key):
                    raise DraftportError(fs.folder, f"{key} {fs.index.get(key)} differs from {sets[0].folder}'s "
                                         f"{first.get(key)}: not one capture")
            end = prev.index.get("offset", 0) + len(prev)
            if fs.index.get("samples_file") != prev.index.get("samples_file") or fs.index.get("offset", 0) != end:
                raise DraftportError(fs.folder, f"does not continue {prev.folder} (prompts "
                                     f"{fs.index.get('samples_file')} from {fs.index.get('offset', 0)}, expected "
                                     f"{prev.index.get('samples_file')} from {end})")
        total = sum(len(fs) for fs in sets)
        if n is not None and not 1 <= n <= total:
            raise DraftportError("n_samples", f"{n} samples asked, the features hold {total} "
                                 f"({', '.join(str(fs.folder) for fs in sets)})")
        self.sets, self.n = sets, total if n is None else n
        self.index = {**{k: first.get(k) for k in self.META}, "samples": self.n,
                      "samples_file": first.get("samples_file"), "offset": first.get("offset", 0)}
        self.where = [(j, i) for j, fs in enumerate(sets) for i in range(len(fs))][: self.n]

    @property
    def prompts(self) -> tuple[str | None, int, int]:
        """(prompt file, first line, end line) of the samples: [start, end)."""
        return self.index["samples_file"], self.index["offset"], self.index["offset"] + self.n

    def __len__(self):
        return self.n

    def sample(self, i: int) -> dict:
        j, li = self.where[i]
        return self.sets[j].sample(li)


def prompt_range(fs) -> tuple[str | None, int, int]:
    """(prompt file, start, end) of a FeatureSet or FeatureChain."""
    if isinstance(fs, FeatureChain):
        return fs.prompts
    off = int(fs.index.get("offset", 0))
    return fs.index.get("samples_file"), off, off + len(fs)


def check_disjoint(train, held_out, where: str) -> None:
    """A held-out set must share no prompt with the training set (same file, overlapping lines)."""
    fa, a0, a1 = prompt_range(train)
    fb, b0, b1 = prompt_range(held_out)
    if fa is not None and fa == fb and a0 < b1 and b0 < a1:
        raise DraftportError(where, f"the held-out set (prompts {b0}-{b1 - 1} of {fb}) overlaps the training "
                             f"prompts ({a0}-{a1 - 1}): it would measure memorized answers")


def collate(samples: list[dict], dtype=torch.float32) -> tuple[Batch, list[int]]:
    """Right-pad a list of samples into a Batch (+ their response starts)."""
    B, T = len(samples), max(s["tokens"].shape[0] for s in samples)
    H3, H = samples[0]["aux"].shape[1], samples[0]["final"].shape[1]
    aux = torch.zeros(B, T, H3, dtype=dtype)
    final = torch.zeros(B, T, H, dtype=dtype)
    tokens = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    has_arg = all("target_arg" in s for s in samples)
    t_arg = torch.zeros(B, T, dtype=torch.long) if has_arg else None
    for i, s in enumerate(samples):
        n = s["tokens"].shape[0]
        aux[i, :n], final[i, :n] = s["aux"].to(dtype), s["final"].to(dtype)
        tokens[i, :n], mask[i, :n], valid[i, :n] = s["tokens"], s["loss_mask"], True
        if has_arg:
            t_arg[i, :n] = s["target_arg"]
    return Batch(aux, final, tokens, mask, valid, t_arg), [s["response_start"] for s in samples]


def iter_batches(fs: FeatureSet, ids: list[int], batch_size: int, dtype=torch.float32):
    for s in range(0, len(ids), batch_size):
        yield collate([fs.sample(i) for i in ids[s: s + batch_size]], dtype)
