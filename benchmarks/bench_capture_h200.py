"""The capture path's speed: draftport's own featurizer + write_features on random-weight targets
of real shapes, against the prefill roofline.

Targets (Llama architecture, built from a config with transformers, bf16 random weights; no
download, no checkpoint on disk):
    8b:  hidden 4096, 32 layers, intermediate 14336, 32 heads / 8 kv heads, vocab 128256 (Llama-3.1-8B)
    32b: hidden 5120, 64 layers, intermediate 27648, 40 heads / 8 kv heads, vocab 152064 (Qwen2.5-32B's
         shape, without its qkv biases)
Aux layers [2, L/2, L-3] (EAGLE-3's low / middle / high), vllm convention.

Per shape, at B x T = 16 x 2048 (no padding), then on a realistic length mix (log-normal, mean
~1.5K tokens, at most 2048; each shard's samples batched by length as draftport batches them):
    forward        a plain bf16 forward of the model (logits for every position, as HF computes them)
    capture        draftport's featurizer (hooks, forward stopped at the final norm, greedy choice
                   from the head in float32 logits) + the packing and the pinned copy to the host
    capture_write  write_features end to end: capture + the shards written, hashed, synced, and
                   index.json; MB/s = shard bytes / seconds
    capture_write_fp8   the same with features.dtype fp8_e4m3
tok/s counts the stored (real) tokens. Roofline = peak (790 TFLOP/s, the bf16 matmul rate measured
on this workplace's H200s) / FLOPs per token, FLOPs per token = 2 x non-embedding params (the
lm_head included) + causal attention 2 x layers x heads x (qk + v head dim) x T/2 (for a mix:
the token-weighted mean of n/2), as draftport.profile.estimate counts a capture.

Also recorded: host ceilings (sha256, pageable vs pinned device-to-host copies, disk write +
fsync), where capture_write's time goes (main thread: featurize / pack+copy / waiting on the
writer queue; writer thread: waiting for copies / pwrite; pool: sha256 / fsync), and checks:
the GPU pipeline writes byte for byte what the CPU writes (a featurizer whose states are exact on
both), the head's float32-output bf16 product against true float32 and against bf16 logits,
and the capture without an attention mask against the masked one on a padded batch.

--compile (the library's `features.compile`, on in the pipeline; off here unless asked, since its
first compiles cost minutes of a device call): after the eager rows and checks of a shape, the same
capture, capture_write and mix capture_write rows again with each decoder layer's forward
compiled by torch.compile (--compile-mode, default "default"; dynamic=False), recorded under
the shape's "compiled" beside the eager rows, with the compile (warm-up) seconds. Each layer's
`forward` is compiled, not the layer module: the Capture hooks (a forward pre-hook on aux
layers, a forward hook on the final norm that ends the forward) stay outside the compiled code,
in the module's eager __call__, and the layers of a model share one compiled graph (their
weights are the graph's inputs). Shapes: dynamic=False compiles once per batch shape; the fixed
rows have one (B x T); for the length mix the input ids are right-padded (pad id 0, never seen
by the real tokens under causal attention; the padding is dropped when rows are packed) to a
multiple of --compile-pad tokens (default 128, at most max(T, the batch's length)), so the mix
costs at most T / 128 compiles (16 at T = 2048; fewer in practice: the batches' lengths come
from a sorted log-normal mix), all done in an untimed warm-up on batches of the mix's own
(batch size, padded length) pairs; the padding costs compute, counted against the compiled rows
(tok/s counts real tokens). Recompiles seen inside the timed rows are recorded.

--budget-s (default 540 on CUDA, none on the CPU): a row (or a shape, or the compiled lever) is
skipped when its estimate no longer fits the time left, and the JSON is written after every row,
so a run killed at a device call's 600 s limit keeps what it measured.

    # draftport estimate reads the newest:
    python benchmarks/bench_capture_h200.py --out benchmarks/results/DATE-h200-capture.json
    python benchmarks/bench_capture_h200.py --shapes 8b --compile --out /tmp/capture-8b.json
    python benchmarks/bench_capture_h200.py --toy --out /tmp/capture.json      # CPU, seconds

Never asserts timings: it prints figures and writes them (after each row, so a partial run
keeps what it measured).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from draftport.data import shards as data  # noqa: E402
from draftport.data.capture import capture_dtype, capture_features, compile_layers, padded_length, uncompile_layers  # noqa: E402  # noqa: E402 (the library's)
from draftport.data.features import featurizer, greedy_choice, greedy_head  # noqa: E402
from draftport.data.shards import FeatureSet, Sequence, write_features  # noqa: E402

SHAPES = {
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "32b": dict(
        hidden_size=5120,
        num_hidden_layers=64,
        intermediate_size=27648,
        num_attention_heads=40,
        num_key_value_heads=8,
        vocab_size=152064,
    ),
    "toy": dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
}


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- FLOPs and the roofline ---------------------------------------------------------------------
def params_of(shape: dict) -> dict:
    H, L, I, V = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    attn = (
        H * shape["num_attention_heads"] * hd
        + 2 * H * shape["num_key_value_heads"] * hd
        + shape["num_attention_heads"] * hd * H
    )
    mlp = 3 * H * I
    return {
        "per_layer": attn + mlp,
        "lm_head": V * H,
        "embedding": V * H,
        "non_embedding": L * (attn + mlp) + V * H,
        "head_dim": hd,
    }


def flops_per_token(shape: dict, lengths: list[int]) -> dict:
    """2 x non-embedding params + causal attention at the token-weighted mean of n / 2."""
    p = params_of(shape)
    half = sum(n * n / 2 for n in lengths) / sum(lengths)
    attention = 2 * shape["num_hidden_layers"] * shape["num_attention_heads"] * (2 * p["head_dim"]) * half
    return {
        "matmul": 2 * p["non_embedding"],
        "attention": attention,
        "total": 2 * p["non_embedding"] + attention,
        "mean_keys": half,
    }


def roofline(shape, lengths, peak_tflops) -> float:
    return peak_tflops * 1e12 / flops_per_token(shape, lengths)["total"]


# ---- the target and the data ------------------------------------------------------------------------
def build_target(shape: dict, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **shape,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in their dtype, on the device (a 32B target: 64 GB, not 128)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def aux_ids(shape):
    L = shape["num_hidden_layers"]
    return [2, L // 2, L - 3] if L > 4 else [0, 1, 2]


def length_mix(n: int, mean: float, top: int, sigma: float = 0.5, seed: int = 0) -> list[int]:
    """n log-normal lengths clipped to [32, top], mu found so that their mean is `mean`."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g, dtype=torch.float64)
    lo, hi = 0.0, 20.0
    for _ in range(60):
        mu = (lo + hi) / 2
        m = float((mu + sigma * z).exp().clamp(32, top).round().mean())
        lo, hi = (mu, hi) if m < mean else (lo, mu)
    return [int(x) for x in (mu + sigma * z).exp().clamp(32, top).round()]


