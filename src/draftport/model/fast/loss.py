"""The TTT loss on the fast path: draftport.training.ttt's terms without materializing what the
reference does.

- Target side (target_stats): the frozen target head's logits in row chunks, keeping only the
  argmax and the draft-vocab softmax; on the GPU in the head's dtype (bf16, an fp32 accumulator
  kept), where the reference upcasts to fp32.
- Drafter side: the fast unroll (draftport.model.fast.unroll) hands back normed outputs; the
  lm_head and the soft-CE run per row chunk inside one autograd function (LinearSoftCE) that keeps
  only d(loss)/d(input) (lm_head frozen) or the d(loss)/d(logits) (lm_head trained), never fp32
  logits for all positions of all steps.
- Rows (FastPath.skip_uncounted, skip_dead_rows): which rows each step counts is known before
  the drafter runs; their counts go to the host asynchronously, and a step's lm_head runs on its
  counted rows only, steps >= 1 of the unroll on the rows a later step still scores.
Which rows count is the reference's definition (training.ttt.counted_rows), passed in.
"""

from __future__ import annotations

import functools

import torch

from draftport.model.drafter import shift
from draftport.model.fast.linear import accumulate_grad, select_rows
from draftport.model.fast.path import FastPath
from draftport.model.fast.unroll import packed_args, unroll


# ---- the target side ---------------------------------------------------------------------------
@functools.cache
def mm_keeps_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.mm(..., out_dtype=torch.float32) takes `dtype` operands on this device (a
    torch that has it): a capability of the installed torch, probed once."""
    a = torch.zeros(1, 1, dtype=dtype, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def logits_fp32(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [N, H] @ w[V, H]^T in fp32 output. A bf16 head on CUDA stays a bf16 GEMM but its fp32
    accumulator is kept (torch.mm out_dtype): logits rounded to bf16 flip near-tied argmaxes,
    and with them the mask."""
    with torch.autocast(x2.device.type, enabled=False):
        if x2.is_cuda and w.dtype in (torch.bfloat16, torch.float16):
            if mm_keeps_fp32(x2.device, w.dtype):
                return torch.mm(x2.to(w.dtype), w.t(), out_dtype=torch.float32)
            # an older torch: a fp32 GEMM would cost ~20x; keep the bf16 GEMM, rounded output
            return (x2.to(w.dtype) @ w.t()).float()
        return x2.float() @ w.float().t()


@torch.no_grad()
def target_stats(
    final: torch.Tensor,
    target_head: torch.Tensor,
    hot: torch.Tensor,
    chunk: int,
    pad: int = 0,
    target_arg: torch.Tensor | None = None,
):
    """Row-chunked target side: (t_prob [B, T+pad, Vd] fp32, zero rows past T; t_arg [B, T]).

    Full-vocab logits exist for `chunk` rows at a time (fp32). With target_arg (captured) only
    the draft rows are computed; target_head may then hold just those rows, in slot order."""
    B, T, _ = final.shape
    Vd = hot.numel()
    t_prob = torch.empty(B, T + pad, Vd, dtype=torch.float32, device=final.device)
    t_prob[:, T:].zero_()  # the rows below are all written
    if target_arg is not None:
        rows = target_head if target_head.shape[0] == Vd else target_head.index_select(0, hot)
        for b in range(B):
            for s in range(0, T, chunk):
                e = min(T, s + chunk)
                t_prob[b, s:e] = torch.softmax(logits_fp32(final[b, s:e], rows), dim=-1)
        return t_prob, target_arg
    t_arg = torch.empty(B, T, dtype=torch.long, device=final.device)
    for b in range(B):
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            full = logits_fp32(final[b, s:e], target_head)  # [c, V]
            t_arg[b, s:e] = full.argmax(-1)
            t_prob[b, s:e] = torch.softmax(full.index_select(1, hot), dim=-1)
    return t_prob, t_arg


# ---- the drafter's lm_head and the soft-CE, per row chunk ----------------------------------------
def softce_rows(lg, t, w):
    """Soft-CE of logits lg [c, V] against probabilities t [c, V], rows weighted by w [c] (fp32).
    -> (weighted loss per row [c] fp32, d(sum loss)/d(lg) in lg's dtype, argmax [c]).

    The loss is written sum(t) * lse - sum(t * lg), the same function as -sum(t * log_softmax(lg)):
    no reduction then waits for the log-softmax to exist, and the compiled kernel reads the
    logits and targets fewer times (benchmarks/results/2026-12-02-h200-probe-softce.json)."""
    lg32, t32 = lg.float(), t.float()
    m = lg32.amax(-1, keepdim=True)
    lse = m + torch.log(torch.exp(lg32 - m).sum(-1, keepdim=True))
    tsum = t32.sum(-1, keepdim=True)
    loss = (lse * tsum - (t32 * lg32).sum(-1, keepdim=True)).squeeze(-1) * w
    g = (torch.exp(lg32 - lse) * tsum - t32) * w[:, None]
    return loss, g.to(lg.dtype), lg32.argmax(-1)


