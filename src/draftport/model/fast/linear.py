"""The fast path's linears as custom autograd functions, and the row and slice views they feed.

- `fused_linear`: y = x @ w^T whose weight gradient can be summed in place across TTT steps
  (`accum`: beta = 1 inside the GEMM; single process or FSDP only, autograd then sees none).
- `multi_linear`: several weights reading one input (q/k/v, gate/up; or one column block of
  their input: q/k/v's embedding and hidden halves), one GEMM each, the input gradient summed
  inside the GEMMs.
- `swiglu_down`: down(silu(g) * u) keeping only g and u (the product is recomputed in backward
  by the kernel that computes dg and du).
- `shifted_slices`: the TTT steps' slices of the embedding half's table, their gradients summed
  in one pass.
- `select_rows` / `scatter_rows`: a step's rows by index (the unroll's live rows, the loss's
  counted rows), exact in both directions.

The elementwise kernels (SwiGLU and its gradients, the slices' sum) run compiled when the
FastPath says so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftport.model.fast.path import FastPath


# ---- weight gradients summed in place -----------------------------------------------------------
def accumulate_grad(w: torch.Tensor, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """w.grad += dy2^T @ x2 inside the GEMM (beta = 1): a weight used in every TTT step gets its
    gradient summed in place instead of one [out, in] tensor per step plus an add."""
    if w.grad is None:
        w.grad = (dy2.t() @ x2).to(w.dtype)
    elif w.grad.dtype == dy2.dtype:
        w.grad.addmm_(dy2.t(), x2)
    else:  # fp32 master weights under autocast
        w.grad.add_(dy2.t() @ x2)


def accumulate_grad_cols(w: torch.Tensor, start: int, stop: int, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """accumulate_grad into the column block [start, stop) of w.grad (zeros elsewhere when this
    is the first gradient the step gives w): a weight whose input halves run as two GEMMs."""
    if w.grad is None:
        w.grad = torch.zeros_like(w)
    g = w.grad[:, start:stop]
    if g.dtype == dy2.dtype:
        g.addmm_(dy2.t(), x2)
    else:  # fp32 master weights under autocast
        g.add_(dy2.t() @ x2)


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


def fused_linear(x, w, accum: bool):
    """x @ w^T through _Linear (with accum, w's gradient summed in place into w.grad)."""
    return _Linear.apply(x, w, accum)


class _MultiLinear(torch.autograd.Function):
    """ys[i] = x @ ws[i][:, cols]^T for several weights reading one input (q/k/v, or one column
    block of their 2H-wide input; gate/up): one GEMM per weight, as a _Linear each would run, but
    in backward the input gradient is one running sum inside the GEMMs (beta = 1) instead of one
    tensor per weight that autograd then adds up. The weight gradients: with accum summed in
    place into w.grad (into the column block: accumulate_grad_cols); else full-size gradients
    through autograd (zero outside the block), for DDP / FSDP."""

    @staticmethod
    def forward(ctx, x, cols, accum: bool, *ws):
        ctx.save_for_backward(x, *ws)
        ctx.cols, ctx.accum = cols, accum
        return tuple(F.linear(x, w if cols is None else w[:, cols[0] : cols[1]]) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        cols = ctx.cols
        blocks = [w if cols is None else w[:, cols[0] : cols[1]] for w in ws]
        dx = None
        if ctx.needs_input_grad[0]:
            for dy, wb in zip(dys, blocks):
                dy2, wc = dy.reshape(-1, dy.shape[-1]), wb.to(dy.dtype)
                if dx is None:
                    dx = dy2 @ wc
                else:
                    dx.addmm_(dy2, wc)
            dx = dx.view(*x.shape[:-1], dx.shape[-1]).to(x.dtype)
        grads = [None] * len(ws)
        for i, (dy, w) in enumerate(zip(dys, ws)):
            if not ctx.needs_input_grad[3 + i]:
                continue
            if ctx.accum:
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
                if cols is None:
                    accumulate_grad(w, dy2, x2)
                else:
                    accumulate_grad_cols(w, cols[0], cols[1], dy2, x2)
            else:
                dw = (dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(w.dtype)
                if cols is not None:
                    full = torch.zeros_like(w)
                    full[:, cols[0] : cols[1]] = dw
                    dw = full
                grads[i] = dw
        return (dx, None, None, *grads)


def multi_linear(x, ws, cols: tuple[int, int] | None, accum: bool) -> tuple:
    """x @ w[:, cols]^T (cols None: all of w) for each w in ws, through _MultiLinear (the input
    gradient summed inside the GEMMs)."""
    return _MultiLinear.apply(x, cols, accum, *ws)


# ---- the MLP's SwiGLU and down projection --------------------------------------------------------
def swiglu(g, u):
    return (F.silu(g.float()) * u.float()).to(g.dtype)


def swiglu_grads(da, g, u):
    return swiglu_grads_act(da, g, u, act=False)


def swiglu_grads_act(da, g, u, act: bool = True):
    """(dg, du) of silu(g) * u given its gradient da, and (act) the product itself, as swiglu
    computes it in forward (the down projection's weight-gradient operand), from one read of g
    and u."""
    gf, uf, daf = g.float(), u.float(), da.float()
    sg = torch.sigmoid(gf)
    silu = gf * sg
    dg, du = (daf * uf * sg * (1 + gf * (1 - sg))).to(g.dtype), (daf * silu).to(u.dtype)
    return (dg, du, (F.silu(gf) * uf).to(g.dtype)) if act else (dg, du)


class _SwiGLUDown(torch.autograd.Function):
    """down(silu(g) * u), keeping g and u only (the product is recomputed in backward)."""

    @staticmethod
    def forward(ctx, g, u, w, accum: bool, fast: FastPath):
        ctx.save_for_backward(g, u, w)
        ctx.accum, ctx.fast = accum, fast
        return F.linear(fast.kernel(swiglu)(g, u), w)

    @staticmethod
    def backward(ctx, dy):
        g, u, w = ctx.saved_tensors
        da = dy @ w.to(dy.dtype)
        if not ctx.needs_input_grad[2]:
            dg, du = ctx.fast.kernel(swiglu_grads)(da, g, u)
            return dg, du, None, None, None
        # the product recomputed by the kernel that computes dg and du (it reads g and u anyway)
        dg, du, a = ctx.fast.kernel(swiglu_grads_act)(da, g, u)
        a2, dy2 = a.reshape(-1, g.shape[-1]).to(dy.dtype), dy.reshape(-1, dy.shape[-1])
        dw = None
        if ctx.accum:
            accumulate_grad(w, dy2, a2)
        else:
            dw = (dy2.t() @ a2).to(w.dtype)
        return dg, du, dw, None, None


def swiglu_down(g, u, w, accum: bool, fast: FastPath):
    """down(silu(g) * u) through _SwiGLUDown (g and u kept, the product recomputed in backward)."""
    return _SwiGLUDown.apply(g, u, w, accum, fast)


# ---- the embedding half's table: shifted slices --------------------------------------------------
def shift_sum(gs, fill_grad):
    """d(table) from the gradients of its slices: gs[j] [B, T, n] is the gradient of rows
    j..j+T-1; fill_grad (or None) that of the last row. -> [B, T-1+len(gs), n], in one pass."""
    k, acc = len(gs), torch.promote_types(gs[0].dtype, torch.float32)  # summed in at least fp32
    out = F.pad(gs[0].to(acc), (0, 0, 0, k - 1))
    for j in range(1, k):
        out = out + F.pad(gs[j].to(acc), (0, 0, j, k - 1 - j))
    if fill_grad is not None:
        out = out + F.pad(fill_grad.to(acc), (0, 0, out.shape[1] - 1, 0))
    return out.to(gs[0].dtype)


class _ShiftedSlices(torch.autograd.Function):
    """The `steps` slices y[:, j:j+T] of one table (and, with fill, its last row y[:, -1:]) as
    views. Their gradients meet in one pass (shift_sum) instead of autograd's per slice: a
    zeroed table-sized buffer, a copy into it and an add into the running sum, seven times."""

    @staticmethod
    def forward(ctx, y, T: int, steps: int, fill: bool, fast: FastPath):
        ctx.steps, ctx.fill, ctx.fast = steps, fill, fast
        outs = [y[:, j : j + T] for j in range(steps)]
        if fill:
            outs.append(y[:, -1:])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):  # autograd hands zeros for an unused slice (materialize_grads)
        fill_grad = gs[ctx.steps] if ctx.fill else None
        return ctx.fast.kernel(shift_sum)(list(gs[: ctx.steps]), fill_grad), None, None, None, None


def shifted_slices(y, T: int, steps: int, fill: bool = False, fast: FastPath = FastPath()) -> tuple:
    """y[:, j:j+T] for j < steps (and y[:, -1:] with fill): slices of the embedding half's table
    whose gradients are summed in one pass (see _ShiftedSlices)."""
    return _ShiftedSlices.apply(y, T, steps, fill, fast)


# ---- rows of a step by index (the unroll's live rows, the loss's counted rows) -----------------
class _SelectRows(torch.autograd.Function):
    """x [B, T, *rest] -> its flattened rows idx, as [1, n, *rest] (idx unique); the gradient goes
    back to those rows, zeros elsewhere (index_copy: no atomics, exact)."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.shape = x.shape
        ctx.save_for_backward(idx)
        B, T = x.shape[:2]
        # written into a fresh [1, n, ...], not a view of a 2-D result: compiled regions guard
        # a view's base strides, and inputs of one layout at every step compile once
        out = x.new_empty(1, idx.numel(), *x.shape[2:])
        torch.index_select(x.reshape(B * T, *x.shape[2:]), 0, idx, out=out[0])
        return out

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        B, T = ctx.shape[:2]
        out = g.new_zeros(B * T, *ctx.shape[2:])
        out.index_copy_(0, idx, g.reshape(-1, *ctx.shape[2:]))
        return out.view(ctx.shape), None


class _ScatterRows(torch.autograd.Function):
    """x [1, n, *rest] -> [B, T, *rest] holding x's rows at the flattened rows idx (unique) and
    zeros elsewhere; the gradient is the output gradient's rows idx."""

    @staticmethod
    def forward(ctx, x, idx, B: int, T: int):
        ctx.save_for_backward(idx)
        rest = x.shape[2:]
        out = x.new_zeros(B * T, *rest)
        out.index_copy_(0, idx, x.reshape(-1, *rest))
        return out.view(B, T, *rest)

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return g.reshape(-1, *g.shape[2:]).index_select(0, idx).unsqueeze(0), None, None, None


def select_rows(x, idx):
    """The rows idx of x [B, T, ...] flattened over (B, T), as [1, n, ...] (autograd: exact)."""
    return _SelectRows.apply(x, idx)


def scatter_rows(x, idx, B: int, T: int):
    """select_rows' inverse: x [1, n, ...] placed at rows idx of a zero [B, T, ...]."""
    return _ScatterRows.apply(x, idx, B, T)