def make_sequences(lengths, vocab, seed=0) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    return [Sequence(torch.randint(0, vocab, (n,), generator=g).tolist(), n // 4) for n in lengths]


# ---- timing ---------------------------------------------------------------------------------------
def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - t) / iters


class Profile:
    """Seconds spent in the writer's parts, by wrapping them for one run (thread-safe sums)."""

    def __init__(self):
        self.sec, self.lock = defaultdict(float), threading.Lock()
        self.finished: list[tuple[float, int]] = []  # (time, tokens) of each shard once synced

    def wrap(self, owner, name, key):
        orig = getattr(owner, name)

        def timed_call(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                with self.lock:
                    self.sec[key] += time.perf_counter() - t

        setattr(owner, name, timed_call)
        return lambda: setattr(owner, name, orig)

    @contextlib.contextmanager
    def on(self):
        undo = [
            self.wrap(data._ShardWriter, "put", "main: put (waiting on the writer queue)"),
            self.wrap(data, "_pack", "main: pack (drop padding, storage dtype)"),
            self.wrap(data._Rows, "__init__", "main: queue the copy to pinned memory"),
            self.wrap(data._Rows, "wait", "writer: wait for the copy (GPU still busy)"),
            self.wrap(data._ShardFile, "write", "writer: pwrite rows in place"),
            self.wrap(data, "sha256_file", "pool: sha256"),
            self.wrap(os, "fsync", "pool: fsync (beside the sha256)"),
            self.wrap(os, "fdatasync", "flusher: fdatasync (write-back as rows come)"),
            self.wrap(data._ShardFile, "finish", "pool: finish (sha256 | fsync, close)"),
        ]
        finish = data._ShardFile.finish

        def finished(shard):
            out = finish(shard)
            with self.lock:
                self.finished.append((time.perf_counter(), shard.tokens))
            return out

        data._ShardFile.finish = finished
        undo.append(lambda: setattr(data._ShardFile, "finish", finish))
        try:
            yield self
        finally:
            for u in undo:
                u()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("shard_*.safetensors"))


# ---- host ceilings -----------------------------------------------------------------------------
def host_ceilings(device, work: Path) -> dict:
    out = {}
    buf = os.urandom(1 << 28)
    t = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    out["sha256_GB_s"] = len(buf) / (time.perf_counter() - t) / 1e9
    path = work / "disk_probe.bin"
    block = memoryview(bytearray(buf))
    n = 8 if torch.device(device).type == "cuda" else 1  # 2 GiB on the GPU machine
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for i in range(n):
        os.pwrite(fd, block, i * len(block))
    t_cache = time.perf_counter() - t
    os.fsync(fd)
    os.close(fd)
    out["page_cache_write_GB_s"] = n * len(block) / t_cache / 1e9
    out["disk_write_fsync_MB_s"] = n * len(block) / (time.perf_counter() - t) / 1e6
    path.unlink()
    if torch.device(device).type == "cuda":
        x = torch.randn(1 << 28, device=device, dtype=torch.bfloat16)  # 512 MiB
        nbytes = x.numel() * 2
        out["d2h_pageable_GB_s"] = nbytes / timed(lambda: x.cpu(), device, 3, 1) / 1e9
        pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        out["d2h_pinned_GB_s"] = nbytes / timed(lambda: pinned.copy_(x, non_blocking=True), device, 3, 1) / 1e9
        del x, pinned
    return out


# ---- the compiled lever ----------------------------------------------------------------------------
def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@contextlib.contextmanager
def padded_inputs(model, multiple: int, top: int):
    """The model's forward on input ids right-padded to padded_length (id 0; a mask, where one is
    passed, padded with zeros): a bounded set of shapes for a compiled forward."""
    assert "forward" not in model.__dict__
    inner = model.forward

    def forward(input_ids=None, attention_mask=None, **kw):
        T = input_ids.shape[1]
        P = padded_length(T, multiple, top)
        if P > T:
            input_ids = torch.nn.functional.pad(input_ids, (0, P - T))
            if attention_mask is not None:
                attention_mask = torch.nn.functional.pad(attention_mask, (0, P - T))
        return inner(input_ids=input_ids, attention_mask=attention_mask, **kw)

    model.forward = forward
    try:
        yield
    finally:
        model.__dict__.pop("forward", None)


def mix_batches(mix, B, window) -> list[list[int]]:
    """The lengths of each batch write_features(by_length=True) makes of these lengths."""
    out = []
    for w0 in range(0, len(mix), window):
        group = sorted(mix[w0 : w0 + window], reverse=True)
        out += [group[b : b + B] for b in range(0, len(group), B)]
    return out


def mix_warmup_batches(mix, B, window, multiple, top) -> dict[tuple, list[int]]:
    """One batch of lengths per compiled shape the mix runs: (samples, padded length, whether
    every sample fills it: a mask without padding, where one is passed, is another graph)."""
    out = {}
    for g in mix_batches(mix, B, window):
        P = padded_length(max(g), multiple, top)
        out.setdefault((len(g), P, min(g) == P), g)
    return out


# ---- checks ---------------------------------------------------------------------------------------
def exact_featurizer(H: int, vocab: int, device):
    """States that are exact products of table entries (one IEEE multiply): equal on every device,
    so the GPU pipeline's folder must be the CPU's byte for byte."""
    g = torch.Generator().manual_seed(1)
    table = torch.randn(vocab, 4 * H, generator=g).to(device)
    pos = (1 + torch.randn(2048, 4 * H, generator=g) * 0.1).to(device)

    def featurize(batch):
        T = max(len(s.tokens) for s in batch)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        ids = ids.to(device)
        x = table[ids] * pos[:T]
        arg = (ids * 7 + torch.arange(T, device=device)) % vocab
        return x[..., : 3 * H], x[..., 3 * H :], arg

    return featurize


def check_pipeline(device, work: Path) -> dict:
    H, V = 1024, 1000
    seqs = make_sequences(length_mix(48, 700, 2048, seed=3), V, seed=3)
    out = {}
    for dtype in ("bfloat16", "fp8_e4m3"):
        kw = dict(meta={"aux_layer_ids": [1, 2, 3]}, shard_samples=20, batch_size=8, dtype=dtype)
        write_features(work / "gpu", seqs, exact_featurizer(H, V, device), by_length=True, **kw)
        write_features(work / "cpu", seqs, exact_featurizer(H, V, "cpu"), **kw)
        same = all((work / "gpu" / p.name).read_bytes() == p.read_bytes() for p in (work / "cpu").iterdir())
        out[f"gpu_pipeline_bytes_equal_cpu_{dtype}"] = same
        shutil.rmtree(work / "gpu")
        shutil.rmtree(work / "cpu")
    return out


@torch.no_grad()
def check_numerics(model, shape, device, mix) -> dict:
    """The head's greedy choice in three precisions, and the capture without a mask vs with."""
    aux = aux_ids(shape)
    seqs = make_sequences(sorted(mix, reverse=True)[:: max(1, len(mix) // 8)][:8], shape["vocab_size"], seed=5)
    T = max(len(s.tokens) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
        mask[i, : len(s.tokens)] = 1
    ids, mask = ids.to(device), mask.to(device)
    valid = mask.bool()
    a0, f0 = capture_features(model, ids, mask, aux)
    a1, f1 = capture_features(model, ids, None, aux)
    # each sequence alone (no padding, no mask): another rounding of the same function
    a2, f2 = torch.zeros_like(a1), torch.zeros_like(f1)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        x, y = capture_features(model, ids[i : i + 1, :n], None, aux)
        a2[i, :n], f2[i, :n] = x[0], y[0]
    rel = lambda x, y: float((x[valid].float() - y[valid].float()).norm() / y[valid].float().norm())  # noqa: E731
    head = greedy_head(model)
    fast = greedy_choice(f1, head)[valid]
    w, fv = model.get_output_embeddings().weight, f1[valid]
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        w32 = w.float()
        exact = torch.cat([(fv[r : r + 1024].float() @ w32.t()).argmax(-1) for r in range(0, len(fv), 1024)])
        del w32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    bf16 = torch.cat([(fv[r : r + 1024] @ w.t()).argmax(-1) for r in range(0, len(fv), 1024)])
    masked_arg = greedy_choice(f0, head)[valid]
    alone_arg = greedy_choice(f2, head)[valid]
    return {
        "tokens": int(valid.sum()),
        "head_impl": "bf16 x bf16 -> float32 (torch.mm out_dtype)"
        if head.dtype != torch.float32
        else "float32 (tf32 for bf16 states)",
        "greedy_agree_fast_vs_float32": float((fast == exact).float().mean()),
        "greedy_agree_bf16_logits_vs_float32": float((bf16 == exact).float().mean()),
        "no_mask_vs_mask_rel_diff_aux": rel(a1, a0),
        "no_mask_vs_mask_rel_diff_final": rel(f1, f0),
        "no_mask_vs_mask_greedy_agree": float((fast == masked_arg).float().mean()),
        "alone_vs_mask_rel_diff_final": rel(f2, f0),
        "alone_vs_no_mask_rel_diff_final": rel(f2, f1),
        "alone_vs_mask_greedy_agree": float((alone_arg == masked_arg).float().mean()),
        "alone_vs_no_mask_greedy_agree": float((alone_arg == fast).float().mean()),
    }


# ---- one shape --------------------------------------------------------------------------------------
def run_shape(name: str, a, device, work: Path, left=lambda: math.inf, save=lambda res: None) -> dict:
    """One shape's rows; save(res) after each, and a row skipped when its estimate exceeds left()."""
    shape = SHAPES[name]
    dtype = capture_dtype(device)
    t = time.perf_counter()
    model = build_target(shape, device, dtype)
    log(
        f"[{name}] built in {time.perf_counter() - t:.1f} s ({params_of(shape)['non_embedding'] / 1e9:.2f}B "
        f"non-embedding params, {dtype})"
    )
    B, T = a.batch, a.seq
    fixed = [T] * (B * a.write_batches)
    mix = length_mix(a.mix_samples, a.mix_mean, T)
    res = {
        "shape": {**shape, "head_dim": params_of(shape)["head_dim"]},
        "aux_layer_ids": aux_ids(shape),
        "params": params_of(shape),
        "flops_per_token": flops_per_token(shape, [T]),
        "roofline_tok_s": roofline(shape, [T], a.peak_tflops),
        "target_dtype": str(dtype).removeprefix("torch."),
    }
    roof = res["roofline_tok_s"]
    save(res)

    def entry(tok_s, r=roof, **kw):
        return {"tok_s": tok_s, "fraction_of_roofline": tok_s / r, **kw}

    def room(what, need) -> bool:
        if left() >= need:
            return True
        log(f"[{name}] {what}: skipped, {max(left(), 0):.0f} s of the budget left (needs ~{need:.0f} s)")
        res.setdefault("skipped_for_budget", []).append(what)
        save(res)
        return False

    ids = torch.randint(0, shape["vocab_size"], (B, T), device=device, generator=None)
    with torch.no_grad():
        sec = timed(lambda: model(input_ids=ids, use_cache=False), device, a.iters, 1)
    res["forward"] = entry(B * T / sec, seconds_per_batch=sec)
    log(f"[{name}] forward        {B * T / sec:9.0f} tok/s  {B * T / sec / roof:6.1%} of {roof:.0f}")
    save(res)
    del ids
    fwd_s = sec  # seconds per batch of B x T: the estimates of the rows below

    featurize = featurizer(model, aux_ids(shape), "vllm", device)
    batches = [make_sequences([T] * B, shape["vocab_size"], seed=10 + i) for i in range(a.iters + 1)]

    def capture(fz=featurize):
        pending = deque()
        for b in batches[1:]:
            ax, fin, arg = fz(b)
            pending.append(data._Rows(data._pack(b, ax, fin, arg, "bfloat16")))
            if len(pending) > 2:
                pending.popleft().wait()
        while pending:
            pending.popleft().wait()

    if not room("capture", 2.5 * a.iters * fwd_s):
        return res
    sec = timed(capture, device, 1, 1) / a.iters  # the warm-up run fills the pinned-memory cache
    res["capture"] = entry(B * T / sec, seconds_per_batch=sec)
    log(f"[{name}] capture        {B * T / sec:9.0f} tok/s  {B * T / sec / roof:6.1%}")
    save(res)

    def write(lengths, dtype_s, key, r, fz=featurize, tag=""):
        seqs = make_sequences(lengths, shape["vocab_size"], seed=1)
        out = work / f"feats_{name}_{key}"
        prof, queued = Profile(), []
        with prof.on():
            t = time.perf_counter()
            index = write_features(
                out,
                seqs,
                fz,
                meta={"aux_layer_ids": aux_ids(shape)},
                shard_samples=a.shard_samples,
                batch_size=B,
                dtype=dtype_s,
                by_length=True,
                writers=a.writers,
                progress=lambda n: queued.append(time.perf_counter()),
            )
            sec = time.perf_counter() - t
        nbytes = folder_bytes(out)
        if a.verify_read:
            FeatureSet(out).sample(len(seqs) - 1)
        shutil.rmtree(out)
        tokens = index["tokens"]
        # the last batch queued -> index.json: the last shards' rows, hash and sync, not overlapped
        # with any forward (a real capture of many shards pays it once). The steady rate: tokens of
        # the shards synced after the first / the time between the first's sync and the last's
        # (windows of shards complete together: from the first window's end to the last's)
        ends = sorted(prof.finished)
        later = [(te, n) for te, n in ends if te > ends[0][0] + 0.05]
        spread = later[-1][0] - ends[0][0] if later else 0.0  # none when all complete at once (one window)
        steady = sum(n for _, n in later) / spread if spread > 0.3 * sec else None
        e = entry(
            tokens / sec,
            r,
            seconds=sec,
            seconds_after_last_batch=t + sec - queued[-1],
            tokens=tokens,
            samples=len(seqs),
            bytes=nbytes,
            MB_s=nbytes / sec / 1e6,
            dtype=dtype_s,
            bytes_per_token=index["bytes_per_token"],
            shards=len(ends),
            steady_tok_s=steady,
            steady_fraction_of_roofline=steady / r if steady else None,
            profile_seconds={k: round(v, 3) for k, v in sorted(prof.sec.items())},
        )
        log(
            f"[{name}] {tag}write {key:5s} {dtype_s:9s} {tokens / sec:9.0f} tok/s  {tokens / sec / r:6.1%}  "
            f"{nbytes / sec / 1e6:7.0f} MB/s  ({sec:.1f} s, {tokens} tokens, "
            f"tail {e['seconds_after_last_batch']:.1f} s; "
            f"steady {e['steady_fraction_of_roofline'] or 0:.1%})"
        )
        log(f"          profile: {json.dumps(e['profile_seconds'])}")
        return e

    def write_need(tokens, rate):  # seconds: the capture's rate, 1.6x for the writer, its tail
        return 1.6 * tokens / rate + 5.0

    cap_rate = res["capture"]["tok_s"]
    if room("capture_write", write_need(len(fixed) * T, cap_rate)):
        res["capture_write"] = write(fixed, "bfloat16", "fixed", roof)
        save(res)
    if room("capture_write_fp8", write_need(len(fixed) // 2 * T, cap_rate)):
        res["capture_write_fp8"] = write(fixed[: len(fixed) // 2], "fp8_e4m3", "fixed", roof)
        save(res)
    mix_roof = roofline(shape, mix, a.peak_tflops)
    window = -(-max(a.shard_samples, 16 * B) // a.shard_samples) * a.shard_samples  # write_features' default
    sorted_pad = 0
    for w0 in range(0, len(mix), window):
        group = sorted(mix[w0 : w0 + window], reverse=True)
        sorted_pad += sum(max(group[b : b + B]) * len(group[b : b + B]) for b in range(0, len(group), B))
    unsorted_pad = sum(max(mix[b : b + B]) * len(mix[b : b + B]) for b in range(0, len(mix), B))
    res["mix"] = {
        "samples": len(mix),
        "mean_tokens": sum(mix) / len(mix),
        "max_tokens": max(mix),
        "min_tokens": min(mix),
        "roofline_tok_s": mix_roof,
        "flops_per_token": flops_per_token(shape, mix),
        "padding_fraction_input_order": 1 - sum(mix) / unsorted_pad,
        "padding_fraction_by_length": 1 - sum(mix) / sorted_pad,
        "sort_window": window,
    }
    if room("mix capture_write", write_need(sorted_pad, cap_rate)):
        res["mix"]["capture_write"] = write(mix, "bfloat16", "mix", mix_roof)
    save(res)
    if torch.device(device).type == "cuda" and room("checks", 20.0):
        res["checks"] = check_numerics(model, shape, device, mix)
        log(f"[{name}] checks: {json.dumps(res['checks'])}")
        res["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        save(res)
    if a.compile:
        run_compiled(
            name,
            a,
            model,
            shape,
            device,
            res,
            capture,
            write,
            entry,
            room,
            save,
            fixed,
            mix,
            window,
            sorted_pad,
            cap_rate,
            write_need,
        )
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return res


def run_compiled(
    name,
    a,
    model,
    shape,
    device,
    res,
    capture,
    write,
    entry,
    room,
    save,
    fixed,
    mix,
    window,
    sorted_pad,
    cap_rate,
    write_need,
) -> None:
    """The --compile lever: capture, capture_write and mix capture_write with each decoder layer's
    forward compiled (dynamic=False), into res["compiled"]; the eager rows stay as measured."""
    B, T, roof = a.batch, a.seq, res["roofline_tok_s"]
    c = res["compiled"] = {
        "mode": a.compile_mode,
        "dynamic": False,
        "what": "each decoder layer's forward (hooks outside the compiled code; one graph shared by the layers)",
        "mix_pad_multiple": a.compile_pad,
    }
    # a first compile: minutes on a cold cache at an 8B/32B shape (one layer graph, its kernels)
    if not room("compiled", 60.0 + 2.5 * a.iters * B * T / cap_rate):
        c["skipped"] = "budget"
        return
    compile_layers(model, a.compile_mode)
    g0 = compiled_graphs()
    try:
        with padded_inputs(model, a.compile_pad, T):
            fz = featurizer(model, aux_ids(shape), "vllm", device)
            t = time.perf_counter()
            fz(make_sequences([T] * B, shape["vocab_size"], seed=99))
            sync(device)
            c["warmup_s"] = time.perf_counter() - t
            log(f"[{name}] compiled ({a.compile_mode}): first batch (the compile) {c['warmup_s']:.1f} s")
            save(res)
            sec = timed(lambda: capture(fz), device, 1, 1) / a.iters
            c["capture"] = entry(B * T / sec, seconds_per_batch=sec)
            log(
                f"[{name}] compiled capture {B * T / sec:9.0f} tok/s  {B * T / sec / roof:6.1%} "
                f"(eager {res['capture']['fraction_of_roofline']:.1%})"
            )
            save(res)
            rate = c["capture"]["tok_s"]
            g = compiled_graphs()
            if room("compiled capture_write", write_need(len(fixed) * T, rate)):
                c["capture_write"] = write(fixed, "bfloat16", "fixed", roof, fz=fz, tag="compiled ")
            c["graphs_compiled_in_timed_fixed_rows"] = compiled_graphs() - g
            save(res)
            # the mix: every (batch size, padded length) it will run, compiled before the timed write
            shapes = mix_warmup_batches(mix, B, window, a.compile_pad, T)
            c["mix_shapes"] = sorted([n, P] for n, P, _ in shapes)
            if room("compiled mix warm-up", 30.0 * len(shapes)):
                t = time.perf_counter()
                for lengths in shapes.values():
                    fz(make_sequences(lengths, shape["vocab_size"], seed=98))
                sync(device)
                c["mix_warmup_s"] = time.perf_counter() - t
                log(f"[{name}] compiled mix warm-up: {len(shapes)} batch shapes in {c['mix_warmup_s']:.1f} s")
                save(res)
                padded = sum(len(g) * padded_length(max(g), a.compile_pad, T) for g in mix_batches(mix, B, window))
                if room("compiled mix capture_write", write_need(padded, rate)):
                    g = compiled_graphs()
                    c["mix"] = {
                        "capture_write": write(
                            mix, "bfloat16", "mix", res["mix"]["roofline_tok_s"], fz=fz, tag="compiled "
                        ),
                        "padding_fraction_padded": 1 - sum(mix) / padded,
                        "graphs_compiled_in_timed_rows": compiled_graphs() - g,
                    }
            save(res)
    except Exception as e:  # the lever failing must not cost the eager rows
        import traceback

        c["failed"] = repr(e)[:500]
        log(f"[{name}] compiled: FAILED {e!r}\n{traceback.format_exc()[-2000:]}")
    finally:
        c["graphs_compiled"] = compiled_graphs() - g0
        uncompile_layers(model)
        torch._dynamo.reset()
        save(res)


def dump(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(res, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON result")
    ap.add_argument("--toy", action="store_true", help="a toy target on the CPU (the test)")
    ap.add_argument("--shapes", default="8b,32b")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=3, help="timed batches of forward and capture")
    ap.add_argument("--write-batches", type=int, default=8, help="batches of B x T written (bf16; fp8: half)")
    ap.add_argument("--mix-samples", type=int, default=192)
    ap.add_argument("--mix-mean", type=float, default=1500)
    ap.add_argument("--shard-samples", type=int, default=32)
    ap.add_argument("--writers", type=int, default=None, help="threads hashing and syncing shards")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--dir", type=Path, default=None, help="where the shards are written (a disk)")
    ap.add_argument("--verify-read", action="store_true", help="read a sample of each folder back")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="also the capture rows with each decoder layer's "
        "forward compiled by torch.compile (beside the eager rows, under each shape's 'compiled')",
    )
    ap.add_argument(
        "--compile-mode",
        default="default",
        help="torch.compile mode: default, reduce-overhead, max-autotune-no-cudagraphs, max-autotune",
    )
    ap.add_argument(
        "--compile-pad",
        type=int,
        default=128,
        help="compiled: the mix's batches right-padded to a "
        "multiple of this many tokens (bounded recompiles; 0: none, one compile per length)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall budget: rows that no longer fit are skipped (default 540 on CUDA, none on the CPU)",
    )
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.toy:
        a.shapes, a.batch, a.seq, a.iters, a.write_batches = "toy", 4, 64, 1, 4
        a.mix_samples, a.mix_mean, a.shard_samples, a.verify_read = 24, 40, 8, True
    device = "cuda" if torch.cuda.is_available() and not a.toy else "cpu"
    if a.budget_s is None:
        a.budget_s = 540.0 if device == "cuda" else math.inf

    def left():
        return a.budget_s - (time.perf_counter() - t0)

    work = Path(tempfile.mkdtemp(prefix="bench-capture.", dir=a.dir))
    res = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "transformers": __import__("transformers").__version__,
            "safetensors": __import__("safetensors").__version__,
        },
        "config": {
            "batch": a.batch,
            "seq": a.seq,
            "iters": a.iters,
            "write_batches": a.write_batches,
            "mix_samples": a.mix_samples,
            "mix_mean": a.mix_mean,
            "shard_samples": a.shard_samples,
            "writers": a.writers or max(1, min(4, (os.cpu_count() or 1) // 4)),
            "cpu_count": os.cpu_count(),
            "peak_tflops": a.peak_tflops,
            "dir": str(work),
            "attention": "sdpa",
            "aux_convention": "vllm",
            "budget_s": a.budget_s if math.isfinite(a.budget_s) else None,
            "compile": a.compile
            and {
                "mode": a.compile_mode,
                "dynamic": False,
                "mix_pad_multiple": a.compile_pad,
                "what": "each decoder layer's forward",
            },
        },
        "shapes": {},
    }
    try:
        res["host"] = host_ceilings(device, work)
        log(f"host: {json.dumps(res['host'])}")
        if device == "cuda":
            res["checks"] = check_pipeline(device, work)
            log(f"checks: {json.dumps(res['checks'])}")
        dump(a.out, res)
        for i, name in enumerate(a.shapes.split(",")):
            if i and left() < 60:
                log(f"[{name}] skipped: {max(left(), 0):.0f} s of the budget left")
                res.setdefault("skipped_for_budget", []).append(name)
                continue

            def save(r, name=name):
                res["shapes"][name] = r
                res["wall_s"] = time.perf_counter() - t0
                dump(a.out, res)

            res["shapes"][name] = run_shape(name, a, device, work, left, save)
            res["wall_s"] = time.perf_counter() - t0
            dump(a.out, res)
            gc.collect()  # the last target's weights back to the allocator before the next is built
            if device == "cuda":
                torch.cuda.empty_cache()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["wall_s"] = time.perf_counter() - t0
    dump(a.out, res)

    def frac(r):
        return "-" if not r or "fraction_of_roofline" not in r else f"{r['fraction_of_roofline']:.1%}"

    def line(n, s):
        w = s.get("capture_write") or {}
        out = (
            f"{n}: forward {frac(s.get('forward'))}, capture {frac(s.get('capture'))}, "
            f"capture+write {frac(w)} ({w.get('MB_s', 0):.0f} MB/s), fp8 {frac(s.get('capture_write_fp8'))}, "
            f"mix {frac((s.get('mix') or {}).get('capture_write'))}"
        )
        c = s.get("compiled")
        if c:
            out += (
                f"; compiled: capture {frac(c.get('capture'))}, capture+write {frac(c.get('capture_write'))}, "
                f"mix {frac((c.get('mix') or {}).get('capture_write'))}, compile {c.get('warmup_s') or 0:.0f} s "
                f"+ mix {c.get('mix_warmup_s') or 0:.0f} s"
            )
        return out

    log("summary: " + "; ".join(line(n, s) for n, s in res["shapes"].items()) + f"; wall {res['wall_s']:.0f} s")
    return res


if __name__ == "__main__":
    main()
