"""Three questions about the training step's remaining time, on the GPU, before building a lever:

1. The fused loss (draftport.training.ttt.LinearSoftCE) runs the drafter's lm_head GEMMs and the soft-CE
   over row chunks (train_step's default: 1024 rows). What do larger chunks give, lm_head frozen
   (logits and d(loss)/dx in the forward) and trainable (logits in the forward, dx and the weight
   gradient in the backward)?
2. Packed rows' step-0 causal attention runs through flash's variable-length kernel; the dense
   rows run through cuDNN (faster there). What does cuDNN's ragged kernel
   (aten._cudnn_attention_forward with cum_seq_q/k) give on a packed row, and does it agree with
   flash (output, log-sum-exp, gradients)?

3. The soft-CE kernel of one chunk (compiled): log-softmax first, or the loss as
   sum(t) * lse - sum(t * lg), which needs no log-softmax before its reductions.

Prints ms and errors; asserts nothing.

    python benchmarks/probe_loss_attn_h200.py [--seqs 2048 4096] [--softce-only] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftport.model.fast import kernels
from draftport.training import ttt  # noqa: E402
from probe_gemm_adam_h200 import timed  # noqa: E402


def loss_probe(T, steps, H, Vd, chunks):
    """LinearSoftCE forward + backward over `steps` step-inputs, per chunk size."""
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    xs = [torch.randn(1, T, H, device="cuda", dtype=dt, generator=g) for _ in range(steps)]
    w = torch.randn(Vd, H, device="cuda", dtype=dt, generator=g) * 0.02
    t = torch.softmax(torch.randn(1, T, Vd, device="cuda", generator=g), -1)
    rw = torch.ones(1, T, device="cuda")
    out = {}
    for mode in ("frozen", "trainable"):
        for c in chunks:
            if c > T:
                continue
            xr = [x.detach().requires_grad_(True) for x in xs]
            wr = w.detach().requires_grad_(mode == "trainable")

            def run():
                wr.grad = None
                tot = 0.0
                for x in xr:
                    x.grad = None
                    loss, _ = ttt.LinearSoftCE.apply(x, wr, t, rw, c, mode == "trainable")
                    tot = tot + loss
                tot.backward()
            s = timed(run, iters=5, warm=2)
            out[f"{mode}/{c}"] = s * 1e3
            print(f"[loss] T {T} lm_head {mode:9s} chunk {c:5d}: {s * 1e3:7.2f} ms for {steps} steps", flush=True)
    return out


def attn_probe(lengths, h=64, d=128, reps=10):
    """One packed row's causal attention, per segment: flash varlen vs cuDNN ragged."""
    dt = torch.bfloat16
    N = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    L = max(lengths)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(N, h, d, device="cuda", dtype=dt, generator=g) for _ in range(4))
    scale = d ** -0.5
    seg = kernels.Segments(cu.tolist(), L)

    def flash():
        o, lse, ex = kernels._seg_fwd(q, k, v, seg, scale)
        grads = kernels._seg_bwd(do, q, k, v, o, lse, seg, scale, ex)
        return o, lse, grads

    def cudnn():
        r = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, L, L, True, 0.0, True, False,
                                                    scale=scale)
        o, lse = r[0], r[1]
        grads = torch.ops.aten._cudnn_attention_backward(do, q, k, v, o, lse, r[6], r[7], None, cu, cu, L, L,
                                                         0.0, True, scale=scale)
        return o, lse, grads

    res = {"lengths": lengths}
    fo, flse, fg = flash()
    try:
        co, clse, cg = cudnn()
    except Exception as e:   # the op may not take ragged input in this build
        res["cudnn_failed"] = repr(e)[:300]
        print(f"[attn] cuDNN ragged failed: {e!r}"[:300], flush=True)
        res["flash_ms"] = timed(flash, reps, 2) * 1e3
        return res
    res["cudnn_lse_shape"] = list(clse.shape)
    c_tok = clse.reshape(N, h) if clse.numel() == N * h and clse.shape[0] == N else clse.reshape(h, N).t()

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
    res["out_rel_err"] = rel(co, fo)
    res["lse_max_abs"] = float((c_tok.float() - flse.float()).abs().max())
    res["grad_rel_err"] = [rel(a, b) for a, b in zip(cg, fg)]
    res["flash_ms"] = timed(flash, reps, 2) * 1e3
    res["cudnn_ms"] = timed(cudnn, reps, 2) * 1e3
    print(f"[attn] packed row {N} tokens ({len(lengths)} segments, longest {L}), fwd+bwd: flash varlen "
          f"{res['flash_ms']:.3f} ms, cuDNN ragged {res['cudnn_ms']:.3f} ms "
          f"(x{res['flash_ms'] / res['cudnn_ms']:.3f}); "
          f"lse {res['cudnn_lse_shape']}, out err {res['out_rel_err']:.1e}, lse err {res['lse_max_abs']:.1e}, "
          f"grad err {max(res['grad_rel_err']):.1e}", flush=True)
    return res