def softce_rows_at(lg, t, idx, w):
    """softce_rows against the target rows t[idx] (t [R, V], idx [c]): compiled, the gather is
    read inside the soft-CE kernel, no [c, V] copy of the targets."""
    return softce_rows(lg, t.index_select(0, idx), w)


def scale_both(a, b, s):
    """(a * s, b * s) in their dtype, s a 0-dim tensor: the loss scale on the input gradient and
    on the weight gradient's operand, one kernel when compiled."""
    return a * s.to(a.dtype), b * s.to(b.dtype)


class LinearSoftCE(torch.autograd.Function):
    """sum_rows w * softCE(x @ W^T, t) over row chunks; -> (loss fp32 scalar, argmax [B, T]).

    W frozen: d(loss)/dx is computed in the forward, chunk by chunk, and only it is kept.
    W trainable: the d(loss)/d(logits) [B, T, V] is kept and both GEMMs run in backward.
    t_idx (B == 1): row i of x is scored against t[t_idx[i]], t being [R, V] (the counted rows
    of a step, see _step_loss_counted)."""

    @staticmethod
    def forward(ctx, x, w, t, rw, chunk, accum, t_idx, fast):
        B, T, H = x.shape
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(x.device.type, enabled=False):
            wc = w.to(x.dtype)
            loss = torch.zeros((), dtype=torch.float32, device=x.device)
            arg = torch.empty(B, T, dtype=torch.long, device=x.device)
            dx = torch.empty_like(x) if need_x and not need_w else None
            # lm_head trained: one chunk (a row of at most `chunk` tokens, the usual case) keeps the
            # kernel's own gradient tensor; several are gathered into one [B, T, V] (a copy each)
            whole = need_w and B == 1 and chunk >= T
            g_all = torch.empty(B, T, w.shape[0], dtype=x.dtype, device=x.device) if need_w and not whole else None
            kern = fast.kernel(softce_rows if t_idx is None else softce_rows_at)
            for b in range(B):
                for s in range(0, T, chunk):
                    e = min(T, s + chunk)
                    lg = x[b, s:e] @ wc.t()
                    if t_idx is None:
                        l_rows, g, a = kern(lg, t[b, s:e], rw[b, s:e])
                    else:  # x's rows are the rows t_idx of t [R, V] (B == 1: _step_loss_counted)
                        l_rows, g, a = kern(lg, t, t_idx[s:e], rw[b, s:e])
                    loss += l_rows.sum()
                    arg[b, s:e] = a
                    if whole:
                        g_all = g.reshape(1, T, -1)
                    elif g_all is not None:
                        g_all[b, s:e] = g
                    elif dx is not None:
                        torch.mm(g, wc, out=dx[b, s:e])
        ctx.mode = "w" if need_w else ("x" if need_x else None)
        ctx.accum, ctx.fast = accum, fast
        if need_w:
            ctx.save_for_backward(x, w, g_all)
        elif need_x:
            ctx.save_for_backward(dx)
        ctx.mark_non_differentiable(arg)
        return loss, arg

    @staticmethod
    def backward(ctx, gl, _garg):
        none = (None,) * 6
        if ctx.mode is None:
            return (None, None) + none
        if ctx.mode == "x":
            (dx,) = ctx.saved_tensors
            return (dx * gl.to(dx.dtype), None) + none
        x, w, g_all = ctx.saved_tensors
        B, T, H = x.shape
        g2 = g_all.view(B * T, -1)
        wc = w.to(x.dtype)
        x2 = x.reshape(B * T, H)
        # the loss scale goes on the smaller operand of each GEMM: the input gradient and x (one
        # compiled function for both)
        if ctx.needs_input_grad[0]:
            dx, xs = ctx.fast.kernel(scale_both)(g2 @ wc, x2, gl)
            dx = dx.view(B, T, H)
        else:
            dx, xs = None, x2 * gl.to(x.dtype)
        if ctx.accum:  # the lm_head's weight gradient summed into w.grad in place
            accumulate_grad(w, g2, xs)
            return (dx, None) + none
        return (dx, (g2.t() @ xs).to(w.dtype)) + none


def linear_softce(x, w, t, rw, chunk: int, accum: bool, fast: FastPath, t_idx=None):
    """LinearSoftCE.apply with its arguments named: -> (loss fp32 scalar, argmax [B, T])."""
    return LinearSoftCE.apply(x, w, t, rw, chunk, accum, t_idx, fast)


