"""The product's training against the training benchmark, at one shape and one token budget, in one
call; and a smoke run of every attention x packing choice the params allow.

    python benchmarks/bench_train_product.py product [--shapes gpu,kimi] [--tokens 16384] [--steps 40]
    python benchmarks/bench_train_product.py smoke [--shape gpu]

product: for each shape, synthetic features of 2048-token samples are written as real shards;
  1. train() (the loop train_phase runs for every training rule: its batches read from the shards,
     packed to train.tokens_per_step and made on a host thread, its held-out monitor, its
     checkpoints) trains a fresh drafter and reports its steady tok/s, warm-up and compiles;
  2. train_step (the function bench_train_h200.py times, the one train() calls) runs on the same
     batches, already on the GPU, with the same fast path and optimizer: its tok/s by CUDA events.
  The ratio product / bench says what the loop around the step costs.
smoke: for attention in flash, cudnn (and fa4 where it imports) and for padded rows, packed rows by
  varlen and packed rows by segments: the fused attention's output and gradients against the dense
  reference on rows holding one-token segments, then a few train() steps at the shape and one
  held-out evaluation; each choice passes or records its error's first line.

Writes one JSON (--out) and prints a table; asserts nothing. On a machine without a GPU it runs at
--shape toy on the CPU (the orchestration only: the CUDA kernels are not reached there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftport.data.shards import FeatureSet, Sequence, write_features  # noqa: E402
from draftport.evaluation.accept import held_out_monitor  # noqa: E402
from draftport.model.config import DrafterConfig  # noqa: E402
from draftport.model.drafter import Eagle3Drafter  # noqa: E402
from draftport.model.fast.attention import Segments, ttt_attention  # noqa: E402
from draftport.model.fast.path import FastPath  # noqa: E402
from draftport.model.flops import sample_flops, shape_of  # noqa: E402
from draftport.model.vocab import build_maps  # noqa: E402
from draftport.plan.params import FastParams, TrainConfig  # noqa: E402
from draftport.training.batches import StepBatches  # noqa: E402
from draftport.training.loop import _optimizer, fast_path, train, train_step, trainable  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_train_h200 import SIZES  # noqa: E402

SHAPES = {
    # configs/gpu.yaml's drafter: hidden 4096, 32/8 heads of 128, MLP 14336, draft vocab 32,000 of 40,960
    "gpu": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        draft_vocab_size=32000,
        vocab_size=40960,
    ),
    # Kimi-K2's drafter and the CPU's toy: the training benchmark's own shapes
    **{name: SIZES[name] for name in ("kimi", "toy")},
}


def drafter_at(shape: dict, device, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(**shape, aux_layer_ids=[1, 2, 3], max_position_embeddings=4096)
    d = Eagle3Drafter(cfg, embed_weight=torch.randn(cfg.vocab_size, cfg.hidden_size) * 0.02)
    counts = torch.randint(0, 1000, (cfg.vocab_size,), generator=torch.Generator().manual_seed(seed)).numpy()
    d.set_vocab_maps(*build_maps(counts, cfg.draft_vocab_size))
    return d.to(device)


def synthetic_features(folder: Path, shape: dict, lengths: list[int], device, seed: int = 0):
    """Real shards of random states whose final state is a fixed function of the aux ones (a
    learnable world: the loss falls), and the target head. -> (FeatureSet, head on device)."""
    H, V = shape["hidden_size"], shape["vocab_size"]
    g = torch.Generator(device=device).manual_seed(seed)
    mix = torch.randn(3 * H, H, generator=g, device=device) / (3 * H) ** 0.5
    gen = torch.Generator().manual_seed(seed)
    seqs = [Sequence(torch.randint(0, V, (n,), generator=gen).tolist(), min(16, n - 1)) for n in lengths]

    def featurize(batch):
        T = max(len(s.tokens) for s in batch)
        aux = torch.randn(len(batch), T, 3 * H, generator=g, device=device)
        return aux.bfloat16(), (torch.tanh(aux @ mix) * 3).bfloat16()

    write_features(folder, seqs, featurize, meta={"aux_layer_ids": [1, 2, 3]}, shard_samples=8, batch_size=2)
    head = (torch.randn(V, H, generator=g, device=device) * 0.02).bfloat16()
    return FeatureSet(folder), head


def _cfg(steps: int, tokens: int, fast: dict, **kw) -> TrainConfig:
    base = dict(steps=steps, lr=1e-4, warmup_steps=2, packing=True, tokens_per_step=tokens, impl="compiled")
    base.update(log_every=10, checkpoint_every=steps, fast=FastParams(**fast))
    return TrainConfig(**{**base, **kw})


# ---- product against bench ---------------------------------------------------------------------
def product_vs_bench(name: str, a, tmp: Path, log) -> dict:
    """The two halves in two processes, one after the other: the product's drafter, optimizer and
    compiled graphs are gone before the bench allocates (at Kimi's shape, in one process, the
    bench ran out of an H100's memory after the product)."""
    product = _half("product", name, a, tmp, log)
    steady = product.get("steady_tokens_per_s") or 0
    log(f"[{name}] product: {steady:,.0f} tok/s steady, warm-up {product.get('warmup_s')} s")
    bench = _half("bench", name, a, tmp, log)
    ratio = product["steady_tokens_per_s"] / bench["tokens_per_s"] if product.get("steady_tokens_per_s") else None
    log(f"[{name}] bench: {bench['tokens_per_s']:,.0f} tok/s; product / bench = {ratio}")
    return {
        "shape": name,
        "tokens_per_step": a.tokens,
        "ttt_steps": a.ttt,
        "product": product,
        "bench": bench,
        "product_over_bench": ratio,
    }


FORWARDED = ("tokens", "sample_len", "steps", "warmup", "iters", "ttt", "attention")


def _half(which: str, name: str, a, tmp: Path, log) -> dict:
    """Run one half in a child process (this script, mode `half`) -> its result."""
    argv = [sys.executable, __file__, "half", "--which", which, "--shapes", name, "--folder", str(tmp)]
    for key in FORWARDED:
        argv += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    argv += ["--tuning"] if a.tuning else []
    proc = subprocess.run(argv, capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    results = [x[len(RESULT) :] for x in lines if x.startswith(RESULT)]
    if proc.returncode or not results:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{which} half exited {proc.returncode}: {tail}")
    for x in lines:
        if not x.startswith(RESULT):
            log(x)
    return json.loads(results[-1])


RESULT = "RESULT "


def half(a, device, tmp: Path, log) -> dict:
    """One half, in this process: `product` writes the features (and the head) and runs train();
    `bench` reads them and times train_step."""
    name = a.shapes
    shape = SHAPES[name]
    fast = {"attention": a.attention, "tune_min_steps": 0 if a.tuning else 10**9}
    cfg = _cfg(a.steps, a.tokens, fast, eval_every=a.steps // 2, ttt_steps=a.ttt)
    head_file = tmp / f"head-{name}.safetensors"
    if a.which == "bench":
        head = load_file(str(head_file))["head"].to(device)
        return bench_step(shape, FeatureSet(tmp / f"feats-{name}"), head, cfg, device, a)
    n = max(8, 3 * a.tokens // a.sample_len)
    t0 = time.perf_counter()
    fs, head = synthetic_features(tmp / f"feats-{name}", shape, [a.sample_len] * n, device)
    mon_fs, _ = synthetic_features(tmp / f"monitor-{name}", shape, [256] * 8, device, seed=1)
    save_file({"head": head.cpu()}, str(head_file))
    log(f"[{name}] {n} samples of {a.sample_len} tokens written in {time.perf_counter() - t0:.1f} s")
    d = drafter_at(shape, device)
    t0 = time.perf_counter()
    res = train(d, fs, head, tmp / f"out-{name}", cfg, progress=False, monitor=held_out_monitor(mon_fs, head, k=3))
    run = res["run"]
    product = {k: run.get(k) for k in ("steady_tokens_per_s", "steady_mfu", "tokens_per_s", "warmup_s", "compiles")}
    product.update(last_compile_step=run.get("last_compile_step"), wall_s=round(time.perf_counter() - t0, 1))
    return product


def bench_step(shape: dict, fs, head, cfg: TrainConfig, device, a) -> dict:
    """train_step on the product's own batches, on the device before the clock starts."""
    d = drafter_at(shape, device)
    params = trainable(d)
    opt = _optimizer(params, cfg, device, fsdp=False)
    fast = fast_path(cfg, "compiled", accumulate_wgrad=True)
    src = StepBatches(fs, cfg, 0, 1, torch.device("cpu"))
    steps = [src.get(s) for s in range(a.warmup + a.iters)]
    src.close()
    batches = [(lengths, b.to(device)) for lengths, b in steps]
    plist = list(params.values())
    for _, b in batches[: a.warmup]:
        train_step(d, b, head, opt, plist, cfg, fast=fast, use_bf16=device.type == "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _, b in batches[a.warmup :]:
        train_step(d, b, head, opt, plist, cfg, fast=fast, use_bf16=device.type == "cuda")
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(sum(lengths) for lengths, _ in batches[a.warmup :])
    flops = sum(sample_flops(shape_of(d.cfg), lengths, cfg.ttt_steps, True) for lengths, _ in batches[a.warmup :])
    return {"tokens_per_s": tokens / dt, "tflops": flops / dt / 1e12, "steps": a.iters, "seconds": round(dt, 3)}


# ---- smoke: every attention x packing choice ----------------------------------------------------
def attention_choices() -> list[str]:
    out = ["flash", "cudnn"]
    if importlib.util.find_spec("flash_attn") is not None:
        out.append("fa4")
    return out


def kernel_check(attention: str, packed: str, device) -> float:
    """The fused attention (forward and backward, two diagonal keys) on packed rows holding
    one-token segments, against the dense reference in fp32: the relative error of out, dq, dk."""
    lens = [1, 63, 1, 130, 61]  # one row of 256 tokens; two one-token segments
    T, h, dd = sum(lens), 4, 128
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32

    def t():  # [1, h, T, d] as a view of a token-major [1, T, h, d], as the drafter lays them out
        return torch.randn(1, T, h, dd, generator=g, device=device, dtype=dt).transpose(1, 2).requires_grad_(True)

    q, k0, v0, k1, v1 = (t() for _ in range(5))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    seg = None if packed == "padded" else Segments(cu, max(lens))
    fast = FastPath(attention=attention, packed_attention="segments" if packed == "segments" else "varlen")
    o = ttt_attention(q, [k0, k1], [v0, v1], dd**-0.5, segments=seg, fast=fast)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k0), do)
    # reference: causal inside each segment (the whole row when padded), plus the diagonal key
    qf, kf, vf, k1f, v1f = (x.detach().double().requires_grad_(True) for x in (q, k0, v0, k1, v1))
    s0 = (qf @ kf.transpose(-1, -2)) * dd**-0.5
    doc = (
        torch.zeros(T, dtype=torch.long, device=device)
        if seg is None
        else torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device))
    )
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=device)) & (doc[:, None] == doc[None, :])
    s0 = s0.masked_fill(~mask, float("-inf"))
    s1 = (qf * k1f).sum(-1, keepdim=True) * dd**-0.5
    p = torch.softmax(torch.cat([s0, s1], -1), -1)
    ref = p[..., :T] @ vf + p[..., T:] * v1f
    ref = ref.transpose(1, 2).reshape(1, T, h * dd)
    rgrads = torch.autograd.grad(ref, (qf, kf), do.double())
    errs = [((o.double() - ref).norm() / ref.norm()).item()]
    errs += [((a.double() - b).norm() / b.norm()).item() for a, b in zip(grads, rgrads)]
    return max(errs)


