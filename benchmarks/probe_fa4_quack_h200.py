"""Two kernel sources the step does not use yet, timed against what it runs now, at its shapes:

- attention: FlashAttention-4 (the CuTe-DSL kernels of the flash-attention project, Hopper
  forward and backward, JIT-compiled; package flash-attn-4; the committed figures,
  results/2026-12-03-h200-probe-fa4-attn.json, ran its source tree at commit 0251105 of
  2026-08-15, the whole-step lever probe the 4.0.0b40 wheel) against
  cuDNN's fused attention as draftport.model.fast.kernels calls it (`set_attention_backend("cudnn")`): the
  dense causal part at T 2,048 and 4,096 (one row, 64 heads of 128), forward with its
  log-sum-exp and backward from given (out, dout, lse), as the TTT attention runs them; and the
  length mix's packed rows (steps of <= 8,192 tokens, first-fit decreasing as the bench packs):
  cuDNN once per segment (draftport's packed default under cuDNN) against FA4's varlen kernel
  over cu_seqlens, one call per row.
- GEMMs: quack's CuTe-DSL GEMM (quack-kernels; Hopper warp-specialized kernels, its default
  config and, with --tuned, its autotuner) against cuBLAS through torch, at the step's GEMM
  shapes for --rows tokens: each linear's forward (x @ W^T), input gradient (dY @ W) and weight
  gradient summed in place (W.grad += dY^T @ x, beta 1, as kernels.accumulate_grad runs it).

Each case alternates the two sides over --rounds rounds (a drift of the card's clocks falls on
both) and prints per side the median time, TFLOP/s and the ratio (the current kernel's time over
the new one's: > 1 means the new one is faster); outputs are compared (largest difference
relative to the current kernel's largest value). Asserts nothing; writes --json.

    python benchmarks/probe_fa4_quack_h200.py [--seqs 2048 4096] [--rows 4096 8192] [--rounds 7]
        [--reps 10] [--tuned] [--skip-gemm] [--skip-attn] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftport.model.fast import kernels  # noqa: E402

H, I, NH, HD, VD = 7168, 18432, 64, 128, 32000   # the Kimi-K2-size drafter (bench_train_h200.py)
MIX = Path(__file__).resolve().parent / "results" / "2026-12-03-mix-lengths.json"


def log(*a):
    print(*a, flush=True)


def timed(fn, reps: int) -> float:
    """The mean of `reps` back-to-back calls, in ms (CUDA events)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / reps


def alternate(sides: dict, rounds: int, reps: int) -> dict:
    """Each side's per-call ms over `rounds` alternated rounds -> {name: [ms per round]}."""
    out = {k: [] for k in sides}
    for _ in range(rounds):
        for k, fn in sides.items():
            out[k].append(timed(fn, reps))
    return out


def rel_diff(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))


def summary(name, flop, times, diff, extra=None):
    med = {k: statistics.median(v) for k, v in times.items()}
    cur, new = list(med)
    r = {"case": name, "gflop": flop / 1e9, "ms": med, "ms_each": times,
         "tflops": {k: flop / (v * 1e-3) / 1e12 for k, v in med.items()},
         "ratio_current_over_new": med[cur] / med[new], "max_rel_diff": diff}
    if extra:
        r.update(extra)
    log(f"  {name:<44} {cur} {med[cur]:8.3f} ms {r['tflops'][cur]:6.1f} TF/s | {new} {med[new]:8.3f} ms "
        f"{r['tflops'][new]:6.1f} TF/s | x{r['ratio_current_over_new']:.3f} | diff {diff:.2e}")
    return r


