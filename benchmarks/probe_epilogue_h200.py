"""Would GEMMs with the SwiGLU work fused into them beat cuBLAS plus a separate kernel at the
drafter's MLP shapes? Inductor's max-autotune (Triton GEMM templates, TMA-persistent ones where
the installed torch has them, each benchmarked against cuBLAS, the elementwise work fused into the
template's epilogue where it wins) against what the step runs now: cuBLAS GEMMs and the SwiGLU in
compiled elementwise kernels of their own (kernels._swiglu / _swiglu_grads_act).

In the profiled T 4,096 step (lm_head trained, mask stored) the GEMMs are 83.6% of the step at
~730 TFLOP/s and every compiled elementwise kernel together 7.1%; a fused epilogue saves one
read of the GEMM's output, so it can only pay if the template's GEMM runs within a few per cent of
cuBLAS. This measures that at the two places the MLP has one:
  fwd: g, u = x @ W_gu^T (gate and up in one GEMM); a = silu(g) * u; out = a @ W_d^T
       (g and u are kept for backward, as _SwiGLUDown keeps them)
  bwd: da = dy @ W_d; dg, du, a = swiglu grads of da (a: the product recomputed for the down
       projection's weight gradient, as _SwiGLUDown's backward recomputes it)
and the plain gate/up GEMM alone (how fast the templates are without any fusion).

Each variant: median of --reps CUDA-event timed calls after warm-up; the largest difference to
the eager reference in units of the reference's largest magnitude; inductor's autotune tables
(which choice won each GEMM) go to stderr. Prints figures, writes --json, asserts nothing.

    python benchmarks/probe_epilogue_h200.py [--seqs 8192 4096] [--reps 20] [--json OUT]
    python benchmarks/probe_epilogue_h200.py --size toy     # CPU: the code paths only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from draftport.model.fast import kernels  # noqa: E402
from probe_lmhead_gemm_h200 import timeit as cuda_timeit  # noqa: E402  (beside this file)

SIZES = {"kimi": (7168, 18432), "toy": (64, 160)}


def timeit(fn, reps):
    """Median seconds of one call: CUDA events on the GPU (probe_lmhead_gemm_h200.timeit), a host
    clock over the calls on the CPU (the code paths only)."""
    if torch.cuda.is_available():
        return cuda_timeit(fn, reps)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def autotune_options() -> dict:
    """max-autotune with Triton templates beside cuBLAS; the TMA-persistent templates and the
    benchmarked epilogue fusion where this torch's inductor has those switches."""
    from torch._inductor import config as ic
    opts = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON",
            "coordinate_descent_tuning": True, "epilogue_fusion": True}
    for name in ("triton.enable_persistent_tma_matmul", "benchmark_epilogue_fusion"):
        mod, _, attr = name.rpartition(".")
        if hasattr(getattr(ic, mod) if mod else ic, attr):
            opts[name] = True
    return opts


def mlp_fwd(x, w_gu, w_d):
    """One graph for max-autotune: the step's own SwiGLU (kernels._swiglu, uncompiled) between the GEMMs."""
    I = w_d.shape[1]
    y = x @ w_gu.t()
    g, u = y[:, :I], y[:, I:]
    return g, u, kernels._swiglu(g, u) @ w_d.t()


def mlp_fwd_now(x, w_gu, w_d):
    """As the step runs it: cuBLAS, the compiled SwiGLU kernel, cuBLAS."""
    I = w_d.shape[1]
    y = x @ w_gu.t()
    g, u = y[:, :I], y[:, I:]
    return g, u, kernels._KERNELS["swiglu"](g, u) @ w_d.t()


def down_bwd(dy, w_d, g, u):
    """One graph: the GEMM and the step's own SwiGLU gradients (kernels._swiglu_grads_act, uncompiled)."""
    return kernels._swiglu_grads_act(dy @ w_d, g, u)


def down_bwd_now(dy, w_d, g, u):
    return kernels._KERNELS["swiglu_grads_act"](dy @ w_d, g, u)