def smoke(a, device, tmp: Path, log) -> list[dict]:
    shape = SHAPES[a.shape]
    lengths = [17, 200, 1, 64, 130, 255, 2, 90, 300, 48, 77, 129] * 2
    fs, head = synthetic_features(tmp / "feats-smoke", shape, lengths, device)
    rows = []
    only = set(a.only.split(",")) if a.only else None
    for attention in attention_choices():
        for packed in ("padded", "varlen", "segments"):
            if only is not None and f"{attention}:{packed}" not in only:
                continue
            row = {"attention": attention, "packing": packed}
            try:  # refused before any compute (the params refuse it the same way)
                FastPath(attention=attention, packed_attention="auto" if packed == "padded" else packed)
            except ValueError as e:
                row.update(status="refused", error=str(e))
                log(f"{attention:6s} {packed:9s} refused {e}")
                rows.append(row)
                continue
            t0 = time.perf_counter()
            try:
                row["kernel_rel_err"] = kernel_check(attention, packed, device)
                fast = {"attention": attention, "tune_min_steps": 10**9}
                if packed != "padded":
                    fast["packed_attention"] = packed
                cfg = _cfg(a.smoke_steps, 0, fast, batch_size=6, log_every=1)
                cfg = cfg.model_copy(update={"packing": packed != "padded"})
                d = drafter_at(shape, device)
                res = train(d, fs, head, tmp / f"smoke-{attention}-{packed}", cfg, progress=False)
                losses = [r["loss"] for r in res["history"]]
                row["losses"] = [round(x, 4) for x in losses]
                row["tau"] = held_out_monitor(fs, head, k=3, batch_size=8)(d)
                ok = all(x == x and abs(x) < 1e4 for x in losses) and row["kernel_rel_err"] < 2e-2
                row["status"] = "pass" if ok else "fail"
                del d
            except Exception as e:  # the smoke records what fails and goes on
                row["status"] = "error"
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            row["seconds"] = round(time.perf_counter() - t0, 1)
            log(f"{attention:6s} {packed:9s} {row['status']:6s} {row.get('kernel_rel_err', '')} {row.get('error', '')}")
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("mode", choices=("product", "smoke", "half"))  # half: one of product's two processes
    p.add_argument("--shapes", default=None, help="product: comma-separated shapes (gpu, kimi; toy on the CPU)")
    p.add_argument("--shape", default=None, help="smoke: the shape (default gpu on CUDA, toy on the CPU)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (train.tokens_per_step)")
    p.add_argument("--sample-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=40, help="train()'s steps")
    p.add_argument("--warmup", type=int, default=3, help="bench: untimed steps")
    p.add_argument("--iters", type=int, default=20, help="bench: timed steps")
    p.add_argument("--ttt", type=int, default=3)
    p.add_argument("--attention", default="flash")
    p.add_argument("--tuning", action="store_true", help="compile_tuning on (off: inductor's defaults)")
    p.add_argument("--smoke-steps", type=int, default=4)
    p.add_argument("--only", default=None, help="smoke: these attention:packing choices only (cudnn:varlen,...)")
    p.add_argument("--out", default=None)
    p.add_argument("--which", choices=("product", "bench"), help=argparse.SUPPRESS)
    p.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:  # the orchestration at toy size
        a.tokens, a.sample_len, a.steps, a.iters = min(a.tokens, 512), min(a.sample_len, 128), min(a.steps, 6), 3

    def log(msg):
        print(msg, flush=True)

    if a.mode == "half":
        print(RESULT + json.dumps(half(a, device, Path(a.folder), log)), flush=True)
        return 0
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "mode": a.mode}
    with tempfile.TemporaryDirectory() as tmp:
        if a.mode == "product":
            names = (a.shapes or ("gpu,kimi" if cuda else "toy")).split(",")
            out["runs"] = []
            for name in names:
                try:
                    out["runs"].append(product_vs_bench(name, a, Path(tmp), log))
                except Exception as e:
                    out["runs"].append({"shape": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
                    log(f"[{name}] error: {out['runs'][-1]['error']}")
                if cuda:
                    torch.cuda.empty_cache()
        else:
            a.shape = a.shape or ("gpu" if cuda else "toy")
            out["shape"] = a.shape
            out["choices"] = smoke(a, device, Path(tmp), log)
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
