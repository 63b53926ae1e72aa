"""Training-step throughput of our EAGLE-3 drafter at Kimi-K2 size, against speculators 0.9.0.

One full training step as train.py runs it (TTT loss over `--ttt` unrolled steps, combine,
backward, grad clipping, fused AdamW), on synthetic bf16 aux/final target states already on the
device, with a frozen bf16 target lm_head [vocab, H] for the target distribution and the
full-vocab argmax mask. Prints tokens/s, analytic FLOPs/token, MFU against --peak-tflops, peak
memory; then runs speculators' Eagle3DraftModel through the anchor script
(benchmarks/anchors/speculators_train_bench.py) in a subprocess with the same shapes and writes
one JSON with both and the ratio.

Parameters are bf16 (no fp32 master copy), like the anchor's model.to(bfloat16), so both hold
the same trainable set in the same precision.

    python benchmarks/bench_train_h200.py                      # kimi on CUDA: ours + speculators
    python benchmarks/bench_train_h200.py --size toy --no-speculators --json /tmp/x.json   # CPU
    python benchmarks/bench_train_h200.py --ladder             # what each lever gives

Never asserts timings: it prints figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from draftport import ttt as ttt_mod  # noqa: E402
from draftport.config import DrafterConfig  # noqa: E402
from draftport.drafter import Eagle3Drafter  # noqa: E402
from draftport.kernels import ttt_attention  # noqa: E402
from draftport.train import TrainConfig, train_step  # noqa: E402
from draftport.data import Batch  # noqa: E402
from draftport.ttt import combine, stats_to_float, ttt_terms  # noqa: E402

SIZES = {
    # H, I, heads, kv heads, head_dim, draft vocab, vocab
    "kimi": dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64,
                 num_key_value_heads=64, head_dim=128, draft_vocab_size=32000, vocab_size=163840),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=128, draft_vocab_size=4096, vocab_size=32768),
    # the anchor script's --toy shapes
    "toy": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=4, head_dim=16, draft_vocab_size=256, vocab_size=1024),
}


# ---- analytic FLOPs ---------------------------------------------------------------------------
def flops_per_token(cfg: DrafterConfig, T: int, steps: int, lm_head_trainable: bool) -> dict:
    """Model FLOPs per trained token (one multiply-add = 2 FLOPs), counted per TTT step.

    Forward, per token and TTT step j (0-based):
      q/k/v   2 * 2H * (heads*hd + 2*kv_heads*hd)      input is [embed | hidden], 2H wide
      o       2 * heads*hd * H
      mlp     2 * 3 * H * I                            gate, up, down
      attn    2 * 2 * heads*hd * ((T+1)/2 + j)         QK^T and PV; the TTT mask lets row p see
                                                       the p+1 causal step-0 keys and its own j
                                                       keys from steps 1..j
      lm_head 2 * H * Vd                               drafter head over the draft vocab
    once per token: fc 2 * 3H * H; target draft rows 2 * H * Vd (frozen, no grad: forward only).
    Training multipliers: weights that train = fwd + input grad + weight grad = 3x; frozen
    weights whose input needs a grad (lm_head when frozen) = 2x; fc's input (the target states)
    needs none = 2x; attention backward = 2x its forward (dQ, dK, dV, dP), so 3x; the target
    head = 1x. Flash recomputation, norms, rope, softmax and the optimizer are not counted.
    The full-vocab argmax mask adds 2 * H * (V - Vd) forward FLOPs (`mask_extra`), counted apart.
    """
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    qkv = 2 * 2 * H * (q + 2 * kv)
    o = 2 * q * H
    mlp = 2 * 3 * H * I
    head = 2 * H * Vd
    attn = [2 * 2 * q * ((T + 1) / 2 + j) for j in range(steps)]
    fc = 2 * cfg.fc_in * H
    per_step_fwd = qkv + o + mlp + head
    train = (steps * 3 * (qkv + o + mlp) + 3 * sum(attn) + steps * (3 if lm_head_trainable else 2) * head
             + 2 * fc + head)
    return {"train": train, "mask_extra": 2 * H * (V - Vd), "target_draft_rows": head,
            "fwd_per_ttt_step_weights": per_step_fwd, "attn_fwd_per_ttt_step": attn, "fc_fwd": fc,
            "lm_head_trainable": lm_head_trainable}


# ---- setup ------------------------------------------------------------------------------------
def build(size: str, dev, dtype, seed: int = 0):
    cfg = DrafterConfig(**SIZES[size], aux_layer_ids=[2, 30, 58], max_position_embeddings=131072,
                        rope_theta=1e6, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            d = Eagle3Drafter(cfg)
    finally:
        torch.set_default_dtype(old)
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    hot = torch.sort(torch.randperm(V)[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_maps(hot - torch.arange(Vd), t2d)
    d.embed_loaded = True
    head = (torch.randn(V, cfg.hidden_size, device=dev, dtype=dtype) * 0.02).requires_grad_(False)
    return cfg, d, head


def make_batch(cfg, B, T, dev, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    H = cfg.hidden_size
    ones = torch.ones(B, T, dtype=torch.bool, device=dev)
    return Batch(aux=torch.randn(B, T, cfg.fc_in, device=dev, dtype=dtype, generator=g),
                 final=torch.randn(B, T, H, device=dev, dtype=dtype, generator=g),
                 tokens=torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g),
                 loss_mask=ones, valid=ones.clone())


class Variant:
    """One way of running our step: which levers are on."""

    def __init__(self, name, attn_fused=True, loss_fused=True, compiled=True, accumulate=True,
                 adam="fused", clip_in_adam=True, sync_each_step=False, lm_head="frozen", mask="computed"):
        self.name, self.attn_fused, self.loss_fused, self.compiled = name, attn_fused, loss_fused, compiled
        self.accumulate, self.adam, self.clip_in_adam = accumulate, adam, clip_in_adam
        self.sync_each_step, self.lm_head, self.mask = sync_each_step, lm_head, mask

    def as_dict(self):
        return dict(name=self.name, attn_fused=self.attn_fused, loss_fused=self.loss_fused,
                    compiled=self.compiled, accumulate_wgrad=self.accumulate, adam=self.adam,
                    clip_in_adam=self.clip_in_adam, host_sync_each_step=self.sync_each_step,
                    lm_head=self.lm_head, mask=self.mask)


def run_variant(v: Variant, d, head, batch, a, dev, cfg, log):
    """Warm up, then time `a.iters` full training steps (train.train_step). -> result dict."""
    cuda = dev.type == "cuda"
    d.lm_head.weight.requires_grad_(v.lm_head == "trainable")
    if v.compiled and "_compiled" not in d.__dict__:
        d.compile_regions()
        ttt_mod.compile_loss_kernels()
    if not v.compiled:
        d.__dict__.pop("_compiled", None)
    d.accumulate_wgrad = v.accumulate and v.loss_fused
    # the attention lever without the rest: force the fused attention under the reference loss
    if v.attn_fused and not v.loss_fused:
        d.unroll = functools.partial(Eagle3Drafter.unroll, d, fused=True)
    else:
        d.__dict__.pop("unroll", None)
    params = [p for p in d.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    kw = {"fused": True} if (v.adam == "fused" and cuda) else {"foreach": True}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), **kw)
    tcfg = TrainConfig(ttt_steps=a.ttt, gamma=a.gamma, grad_clip=1.0, train_lm_head=v.lm_head == "trainable")
    impl = "fused" if v.loss_fused else "reference"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        # train.py's step: autocast (a no-op on bf16 weights, but what the loop runs), TTT terms,
        # combine, backward, clip, AdamW; no host sync (the loop reads stats at log steps only)
        loss, terms, counts, stats, gnorm = train_step(d, batch, head, opt, params, tcfg, impl=impl,
                                                       use_bf16=cuda, clip_in_optimizer=v.clip_in_adam and "fused" in kw)
        if v.sync_each_step:  # what the loop did before: stats, finite check, grad norm each step
            stats = stats_to_float(stats)
            if not torch.isfinite(loss):
                raise RuntimeError("loss is not finite")
            float(gnorm)
        return loss, stats

    t_c = time.perf_counter()
    for _ in range(a.warmup):
        loss, stats = step()
    sync()
    warm_s = time.perf_counter() - t_c
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters + 1)]
    t0 = time.perf_counter()
    for i in range(a.iters):
        if cuda:
            ev[i].record()
        loss, stats = step()
    if cuda:
        ev[-1].record()
    sync()
    dt = (time.perf_counter() - t0) / a.iters
    times = [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(a.iters)] if cuda else [dt] * a.iters
    stats = stats_to_float(stats) if not v.sync_each_step else stats
    loss = float(loss.detach())
    tok = batch.tokens.numel()
    fl = flops_per_token(cfg, batch.tokens.shape[1], a.ttt, v.lm_head == "trainable")
    if v.mask != "computed":
        fl["mask_extra"] = 0
    tps = tok / dt
    res = dict(v.as_dict(), trainable_params=n_train, step_s=dt, step_s_each=times,
               step_s_median=sorted(times)[len(times) // 2], tokens_per_s=tps,
               gflop_per_token=fl["train"] / 1e9,
               gflop_per_token_with_mask=(fl["train"] + fl["mask_extra"]) / 1e9,
               mfu=fl["train"] * tps / (a.peak_tflops * 1e12),
               mfu_with_mask=(fl["train"] + fl["mask_extra"]) * tps / (a.peak_tflops * 1e12),
               peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               warmup_s=warm_s, loss=loss, acc_0=stats.get("acc_0"))
    log(f"[ours] {v.name:40s} {tps:8.0f} tok/s  step {dt * 1e3:7.1f} ms  mfu {res['mfu']:.3f} "
        f"(with mask {res['mfu_with_mask']:.3f})  peak {res['peak_mem_gib'] or 0:.2f} GiB  "
        f"warmup {warm_s:.1f}s  loss {loss:.4f}")
    if a.profile_dir and cuda and any(v.name.startswith(pfx) for pfx in a.profile):
        try:
            slug = "".join(c if c.isalnum() else "_" for c in v.name).strip("_")
            profile(step, Path(a.profile_dir) / f"profile_{slug}.txt", log)
        except Exception as e:  # a profiler problem must not cost the run
            log(f"[profile] failed: {e!r}")
    del opt
    d.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.empty_cache()
    return res


def profile(step, path: Path, log):
    from torch.profiler import ProfilerActivity, profile as tprof
    path.parent.mkdir(parents=True, exist_ok=True)
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    try:
        table = ka.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70)
    except Exception:
        table = ka.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    path.write_text(table)
    log(f"[profile] {path.name}\n" + "\n".join(table.splitlines()[:22]))


def gemm_probe(cfg, T, log):
    """cuBLAS bf16 rate at this model's GEMM shapes (M = tokens), against the peak used for MFU."""
    H, I, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    shapes = {"q/k/v fwd [T,2H]x[2H,q]": (T, 2 * H, q), "mlp up fwd [T,H]x[H,I]": (T, H, I),
              "mlp down fwd [T,I]x[I,H]": (T, I, H), "lm_head fwd [T,H]x[H,Vd]": (T, H, cfg.draft_vocab_size),
              "q/k/v wgrad [q,T]x[T,2H]": (q, T, 2 * H), "mlp wgrad [I,T]x[T,H]": (I, T, H),
              "8192^3": (8192, 8192, 8192)}
    out = {}
    for name, (m, k, n) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            x @ w
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            x @ w
        torch.cuda.synchronize()
        out[name] = 2 * m * k * n * 20 / (time.perf_counter() - t0) / 1e12
        del x, w
    log("[gemm] TFLOP/s " + "; ".join(f"{k} {v:.0f}" for k, v in out.items()))
    return out