# ---- attention -----------------------------------------------------------------------------
def ffd_rows(lengths, cap=8192, align=64):
    """First-fit decreasing into steps of <= cap tokens, each sample rounded up to `align`."""
    rows = []
    for n in sorted(lengths, reverse=True):
        m = -(-n // align) * align
        for r in rows:
            if sum(x for _, x in r) + m <= cap:
                r.append((n, m))
                break
        else:
            rows.append([(n, m)])
    return rows


def attn_cases(seqs, rounds, reps):
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    kernels.set_attention_backend("cudnn")
    kernels.set_packed_attention("segments")
    dev, dt = "cuda", torch.bfloat16
    scale = 1.0 / math.sqrt(HD)
    g = torch.Generator(device=dev).manual_seed(0)
    res = []

    def mk(T):
        return [torch.randn(1, T, NH, HD, device=dev, dtype=dt, generator=g) for _ in range(4)]

    for T in seqs:
        q, k, v, do = mk(T)                       # [B, T, h, d], as the drafter lays them out
        qb, kb, vb, dob = (t.transpose(1, 2) for t in (q, k, v, do))   # [B, h, T, d] views
        o_c, lse_c, ex = kernels._flash_fwd(qb, kb, vb, scale)
        o_f, lse_f, *_ = _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
        g_c = kernels._flash_bwd(dob, qb, kb, vb, o_c, lse_c, scale, ex)
        g_f = _flash_attn_bwd(q, k, v, o_f, do, lse_f, scale, True)
        torch.cuda.synchronize()
        flop_f = 4 * T * T / 2 * NH * HD          # causal: half the square
        d_f = max(rel_diff(o_c.transpose(1, 2), o_f), rel_diff(lse_c.reshape(1, NH, T), lse_f.reshape(1, NH, T)))
        d_b = max(rel_diff(a.transpose(1, 2), b) for a, b in zip(g_c[:3], g_f[:3]))
        t = alternate({"cudnn": lambda: kernels._flash_fwd(qb, kb, vb, scale),
                       "fa4": lambda: _flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)},
                      rounds, reps)
        res.append(summary(f"attn fwd T{T}", flop_f, t, d_f, {"T": T}))
        t = alternate({"cudnn": lambda: kernels._flash_bwd(dob, qb, kb, vb, o_c, lse_c, scale, ex),
                       "fa4": lambda: _flash_attn_bwd(q, k, v, o_f, do, lse_f, scale, True)}, rounds, reps)
        res.append(summary(f"attn bwd T{T}", 2.5 * flop_f, t, d_b, {"T": T}))
        del q, k, v, do, o_c, o_f, g_c, g_f
        torch.cuda.empty_cache()

    if MIX.exists():
        lengths = json.loads(MIX.read_text())["lengths"]
        rows = ffd_rows(lengths)
        sides_f, sides_b, flop, dfs, dbs = [], [], 0.0, [], []
        for r in rows:
            cu = [0]
            for n, m in r:
                cu.append(cu[-1] + m)
            N = cu[-1]
            flop += sum(4 * m * m / 2 * NH * HD for _, m in r)
            seg = kernels.Segments(cu, max(m for _, m in r))
            q, k, v, do = (torch.randn(N, NH, HD, device=dev, dtype=dt, generator=g) for _ in range(4))
            cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
            mx = seg.max_len
            o_c, lse_c, ex = kernels._seg_fwd(q, k, v, seg, scale)
            fwd_f = (lambda q=q, k=k, v=v, cu_t=cu_t, mx=mx: _flash_attn_fwd(
                q, k, v, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t, max_seqlen_q=mx, max_seqlen_k=mx,
                softmax_scale=scale, causal=True, return_lse=True))
            o_f, lse_f, *_ = fwd_f()
            g_c = kernels._seg_bwd(do, q, k, v, o_c, lse_c, seg, scale, ex)
            bwd_f = (lambda q=q, k=k, v=v, o_f=o_f, do=do, lse_f=lse_f, cu_t=cu_t, mx=mx: _flash_attn_bwd(
                q, k, v, o_f, do, lse_f, scale, True, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                max_seqlen_q=mx, max_seqlen_k=mx))
            g_f = bwd_f()
            torch.cuda.synchronize()
            dfs.append(rel_diff(o_c, o_f))
            dbs.append(max(rel_diff(a, b) for a, b in zip(g_c[:3], g_f[:3])))
            sides_f.append((lambda q=q, k=k, v=v, seg=seg: kernels._seg_fwd(q, k, v, seg, scale), fwd_f))
            sides_b.append((lambda do=do, q=q, k=k, v=v, o=o_c, l=lse_c, seg=seg, ex=ex:
                            kernels._seg_bwd(do, q, k, v, o, l, seg, scale, ex), bwd_f))
        info = {"rows": [[n for n, _ in r] for r in rows]}
        t = alternate({"cudnn_segments": lambda: [c() for c, _ in sides_f],
                       "fa4_varlen": lambda: [f() for _, f in sides_f]}, rounds, reps)
        res.append(summary(f"attn fwd mix ({len(rows)} packed rows)", flop, t, max(dfs), info))
        t = alternate({"cudnn_segments": lambda: [c() for c, _ in sides_b],
                       "fa4_varlen": lambda: [f() for _, f in sides_b]}, rounds, reps)
        res.append(summary(f"attn bwd mix ({len(rows)} packed rows)", 2.5 * flop, t, max(dbs), info))
    return res


