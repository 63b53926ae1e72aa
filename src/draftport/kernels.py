"""The drafter's fused training paths: TTT attention through flash attention and a log-sum-exp
merge, and the linears and SwiGLU MLP as custom autograd functions (draftport.drafter's
`impl` fused / compiled dispatches here; the readable reference is in drafter.py).

Fused TTT attention computes the same function as `Attention.attend_core`: step j's row p sees
the step-0 keys of rows <= p (causal) and its own keys from steps 1..j (diagonal). The step-0
causal part runs through flash attention (private aten ops), which also returns its
log-sum-exp; the few diagonal keys are merged by log-sum-exp (fp32). Its backward calls the
flash backward with the *merged* output and log-sum-exp (the ring-attention identity:
dS = P_final * (dP - rowsum(dO * O_final)) per key block), so no [T, T] tensor ever exists. It
assumes right padding (a valid row's earlier rows are valid), as `data.collate` pads.

The linears can sum their weight gradient in place across TTT steps (`accumulate_grad`: beta = 1
inside the GEMM), single process only; the MLP keeps only its gate/up outputs and recomputes
the product in backward. `compile_kernels` swaps the elementwise pieces for torch.compile'd
versions (GPU path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- fused TTT attention ----------------------------------------------------------------------
def _flash_fwd(q, k, v, scale):
    """Causal attention over the step-0 keys -> (out [B,h,T,d], lse [B,h,T] fp32, extras)."""
    if q.is_cuda:
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], tuple(r[2:8])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return o, lse, ()


def _flash_bwd(do, q, k, v, o, lse, scale, extras):
    if q.is_cuda:
        cq, ck, mq, mk, seed, off = extras
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, off, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True, scale=scale)


def _diag_merge(q, o0, lse0, ks, vs, scale: float):
    """Merge the causal result (o0, lse0) with the row's own keys ks/vs by log-sum-exp (fp32)."""
    qf = q.float()
    s = [(qf * k.float()).sum(-1) * scale for k in ks]            # [B,h,T] each
    m = lse0
    for si in s:
        m = torch.maximum(m, si)
    w0 = torch.exp(lse0 - m)
    ws = [torch.exp(si - m) for si in s]
    z = w0
    for wi in ws:
        z = z + wi
    o = o0.float() * (w0 / z)[..., None]
    for wi, v in zip(ws, vs):
        o = o + v.float() * (wi / z)[..., None]
    return o.to(q.dtype), m + torch.log(z)


def _diag_grads(do, q, o, lse, ks, vs, scale: float, dq_causal):
    """Gradients through the diagonal keys, given the merged output and log-sum-exp; dq adds
    the causal part's dq_causal."""
    dof, qf = do.float(), q.float()
    D = (dof * o.float()).sum(-1)                                  # [B,h,T]
    dq = dq_causal.float()
    dks, dvs = [], []
    for k, v in zip(ks, vs):
        kf = k.float()
        p = torch.exp((qf * kf).sum(-1) * scale - lse)             # final softmax weight
        dvs.append((p[..., None] * dof).to(v.dtype))
        ds = p * ((dof * v.float()).sum(-1) - D) * scale
        dq = dq + ds[..., None] * kf
        dks.append((ds[..., None] * qf).to(k.dtype))
    return dq.to(q.dtype), dks, dvs


# ---- the MLP and the linears ------------------------------------------------------------------
def _swiglu(g, u):
    return (F.silu(g.float()) * u.float()).to(g.dtype)


def _swiglu_grads(da, g, u):
    gf, uf, daf = g.float(), u.float(), da.float()
    sg = torch.sigmoid(gf)
    silu = gf * sg
    return (daf * uf * sg * (1 + gf * (1 - sg))).to(g.dtype), (daf * silu).to(u.dtype)


# Swapped for torch.compile'd versions by compile_kernels() (diag kernels: one graph per number
# of diagonal keys).
_KERNELS = {"merge": _diag_merge, "grads": _diag_grads, "swiglu": _swiglu, "swiglu_grads": _swiglu_grads}


def compile_kernels():
    """Compile the elementwise diagonal-key kernels (GPU path; call once)."""
    import torch._dynamo
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 64))
    for name, fn in (("merge", _diag_merge), ("grads", _diag_grads), ("swiglu", _swiglu),
                     ("swiglu_grads", _swiglu_grads)):
        _KERNELS[name] = torch.compile(fn, dynamic=False)