def gemm(x, w):
    return x @ w.t()


def rel_diff(out, ref) -> float:
    out = out if isinstance(out, (tuple, list)) else (out,)
    ref = ref if isinstance(ref, (tuple, list)) else (ref,)
    return max(float((o.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30))
               for o, r in zip(out, ref))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="kimi")
    ap.add_argument("--seqs", type=int, nargs="+", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.size == "kimi" and not cuda:
        sys.exit("probe_epilogue_h200.py: --size kimi needs a CUDA device (--size toy runs on the CPU)")
    if a.reps < 1:
        sys.exit("probe_epilogue_h200.py: --reps takes a positive number")
    seqs = a.seqs or ([8192, 4096] if a.size == "kimi" else [64])
    H, I = SIZES[a.size]
    dev, dt = ("cuda" if cuda else "cpu"), torch.bfloat16
    kernels.compile_kernels()          # the step's compiled SwiGLU kernels, with the default options
    opts = autotune_options()
    tuned = {name: torch.compile(fn, options=opts, dynamic=False)
             for name, fn in (("fwd", mlp_fwd), ("bwd", down_bwd), ("gemm", gemm))}
    now = {"fwd": mlp_fwd_now, "bwd": down_bwd_now, "gemm": gemm}
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "size": a.size, "hidden": H, "intermediate": I, "reps": a.reps, "autotune_options": opts,
           "results": {}}
    g0 = torch.Generator(device=dev).manual_seed(0)
    for T in seqs:
        def rnd(*shape, s=1.0):
            return (torch.randn(*shape, device=dev, dtype=dt, generator=g0) * s)
        x, dy = rnd(T, H), rnd(T, H, s=1e-2)
        w_gu, w_d = rnd(2 * I, H, s=H ** -0.5), rnd(H, I, s=I ** -0.5)
        g, u = rnd(T, I), rnd(T, I)
        args = {"fwd": (x, w_gu, w_d), "bwd": (dy, w_d, g, u), "gemm": (x, w_gu)}
        flops = {"fwd": 2 * T * H * 2 * I + 2 * T * I * H, "bwd": 2 * T * H * I, "gemm": 2 * T * H * 2 * I}
        res = out["results"][str(T)] = {}
        for name in ("gemm", "fwd", "bwd"):
            t0 = time.perf_counter()
            tuned[name](*args[name])           # compile + autotune, timed apart
            if cuda:
                torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
            ref = now[name](*args[name])
            diff = rel_diff(tuned[name](*args[name]), ref)
            t_now = timeit(lambda: now[name](*args[name]), a.reps)
            t_tuned = timeit(lambda: tuned[name](*args[name]), a.reps)
            t_now2 = timeit(lambda: now[name](*args[name]), a.reps)   # the same version twice: the spread
            rec = res[name] = {"now_ms": t_now * 1e3, "now_again_ms": t_now2 * 1e3, "tuned_ms": t_tuned * 1e3,
                               "now_tflops": flops[name] / t_now / 1e12, "tuned_tflops": flops[name] / t_tuned / 1e12,
                               "tuned_vs_now": t_now / t_tuned, "max_rel_diff": diff, "compile_s": compile_s}
            print(f"T{T} {name:4s} now {rec['now_ms']:7.3f} ms (again {rec['now_again_ms']:7.3f}) "
                  f"{rec['now_tflops']:5.0f} TFLOP/s | max-autotune {rec['tuned_ms']:7.3f} ms "
                  f"{rec['tuned_tflops']:5.0f} TFLOP/s | x{rec['tuned_vs_now']:.3f} | rel diff {diff:.2e} | "
                  f"compile {compile_s:.0f} s", flush=True)
        if cuda:
            torch.cuda.empty_cache()
        if a.json:                         # after each length: a run cut short keeps what it measured
            tmp = Path(a.json).with_suffix(".tmp")
            tmp.write_text(json.dumps(out, indent=1))
            tmp.replace(a.json)
    return out


if __name__ == "__main__":
    main()
