"""draftport's AdamW (draftport.training.optim: one compiled pointwise kernel per parameter) against torch's
fused AdamW, as train_step calls them: bf16 parameters of the Kimi-size drafter (lm_head frozen:
961.6M; trained: 1,190.9M), a gradient scale set (the clipping), betas (0.9, 0.95).

Per set: the optimizer step alone (median of timed steps, CUDA events), its rate in TB/s over the
bytes each must move (torch's: parameter, gradient and both moments read and written, 16 bytes a
parameter; draftport's: the gradient is only read, 14 bytes), and how far the two drift apart
from the same start over --check-steps steps on the same gradients (the share of bf16 values that
differ, the largest difference, and the difference's norm against the parameters' and against the
updates' own).

Prints figures and writes --json; asserts nothing.

Also: the pointwise kernel compiled once with sizes dynamic ("draftport_dynamic"), which
draftport.training.optim does not do (slower).

    python benchmarks/probe_adamw_h200.py [--iters 20] [--check-steps 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from draftport.training import optim  # noqa: E402

H, I, Q, VD = 7168, 18432, 8192, 32000
# the drafter's trainable tensors: fc, q/k/v (2H wide), o, gate/up/down, 4 norms (+ lm_head trained)
FROZEN = [(H, 3 * H), (Q, 2 * H), (Q, 2 * H), (Q, 2 * H), (H, Q), (I, H), (I, H), (H, I), (H,), (H,), (H,), (H,)]
SETS = {"frozen": FROZEN, "trained": FROZEN + [(VD, H)]}


def make(shapes, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [(torch.randn(s, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for s in shapes]
    gs = [(torch.randn(s, device="cuda", generator=g) * 1e-3).to(torch.bfloat16) for s in shapes]
    return ps, gs


def build(kind, ps):
    if kind == "torch":
        return torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    return optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)


def time_steps(opt, scale, iters, warm=3):
    for _ in range(warm):
        opt.grad_scale = scale
        opt.step()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    torch.cuda.synchronize()
    for i in range(iters):
        ev[i].record()
        opt.grad_scale = scale
        opt.step()
    ev[-1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(iters))


def agreement(shapes, steps):
    """Both optimizers from one start, the same gradients each step: how far apart they end."""
    ps0, _ = make(shapes, 1)
    runs = {}
    for kind in ("torch", "draftport"):
        ps = [p.clone() for p in ps0]
        opt = build(kind, ps)
        g = torch.Generator(device="cuda").manual_seed(2)
        for _ in range(steps):
            for p in ps:
                p.grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
            opt.grad_scale = torch.tensor(1.7, device="cuda")
            opt.step()
        runs[kind] = ps
        del opt
    differ, total, worst, num, den = 0, 0, 0.0, 0.0, 0.0
    for a, b in zip(runs["torch"], runs["draftport"]):
        a32, b32 = a.float(), b.float()
        differ += int((a32 != b32).sum())
        total += a.numel()
        worst = max(worst, float((a32 - b32).abs().max()))
        num += float((a32 - b32).pow(2).sum())
        den += float(a32.pow(2).sum())
    moved = sum(float((a.float() - p.float()).pow(2).sum()) for a, p in zip(runs["torch"], ps0)) ** 0.5
    return {"steps": steps, "fraction_differing": differ / total, "max_abs_diff": worst,
            "rel_norm_diff": (num / den) ** 0.5, "diff_vs_update_norm": num ** 0.5 / moved}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check-steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sets": {}}
    for name, shapes in SETS.items():
        n = sum(torch.Size(s).numel() for s in shapes)
        rec = {"params": n}
        for kind, bytes_per in (("torch", 16), ("draftport", 14), ("draftport_dynamic", 14)):
            ps, gs = make(shapes, 0)
            for p, g in zip(ps, gs):
                p.grad = g
            # draftport_dynamic: the pointwise kernel compiled once with sizes dynamic (not per size)
            optim._COMPILED.clear()
            if kind == "draftport_dynamic":
                optim._compiled()["pointwise"] = torch.compile(optim.adamw_pointwise, dynamic=True, fullgraph=True)
            opt = build("torch" if kind == "torch" else "draftport", ps)
            s = time_steps(opt, torch.tensor(1.3, device="cuda"), a.iters)
            rec[kind] = {"ms": s * 1e3, "tb_s": bytes_per * n / s / 1e12}
            print(f"[adamw] {name:7s} {n / 1e6:7.1f}M  {kind:9s} {s * 1e3:6.2f} ms  "
                  f"{bytes_per * n / s / 1e12:5.2f} TB/s over {bytes_per} B/param", flush=True)
            del opt, ps, gs
            torch.cuda.empty_cache()
        optim._COMPILED.clear()
        rec["speedup"] = rec["torch"]["ms"] / rec["draftport"]["ms"]
        rec["agreement"] = agreement(shapes, a.check_steps)
        print(f"[adamw] {name}: draftport x{rec['speedup']:.2f}; after {a.check_steps} steps "
              f"{rec['agreement']['fraction_differing'] * 100:.3f}% of the bf16 values differ (largest by "
              f"{rec['agreement']['max_abs_diff']:.2e}); |diff| / |p| {rec['agreement']['rel_norm_diff']:.2e}, "
              f"|diff| / |total update| {rec['agreement']['diff_vs_update_norm']:.2e}", flush=True)
        out["sets"][name] = rec
        torch.cuda.empty_cache()
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
