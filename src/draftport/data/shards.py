"""Feature shards: what the target computed on each training sample.

A feature folder holds shard_NNNNN.safetensors files and index.json. Per shard, samples are
concatenated along the token axis:
    tokens [N] int32, loss_mask [N] bool (assistant tokens), aux [N, 3H], final [N, H],
    offsets [n+1] int64 (sample i = rows offsets[i]:offsets[i+1]), response_start [n] int64,
    target_arg [N] int32 (optional): the target's full-vocab greedy choice at each position, from
    float32 logits of the final state the target computed (draftport.data.features: the target runs in
    float32 on the CPU, in bfloat16 on CUDA). Training then needs only the draft-vocab rows of the
    target head, and evaluation compares drafts with exactly what the target chose (bf16 or fp8
    storage of `final` can flip near-tied argmaxes).
Storage dtype (index.json "dtype"): bfloat16 (the default), float16, float32, or fp8_e4m3: aux and
final as float8_e4m3fn with float32 scales beside them, aux_scale [N, 3] (one per token and aux
layer: layers differ in magnitude) and final_scale [N]; each row segment is scaled by the power of
two that brings its amax within e4m3's 448 (quantize_fp8), and FeatureSet.sample returns the
dequantized float32 states, so trainers and evaluators read every dtype alike. fp8 halves the
bytes per token.
index.json records sample/token counts, dtype, hidden size, aux layer ids and their convention,
the target's id and revision, and each shard's sha256 (checked before a shard is trusted).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from draftport.errors import DraftportError
from draftport.files import sha256 as sha256_file

# the layout of save_safetensors' files, used to write a shard in place (see _ShardFile)
from draftport.model.formats import (
    TORCH_CODES,
    atomic_dir,
    atomic_write_text,
    disk_full_error,
    layout_header,
    save_safetensors,
)

FP8 = "fp8_e4m3"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, FP8: torch.float8_e4m3fn}
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SETS_FILE = "sets.json"  # a held-out folder's named eval sets: {sets: [{name, share, start, count}]}
SCALE_BYTES = 4  # fp8: one float32 scale per token per state (each aux layer, the final state)


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, groups * H] -> (q [N, groups * H] float8_e4m3fn, scale [N, groups] float32). Each
    row's group (one aux layer's state, or the final state) is divided by its own scale, the least
    power of two that brings its amax within 448 (e4m3's largest finite value), so every token
    keeps e4m3's relative precision (3 mantissa bits: a rounding error of at most 2^-4 of the
    value, for values down to 2^-14 of the group's amax; under that, e4m3's subnormals: at most
    2^-10 of the scale) whatever its magnitude. A power of two scales
    exactly: the only rounding is e4m3's own, the same on every device (a GPU folder is the CPU's
    byte for byte), and q * scale is exact in float32 and bfloat16. An all-zero group: scale 1."""
    n = x.shape[0]
    g = x.float().reshape(n, groups, -1)
    amax = g.abs().amax(-1)
    m, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1); 448 = 0.875 * 2^9
    e = (e - 9 + (m > 0.875).to(e.dtype)).clamp(-126, 127)
    scale = torch.where(amax > 0, ((e + 127) << 23).to(torch.int32).view(torch.float32), 1.0)
    q = (g / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(n, -1), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """quantize_fp8's inverse up to its rounding: q [N, groups * H], scale [N, groups] -> float32."""
    n, groups = scale.shape[0], scale.shape[1]
    return (q.float().reshape(n, groups, -1) * scale.float()[..., None]).reshape(n, -1)


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3*Ht]
    final: torch.Tensor  # [B, T, Ht] target's last hidden state after its final norm
    tokens: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool: token t is an assistant token
    valid: torch.Tensor  # [B, T] bool: not padding
    # [B, T] long, optional: the target's full-vocab argmax at each position, when the capture
    # stored it; the fused loss then needs only the draft-vocab rows of the target head.
    target_arg: torch.Tensor | None = None
    # the share of rows that are assistant tokens and not padding, read on the host (to() fills
    # it from a host batch): the fused loss reads it to know, without waiting on the device,
    # that too few rows lie outside the loss for skipping them to pay (FastPath.skip_uncounted)
    loss_share: float | None = None

    def host_loss_share(self) -> float | None:
        """loss_share, or computed here when the masks are host tensors (None on a device)."""
        if self.loss_share is not None or self.loss_mask.device.type != "cpu":
            return self.loss_share
        return float((self.loss_mask.bool() & self.valid.bool()).sum()) / max(1, self.loss_mask.numel())

    def to(self, device, dtype=None, non_blocking: bool = False):
        """On `device` (non_blocking: the copies queued behind the device's work, from pinned
        host memory: pin() first)."""
        nb = non_blocking

        def f(t):
            return t.to(device=device, dtype=dtype, non_blocking=nb) if dtype else t.to(device, non_blocking=nb)

        return Batch(
            f(self.aux),
            f(self.final),
            self.tokens.to(device, non_blocking=nb),
            self.loss_mask.to(device, non_blocking=nb),
            self.valid.to(device, non_blocking=nb),
            None if self.target_arg is None else self.target_arg.to(device, non_blocking=nb),
            loss_share=self.host_loss_share(),
        )

    def pin(self):
        """This batch with its host tensors in page-locked memory (a copy to the GPU then runs
        behind the GPU's work instead of holding the host until it is done)."""
        changes = {
            f.name: getattr(self, f.name).pin_memory()
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor) and getattr(self, f.name).device.type == "cpu"
        }
        return dataclasses.replace(self, loss_share=self.host_loss_share(), **changes)


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", n_aux: int = 3) -> int:
    """(3 aux + final) states x H x element size, + token id and mask; fp8_e4m3: + the float32
    scale of each of those states. An unknown dtype: KeyError."""
    scales = (n_aux + 1) * SCALE_BYTES if dtype == FP8 else 0
    return (n_aux + 1) * hidden_size * DTYPES[dtype].itemsize + scales + 4 + 1


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


