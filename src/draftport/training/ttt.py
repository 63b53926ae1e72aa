"""Training-time test: the K-step unrolled loss of EAGLE-3.

Targets come from the target model itself: its final hidden state (after the last norm) through
its lm_head gives full-vocab logits at every position. The drafter learns the target's softmax
restricted to the draft vocab (soft cross-entropy); positions whose full-vocab argmax lies outside
the draft vocab are masked (the drafter cannot propose that token anyway); step j is weighted
gamma**j.

`ttt_terms(..., fused=True)` computes the same terms without materializing what the reference
does: target logits go through the (frozen) target head in row chunks, keeping only the argmax
and the draft-vocab softmax; the drafter's lm_head and the soft-CE run per row chunk inside one
autograd function (LinearSoftCE) that keeps only d(loss)/d(input) (lm_head frozen) or the bf16
d(loss)/d(logits) (lm_head trainable), never fp32 logits for all positions of all steps; and the
drafter uses its fused attention. On the GPU the target logits are computed in the head's dtype
(bf16), where the reference upcasts to fp32.

Packed batches (draftport.data.packing.PackedBatch, several samples per row) give the same terms as
the padded batch of the same samples: the drafter keeps attention, positions and token shifts per
sample, and row p of step j counts only when p + j + 2 lies in p's own sample.
"""

from __future__ import annotations

import torch

from draftport.model.fast import kernels
from draftport.data.shards import Batch
from draftport.model.drafter import Eagle3Drafter, shift
from draftport.model.fast.kernels import Segments, accumulate_grad, select_rows, wgrad_side