def check_equivalence(a, dev, log):
    """Fused path vs reference on one small problem: loss and gradients.

    On CUDA both run in bf16 and are compared with the reference in fp32 on the same weights
    (bf16 rounding alone moves gradients by percents; the fused path must not move them more);
    the attention alone is compared with an fp32 reference too. On CPU both run in fp32."""
    cuda = dev.type == "cuda"
    size = "small" if cuda else "toy"
    cfg, d, head = build(size, dev, torch.float32, seed=1)
    d.lm_head.weight.requires_grad_(True)
    batch = make_batch(cfg, 2, 256 if cuda else 24, dev, torch.float32, seed=1)
    batch.valid[1, -17:] = False
    batch.loss_mask[1, -17:] = False

    def run(fused, dtype):
        d.to(dtype)
        d.accumulate_wgrad = fused
        b = Batch(batch.aux.to(dtype), batch.final.to(dtype), batch.tokens, batch.loss_mask, batch.valid)
        d.zero_grad(set_to_none=True)
        terms = ttt_terms(d, b, head.to(dtype), a.ttt, fused=fused, chunk=96)
        loss, _ = combine(terms, a.gamma)
        loss.backward()
        return float(loss.detach()), {n: p.grad.float().clone() for n, p in d.named_parameters() if p.grad is not None}

    def err(g, ref):
        rel = {k: float((g[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref}
        worst = max(rel, key=rel.get)
        return rel[worst], worst, sum(rel.values()) / len(rel)

    res = {"size": size}
    if cuda:
        l32, g32 = run(False, torch.float32)
        lr, gr = run(False, torch.bfloat16)
        lf, gf = run(True, torch.bfloat16)
        er, ef = err(gr, g32), err(gf, g32)
        res.update(loss_fp32_reference=l32, loss_reference=lr, loss_fused=lf, loss_rel_err=abs(lf - l32) / abs(l32),
                   grad_rel_err_max=ef[0], grad_rel_err_worst_param=ef[1], grad_rel_err_mean=ef[2],
                   ref_bf16_grad_rel_err_max=er[0], ref_bf16_grad_rel_err_mean=er[2])
        # the attention alone, bf16 fused vs fp32 reference on the same (upcast) inputs
        g = torch.Generator(device=dev).manual_seed(3)
        B, h, T, hd = 1, 4, 512, 128
        qkv = [torch.randn(B, h, T, hd, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(9)]
        q, ks, vs = qkv[0], qkv[1:5], qkv[5:9]
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        bias = torch.zeros(1, 1, T, T, device=dev).masked_fill(~causal, float("-inf"))
        outs = []
        for name, tensors in (("fp32", [t.float() for t in qkv]), ("fused", list(qkv))):
            ts = [t.clone().requires_grad_(True) for t in tensors]
            if name == "fp32":
                o = d.midlayer.self_attn.attend_core(ts[0], ts[1:5], ts[5:9], bias)
            else:
                o = ttt_attention(ts[0], ts[1:5], ts[5:9], 1 / math.sqrt(hd))
            go = torch.ones_like(o) * torch.linspace(-1, 1, o.shape[-1], device=dev, dtype=o.dtype)
            grads = torch.autograd.grad((o * go).sum(), ts)
            outs.append((o.detach().float(), [x.float() for x in grads]))
        (o32, g32a), (of, gfa) = outs
        res["attn_out_rel_err"] = float((of - o32).norm() / o32.norm())
        res["attn_grad_rel_err_max"] = max(float((x - y).norm() / y.norm()) for x, y in zip(gfa, g32a))
        log(f"[check] {size}: loss fp32 {l32:.5f} ref-bf16 {lr:.5f} fused-bf16 {lf:.5f}; grad rel err vs fp32: "
            f"fused max {ef[0]:.2e} mean {ef[2]:.2e} ({ef[1]}), ref-bf16 max {er[0]:.2e} mean {er[2]:.2e}; "
            f"attention alone: out {res['attn_out_rel_err']:.2e}, grads max {res['attn_grad_rel_err_max']:.2e}")
    else:
        lr, gr = run(False, torch.float32)
        lf, gf = run(True, torch.float32)
        ef = err(gf, gr)
        res.update(loss_reference=lr, loss_fused=lf, loss_rel_err=abs(lf - lr) / abs(lr),
                   grad_rel_err_max=ef[0], grad_rel_err_worst_param=ef[1], grad_rel_err_mean=ef[2])
        log(f"[check] {size}: loss ref {lr:.5f} fused {lf:.5f}; worst grad rel err {ef[0]:.2e} ({ef[1]})")
    del d, head
    return res


def time_target_side(cfg, head, batch, hot, a, dev, log):
    """The target side alone: full-vocab head (argmax mask + draft softmax) vs draft rows only."""
    if dev.type != "cuda":
        return None
    sub = head.index_select(0, hot)
    out = {}
    for name, h in (("full_vocab_head", head), ("draft_rows_only", sub)):
        for _ in range(2):
            ttt_mod.target_stats(batch.final, h, torch.arange(hot.numel(), device=dev) if h is sub else hot, a.chunk)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            ttt_mod.target_stats(batch.final, h, torch.arange(hot.numel(), device=dev) if h is sub else hot, a.chunk)
        torch.cuda.synchronize()
        out[name + "_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    log(f"[target] full-vocab head {out['full_vocab_head_ms']:.2f} ms/step, draft rows only "
        f"{out['draft_rows_only_ms']:.2f} ms/step")
    del sub
    return out


def run_speculators(a, log) -> dict | None:
    script = HERE / "anchors" / "speculators_train_bench.py"
    cmd = [sys.executable, str(script), "--seq", str(a.seq), "--ttt", str(a.ttt), "--iters", str(a.iters),
           "--warmup", str(a.warmup), "--peak-tflops", str(a.peak_tflops), "--loss-impl", a.spec_loss]
    if a.size == "toy":
        cmd.append("--toy")
    if a.spec_attn:
        cmd += ["--attn", a.spec_attn]
    log("[speculators] " + " ".join(cmd))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.spec_timeout)
    except subprocess.TimeoutExpired as e:
        log(f"[speculators] timed out after {a.spec_timeout}s\n{(e.stderr or '')[-3000:] if isinstance(e.stderr, str) else ''}")
        return None
    tail = (r.stderr or "")[-4000:]
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
    if r.returncode != 0 or line is None:
        log(f"[speculators] failed (rc {r.returncode}):\n{tail}\n{r.stdout[-2000:]}")
        return None
    res = json.loads(line)
    res["wall_s"] = time.perf_counter() - t0
    log(f"[speculators] {res['tokens_per_s']:.0f} tok/s  step {res['step_s'] * 1e3:.1f} ms  "
        f"own mfu {res['mfu']:.3f}  peak {res.get('peak_mem_gib') or 0:.2f} GiB  (wall {res['wall_s']:.0f}s)")
    return res


def versions():
    out = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        from importlib.metadata import version
        out["speculators"] = version("speculators")
    except Exception:
        out["speculators"] = None
    try:
        import triton
        out["triton"] = triton.__version__
    except Exception:
        pass
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="kimi on CUDA, toy on CPU")
    ap.add_argument("--seq", type=int, default=None, help="2048 (kimi/small), 64 (toy)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=2048, help="rows per chunk of the fused loss / target")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--lm-head", choices=["frozen", "trainable", "both"], default="both")
    ap.add_argument("--impl", choices=["compiled", "fused", "reference"], default=None,
                    help="compiled (CUDA default): fused attention + fused loss + compiled regions")
    ap.add_argument("--ladder", action="store_true", help="also time each lever on and off")
    ap.add_argument("--check", action="store_true", help="fused vs reference on a small problem first")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--profile", nargs="*", default=["L0", "main lm_head frozen"],
                    help="name prefixes of the variants to profile (with --profile-dir)")
    ap.add_argument("--gemm-probe", action="store_true", help="time cuBLAS at the model's GEMM shapes")
    ap.add_argument("--no-speculators", action="store_true")
    ap.add_argument("--no-precomputed", action="store_true",
                    help="skip the variant whose argmax mask comes with the data")
    ap.add_argument("--spec-loss", default="eager", help="the anchor's --loss-impl (fused fails on torch 2.11)")
    ap.add_argument("--spec-attn", default=None)
    ap.add_argument("--spec-timeout", type=int, default=420)
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--log", default=None, help="also write the printed lines here")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    a.size = a.size or ("kimi" if cuda else "toy")
    a.seq = a.seq or (64 if a.size == "toy" else 2048)
    a.impl = a.impl or ("compiled" if cuda else "fused")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        if a.log:
            Path(a.log).parent.mkdir(parents=True, exist_ok=True)
            Path(a.log).write_text("\n".join(lines) + "\n")

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    log(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; {versions()}")
    check = check_equivalence(a, dev, log) if a.check else None

    cfg, d, head = build(a.size, dev, dtype)
    batch = make_batch(cfg, a.batch, a.seq, dev, dtype)
    fl_frozen = flops_per_token(cfg, a.seq, a.ttt, False)
    fl_train = flops_per_token(cfg, a.seq, a.ttt, True)
    log(f"size {a.size}: H {cfg.hidden_size} I {cfg.intermediate_size} heads {cfg.num_attention_heads}x{cfg.head_dim} "
        f"kv {cfg.num_key_value_heads} Vd {cfg.draft_vocab_size} V {cfg.vocab_size}; B {a.batch} T {a.seq} TTT {a.ttt} {dtype}")
    log(f"FLOPs/token: train {fl_frozen['train'] / 1e9:.2f} G (lm_head frozen), {fl_train['train'] / 1e9:.2f} G "
        f"(trainable); of which target draft rows {fl_frozen['target_draft_rows'] / 1e9:.3f} G; "
        f"full-vocab mask extra {fl_frozen['mask_extra'] / 1e9:.3f} G (counted apart)")

    gemm = gemm_probe(cfg, a.seq * a.batch, log) if (a.gemm_probe and dev.type == "cuda") else None
    comp = a.impl == "compiled"
    fused = a.impl in ("compiled", "fused")
    variants = []
    if a.ladder:
        old_loop = dict(adam="fused", clip_in_adam=False, sync_each_step=True)   # train.py before
        variants += [
            Variant("L0 reference (old loop)", attn_fused=False, loss_fused=False, compiled=False,
                    accumulate=False, **old_loop),
            Variant("L1 +fused attention", attn_fused=True, loss_fused=False, compiled=False, accumulate=False,
                    **old_loop),
            Variant("L2 +fused loss/linears/swiglu", compiled=False, accumulate=False, **old_loop),
            Variant("L3 +in-place wgrad accumulation", compiled=False, **old_loop)]
        if dev.type == "cuda":
            variants += [Variant("L4 +compiled regions", **old_loop),
                         Variant("L5 +clip inside fused AdamW", sync_each_step=True),
                         Variant("X  main with foreach AdamW + clip_grad_norm_", adam="foreach", clip_in_adam=False)]
    heads = ["frozen", "trainable"] if a.lm_head == "both" else [a.lm_head]
    for lh in heads:
        variants.append(Variant(f"main lm_head {lh}", attn_fused=fused, loss_fused=fused, compiled=comp, lm_head=lh))
    results = []
    for v in variants:
        results.append(run_variant(v, d, head, batch, a, dev, cfg, log))
    target = time_target_side(cfg, head, batch, d.hot_ids, a, dev, log)
    if fused and not a.no_precomputed:
        # the argmax mask captured with the features: the full-vocab head leaves the GPU
        with torch.no_grad():
            batch.target_arg = ttt_mod.target_stats(batch.final, head, d.hot_ids, a.chunk)[1]
            rows = head.index_select(0, d.hot_ids).contiguous()
        del head
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        head = rows
        results.append(run_variant(Variant("main lm_head frozen, mask precomputed", attn_fused=fused,
                                           loss_fused=fused, compiled=comp, mask="precomputed"),
                                   d, head, batch, a, dev, cfg, log))
    del d, head, batch
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    spec = None if a.no_speculators else run_speculators(a, log)

    main_res = {r["lm_head"]: r for r in results if r["name"].startswith("main") and r["mask"] == "computed"}
    pre = next((r for r in results if r["mask"] == "precomputed"), None)
    ours = main_res.get("frozen") or next(iter(main_res.values()))
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "versions": versions(),
        "config": {"size": a.size, **SIZES[a.size], "fc_in": cfg.fc_in, "batch": a.batch, "seq": a.seq,
                   "ttt_steps": a.ttt, "gamma": a.gamma, "dtype": str(dtype).replace("torch.", ""),
                   "params_dtype": str(dtype).replace("torch.", ""), "impl": a.impl, "chunk": a.chunk,
                   "optimizer": "AdamW fused (CUDA), betas (0.9, 0.95)", "grad_clip": 1.0,
                   "target": "frozen target lm_head [V, H]: full-vocab argmax mask + draft-vocab softmax",
                   "iters": a.iters, "warmup": a.warmup, "peak_tflops": a.peak_tflops},
        "flops_per_token": {"train_lm_head_frozen": fl_frozen["train"], "train_lm_head_trainable": fl_train["train"],
                            "target_draft_rows": fl_frozen["target_draft_rows"], "mask_extra": fl_frozen["mask_extra"],
                            "note": "MFU counts train FLOPs (target draft rows included, as speculators needs "
                                    "them too); mfu_with_mask adds the full-vocab argmax mask's head rows"},
        "tokens_per_s": ours["tokens_per_s"],
        "mfu": ours["mfu"],
        "mfu_with_mask": ours["mfu_with_mask"],
        "peak_mem_gib": ours["peak_mem_gib"],
        "lm_head": ours["lm_head"],
        "trainable_params": ours["trainable_params"],
        "ours": results,
        "target_side_ms": target,
        "check": check,
        "gemm_tflops": gemm,
    }
    out["fp32_target_logits_via_mm_out_dtype"] = ttt_mod._MM_OUT_DTYPE[0] if dev.type == "cuda" else None
    if pre is not None:
        out.update(tokens_per_s_mask_precomputed=pre["tokens_per_s"], mfu_mask_precomputed=pre["mfu"],
                   peak_mem_gib_mask_precomputed=pre["peak_mem_gib"])
    if "trainable" in main_res:
        t = main_res["trainable"]
        out.update(tokens_per_s_lm_head_trainable=t["tokens_per_s"], mfu_lm_head_trainable=t["mfu"],
                   peak_mem_gib_lm_head_trainable=t["peak_mem_gib"])
    if spec is not None:
        sp_tps = spec["tokens_per_s"]
        out.update(speculators_tokens_per_s=sp_tps,
                   speedup_vs_speculators=ours["tokens_per_s"] / sp_tps,
                   speculators_mfu=fl_frozen["train"] * sp_tps / (a.peak_tflops * 1e12),
                   speculators_peak_mem_gib=spec.get("peak_mem_gib"),
                   speculators_trainable_params=spec.get("trainable_params"),
                   speculators_raw=spec,
                   same_trainable_set=(spec.get("trainable_params") == ours["trainable_params"]
                                       and not spec.get("lm_head_trainable")))
        if pre is not None:
            out["speedup_vs_speculators_mask_precomputed"] = pre["tokens_per_s"] / sp_tps
        log(f"[ratio] ours/speculators (lm_head frozen both) = {out['speedup_vs_speculators']:.3f}x "
            f"(mask precomputed: {out.get('speedup_vs_speculators_mask_precomputed') or 0:.3f}x); "
            f"speculators mfu by our count {out['speculators_mfu']:.3f}")
    log("summary: " + json.dumps({k: out.get(k) for k in (
        "tokens_per_s", "speculators_tokens_per_s", "speedup_vs_speculators", "mfu", "mfu_with_mask",
        "peak_mem_gib", "speculators_peak_mem_gib", "tokens_per_s_lm_head_trainable",
        "mfu_lm_head_trainable", "peak_mem_gib_lm_head_trainable", "tokens_per_s_mask_precomputed",
        "speedup_vs_speculators_mask_precomputed", "peak_mem_gib_mask_precomputed")}))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