# ---- which rows run: the counted ones (the lm_head), the live ones (the unroll) ------------------
# the per-step lm_head GEMMs and soft-CE run on the rows the loss counts only (rows whose scored
# position is a prompt token, padding, past the sample's end, or whose target argmax lies outside
# the draft vocab add nothing to the loss or any gradient) when a step leaves at least this share
# of its rows uncounted; below it, gathering the rows costs about what the GEMMs save
SKIP_MIN = 1 / 16
# live rows' counts on CUDA are rounded up to this (fewer shapes for the compiled regions,
# GEMM-friendly sizes)
LIVE_MULTIPLE = 128


def row_multiple(t: torch.Tensor) -> int:
    """What a step's selected rows are rounded up to: LIVE_MULTIPLE on CUDA, 1 on the CPU."""
    return LIVE_MULTIPLE if t.is_cuda else 1


class _HostCounts:
    """A small device tensor's values on the host without stalling the GPU: on CUDA an
    asynchronous copy into pinned memory behind an event, so tolist() waits for that copy alone,
    not for the work queued after it (read once, then kept)."""

    def __init__(self, t: torch.Tensor):
        self.event, self._list = None, None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self._list is None:
            if self.event is not None:
                self.event.synchronize()
            self._list = self.host.tolist()
        return self._list