# ---- GEMMs ---------------------------------------------------------------------------------
LINEARS = {"q/k/v hidden half (each)": (NH * HD, H),
           "o_proj": (H, NH * HD), "gate/up (each)": (I, H), "down": (H, I), "lm_head": (VD, H)}


def gemm_cases(rows_list, rounds, reps, tuned):
    from quack.gemm_interface import gemm, gemm_add_inplace

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    res = []
    for M in rows_list:
        for name, (N, K) in LINEARS.items():
            x = torch.randn(M, K, device=dev, dtype=dt, generator=g)
            w = torch.randn(N, K, device=dev, dtype=dt, generator=g) * 0.02
            dy = torch.randn(M, N, device=dev, dtype=dt, generator=g)
            acc_c = torch.zeros(N, K, device=dev, dtype=dt)
            acc_q = torch.zeros(N, K, device=dev, dtype=dt)
            flop = 2.0 * M * N * K
            # forward: x @ W^T
            y_c = x @ w.t()
            y_q = gemm(x, w.t(), tuned=tuned)
            t = alternate({"cublas": lambda: x @ w.t(), "quack": lambda: gemm(x, w.t(), tuned=tuned)}, rounds, reps)
            res.append(summary(f"M{M} {name} fwd [{M}x{K}]@[{K}x{N}]", flop, t, rel_diff(y_c, y_q),
                               {"M": M, "N": N, "K": K, "op": "fwd"}))
            # input gradient: dY @ W
            d_c = dy @ w
            d_q = gemm(dy, w, tuned=tuned)
            t = alternate({"cublas": lambda: dy @ w, "quack": lambda: gemm(dy, w, tuned=tuned)}, rounds, reps)
            res.append(summary(f"M{M} {name} dgrad", flop, t, rel_diff(d_c, d_q), {"M": M, "N": N, "K": K, "op": "dgrad"}))
            # weight gradient summed in place: W.grad += dY^T @ x
            acc_c.addmm_(dy.t(), x)
            gemm_add_inplace(dy.t(), x, acc_q, tuned=tuned)
            diff = rel_diff(acc_c, acc_q)
            t = alternate({"cublas": lambda: acc_c.addmm_(dy.t(), x),
                           "quack": lambda: gemm_add_inplace(dy.t(), x, acc_q, tuned=tuned)}, rounds, reps)
            res.append(summary(f"M{M} {name} wgrad+=", flop, t, diff, {"M": M, "N": N, "K": K, "op": "wgrad"}))
            del x, w, dy, acc_c, acc_q, y_c, y_q, d_c, d_q
            torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tuned", action="store_true", help="quack's autotuner (compiles several configs)")
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--skip-attn", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_fa4_quack_h200.py: needs a CUDA device")
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
           "versions": {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()},
           "args": vars(a), "attention": None, "gemm": None, "errors": {}}
    for mod in ("cutlass", "quack"):
        try:
            m = __import__(mod)
            out["versions"][mod] = getattr(m, "__version__", "?")
        except Exception as e:   # reported, the other part still runs
            out["errors"][f"import {mod}"] = repr(e)
    t0 = time.perf_counter()
    for part, run in (("attention", None if a.skip_attn else lambda: attn_cases(a.seqs, a.rounds, a.reps)),
                      ("gemm", None if a.skip_gemm else lambda: gemm_cases(a.rows, a.rounds, a.reps, a.tuned))):
        if run is None:
            continue
        log(f"[{part}]")
        t = time.perf_counter()
        try:
            out[part] = run()
        except Exception as e:
            traceback.print_exc()
            out["errors"][part] = repr(e)
        log(f"[{part}] {time.perf_counter() - t:.0f} s")
    out["wall_s"] = time.perf_counter() - t0
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