def target_logits(final: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
    """Full-vocab target logits [B, T, V] in fp32."""
    return final.float() @ target_head.float().t()


# rows per chunk on the fused path: the target side holds fp32 full-vocab logits [chunk, V] at a
# time (V = 163,840 at Kimi size: 0.67 GB at 1,024 rows); the loss only bf16 draft-vocab logits
# [chunk, Vd], so it takes whole rows up to 4,096 tokens (one GEMM pair per step, 4x fewer kernels).
# On the H200 the loss alone ran 13% faster at T 4,096 that way; in the whole training step the
# A/B is within its run-to-run spread (+1.0% at 4,096, -1.2% at 2,048; benchmarks/results/
# 2026-12-01-h200-probe-loss-attn.json, -ab-loss-chunk.json)
TARGET_CHUNK = 1024
LOSS_CHUNK = 4096


def ttt_terms(drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, steps: int, *,
              fused: bool = False, chunk: int | None = None):
    """Per-step (summed soft-CE, rows counted, rows where the argmax agrees), unnormalized, so
    that data-parallel ranks can normalize by the global row count.

    fused: the memory-lean path (same terms; see the module docstring); chunk: rows per chunk
    on both sides (default TARGET_CHUNK for the target logits, LOSS_CHUNK for the loss)."""
    if fused:
        return _ttt_terms_fused(drafter, batch, target_head, steps, chunk or TARGET_CHUNK, chunk or LOSS_CHUNK)
    hot = drafter.hot_ids
    t2d = drafter.t2d
    with torch.no_grad():
        full = target_logits(batch.final, target_head)            # [B, T, V]
        t_arg = full.argmax(-1) if batch.target_arg is None else batch.target_arg  # target's choice
        in_draft = t2d[t_arg]                                      # argmax inside draft vocab?
        t_prob = torch.softmax(full[..., hot], dim=-1)             # restricted + renormalized
        del full
    logits = drafter.unroll(batch.aux, batch.tokens, steps, teacher_tokens=True, valid=batch.valid,
                            **packed_args(batch))
    terms = []
    for j, lg in enumerate(logits):
        q = j + 1  # row p of step j is scored against the target's prediction at position p + q
        ok = _ok_rows(batch, in_draft, q)
        per_row = -(shift_rows(t_prob, q) * torch.log_softmax(lg.float(), dim=-1)).sum(-1)
        with torch.no_grad():
            correct = ((hot[lg.argmax(-1)] == shift(t_arg, q)) & ok).sum()
        terms.append(((per_row * ok).sum(), ok.sum(), correct))
    return terms


def packed_args(batch) -> dict:
    """unroll's keyword arguments for a packed batch (doc, positions, segments); {} otherwise."""
    doc = getattr(batch, "doc", None)
    if doc is None:
        return {}
    seg = Segments(batch.cu_seqlens, batch.max_seqlen, getattr(batch, "cu_seqlens_t", None))
    return {"doc": doc, "positions": batch.positions, "segments": seg}


def _ok_rows(batch: Batch, in_draft: torch.Tensor, q: int) -> torch.Tensor:
    """Rows of step q-1 that count: the position scored (p + q + 1) is a valid assistant token of
    row p's own sample (packed rows: the same doc), and the target's argmax there is a draft id."""
    T = batch.tokens.shape[1]
    ok = (shift(batch.loss_mask.long(), q + 1).bool() & shift(batch.valid.long(), q + 1).bool()
          & shift(in_draft.long(), q).bool())
    doc = getattr(batch, "doc", None)
    if doc is not None:
        ok = ok & (shift(doc, q + 1, fill=-1) == doc)
    return torch.zeros_like(ok) if T <= q + 1 else ok


def logits_fp32(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [N, H] @ w[V, H]^T in fp32 output. A bf16 head on CUDA stays a bf16 GEMM but its fp32
    accumulator is kept (torch.mm out_dtype): logits rounded to bf16 flip near-tied argmaxes,
    and with them the mask."""
    with torch.autocast(x2.device.type, enabled=False):
        if x2.is_cuda and w.dtype in (torch.bfloat16, torch.float16):
            if _MM_OUT_DTYPE[0]:
                try:
                    return torch.mm(x2.to(w.dtype), w.t(), out_dtype=torch.float32)
                except (TypeError, RuntimeError, NotImplementedError):
                    _MM_OUT_DTYPE[0] = False
            # an older torch: a fp32 GEMM would cost ~20x; keep the bf16 GEMM, rounded output
            return (x2.to(w.dtype) @ w.t()).float()
        return x2.float() @ w.float().t()


_MM_OUT_DTYPE = [True]   # torch.mm(..., out_dtype=) works here (cleared at the first failure)


@torch.no_grad()
def target_stats(final: torch.Tensor, target_head: torch.Tensor, hot: torch.Tensor, chunk: int,
                 pad: int = 0, target_arg: torch.Tensor | None = None):
    """Row-chunked target side: (t_prob [B, T+pad, Vd] fp32, zero rows past T; t_arg [B, T]).

    Full-vocab logits exist for `chunk` rows at a time (fp32). With target_arg (captured) only
    the draft rows are computed; target_head may then hold just those rows, in slot order."""
    B, T, _ = final.shape
    Vd = hot.numel()
    t_prob = torch.empty(B, T + pad, Vd, dtype=torch.float32, device=final.device)
    t_prob[:, T:].zero_()   # the rows below are all written
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
            full = logits_fp32(final[b, s:e], target_head)                      # [c, V]
            t_arg[b, s:e] = full.argmax(-1)
            t_prob[b, s:e] = torch.softmax(full.index_select(1, hot), dim=-1)
    return t_prob, t_arg


def _softce_rows(lg, t, w):
    """Soft-CE of logits lg [c, V] against probabilities t [c, V], rows weighted by w [c] (fp32).
    -> (weighted loss per row [c] fp32, d(sum loss)/d(lg) in lg's dtype, argmax [c]).

    The loss is written sum(t) * lse - sum(t * lg), the same function as -sum(t * log_softmax(lg)):
    no reduction then waits for the log-softmax to exist, and the compiled kernel reads the
    logits and targets fewer times (H200, [2048, 32000] x 7 steps: 1.89 vs 2.22 ms;
    benchmarks/probe_loss_attn_h200.py --softce-only,
    results/2026-12-02-h200-probe-softce.json)."""
    lg32, t32 = lg.float(), t.float()
    m = lg32.amax(-1, keepdim=True)
    lse = m + torch.log(torch.exp(lg32 - m).sum(-1, keepdim=True))
    tsum = t32.sum(-1, keepdim=True)
    loss = (lse * tsum - (t32 * lg32).sum(-1, keepdim=True)).squeeze(-1) * w
    g = (torch.exp(lg32 - lse) * tsum - t32) * w[:, None]
    return loss, g.to(lg.dtype), lg32.argmax(-1)


def _scale_both(a, b, s):
    """(a * s, b * s) in their dtype, s a 0-dim tensor: the loss scale on the input gradient and
    on the weight gradient's operand, compiled on the GPU path (eager multiplies by a 0-dim tensor
    ran at ~1.5 TB/s on an H200, 1.1 ms per step at T 4,096; compiled, 0.4 ms)."""
    return a * s.to(a.dtype), b * s.to(b.dtype)


def _softce_rows_into(lg, t, w):
    """_softce_rows with the gradient written over the logits (lg is a slice of the stacked
    logits; its rows become d(loss)/d(lg)). -> (weighted loss per row [c] fp32, argmax [c])."""
    loss, g, arg = _softce_rows(lg, t, w)
    lg.copy_(g)
    return loss, arg


def _softce_rows_at(lg, t, idx, w):
    """_softce_rows against the target rows t[idx] (t [R, V], idx [c]): compiled, the gather is
    read inside the soft-CE kernel, no [c, V] copy of the targets."""
    return _softce_rows(lg, t.index_select(0, idx), w)


_LOSS_KERNELS = {"softce": _softce_rows, "softce_into": _softce_rows_into, "scale": _scale_both,
                 "softce_at": _softce_rows_at}


def compile_loss_kernels():
    """Compile the per-chunk soft-CE elementwise kernels and the loss scale (GPU path; call once)."""
    for name, fn in (("softce", _softce_rows), ("softce_into", _softce_rows_into), ("scale", _scale_both),
                     ("softce_at", _softce_rows_at)):
        _LOSS_KERNELS[name] = kernels.compiled(fn, dynamic=None)   # see kernels.compile_kernels


class LinearSoftCE(torch.autograd.Function):
    """sum_rows w * softCE(x @ W^T, t) over row chunks; -> (loss fp32 scalar, argmax [B, T]).

    W frozen: d(loss)/dx is computed in the forward, chunk by chunk, and only it is kept.
    W trainable: the bf16 d(loss)/d(logits) [B, T, V] is kept and both GEMMs run in backward.
    t_idx (B == 1): row i of x is scored against t[t_idx[i]], t being [R, V] (the counted rows
    of a step, see _step_loss_counted)."""

    @staticmethod
    def forward(ctx, x, w, t, rw, chunk, accum=False, t_idx=None):
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
            kern = _LOSS_KERNELS["softce" if t_idx is None else "softce_at"]
            for b in range(B):
                for s in range(0, T, chunk):
                    e = min(T, s + chunk)
                    lg = x[b, s:e] @ wc.t()
                    if t_idx is None:
                        l_rows, g, a = kern(lg, t[b, s:e], rw[b, s:e])
                    else:   # x's rows are the rows t_idx of t [R, V] (B == 1: _step_loss_counted)
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
        ctx.accum = accum
        if need_w:
            ctx.save_for_backward(x, w, g_all)
        elif need_x:
            ctx.save_for_backward(dx)
        ctx.mark_non_differentiable(arg)
        return loss, arg

    @staticmethod
    def backward(ctx, gl, _garg):
        if ctx.mode is None:
            return None, None, None, None, None, None, None
        if ctx.mode == "x":
            (dx,) = ctx.saved_tensors
            return dx * gl.to(dx.dtype), None, None, None, None, None, None
        x, w, g_all = ctx.saved_tensors
        B, T, H = x.shape
        g2 = g_all.view(B * T, -1)
        wc = w.to(x.dtype)
        x2 = x.reshape(B * T, H)
        # the loss scale goes on the smaller operand of each GEMM: the input gradient and x (one
        # compiled function for both)
        if ctx.needs_input_grad[0]:
            dx, xs = _LOSS_KERNELS["scale"](g2 @ wc, x2, gl)
            dx = dx.view(B, T, H)
        else:
            dx, xs = None, x2 * gl.to(x.dtype)
        return dx, _head_wgrad(w, g2, xs, ctx.accum), None, None, None, None, None


def _head_wgrad(w, g2, xs, accum: bool):
    """The lm_head's weight gradient g2^T @ xs: summed into w.grad in place (accum; returns None)
    or returned for autograd."""
    if accum:
        with wgrad_side(g2, xs):
            accumulate_grad(w, g2, xs)
        return None
    return (g2.t() @ xs).to(w.dtype)


class StackedLinearSoftCE(torch.autograd.Function):
    """LinearSoftCE for several TTT steps at once: their inputs stacked into one [S*B*T, H]
    operand, so the lm_head forward, its input gradient and its weight gradient are one GEMM
    each (the weight gradient's K is S*B*T: summed inside the GEMM, not S in-place updates of a
    bf16 gradient). With teacher tokens no step reads another's logits, so nothing waits for
    them. The soft-CE kernel writes each step's d(loss)/d(logits) over its logits (no second
    [S*B*T, V] buffer); the input gradient is computed in forward when W is frozen, as
    LinearSoftCE does. Row p of step j is scored against t[:, q0 + j + p].

    apply(w, t, rw [S, B, T], q0, accum, *xs) -> (losses [S] fp32, argmax [S, B, T])."""

    @staticmethod
    def forward(ctx, w, t, rw, q0, accum, *xs):
        S = len(xs)
        B, T, H = xs[0].shape
        need_w = ctx.needs_input_grad[0]
        need_x = any(ctx.needs_input_grad[5:])
        with torch.autocast(xs[0].device.type, enabled=False):
            wc = w.to(xs[0].dtype)
            x2 = torch.stack(xs).view(S * B * T, H)
            lg = x2 @ wc.t()                                        # [S*B*T, V]: one GEMM
            losses, arg = [], torch.empty(S, B, T, dtype=torch.long, device=x2.device)
            kern = _LOSS_KERNELS["softce_into"]
            for j in range(S):
                loss = torch.zeros((), dtype=torch.float32, device=x2.device)
                for b in range(B):
                    r = (j * B + b) * T
                    l_rows, a = kern(lg[r:r + T], t[b, q0 + j:q0 + j + T], rw[j, b])
                    loss = loss + l_rows.sum()
                    arg[j, b] = a
                losses.append(loss)
            dx = lg @ wc if need_x and not need_w else None           # [S*B*T, H]: one GEMM
        ctx.mode = "w" if need_w else ("x" if need_x else None)
        ctx.accum, ctx.shape = accum, (S, B, T, H)
        if need_w:
            ctx.save_for_backward(x2, w, lg)
        elif need_x:
            ctx.save_for_backward(dx)
        ctx.mark_non_differentiable(arg)
        return torch.stack(losses), arg

    @staticmethod
    def backward(ctx, gl, _garg):
        S, B, T, H = ctx.shape
        none = (None,) * 5
        if ctx.mode is None:
            return none + (None,) * S
        s = gl.view(S, 1, 1)
        if ctx.mode == "x":
            (dx,) = ctx.saved_tensors
            dx = dx.view(S, B * T, H) * s.to(dx.dtype)
            return none + tuple(dx[j].view(B, T, H) for j in range(S))
        x2, w, g2 = ctx.saved_tensors
        wc = w.to(x2.dtype)
        need_x = any(ctx.needs_input_grad[5:])
        if need_x:   # the loss scale on the smaller operand of each GEMM, as LinearSoftCE
            dx, xs = _LOSS_KERNELS["scale"]((g2 @ wc).view(S, B * T, H), x2.view(S, B * T, H), s)
        else:
            dx, xs = None, x2.view(S, B * T, H) * s.to(x2.dtype)
        dw = _head_wgrad(w, g2, xs.view(S * B * T, H), ctx.accum)
        dxs = tuple(dx[j].view(B, T, H) for j in range(S)) if need_x else (None,) * S
        return (dw,) + none[1:] + dxs


# the stacked lm_head (StackedLinearSoftCE) holds the logits of every step it takes at once:
# bf16 [S*B*T, V], which become the kept gradient when the lm_head is trained. Steps are taken in
# groups whose logits fit this many bytes (Kimi size, T 4,096, 7 steps: 1.8 GB, one group).
STACK_BYTES = 2 << 30
_STACKED = {"on": False}


def set_stacked_head(on: bool) -> None:
    """The fused loss takes its TTT steps' lm_head GEMMs stacked (StackedLinearSoftCE) instead of
    one LinearSoftCE per step: the same terms (the loss's row chunk does not apply: each step's
    rows are one chunk). Off by default: on one H200 (Kimi size, TTT 7) the
    whole step moved +0.4 / -1.2 / +0.4% at T 4,096 (lm_head trained mask stored / trained
    computed / frozen stored), -2.7 / +2.0 / +2.3% at 2,048 and -0.1 to +0.5% on the packed mix,
    all within the blocks' spread: the stacked GEMMs ran at ~690-710 TFLOP/s, as the per-step
    ones do; lm_head frozen, the stacked logits add 0.8-1.6 GiB of peak memory
    (benchmarks/results/2026-12-02-h200-probe-stacked-head.json)."""
    _STACKED["on"] = bool(on)


def _step_groups(steps: int, rows: int, vocab: int, itemsize: int) -> list[range]:
    """Consecutive steps in groups whose stacked logits fit STACK_BYTES (at least one step each)."""
    per = max(1, STACK_BYTES // max(1, rows * vocab * itemsize))
    return [range(s, min(steps, s + per)) for s in range(0, steps, per)]


# the per-step lm_head GEMMs and soft-CE run on the rows the loss counts only (rows whose scored
# position is a prompt token, padding, past the sample's end, or whose target argmax lies outside
# the draft vocab add nothing to the loss or any gradient) when a step leaves at least this share
# of its rows uncounted; below it, gathering the rows costs about what the GEMMs save
SKIP_MIN = 1 / 16
_SKIP = {"on": True}


def set_skip_uncounted(on: bool) -> None:
    """The fused loss's per-step lm_head and soft-CE on the counted rows only (on, the default)
    or on every row: the same terms and gradients. The rows counted are read back to the host
    while the drafter's forward is queued; that wait ties the host to the device once per step
    (an H200 probe read -1 to -3% at T 2,048 with nothing to skip, inside that probe's own A/A
    bias there), so a batch whose host-side loss_share (Batch.to fills it) leaves fewer than
    SKIP_MIN of its rows out of the loss skips nothing and waits for nothing. Not under CUDA-graph capture or with the stacked lm_head
    (set_stacked_head), which take every row."""
    _SKIP["on"] = bool(on)


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


class _RowCounts:
    """Which rows each TTT step counts, read back without stalling the GPU: the counts go to the
    host by an asynchronous copy and each step's rows are ordered counted-first (a stable sort:
    no host sync); rows_to_run() waits for the copy alone, which the GPU reaches before the
    drafter's forward queued in between."""

    def __init__(self, oks: list[torch.Tensor]):
        ok_all = torch.stack([ok.reshape(-1) for ok in oks])                      # [S, B*T]
        self.rows = ok_all.shape[1]
        self.order = torch.argsort((~ok_all).to(torch.int8), dim=1, stable=True)  # counted rows first
        self.counts = _HostCounts(ok_all.sum(1))

    def rows_to_run(self) -> list[torch.Tensor | None]:
        """Per step: the counted rows' indices in the flattened [B*T] (ascending) when at least
        SKIP_MIN of its rows are not counted, else None (every row); a step with no counted row
        runs row 0, at weight 0."""
        out = []
        for j, n in enumerate(self.counts.tolist()):
            if n > (1 - SKIP_MIN) * self.rows:
                out.append(None)
            elif n == 0:
                out.append(self.order[j, :1])
            else:
                out.append(self.order[j, :n])
        return out