def softce_log_softmax_first(lg, t, w):
    """The soft-CE kernel as ttt._softce_rows had it before 2026-12-02: log-softmax, then the
    loss and the gradient from it."""
    lg32, t32 = lg.float(), t.float()
    logp = lg32 - torch.logsumexp(lg32, dim=-1, keepdim=True)
    loss = -(t32 * logp).sum(-1) * w
    g = (torch.exp(logp) * t32.sum(-1, keepdim=True) - t32) * w[:, None]
    return loss, g.to(lg.dtype), lg32.argmax(-1)


def softce_probe(T, Vd, steps):
    """The fused loss's per-chunk soft-CE kernel (compiled), per form: log-softmax first (as it
    was) vs the loss as sum(t) * lse - sum(t * lg) (ttt._softce_rows, what train runs), on
    one whole row of T positions, `steps` times as a training step runs it. -> ms per form and
    the GB/s over the fewest bytes (logits and targets read once, the gradient written once)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    lg = torch.randn(T, Vd, device="cuda", generator=g).to(torch.bfloat16) * 3
    t = torch.softmax(torch.randn(T, Vd, device="cuda", generator=g), -1)
    w = torch.ones(T, device="cuda")
    out = {}
    ref = None
    for name, fn in (("log_softmax_first", softce_log_softmax_first), ("lse_form", ttt._softce_rows)):
        f = torch.compile(fn, dynamic=None)
        r = f(lg, t, w)
        if ref is None:
            ref = r
        err = float((r[0] - ref[0]).abs().max() / ref[0].abs().max())
        same_g = float((r[1].float() - ref[1].float()).abs().max())

        def run():
            for _ in range(steps):
                f(lg, t, w)
        s = timed(run, iters=10, warm=3)
        nbytes = steps * (lg.numel() * 2 + t.numel() * 4 + lg.numel() * 2)
        out[name] = {"ms": s * 1e3, "tb_s_over_fewest_bytes": nbytes / s / 1e12, "loss_rel_diff": err,
                     "grad_max_abs_diff": same_g}
        print(f"[softce] T {T} {name:18s} {s * 1e3:7.3f} ms for {steps} steps "
              f"({nbytes / s / 1e12:.2f} TB/s over the fewest bytes); loss rel diff {err:.1e}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 4096])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--chunks", type=int, nargs="*", default=[1024, 2048, 4096])
    ap.add_argument("--json", default=None)
    ap.add_argument("--softce-only", action="store_true", help="only the soft-CE kernel's two forms")
    a = ap.parse_args()
    H, Vd = 7168, 32000
    ttt.compile_loss_kernels()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "steps": a.steps}
    out["softce"] = {str(T): softce_probe(T, Vd, a.steps) for T in a.seqs}
    if a.softce_only:
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=2))
        return
    out["loss"] = {str(T): loss_probe(T, a.steps, H, Vd, a.chunks) for T in a.seqs}
    rows = {"mix-like row": [1873, 1422, 1187, 2048, 1530], "one segment 2048": [2048],
            "one segment 4096": [4096]}
    out["attention"] = {}
    for name, lengths in rows.items():
        try:
            out["attention"][name] = attn_probe(lengths)
        except Exception as e:
            out["attention"][name] = {"failed": repr(e)[:300]}
            print(f"[attn] {name} failed: {e!r}"[:300], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
