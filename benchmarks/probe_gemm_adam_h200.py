"""Two questions about the training step's remaining time, on the GPU, before building a lever:

1. Weight gradients summed over the TTT steps: today each step adds its dy^T x into the weight
   gradient in place (addmm_, K = T rows per GEMM, `steps` GEMMs); one GEMM over all steps' rows
   (K = steps * T) would need every step's dy and x kept until the end of the backward. What
   does the longer K give, per weight shape of the Kimi-size drafter?
2. Fused AdamW over the drafter's parameter list vs over one flat buffer of the same size: does
   the tensor count cost anything?

Prints TFLOP/s and ms; asserts nothing.

    python benchmarks/probe_gemm_adam_h200.py [--seqs 2048 4096] [--steps 7] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def timed(fn, iters=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def wgrad_probe(T, steps, shapes):
    out = {}
    dt = torch.bfloat16
    for name, (n_out, n_in) in shapes.items():
        dys = torch.randn(steps * T, n_out, device="cuda", dtype=dt)
        xs = torch.randn(steps * T, n_in, device="cuda", dtype=dt)
        g = torch.zeros(n_out, n_in, device="cuda", dtype=dt)

        def per_step():
            for j in range(steps):
                g.addmm_(dys[j * T:(j + 1) * T].t(), xs[j * T:(j + 1) * T])

        def one():
            torch.mm(dys.t(), xs, out=g)
        fl = 2 * n_out * n_in * steps * T
        a, b = timed(per_step), timed(one)
        out[name] = {"per_step_ms": a * 1e3, "one_gemm_ms": b * 1e3, "per_step_tflops": fl / a / 1e12,
                     "one_gemm_tflops": fl / b / 1e12, "gain": a / b}
        print(f"[wgrad] T {T} {name:10s} [{n_out}x{n_in}]: {steps} x addmm_ K={T} {a * 1e3:7.2f} ms "
              f"({fl / a / 1e12:4.0f} TFLOP/s); one mm K={steps * T} {b * 1e3:7.2f} ms ({fl / b / 1e12:4.0f}); "
              f"x{a / b:.3f}", flush=True)
        del dys, xs, g
        torch.cuda.empty_cache()
    return out


def adam_probe(shapes_params):
    dt = torch.bfloat16
    ps = [torch.randn(s, device="cuda", dtype=dt) for s in shapes_params]
    n = sum(p.numel() for p in ps)
    res = {}
    for layout in ("list", "flat"):
        if layout == "flat":
            ps = [torch.randn(n, device="cuda", dtype=dt)]
        gs = [torch.randn_like(p) for p in ps]
        opt = torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), fused=True)
        for p, g in zip(ps, gs):
            p.grad = g

        def step():
            opt.step()
        s = timed(step, iters=10, warm=2)
        res[layout] = s * 1e3
        print(f"[adam] fused AdamW over {len(ps)} tensor(s), {n / 1e6:.1f}M bf16 params: {s * 1e3:.2f} ms "
              f"({7 * 2 * n / s / 1e12:.2f} TB/s at 7 bf16 passes)", flush=True)
        del opt, gs
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 4096])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    H, I, q, Vd = 7168, 18432, 8192, 32000
    shapes = {"q/k/v half": (q, H), "o": (H, q), "gate/up": (I, H), "down": (H, I), "lm_head": (Vd, H)}
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "steps": a.steps,
           "wgrad": {str(T): wgrad_probe(T, a.steps, shapes) for T in a.seqs}}
    # the Kimi-size drafter's trainable tensors (lm_head frozen): fc, q/k/v/o, gate/up/down, 4 norms
    params = [(H, 3 * H), (q, 2 * H), (q, 2 * H), (q, 2 * H), (H, q), (I, H), (I, H), (H, I), (H,), (H,), (H,), (H,)]
    out["adam_ms"] = adam_probe(params)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