def write_features(
    out_dir: str | Path,
    sequences: list[Sequence],
    featurize,
    *,
    meta: dict,
    shard_samples: int = 256,
    batch_size: int = 16,
    dtype: str = "bfloat16",
    progress=None,
    by_length: bool = False,
    sort_window: int | None = None,
    writers: int | None = None,
) -> dict:
    """Run featurize(batch_of_sequences) -> (aux [B,T,3H], final [B,T,H][, target_arg [B,T]]),
    right-padded, on any device, and write shards. featurize must return new tensors at each
    call (they are written while the next batch runs).

    by_length: the samples are batched longest first within windows of `sort_window` samples
    (whole shards; default: max(shard_samples, 16 x batch_size)), so that a batch holds samples
    of similar lengths and little of it is padding (a log-normal mix of mean 1.5K tokens, at most
    2048, batches of 16: 27% padding in input order, 3% sorted over 256 samples); the shards hold
    the samples in the input order either way. Off by default: a featurize that reads anything
    in call order (the vLLM path's per-sequence files) needs the input order.
    The host side runs beside the next batch's forward (_ShardWriter): the states leave the
    device without their padding, through pinned buffers when it is a GPU; one thread writes each
    batch's rows in place into their shards and has the disk write them back as they come;
    `writers` threads (default: a quarter of the cores, 1 to 4) hash and sync each finished
    shard. The files are those the former writer made: a shard's bytes are save_safetensors' for
    the same tensors.

    Everything is written into a temporary sibling folder that replaces out_dir at the end, so
    an interrupted run never leaves a folder a later step would trust.
    """
    out_dir = Path(out_dir)
    if not sequences:
        raise DraftportError(out_dir, "no samples to featurize (empty dataset)")
    if dtype not in DTYPES:
        raise DraftportError("features.dtype", f"{dtype!r} is not a storage dtype ({', '.join(DTYPES)})")
    try:
        window = -(-(sort_window or max(shard_samples, 16 * batch_size)) // shard_samples) * shard_samples
        return _write_shards(
            out_dir,
            sequences,
            featurize,
            meta,
            shard_samples,
            batch_size,
            dtype,
            progress,
            window if by_length else None,
            writers,
        )
    except Exception as e:
        full = disk_full_error(e, out_dir)
        if full is None:
            raise
        raise DraftportError(out_dir, f"{full}; no features written (the folder is as it was before)") from None


def _write_shards(
    out_dir: Path, sequences, featurize, meta, shard_samples, batch_size, dtype, progress, window, writers
) -> dict:
    """window: the samples (whole shards) batched longest first together; None: each shard's in
    input order, as the former writer batched them."""
    with atomic_dir(out_dir) as tmp:
        files: list[_ShardFile] = []
        writer = _ShardWriter(writers)
        try:
            for w0 in range(0, len(sequences), window or shard_samples):
                group = []
                for s0 in range(w0, min(w0 + (window or shard_samples), len(sequences)), shard_samples):
                    files.append(
                        _ShardFile(tmp / f"shard_{len(files):05d}.safetensors", sequences[s0 : s0 + shard_samples])
                    )
                    group += [(files[-1], i) for i in range(len(files[-1].chunk))]
                if window:  # longest first (stable): a batch too large for the device fails at once
                    group.sort(key=lambda fi: -len(fi[0].chunk[fi[1]].tokens))
                for b0 in range(0, len(group), batch_size):
                    part = group[b0 : b0 + batch_size]
                    bseq = [f.chunk[i] for f, i in part]
                    aux, final, *arg = featurize(bseq)
                    writer.put(part, _Rows(_pack(bseq, aux, final, arg[0] if arg else None, dtype)))
                    if progress is not None:
                        progress(len(bseq))
            shards = writer.close(files)
        except BaseException:
            writer.abort(files)
            raise
        hidden, n_aux = files[-1].hidden, files[-1].n_aux
        index = dict(meta)
        index.update(
            samples=len(sequences),
            tokens=sum(sh["tokens"] for sh in shards),
            dtype=dtype,
            hidden_size=hidden,
            bytes_per_token=bytes_per_token(hidden, dtype, n_aux),
            shards=shards,
        )
        atomic_write_text(tmp / "index.json", json.dumps(index, indent=2) + "\n")
    return index


def _pack(bseq: list[Sequence], aux, final, arg, dtype: str) -> dict[str, torch.Tensor]:
    """One batch's states without their padding (rows of sample after sample, in batch order), in
    the storage dtype (fp8: with their scales), on the device that computed them."""
    lens = [len(sq.tokens) for sq in bseq]
    B, T = aux.shape[0], aux.shape[1]
    if (
        B != len(bseq)
        or T < max(lens)
        or tuple(final.shape[:2]) != (B, T)
        or (arg is not None and tuple(arg.shape[:2]) != (B, T))
    ):
        raise DraftportError(
            "featurize",
            f"returned states of shapes {list(aux.shape)}, {list(final.shape)} for "
            f"{len(bseq)} sequences of up to {max(lens)} tokens",
        )
    H = final.shape[-1]
    if aux.shape[-1] % H:
        raise DraftportError("featurize", f"aux width {aux.shape[-1]} is not a multiple of the hidden size {H}")
    if all(n == T for n in lens):

        def take(t):
            return t.reshape(B * T, *t.shape[2:])
    else:  # the row index is built here (a mask's nonzero would wait for the forward)
        idx = to_device(torch.cat([torch.arange(n) + i * T for i, n in enumerate(lens)]), aux.device)

        def take(t):
            return t.reshape(B * T, *t.shape[2:]).index_select(0, idx)

    src = {"aux": aux, "final": final}
    a, f = take(aux), take(final)
    if dtype == FP8:
        out = dict(zip(("aux", "aux_scale"), quantize_fp8(a, aux.shape[-1] // H)))
        out["final"], scale = quantize_fp8(f, 1)
        out["final_scale"] = scale.reshape(-1)
    else:
        out = {"aux": a.to(DTYPES[dtype]), "final": f.to(DTYPES[dtype])}
    if arg is not None:
        src["target_arg"] = arg
        out["target_arg"] = take(arg).to(torch.int32)
    for k in src:  # never a view of featurize's output: it is written while the next batch runs
        if out[k].untyped_storage().data_ptr() == src[k].untyped_storage().data_ptr():
            out[k] = out[k].clone()
    return out


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor onto `device` without waiting for the work queued there: from pinned memory,
    asynchronously (a plain .to() from pageable memory synchronizes the stream first)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


_COPY_STREAMS: dict = {}


class _Rows:
    """One batch's packed rows on their way to the host. From a GPU: copied on a side stream into
    pinned buffers (55 GB/s against ~2 GB/s for pageable .cpu() copies on an H200 host), the
    compute stream free to start the next forward; wait() returns them once the copy is done."""

    def __init__(self, packed: dict[str, torch.Tensor]):
        dev = next(iter(packed.values())).device
        self.event, self.keep = None, None
        if dev.type != "cuda":
            self.host = packed
            return
        stream = _COPY_STREAMS.get(dev)
        if stream is None:
            stream = _COPY_STREAMS[dev] = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            self.host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in packed.items()}
            for k, v in packed.items():
                self.host[k].copy_(v, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        self.keep = packed  # the device rows must outlive the copy

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        self.keep = None
        return self.host


def _as_bytes(t: torch.Tensor):
    """[n, ...] tensor -> [n, row bytes] uint8 numpy view (no copy)."""
    t = t.contiguous()
    return t.reshape(t.shape[0] if t.dim() else 1, -1).view(torch.uint8).numpy()


def _pwrite_all(fd: int, buf, offset: int) -> None:
    mv = memoryview(buf).cast("B")
    while mv:  # a single write may take less (Linux: at most 2 GiB - 4 KiB)
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def sequence_tensors(seqs: list[Sequence], offsets: torch.Tensor) -> dict[str, torch.Tensor]:
    """A shard's small tensors for these sequences: tokens, loss_mask (the answer's tokens),
    offsets, response_start."""
    masks = []
    for sq in seqs:
        m = torch.zeros(len(sq.tokens), dtype=torch.bool)
        m[sq.response_start :] = True
        masks.append(m)
    return {
        "tokens": torch.tensor([t for sq in seqs for t in sq.tokens], dtype=torch.int32),
        "loss_mask": torch.cat(masks),
        "offsets": offsets,
        "response_start": torch.tensor([sq.response_start for sq in seqs], dtype=torch.int64),
    }


class _ShardFile:
    """One shard, written in place. The samples' lengths and the first batch's widths fix its
    layout (that of save_safetensors for the same tensors: dtype rank, then name), so each batch's
    rows go straight to where they belong (os.pwrite), in whatever order the batches come; the
    small tensors (tokens, loss_mask, offsets, response_start) are written with the header."""

    def __init__(self, path: Path, chunk: list[Sequence]):
        self.path, self.chunk = path, chunk
        lens = torch.tensor([len(sq.tokens) for sq in chunk], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        self.tokens = int(self.offsets[-1])
        self.left = len(chunk)  # samples not written yet
        self.fd = None
        self.flushing = None  # the write-back started after the last batch (a future of _try)
        self.rows: dict[str, tuple[int, int, torch.dtype, tuple]] = {}  # name -> (offset, row bytes, dtype, row shape)
        self.hidden = self.n_aux = None

    def _open(self, host: dict[str, torch.Tensor]) -> None:
        chunk, N = self.chunk, self.tokens
        small = sequence_tensors(chunk, self.offsets)
        items = [
            (k, TORCH_CODES[str(v.dtype).removeprefix("torch.")], list(v.shape), v.numel() * v.element_size())
            for k, v in small.items()
        ]
        for k, v in host.items():
            row = v[0].numel() * v.element_size() if v.shape[0] else 0
            items.append((k, TORCH_CODES[str(v.dtype).removeprefix("torch.")], [N, *v.shape[1:]], N * row))
        head, order = layout_header(items, None)
        size = {name: nbytes for name, _, _, nbytes in items}
        at, pos = {}, len(head)
        for name in order:
            at[name], pos = pos, pos + size[name]
        self.rows = {k: (at[k], size[k] // N, v.dtype, tuple(v.shape[1:])) for k, v in host.items()}
        self.hidden = int(host["final"].shape[1])
        self.n_aux = (
            int(host["aux_scale"].shape[1]) if "aux_scale" in host else int(host["aux"].shape[1]) // self.hidden
        )
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        _pwrite_all(self.fd, head, 0)
        for k, v in small.items():
            _pwrite_all(self.fd, _as_bytes(v), at[k])

    def write(self, pieces: list[tuple[int, int]], host: dict[str, torch.Tensor]) -> None:
        """pieces: (sample, its first row in host), for samples of this shard in host's order."""
        if self.fd is None:
            self._open(host)
        got = {k: (v.dtype, tuple(v.shape[1:])) for k, v in host.items()}
        want = {k: r[2:] for k, r in self.rows.items()}
        if got != want:
            raise DraftportError("featurize", f"a batch of {self.path.name} returned {got}, its first batch {want}")
        runs: list[list[int]] = []  # [row in host, row in shard, rows]: one write each
        for i, src in pieces:
            n, dst = len(self.chunk[i].tokens), int(self.offsets[i])
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
                runs[-1][2] += n
            else:
                runs.append([src, dst, n])
        for k, (at, row, _, _) in self.rows.items():
            b = _as_bytes(host[k])
            for s, d, n in runs:
                _pwrite_all(self.fd, b[s : s + n], at + d * row)
        self.left -= len(pieces)

    def finish(self) -> dict:
        """Sync the complete file to disk while hashing it (its pages are still cached): its
        index.json entry. The two at once: the last shard's are the capture's tail."""
        if self.flushing is not None and self.flushing.result() is not None:
            raise self.flushing.result()
        synced: list = []
        t = threading.Thread(target=lambda: synced.append(_try(os.fsync, self.fd)), daemon=True)
        t.start()
        try:
            digest = sha256_file(self.path)
        finally:
            t.join()
        if synced[0] is not None:
            raise synced[0]
        self.close()
        return {"file": self.path.name, "samples": len(self.chunk), "tokens": self.tokens, "sha256": digest}

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _try(fn, *args) -> BaseException | None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 (raised in the caller's thread)
        return e
    return None


class _ShardWriter:
    """The host side of a capture, off the thread that drives the target (which only queues each
    batch: its forward, its packing, its copy). One thread waits for each batch's copy, writes its
    rows into their shards and has the disk write them back (fdatasync on a flusher thread, so
    that the disk keeps pace and a shard's last sync has little left); a pool of `workers`
    threads hashes and syncs each shard once its last sample is in, while the next ones fill.
    The queue holds 2 batches, so the host holds a few batches, never a whole shard (the former
    writer held two; the page cache holds what the disk has not taken yet). An error in any of
    them is raised in the caller's thread at its next put, or at close."""

    def __init__(self, workers: int | None = None):
        workers = workers or max(1, min(4, (os.cpu_count() or 1) // 4))
        self.q: queue.Queue = queue.Queue(maxsize=2)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="draftport-shard")
        self.flusher = ThreadPoolExecutor(1, thread_name_prefix="draftport-flush")
        self.done: dict = {}  # shard -> the future of its index.json entry
        self.error: BaseException | None = None
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="draftport-writer", daemon=True)
        self.thread.start()

    def put(self, part: list[tuple[_ShardFile, int]], rows: _Rows) -> None:
        """part: the batch's samples, (shard, sample in it), in the order of their rows."""
        self._raise()
        self.q.put((part, rows))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is not None or self.stop:
                continue  # drain, so the caller never blocks on a full queue
            part, rows = item
            del item
            try:
                self._write(part, rows.wait())
            except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
                self.error = e
            del rows

    def _write(self, part, host: dict[str, torch.Tensor]) -> None:
        pieces: dict[_ShardFile, list[tuple[int, int]]] = {}
        row = 0
        for f, i in part:
            pieces.setdefault(f, []).append((i, row))
            row += len(f.chunk[i].tokens)
        for k, v in host.items():
            if v.shape[0] != row:
                raise DraftportError("featurize", f"{k}: {v.shape[0]} rows for {row} tokens")
        for f, p in pieces.items():
            f.write(p, host)
            if f.flushing is None or f.flushing.done():
                if f.flushing is not None and f.flushing.result() is not None:
                    raise f.flushing.result()
                f.flushing = self.flusher.submit(_try, os.fdatasync, f.fd)
            if f.left == 0:  # queued, never waited for: the shards of a window complete together
                self.done[f] = self.pool.submit(f.finish)

    def _raise(self) -> None:
        if self.error is None:
            self.error = next((f.exception() for f in self.done.values() if f.done() and f.exception()), None)
        if self.error is not None:
            raise self.error

    def close(self, files: list[_ShardFile]) -> list[dict]:
        """The index.json entries of `files`, in their order, once all are written and synced."""
        self.q.put(None)
        self.thread.join()
        self._raise()
        missing = [f.path.name for f in files if f not in self.done]
        if missing:
            raise DraftportError(files[0].path.parent, f"shards never completed: {', '.join(missing)}")
        out = [self.done[f].result() for f in files]
        self.pool.shutdown()
        self.flusher.shutdown()
        return out

    def abort(self, files: list[_ShardFile]) -> None:
        """Stop every thread before the temporary folder goes (no write into a removed folder)."""
        self.stop = True
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.flusher.shutdown(wait=True)
        for f in files:
            f.close()


def read_index(folder: Path, what: str) -> tuple[Path, dict]:
    """(path, parsed) of folder/index.json; one-line errors when it is missing or not JSON."""
    idx_path = folder / "index.json"
    if not idx_path.is_file():
        raise DraftportError(folder, f"not a {what} folder (no index.json)")
    try:
        return idx_path, json.loads(idx_path.read_text())
    except json.JSONDecodeError as e:
        raise DraftportError(idx_path, f"corrupt index ({e})") from None


class FeatureSet:
    """Random access to the samples of a feature folder (shards opened lazily)."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        idx_path, self.index = read_index(self.folder, "feature")
        if not self.index.get("samples"):
            raise DraftportError(idx_path, "feature folder holds no samples (empty dataset)")
        if self.index.get("storage") in ("online", "hybrid"):
            raise DraftportError(
                self.folder,
                f"holds sequences without their states (features.storage "
                f"{self.index['storage']}): the training step captures them",
            )
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
        self.fp8 = self.index.get("dtype") == FP8

    def __len__(self):
        return len(self.where)

    def _shard(self, si):
        if self.shards[si] is None:
            path = self.folder / self.index["shards"][si]["file"]
            try:
                sh = load_file(str(path))
            except Exception as e:  # safetensors raises its own error types
                raise DraftportError(path, f"cannot read feature shard ({e})") from None
            self._check_dtype(path, sh)
            self.shards[si] = sh
        return self.shards[si]

    def _check_dtype(self, path: Path, sh: dict) -> None:
        """The states are stored as index.json says; fp8: with one finite positive float32 scale
        per token and state (aux_scale [N, states in aux], final_scale [N])."""
        fp8 = [k for k in ("aux", "final") if k in sh and sh[k].dtype == torch.float8_e4m3fn]
        if not self.fp8:
            if fp8:
                raise DraftportError(
                    path,
                    f"{fp8[0]} is stored as float8_e4m3fn but index.json says "
                    f"{self.index.get('dtype')}: its scales would be ignored",
                )
            return
        n = sh["tokens"].shape[0]
        H = sh["final"].shape[1] if sh["final"].dim() == 2 else 0
        for k in ("aux", "final"):
            if k not in fp8:
                raise DraftportError(path, f"{k} is stored as {sh[k].dtype}, index.json says fp8_e4m3")
        want = {"aux_scale": (n, sh["aux"].shape[1] // H if H else 0), "final_scale": (n,)}
        for k, shape in want.items():
            s = sh.get(k)
            if s is None:
                raise DraftportError(path, f"fp8_e4m3 shard without {k} (the states cannot be dequantized)")
            if s.dtype != torch.float32 or tuple(s.shape) != shape:
                raise DraftportError(
                    path,
                    f"{k} is {s.dtype} {list(s.shape)}, expected float32 {list(shape)} "
                    f"(one scale per token{' and aux layer' if k == 'aux_scale' else ''})",
                )
            bad = int((~torch.isfinite(s) | (s <= 0)).sum())
            if bad:
                raise DraftportError(path, f"{k} holds {bad} non-finite or non-positive scales (corrupt shard)")

    def length(self, i: int) -> int:
        """Sample i's tokens, read from its shard's offsets alone (no states loaded)."""
        si, li = self.where[i]
        offsets = self._offsets(si)
        return int(offsets[li + 1] - offsets[li])

    def _offsets(self, si: int) -> torch.Tensor:
        if self.shards[si] is not None:
            return self.shards[si]["offsets"]
        cache = self.__dict__.setdefault("_offsets_cache", {})
        if si not in cache:
            path = self.folder / self.index["shards"][si]["file"]
            try:
                with safe_open(str(path), "pt") as f:
                    cache[si] = f.get_tensor("offsets")
            except Exception as e:  # safetensors raises its own error types
                raise DraftportError(path, f"cannot read feature shard ({e})") from None
        return cache[si]

    def sample(self, i: int) -> dict:
        si, li = self.where[i]
        sh = self._shard(si)
        a, b = int(sh["offsets"][li]), int(sh["offsets"][li + 1])
        aux, final = sh["aux"][a:b], sh["final"][a:b]
        if self.fp8:  # float32, as a float32 folder reads
            aux = dequantize_fp8(aux, sh["aux_scale"][a:b])
            final = dequantize_fp8(final, sh["final_scale"][a:b, None])
        out = {
            "tokens": sh["tokens"][a:b].long(),
            "loss_mask": sh["loss_mask"][a:b],
            "aux": aux,
            "final": final,
            "response_start": int(sh["response_start"][li]),
        }
        if "target_arg" in sh:
            out["target_arg"] = sh["target_arg"][a:b].long()
        return out


SEQUENCES = "sequences.safetensors"
# what a feature folder's index.json says of where its samples come from (build_features' meta):
# a capture of a sequences folder's samples carries it over to the shards it writes
CAPTURE_META = (
    "aux_layer_ids",
    "aux_convention",
    "target",
    "regenerated",
    "samples_file",
    "offset",
    "num_target_layers",
)


def capture_meta(index: dict) -> dict:
    """The CAPTURE_META entries of a folder's (or a chain's) index."""
    return {k: v for k, v in index.items() if k in CAPTURE_META}


def write_sequences(out_dir: str | Path, sequences: list[Sequence], *, meta: dict, capture: dict) -> dict:
    """A folder of sequences without their states (features.storage online / hybrid): the
    training step captures them itself (draftport.training.spool). One file, sequences.safetensors:
    tokens [N] int32, loss_mask [N] bool, offsets [n+1] int64, response_start [n] int64 (a
    feature shard's small tensors), and index.json: the meta a feature folder records, its
    counts, `storage`, `capture` (how the states are to be captured: engine, storage dtype,
    batch size, ...; the training step reads it, so a change reruns what trains on it), the
    hidden size and bytes per token the capture will give, and the file's sha256. Written into
    a temporary sibling folder renamed into place."""
    out_dir = Path(out_dir)
    if not sequences:
        raise DraftportError(out_dir, "no samples to write (empty dataset)")
    dtype = capture.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        raise DraftportError("features.dtype", f"{dtype!r} is not a storage dtype ({', '.join(DTYPES)})")
    lens = torch.tensor([len(sq.tokens) for sq in sequences], dtype=torch.int64)
    tensors = sequence_tensors(sequences, torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]))
    hidden, n_aux = int(capture["hidden_size"]), len(meta.get("aux_layer_ids") or (0, 0, 0))
    with atomic_dir(out_dir) as tmp:
        save_safetensors(tensors, tmp / SEQUENCES)
        index = dict(meta)
        index.update(
            samples=len(sequences),
            tokens=int(lens.sum()),
            storage=capture["storage"],
            dtype=dtype,
            hidden_size=hidden,
            bytes_per_token=bytes_per_token(hidden, dtype, n_aux),
            capture=dict(capture),
            sequences={"file": SEQUENCES, "sha256": sha256_file(tmp / SEQUENCES)},
            shards=[],
        )
        atomic_write_text(tmp / "index.json", json.dumps(index, indent=2) + "\n")
    return index


def is_sequences(folder: str | Path) -> bool:
    """Whether folder is a sequences folder (write_sequences), not a feature folder."""
    try:
        return json.loads((Path(folder) / "index.json").read_text()).get("storage") in ("online", "hybrid")
    except (OSError, json.JSONDecodeError):
        return False


class SequenceSet:
    """The samples of a sequences folder (write_sequences): sample(i) gives what a FeatureSet's
    does without the states (tokens, loss_mask, response_start); sequence(i) the Sequence the
    capture runs on. Checked as a FeatureSet is: index.json parsed, the file's sha256."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        idx_path, self.index = read_index(self.folder, "sequences")
        ent = self.index.get("sequences")
        if (
            not isinstance(ent, dict)
            or not self.index.get("samples")
            or not isinstance(self.index.get("capture"), dict)
        ):
            raise DraftportError(idx_path, "not a sequences index (no sequences file, samples or capture settings)")
        path = self.folder / str(ent.get("file"))
        if not path.is_file():
            raise DraftportError(path, "sequences file listed in index.json is missing")
        if verify and sha256_file(path) != ent.get("sha256"):
            raise DraftportError(path, "sequences file is corrupted (sha256 differs from index.json)")
        try:
            t = load_file(str(path))
        except Exception as e:  # safetensors raises its own error types
            raise DraftportError(path, f"cannot read the sequences ({e})") from None
        want = {"tokens": 1, "loss_mask": 1, "offsets": 1, "response_start": 1}
        if (
            any(k not in t or t[k].dim() != d for k, d in want.items())
            or t["offsets"].shape[0] != self.index["samples"] + 1
            or int(t["offsets"][-1]) != t["tokens"].shape[0]
        ):
            raise DraftportError(
                path, f"does not hold {self.index['samples']} sequences (tokens, loss_mask, offsets, response_start)"
            )
        self.t = t

    def __len__(self):
        return int(self.index["samples"])

    def length(self, i: int) -> int:
        return int(self.t["offsets"][i + 1] - self.t["offsets"][i])

    def sequence(self, i: int) -> Sequence:
        a, b = int(self.t["offsets"][i]), int(self.t["offsets"][i + 1])
        return Sequence(self.t["tokens"][a:b].tolist(), int(self.t["response_start"][i]))

    def sample(self, i: int) -> dict:
        a, b = int(self.t["offsets"][i]), int(self.t["offsets"][i + 1])
        return {
            "tokens": self.t["tokens"][a:b].long(),
            "loss_mask": self.t["loss_mask"][a:b],
            "response_start": int(self.t["response_start"][i]),
        }


def open_set(folder: str | Path, verify: bool = True):
    """A FeatureSet, or a SequenceSet for a folder written by features.storage online / hybrid."""
    return SequenceSet(folder, verify) if is_sequences(folder) else FeatureSet(folder, verify)


CHAIN_FILE = "chain.json"  # a folder of feature folders captured one after another (the adaptive budget's rounds)


def chain_parts(folder) -> list[Path]:
    """A feature folder as the list of folders it reads: itself, or, for a chain folder (chain.json
    lists its parts, in order), those parts."""
    folder = Path(folder)
    f = folder / CHAIN_FILE
    if not f.is_file():
        return [folder]
    try:
        parts = json.loads(f.read_text())["parts"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DraftportError(f, 'not a chain of feature folders (no readable "parts" list)') from None
    return [folder / p for p in parts]


def write_chain(folder, parts: list[str], summary: dict) -> None:
    """folder/chain.json: its parts (subfolders, in capture order) and a summary of them (samples,
    tokens, prompt file, offset: what a feature folder's index.json says of its samples)."""
    atomic_write_text(Path(folder) / CHAIN_FILE, json.dumps({"parts": parts, **summary}, indent=2) + "\n")


class FeatureChain:
    """The first `n` samples of several feature folders read one after another (a prefix of one
    capture split over steps: Phase 1's samples, then Phase 2's), as one FeatureSet. The folders
    must be captures of the same prompt file in order (each one's offset = where the one before
    ended) with the same layers, convention and hidden size: the chain is then exactly the
    capture of the first n prompts, and `prompts` says which ([offset, offset + n))."""

    META = ("aux_layer_ids", "aux_convention", "hidden_size", "storage", "capture")

    def __init__(self, sets: list[FeatureSet], n: int | None = None):
        if not sets:
            raise DraftportError("features", "no feature folders to chain")
        first = sets[0].index
        for prev, fs in zip(sets, sets[1:]):
            for key in self.META:
                if fs.index.get(key) != first.get(key):
                    raise DraftportError(
                        fs.folder,
                        f"{key} {fs.index.get(key)} differs from {sets[0].folder}'s {first.get(key)}: not one capture",
                    )
            end = prev.index.get("offset", 0) + len(prev)
            if fs.index.get("samples_file") != prev.index.get("samples_file") or fs.index.get("offset", 0) != end:
                raise DraftportError(
                    fs.folder,
                    f"does not continue {prev.folder} (prompts "
                    f"{fs.index.get('samples_file')} from {fs.index.get('offset', 0)}, expected "
                    f"{prev.index.get('samples_file')} from {end})",
                )
        total = sum(len(fs) for fs in sets)
        if n is not None and not 1 <= n <= total:
            raise DraftportError(
                "n_samples",
                f"{n} samples asked, the features hold {total} ({', '.join(str(fs.folder) for fs in sets)})",
            )
        self.sets, self.n = sets, total if n is None else n
        self.index = {
            **{k: first.get(k) for k in self.META},
            "samples": self.n,
            "samples_file": first.get("samples_file"),
            "offset": first.get("offset", 0),
        }
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

    def sequence(self, i: int) -> Sequence:
        """A chain of SequenceSets: sample i's Sequence."""
        j, li = self.where[i]
        return self.sets[j].sequence(li)

    def length(self, i: int) -> int:
        """A chain of SequenceSets: sample i's tokens."""
        j, li = self.where[i]
        return self.sets[j].length(li)


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
        raise DraftportError(
            where,
            f"the held-out set (prompts {b0}-{b1 - 1} of {fb}) overlaps the training "
            f"prompts ({a0}-{a1 - 1}): it would measure memorized answers",
        )


def batch_buffers(samples: list[dict], B: int, T: int, dtype=torch.float32):
    """Zeroed [B, T] buffers for samples' fields: aux, final, tokens, loss mask, valid, and
    target_arg (None unless every sample has one)."""
    H3, H = samples[0]["aux"].shape[1], samples[0]["final"].shape[1]
    has_arg = all("target_arg" in s for s in samples)
    return (
        torch.zeros(B, T, H3, dtype=dtype),
        torch.zeros(B, T, H, dtype=dtype),
        torch.zeros(B, T, dtype=torch.long),
        torch.zeros(B, T, dtype=torch.bool),
        torch.zeros(B, T, dtype=torch.bool),
        torch.zeros(B, T, dtype=torch.long) if has_arg else None,
    )


def collate(samples: list[dict], dtype=torch.float32) -> tuple[Batch, list[int]]:
    """Right-pad a list of samples into a Batch (+ their response starts)."""
    B, T = len(samples), max(s["tokens"].shape[0] for s in samples)
    aux, final, tokens, mask, valid, t_arg = batch_buffers(samples, B, T, dtype)
    has_arg = t_arg is not None
    for i, s in enumerate(samples):
        n = s["tokens"].shape[0]
        aux[i, :n], final[i, :n] = s["aux"].to(dtype), s["final"].to(dtype)
        tokens[i, :n], mask[i, :n], valid[i, :n] = s["tokens"], s["loss_mask"], True
        if has_arg:
            t_arg[i, :n] = s["target_arg"]
    return Batch(aux, final, tokens, mask, valid, t_arg), [s["response_start"] for s in samples]


def iter_batches(fs: FeatureSet, ids: list[int], batch_size: int, dtype=torch.float32):
    for s in range(0, len(ids), batch_size):
        yield collate([fs.sample(i) for i in ids[s : s + batch_size]], dtype)