def accumulate_grad(w: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """w.grad += dy2^T @ x2 inside the GEMM (beta = 1): a weight used in every TTT step gets its
    gradient summed in place instead of one [out, in] tensor per step plus an add."""
    if w.grad is None:
        w.grad = (dy2.t() @ x2).to(w.dtype)
    elif w.grad.dtype == dy2.dtype:
        w.grad.addmm_(dy2.t(), x2)
    else:  # fp32 master weights under autocast
        w.grad.add_(dy2.t() @ x2)


class _Linear(torch.autograd.Function):
    """y = x @ w^T; with accum, the weight gradient goes straight into w.grad (see
    accumulate_grad) and autograd sees none, so only for single-process training."""

    @staticmethod
    def forward(ctx, x, w, accum: bool):
        ctx.save_for_backward(x, w)
        ctx.accum = accum
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = (dy @ w.to(dy.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
            if ctx.accum:
                accumulate_grad(w, dy2, x2)
            else:
                dw = (dy2.t() @ x2).to(w.dtype)
        return dx, dw, None


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(g) * u), keeping g and u only (the product is recomputed in backward)."""

    @staticmethod
    def forward(ctx, g, u, w, accum: bool):
        ctx.save_for_backward(g, u, w)
        ctx.accum = accum
        return F.linear(_KERNELS["swiglu"](g, u), w)

    @staticmethod
    def backward(ctx, dy):
        g, u, w = ctx.saved_tensors
        dw = None
        da = dy @ w.to(dy.dtype)
        if ctx.needs_input_grad[2]:
            a2 = _KERNELS["swiglu"](g, u).reshape(-1, g.shape[-1]).to(dy.dtype)
            dy2 = dy.reshape(-1, dy.shape[-1])
            if ctx.accum:
                accumulate_grad(w, dy2, a2)
            else:
                dw = (dy2.t() @ a2).to(w.dtype)
        dg, du = _KERNELS["swiglu_grads"](da, g, u)
        return dg, du, dw, None


# ---- fused TTT attention, as one autograd function ---------------------------------------------
class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scale, q, k0, v0, *kv):
        o, lse, extras = _flash_fwd(q, k0, v0, scale)
        ks, vs = kv[0::2], kv[1::2]
        if ks:
            o, lse = _KERNELS["merge"](q, o, lse, ks, vs, scale)
            lse = lse.contiguous()
        ctx.save_for_backward(q, k0, v0, o, lse, *kv)
        ctx.scale, ctx.extras = scale, extras
        return o

    @staticmethod
    def backward(ctx, do):
        q, k0, v0, o, lse, *kv = ctx.saved_tensors
        do = do.contiguous() if do.stride(-1) != 1 else do
        dq, dk0, dv0 = _flash_bwd(do, q, k0, v0, o, lse, ctx.scale, ctx.extras)
        ks, vs = kv[0::2], kv[1::2]
        grads = []
        if ks:
            dq, dks, dvs = _KERNELS["grads"](do, q, o, lse, ks, vs, ctx.scale, dq)
            for dk, dv in zip(dks, dvs):
                grads += [dk, dv]
        return (None, dq, dk0, dv0, *grads)


def fused_attention_supported(q: torch.Tensor) -> bool:
    return (not q.is_cuda) or q.dtype in (torch.float16, torch.bfloat16)


def ttt_attention(q, cache_k, cache_v, scale: float):
    """Fused TTT attention: the same function as Attention.attend_core (right padding). -> [B,T,h*d]"""
    kv = [t for pair in zip(cache_k[1:], cache_v[1:]) for t in pair]
    o = _TTTAttention.apply(scale, q, cache_k[0], cache_v[0], *kv)
    B, h, T, d = o.shape
    return o.transpose(1, 2).reshape(B, T, h * d)


# ---- what drafter.py calls on its fused path ------------------------------------------------------
def fused_linear(x, w, accum: bool):
    """x @ w^T through _Linear (with accum, w's gradient summed in place into w.grad)."""
    return _Linear.apply(x, w, accum)


def swiglu_down(g, u, w, accum: bool):
    """down(silu(g) * u) through _SwiGLUDown (g and u kept, the product recomputed in backward)."""
    return _SwiGLUDown.apply(g, u, w, accum)