class RowCounts:
    """Which rows each TTT step counts, read back without stalling the GPU: the counts go to the
    host by an asynchronous copy and each step's rows are ordered counted-first (a stable sort:
    no host sync); rows_to_run() waits for the copy alone, which the GPU reaches before the
    drafter's forward queued in between."""

    def __init__(self, oks: list[torch.Tensor], fixed: bool = False):
        ok_all = torch.stack([ok.reshape(-1) for ok in oks])  # [S, B*T]
        self.rows, self.fixed = ok_all.shape[1], fixed
        self.order = torch.argsort((~ok_all).to(torch.int8), dim=1, stable=True)  # counted rows first
        self.counts = _HostCounts(ok_all.sum(1))
        self.multiple = row_multiple(ok_all)

    def rows_to_run(self) -> list[torch.Tensor | None]:
        """Per step: the counted rows' indices in the flattened [B*T] (ascending) when at least
        SKIP_MIN of its rows are not counted, else None (every row); a step with no counted row
        runs row 0, at weight 0. fixed (compiled regions): always the rows, their count rounded
        up to LIVE_MULTIPLE on CUDA (the extra rows weigh 0), so that every step takes the one
        path and the first step past the threshold compiles nothing new."""
        out = []
        for j, n in enumerate(self.counts.tolist()):
            if self.fixed:
                m = self.multiple
                out.append(self.order[j, : min(self.rows, max(m, -(-n // m) * m))])
            elif n > (1 - SKIP_MIN) * self.rows:
                out.append(None)
            elif n == 0:
                out.append(self.order[j, :1])
            else:
                out.append(self.order[j, :n])
        return out


def count_rows(oks: list[torch.Tensor], fixed: bool = False) -> RowCounts | None:
    """The rows counted, read back asynchronously (None: every row runs, as under CUDA-graph
    capture or with no steps). fixed: see RowCounts.rows_to_run."""
    if not oks or (oks[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return RowCounts(oks, fixed)


class LiveRows:
    """Which rows each TTT step still needs, for the fast unroll's `live`: rows ordered by the
    last step that scores them (latest first, a stable sort: no host sync), so step j's rows are
    a prefix of step j-1's; the counts go to the host by an asynchronous copy, waited for at the
    first rows() (after step 0's forward is queued). A row's state at step j >= 1 reaches only
    that row's own later steps, so rows no step >= j scores (a sample's prompt, padding, a
    sample's last rows) need step 0 alone, for the causal keys every row reads."""

    def __init__(self, oks: list[torch.Tensor], multiple: int | None = None, fixed: bool = False):
        ok_all = torch.stack([ok.reshape(-1) for ok in oks])  # [S, N]
        S, self.n = ok_all.shape
        step = torch.arange(S, device=ok_all.device)
        last = torch.where(ok_all, step[:, None], -1).amax(0)  # [N], -1: never
        self.order = torch.argsort(-last, stable=True)
        counts = (last[None, :] >= step[:, None]).sum(1)  # [S]
        self.multiple = multiple or row_multiple(ok_all)
        self.counts = _HostCounts(counts)
        self.fixed = fixed

    def rows(self, j: int) -> torch.Tensor | None:
        """Step j's rows (a prefix of self.order), or None to keep every row (never when fixed:
        compiled regions see one path at every step, see RowCounts.rows_to_run)."""
        m = self.multiple
        n = min(self.n, max(m, -(-self.counts.tolist()[j] // m) * m))
        return None if (n > (1 - SKIP_MIN) * self.n and not self.fixed) else self.order[:n]


def live_rows(oks: list[torch.Tensor], share: float | None, fixed: bool = False) -> LiveRows | None:
    """The rows each step needs (None: every row, when the host-side share of loss rows leaves
    too few out, under CUDA-graph capture or with fewer than 2 steps). A batch without a
    host-side share (built on the device) is counted. fixed: the rows at every step."""
    if (
        len(oks) < 2
        or (share is not None and share > 1 - SKIP_MIN and not fixed)
        or (oks[0].is_cuda and torch.cuda.is_current_stream_capturing())
    ):
        return None
    return LiveRows(oks, fixed=fixed)


def _step_loss_counted(xn, w, t_prob, ok, idx, j: int, fast: FastPath):
    """LinearSoftCE of step j on the rows idx of xn [B, T, H] only -> (loss, argmax [B, T]; rows
    not counted hold 0). t_prob [B, T + pad, V]: row p of sample b is scored against
    t_prob[b, p + j + 1]."""
    B, T = ok.shape
    pad = t_prob.shape[1] - T
    t_idx = idx + (idx // T) * pad + (j + 1)
    rw = ok.reshape(1, -1).index_select(1, idx).float()
    loss, a = linear_softce(
        select_rows(xn, idx),
        w,
        t_prob.view(-1, t_prob.shape[-1]),
        rw,
        fast.loss_chunk,
        fast.accumulate_wgrad,
        fast,
        t_idx,
    )
    arg = torch.zeros(B * T, dtype=a.dtype, device=a.device)
    arg.index_copy_(0, idx, a.reshape(-1))
    return loss, arg.view(B, T)


# ---- the terms ---------------------------------------------------------------------------------
def ttt_terms(drafter, batch, target_head: torch.Tensor, steps: int, fast: FastPath, counted_rows):
    """draftport.training.ttt.ttt_terms' terms on the fast path: per step (summed soft-CE, rows
    counted, rows where the argmax agrees), unnormalized.

    drafter: the Eagle3Drafter or a view of it that runs its forward (DDP's: `.module` is the
    drafter). counted_rows(batch, in_draft, q) -> [B, T] bool: the rows of step q-1 that count
    (the reference's definition, training.ttt.counted_rows)."""
    base = getattr(drafter, "module", drafter)
    hot, t2d = drafter.hot_ids, drafter.t2d
    T = batch.tokens.shape[1]
    t_prob, t_arg = target_stats(
        batch.final, target_head, hot, fast.target_chunk, pad=steps, target_arg=batch.target_arg
    )
    in_draft = t2d[t_arg]
    # which rows count is known before the drafter runs: counted here, read back once its
    # forward is queued
    oks = [counted_rows(batch, in_draft, j + 1) for j in range(steps)]
    share = getattr(batch, "loss_share", None)
    # compiled: the row selections at every step, whatever the batch (a first batch past the
    # threshold would compile a second set of graphs mid-training)
    fixed = fast.compile
    few_out = share is not None and share > 1 - SKIP_MIN and not fixed  # known on the host: nothing to wait for
    counted = count_rows(oks, fixed) if (fast.skip_uncounted and not few_out) else None
    live = live_rows(oks, share, fixed) if fast.skip_dead_rows else None
    normed = drafter(
        batch.aux,
        batch.tokens,
        steps,
        impl=unroll,
        fast=fast,
        teacher_tokens=True,
        valid=batch.valid,
        return_normed=True,
        live=live,
        **packed_args(batch),
    )
    oks = oks[: len(normed)]
    idxs = [None] * steps if counted is None else counted.rows_to_run()
    w = base.lm_head.weight
    # row p of step j is scored against the target's prediction at position p + j + 1
    losses, args = zip(
        *[
            linear_softce(
                xn, w, t_prob[:, j + 1 : j + 1 + T], oks[j].float(), fast.loss_chunk, fast.accumulate_wgrad, fast
            )
            if idxs[j] is None
            else _step_loss_counted(xn, w, t_prob, oks[j], idxs[j], j, fast)
            for j, xn in enumerate(normed)
        ]
    )
    terms = []
    for j, (loss_sum, arg, ok) in enumerate(zip(losses, args, oks)):
        with torch.no_grad():
            correct = ((hot[arg] == shift(t_arg, j + 1)) & ok).sum()
        terms.append((loss_sum, ok.sum(), correct))
    return terms