def _count_rows(oks: list[torch.Tensor]) -> _RowCounts | None:
    """The rows counted, read back asynchronously (None: every row runs, as when off, under
    CUDA-graph capture or with no steps)."""
    if not oks or not _SKIP["on"] or (oks[0].is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    return _RowCounts(oks)


# steps >= 1 run their GEMMs on the rows some later step still scores (drafter.unroll's `live`):
# a row's state at step j >= 1 reaches only that row's own later steps, so rows no step >= j
# scores (a sample's prompt, padding, a sample's last rows) need step 0 alone, for the causal keys
# every row reads. On CUDA row counts are rounded up to LIVE_MULTIPLE (fewer shapes for the
# compiled regions, GEMM-friendly sizes); a step keeps every row unless at least SKIP_MIN of them
# can go.
LIVE_MULTIPLE = 128
_LIVE = {"on": True}


def set_skip_dead_rows(on: bool) -> None:
    """Steps >= 1 of the fused unroll on the rows a later step scores only (on, the default) or
    on every row: the same terms and gradients. It needs the rows' counts on the host, read back
    as set_skip_uncounted reads its own (one wait per batch, at step 1); a batch whose host-side
    loss_share leaves fewer than SKIP_MIN of its rows out of the loss does not wait and keeps
    every row. Not under CUDA-graph capture."""
    _LIVE["on"] = bool(on)


class _LiveRows:
    """Which rows each TTT step still needs, for drafter.unroll(live=...): rows ordered by the
    last step that scores them (latest first, a stable sort: no host sync), so step j's rows are
    a prefix of step j-1's; the counts go to the host by an asynchronous copy, waited for at the
    first rows() (after step 0's forward is queued)."""

    def __init__(self, oks: list[torch.Tensor], multiple: int | None = None):
        ok_all = torch.stack([ok.reshape(-1) for ok in oks])                      # [S, N]
        S, self.n = ok_all.shape
        step = torch.arange(S, device=ok_all.device)
        last = torch.where(ok_all, step[:, None], -1).amax(0)                    # [N], -1: never
        self.order = torch.argsort(-last, stable=True)
        counts = (last[None, :] >= step[:, None]).sum(1)                         # [S]
        self.multiple = multiple or (LIVE_MULTIPLE if ok_all.is_cuda else 1)
        self.counts = _HostCounts(counts)

    def rows(self, j: int) -> torch.Tensor | None:
        """Step j's rows (a prefix of self.order), or None to keep every row."""
        m = self.multiple
        n = min(self.n, max(m, -(-self.counts.tolist()[j] // m) * m))
        return None if n > (1 - SKIP_MIN) * self.n else self.order[:n]


def _live_rows(oks: list[torch.Tensor], share: float | None) -> _LiveRows | None:
    """The rows each step needs (None: every row, when off, when the host-side share of loss
    rows leaves too few out, under CUDA-graph capture or with fewer than 2 steps). A batch
    without a host-side share (built on the device) is counted."""
    if (len(oks) < 2 or not _LIVE["on"] or (share is not None and share > 1 - SKIP_MIN)
            or (oks[0].is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    return _LiveRows(oks)


def _step_loss_counted(xn, w, t_prob, ok, idx, j: int, loss_chunk: int, accum: bool):
    """LinearSoftCE of step j on the rows idx of xn [B, T, H] only -> (loss, argmax [B, T]; rows
    not counted hold 0). t_prob [B, T + pad, V]: row p of sample b is scored against
    t_prob[b, p + j + 1]."""
    B, T = ok.shape
    pad = t_prob.shape[1] - T
    t_idx = idx + (idx // T) * pad + (j + 1)
    rw = ok.reshape(1, -1).index_select(1, idx).float()
    loss, a = LinearSoftCE.apply(select_rows(xn, idx), w, t_prob.view(-1, t_prob.shape[-1]), rw,
                                 loss_chunk, accum, t_idx)
    arg = torch.zeros(B * T, dtype=a.dtype, device=a.device)
    arg.index_copy_(0, idx, a.reshape(-1))
    return loss, arg.view(B, T)


def _ttt_terms_fused(drafter, batch: Batch, target_head: torch.Tensor, steps: int, chunk: int, loss_chunk: int):
    base = getattr(drafter, "module", drafter)  # the drafter behind a DDP view
    hot, t2d = drafter.hot_ids, drafter.t2d
    T = batch.tokens.shape[1]
    t_prob, t_arg = target_stats(batch.final, target_head, hot, chunk, pad=steps, target_arg=batch.target_arg)
    in_draft = t2d[t_arg]
    # which rows count is known before the drafter runs: counted here, read back once its
    # forward is queued
    oks = [_ok_rows(batch, in_draft, j + 1) for j in range(steps)]
    share = getattr(batch, "loss_share", None)
    few_out = share is not None and share > 1 - SKIP_MIN   # known on the host: nothing to wait for
    counted = None if (_STACKED["on"] or few_out) else _count_rows(oks)
    live = _live_rows(oks, share)
    normed = drafter.unroll(batch.aux, batch.tokens, steps, teacher_tokens=True, valid=batch.valid,
                            fused=True, return_normed=True, live=live, **packed_args(batch))
    oks = oks[:len(normed)]
    idxs = [None] * steps if counted is None else counted.rows_to_run()
    w = base.lm_head.weight
    if _STACKED["on"]:
        args, losses = [], []
        for grp in _step_groups(len(normed), normed[0].shape[0] * T, w.shape[0], normed[0].element_size()):
            rw = torch.stack([oks[j] for j in grp]).float()
            l_g, a_g = StackedLinearSoftCE.apply(w, t_prob, rw, grp[0] + 1, base.accumulate_wgrad,
                                                 *[normed[j] for j in grp])
            losses += list(l_g.unbind(0))
            args += list(a_g.unbind(0))
    else:
        # row p of step j is scored against the target's prediction at position p + j + 1
        losses, args = zip(*[LinearSoftCE.apply(xn, w, t_prob[:, j + 1:j + 1 + T], oks[j].float(),
                                                loss_chunk, base.accumulate_wgrad)
                             if idxs[j] is None else
                             _step_loss_counted(xn, w, t_prob, oks[j], idxs[j], j, loss_chunk, base.accumulate_wgrad)
                             for j, xn in enumerate(normed)])
    terms = []
    for j, (loss_sum, arg, ok) in enumerate(zip(losses, args, oks)):
        with torch.no_grad():
            correct = ((hot[arg] == shift(t_arg, j + 1)) & ok).sum()
        terms.append((loss_sum, ok.sum(), correct))
    return terms


def combine(terms, gamma: float, counts=None, scale: float = 1.0, sync: bool = True):
    """Weighted loss from ttt_terms; `counts` overrides the row counts (global under DDP).

    sync=False leaves the stats as 0-dim tensors (no host sync; see stats_to_float)."""
    total = 0.0
    stats = {}
    for j, (loss_sum, n, correct) in enumerate(terms):
        denom = (counts[j] if counts is not None else n).clamp_min(1)
        total = total + (gamma ** j) * loss_sum / denom
        stats[f"loss_{j}"] = loss_sum.detach() / denom
        stats[f"acc_{j}"] = correct / denom
        stats[f"n_{j}"] = denom
    return total * scale, (stats_to_float(stats) if sync else stats)


def stats_to_float(stats: dict) -> dict:
    """0-dim tensor stats -> python floats, in one device-to-host copy."""
    keys = list(stats)
    if not keys:
        return {}
    vals = torch.stack([torch.as_tensor(stats[k]).float().reshape(()) for k in keys]).tolist()
    return dict(zip(keys, vals))


def ttt_loss(drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, steps: int,
             gamma: float) -> tuple[torch.Tensor, dict]:
    """Weighted soft-CE over `steps` unrolled draft steps; returns (loss, stats).

    stats: loss_{j}, acc_{j} (argmax agreement with the target's argmax on counted rows),
    n_{j} (rows counted) as python floats, for logging.
    """
    return combine(ttt_terms(drafter, batch, target_head, steps), gamma)


def shift_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, p + n] at row p for a [B, T, ...] tensor (zeros past the end)."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, :-n] = x[:, n:]
    return out
