"""The drafter's lm_head GEMMs ([T, H] x [H, Vd] forward, [T, Vd] x [Vd, H] input gradient,
[Vd, T] x [T, H] weight gradient summed in place) written several ways, beside the MLP's GEMMs
at the same T for reference: which formulation cuBLAS runs fastest at these shapes.

In a profiled training step at T 4,096 (lm_head trained, mask stored) the three lm_head GEMMs ran
at 691 / 733 / 696 TFLOP/s where gate/up and down ran at ~790: this asks whether the same
products, laid out otherwise (the transposed problem, the output columns in two halves, cuBLASLt
instead of cuBLAS), run faster. Bit-for-bit equality is not expected across formulations (other
kernels, other summation orders); the largest difference to the first is printed.

--vocabs V1 V2 ...: instead, the three GEMMs as the step runs them at several lm_head widths
(e.g. the draft vocab 32,000 and that width padded to 32,256 or 32,768 rows), the widths
alternated over --rounds rounds so that a drift of the card's clocks falls on all of them; per
width the median time, TFLOP/s of the GEMM as run, and the rate in the first width's FLOPs (what a
padded head would give for the same useful work).

Prints TFLOP/s per formulation and writes --json; asserts nothing.

    python benchmarks/probe_lmhead_gemm_h200.py [--seqs 2048 4096 8192] [--reps 20] [--json OUT]
    python benchmarks/probe_lmhead_gemm_h200.py --vocabs 32000 32256 32768 [--rounds 5] [--seqs 2048 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

H, I, VD = 7168, 18432, 32000


def timeit(fn, reps):
    for _ in range(3):
        fn()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    torch.cuda.synchronize()
    for i in range(reps):
        ev[i].record()
        fn()
    ev[-1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(reps))


def forms(T, g):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(VD, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    d = torch.randn(T, VD, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    acc = torch.zeros(VD, H, device="cuda", dtype=torch.bfloat16)
    half = VD // 2
    out = torch.empty(T, VD, device="cuda", dtype=torch.bfloat16)
    out_a, out_b = torch.empty(T, half, device="cuda", dtype=torch.bfloat16), torch.empty(
        T, VD - half, device="cuda", dtype=torch.bfloat16)
    xt = x.t().contiguous()
    dt = d.t().contiguous()
    f = 2 * T * H * VD
    return {
        "fwd": (f, {
            "x @ w.t() (now)": lambda: x @ w.t(),
            "F.linear(x, w)": lambda: torch.nn.functional.linear(x, w),
            "mm(x, w.t(), out=)": lambda: torch.mm(x, w.t(), out=out),
            "(w @ x.t()).t() (transposed problem)": lambda: (w @ x.t()).t(),
            "two column halves": lambda: (torch.mm(x, w[:half].t(), out=out_a), torch.mm(x, w[half:].t(), out=out_b)),
            "w @ xt (x stored transposed)": lambda: w @ xt,
        }),
        "dgrad": (f, {
            "d @ w (now)": lambda: d @ w,
            "(w.t() @ d.t()).t() (transposed problem)": lambda: (w.t() @ d.t()).t(),
            "dt.t() @ w (d stored transposed)": lambda: dt.t() @ w,
            "two K halves, addmm": lambda: torch.addmm(d[:, :half] @ w[:half], d[:, half:], w[half:]),
        }),
        "wgrad_acc": (f, {
            "acc.addmm_(d.t(), x) (now)": lambda: acc.addmm_(d.t(), x),
            "acc.t().addmm_(x.t(), d) (transposed problem)": lambda: acc.t().addmm_(x.t(), d),
            "acc.add_(d.t() @ x)": lambda: acc.add_(d.t() @ x),
            "acc.addmm_(dt, x) (d stored transposed)": lambda: acc.addmm_(dt, x),
            "two row halves, addmm_": lambda: (acc[:half].addmm_(d[:, :half].t(), x), acc[half:].addmm_(d[:, half:].t(), x)),
        }),
    }


def reference(T, g):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(I, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    dy = torch.randn(T, I, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
    acc = torch.zeros(I, H, device="cuda", dtype=torch.bfloat16)
    f = 2 * T * H * I
    return {"mlp up fwd x @ w.t()": (f, lambda: x @ w.t()), "mlp up dgrad dy @ w": (f, lambda: dy @ w),
            "mlp up wgrad acc.addmm_(dy.t(), x)": (f, lambda: acc.addmm_(dy.t(), x))}


def vocab_sweep(T, vocabs, rounds, reps, g):
    """The lm_head's forward, input gradient and weight gradient (summed in place) at each width,
    alternated over rounds. -> {op: {width: {"ms", "tflops", "tflops_useful"}}}"""
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    ops = {}
    for v in vocabs:
        w = torch.randn(v, H, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        d = torch.randn(T, v, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-3
        acc = torch.zeros(v, H, device="cuda", dtype=torch.bfloat16)
        ops[v] = {"fwd x @ w.t()": lambda x=x, w=w: x @ w.t(), "dgrad d @ w": lambda d=d, w=w: d @ w,
                  "wgrad acc.addmm_(d.t(), x)": lambda acc=acc, d=d, x=x: acc.addmm_(d.t(), x)}
    times = {op: {v: [] for v in vocabs} for op in ops[vocabs[0]]}
    for r in range(rounds):
        for v in (vocabs if r % 2 == 0 else vocabs[::-1]):
            for op, fn in ops[v].items():
                times[op][v].append(timeit(fn, reps))
    useful = 2 * T * H * vocabs[0]
    return {op: {str(v): {"ms": statistics.median(ts) * 1e3,
                          "tflops": 2 * T * H * v / statistics.median(ts) / 1e12,
                          "tflops_useful": useful / statistics.median(ts) / 1e12}
                 for v, ts in per.items()} for op, per in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--vocabs", type=int, nargs="+", default=None,
                    help="time the lm_head GEMMs at these widths instead (the first is the useful one)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the widths alternated (--vocabs)")
    a = ap.parse_args(argv)
    if a.vocabs is not None and (min(a.vocabs) < 1 or a.rounds < 1):
        sys.exit("probe_lmhead_gemm_h200.py: --vocabs and --rounds take positive numbers")
    if not torch.cuda.is_available():
        sys.exit("probe_lmhead_gemm_h200.py needs a CUDA device")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": a.reps, "results": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    if a.vocabs is not None:
        out.update(vocabs=a.vocabs, rounds=a.rounds)
        for T in a.seqs:
            res = out["results"][str(T)] = vocab_sweep(T, a.vocabs, a.rounds, a.reps, g)
            res["mlp reference"] = {name: {"tflops": f / timeit(fn, a.reps) / 1e12}
                                    for name, (f, fn) in reference(T, g).items()}
            print(f"T{T} mlp reference: " + ", ".join(f"{k} {r['tflops']:.0f}" for k, r in res["mlp reference"].items()))
            for op, per in res.items():
                if op == "mlp reference":
                    continue
                for v, rec in per.items():
                    print(f"T{T} {op:28s} V {v:>6s} {rec['ms']:7.3f} ms {rec['tflops']:6.0f} TFLOP/s "
                          f"({rec['tflops_useful']:6.0f} in V {a.vocabs[0]}'s FLOPs)", flush=True)
            torch.cuda.empty_cache()
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
        return out
    for T in a.seqs:
        res = out["results"].setdefault(str(T), {})
        for name, (f, fn) in reference(T, g).items():
            res[name] = {"tflops": f / timeit(fn, a.reps) / 1e12}
            print(f"T{T} {name:50s} {res[name]['tflops']:6.0f} TFLOP/s", flush=True)
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            for op, (f, fns) in forms(T, g).items():
                first = None
                for name, fn in fns.items():
                    s = timeit(fn, a.reps)
                    key = f"{op} {name} [{lib}]"
                    rec = {"tflops": f / s / 1e12, "ms": s * 1e3}
                    if op != "wgrad_acc":   # equality to the first formulation (outputs, not sums in place)
                        r = fn()
                        r = torch.cat([t for t in r], dim=1) if isinstance(r, tuple) else r
                        r = r.t() if first is not None and r.shape != first.shape else r
                        if first is None:
                            first = r.float()
                        rec["max_abs_diff_to_first"] = float((r.float() - first).abs().max())
                    res[key] = rec
                    print(f"T{T} {key:60s} {rec['tflops']:6.0f} TFLOP/s  {rec['ms']:.3f} ms"
                          + (f"  diff {rec['max_abs_diff_to_first']:.3g}" if "max_abs_diff_to_first" in rec else ""),
                          flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
