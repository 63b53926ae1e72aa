"""The drafter's fused training paths: TTT attention through flash attention and a log-sum-exp
merge, and the linears and SwiGLU MLP as custom autograd functions (draftport.model.drafter's
`impl` fused / compiled dispatches here; the readable reference is in drafter.py).

Fused TTT attention computes the same function as `Attention.attend_core`: step j's row p sees
the step-0 keys of rows <= p (causal) and its own keys from steps 1..j (diagonal). The step-0
causal part runs through flash attention (private aten ops), which also returns its
log-sum-exp; the few diagonal keys are merged by log-sum-exp (fp32). Its backward calls the
flash backward with the *merged* output and log-sum-exp (the ring-attention identity:
dS = P_final * (dP - rowsum(dO * O_final)) per key block), so no [T, T] tensor ever exists. It
assumes right padding (a valid row's earlier rows are valid), as `data.collate` pads.

Packed rows (draftport.data.packing): the step-0 part runs per segment instead (variable-length
flash attention over cu_seqlens on CUDA, or the dense kernel segment by segment: the CPU
flash kernel, and on CUDA under cudnn by default, `set_packed_attention`), in
a token-major layout [B*T, h, d] with the log-sum-exp as [B*T, h]. The diagonal merge and its
gradients run in that layout on both paths: q/k/v come token-major from the drafter (a
[B, h, T, d] view of [B, T, h, d]), the dense kernels keep that layout in their outputs and
gradients, so no step copies to or from the [B, T, h*d] GEMM layout. The keys' gradients across
TTT steps can be summed in one accumulator per unroll (KVGradSum, `set_kv_grad_sum`).
`set_attention_backend("cudnn")` runs the dense causal part through cuDNN's fused attention
instead of flash (same identity, its backward also takes the merged output and log-sum-exp);
`"fa4"` through FlashAttention-4 (package flash-attn-4: CuTe-DSL kernels for Hopper and
Blackwell, compiled at first use), packed rows through its varlen kernel.

The linears can sum their weight gradient in place across TTT steps (`accumulate_grad`: beta = 1
inside the GEMM), single process only; weights reading one input run as one function
(`multi_linear`: q/k/v, gate/up) whose input gradient is summed inside the GEMMs, and a column
block of them as its own GEMMs (q/k/v's embedding and hidden halves, the first once per unroll),
its gradient into that block; the MLP keeps only its gate/up outputs and recomputes the product
in backward.
`compile_kernels` swaps the elementwise pieces for torch.compile'd versions (GPU path).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F


# ---- fused TTT attention ----------------------------------------------------------------------
# the CUDA kernel of the dense causal part: flash (default) or cudnn (DRAFTPORT_ATTENTION=cudnn);
# benchmarks/bench_train_h200.py times both on the device and says which is faster where
# packed rows on CUDA: flash varlen, one call for all segments, or the dense kernel above once
# per segment (segments). auto (default): segments when the dense kernel is cuDNN, whose dense
# causal 2,048 ran ~2x flash varlen's rate on an H200 (results/*-profiles-4 vs -6) and the length
# mix's whole step 1.0-1.2% faster (results/*-probe-packed-segments); varlen with flash and
# with fa4 (FlashAttention-4's varlen kernel: 1.54x cuDNN once per segment on the mix's rows,
# forward and backward; dense causal 1.03x forward, 1.17-1.19x backward at T 2,048 / 4,096:
# results/2026-12-03-h200-probe-fa4-attn.json)
_BACKEND = {"dense": os.environ.get("DRAFTPORT_ATTENTION", "flash"),
            "packed": os.environ.get("DRAFTPORT_PACKED_ATTENTION", "auto")}
_DENSE = ("flash", "cudnn", "fa4")
if _BACKEND["dense"] not in _DENSE:
    raise ValueError(f"DRAFTPORT_ATTENTION={_BACKEND['dense']!r}: flash, cudnn or fa4")
if _BACKEND["packed"] not in ("auto", "varlen", "segments"):
    raise ValueError(f"DRAFTPORT_PACKED_ATTENTION={_BACKEND['packed']!r}: auto, varlen or segments")


def set_attention_backend(name: str) -> None:
    """flash (default), cudnn or fa4: which fused kernel runs the causal part on CUDA."""
    if name not in _DENSE:
        raise ValueError(f"attention backend {name!r}: flash, cudnn or fa4")
    _BACKEND["dense"] = name


def set_packed_attention(name: str) -> None:
    """auto (default), varlen or segments: how packed rows' causal part runs on CUDA (the CPU
    path always runs the dense kernel once per segment); auto is segments under cudnn. varlen
    is the dense backend's varlen kernel (flash: torch's FlashAttention 2, fa4: its own)."""
    if name not in ("auto", "varlen", "segments"):
        raise ValueError(f"packed attention {name!r}: auto, varlen or segments")
    _BACKEND["packed"] = name


def packed_attention(dense: str | None = None) -> str:
    """The packed rows' path on CUDA, varlen or segments, under this dense backend (None: the
    one set now)."""
    if _BACKEND["packed"] == "auto":
        return "segments" if (dense or _BACKEND["dense"]) == "cudnn" else "varlen"
    return _BACKEND["packed"]


_FA4 = {}


def _fa4():
    """FlashAttention-4's forward and backward (flash_attn.cute), imported at first use."""
    if not _FA4:
        try:
            from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
        except ImportError as e:
            raise RuntimeError(f"attention backend fa4: FlashAttention-4 is not importable ({e}); "
                               "pip install --pre flash-attn-4 (Hopper or Blackwell GPUs)") from None
        _FA4.update(fwd=_flash_attn_fwd, bwd=_flash_attn_bwd)
    return _FA4["fwd"], _FA4["bwd"]


def _flash_fwd(q, k, v, scale):
    """Causal attention over the step-0 keys -> (out [B,h,T,d], lse [B,h,T] fp32, extras)."""
    if q.is_cuda:
        if _BACKEND["dense"] == "fa4":   # it takes [B, T, h, d]: the token-major tensors q/k/v view
            r = _fa4()[0](q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                          causal=True, return_lse=True)
            return r[0].transpose(1, 2), r[1], ("fa4",)
        if _BACKEND["dense"] == "cudnn":
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False,
                                                                    scale=scale)
            lse = r[1]
            extras = ("cudnn", tuple(lse.shape), r[6], r[7], r[2], r[3], r[4], r[5])
            return r[0], lse.reshape(q.shape[:-1]), extras
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], ("flash",) + tuple(r[2:8])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return o, lse, ()


def _flash_bwd(do, q, k, v, o, lse, scale, extras):
    if q.is_cuda:
        if extras[0] == "fa4":
            g = _fa4()[1](*(t.transpose(1, 2) for t in (q, k, v, o, do)), lse.contiguous(), scale, True)
            return tuple(t.transpose(1, 2) for t in g[:3])
        if extras[0] == "cudnn":
            _, shape, seed, off, cq, ck, mq, mk = extras
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o, lse.reshape(shape).contiguous(), seed, off, None, cq, ck, mq, mk, 0.0, True,
                scale=scale)
        cq, ck, mq, mk, seed, off = extras[1:]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, off, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True, scale=scale)


# ---- packed rows: causal attention inside each segment -----------------------------------------
class Segments:
    """The segments of packed rows (draftport.data.packing): cu_seqlens over the B*T token-major rows
    (host ints) and the longest; the device copies are made once and reused by every TTT step."""

    def __init__(self, cu_seqlens: list[int], max_seqlen: int, cu_tensor: torch.Tensor | None = None):
        self.cu = [int(c) for c in cu_seqlens]
        self.max_len = int(max_seqlen)
        self._dev = {}
        if cu_tensor is not None:   # already on its device (PackedBatch.to): no copy per step
            self._dev[("cu", str(cu_tensor.device))] = cu_tensor.to(torch.int32)

    def cu_dev(self, device):
        key = ("cu", str(device))
        if key not in self._dev:
            self._dev[key] = torch.tensor(self.cu, dtype=torch.int32, device=device)
        return self._dev[key]

    def padded_index(self, device):
        """Token-major row -> segment * max_len + position in it (a padded lse layout)."""
        key = ("pad", str(device))
        if key not in self._dev:
            idx = torch.cat([torch.arange(e - s) + i * self.max_len
                             for i, (s, e) in enumerate(zip(self.cu[:-1], self.cu[1:]))])
            self._dev[key] = idx.to(device)
        return self._dev[key]


def _tok(x):
    """[B, h, T, ...] -> token-major [B*T, h, ...] (a view when x is laid out as [B, T, h, ...])."""
    B, h, T = x.shape[:3]
    return x.transpose(1, 2).reshape(B * T, h, *x.shape[3:])


def _untok(x, B: int, T: int):
    return x.view(B, T, *x.shape[1:]).transpose(1, 2)


def _lse_to_tok(lse, seg: Segments, n: int):
    """The varlen kernel's log-sum-exp -> [N, h] (it is [h, N], or [segments, h, max_len] padded)."""
    if lse.dim() == 2:
        return lse.t()
    S, h, L = lse.shape
    return lse.permute(0, 2, 1).reshape(S * L, h).index_select(0, seg.padded_index(lse.device))


def _lse_from_tok(lse_tok, like, seg: Segments):
    if like.dim() == 2:
        return lse_tok.t().contiguous()
    S, h, L = like.shape
    out = torch.zeros(S * L, h, dtype=lse_tok.dtype, device=lse_tok.device)
    out.index_copy_(0, seg.padded_index(lse_tok.device), lse_tok)
    return out.view(S, L, h).permute(0, 2, 1).contiguous()


def _seg_view(t, s: int, e: int):
    """Rows s..e of a token-major [N, h, d] tensor as [1, h, e-s, d]: a view on CUDA (the dense
    kernels take the token-major strides), a contiguous copy for the CPU kernels."""
    v = t[s:e].transpose(0, 1)[None]
    return v if t.is_cuda else v.contiguous()


def _seg_fwd(q, k, v, seg: Segments, scale):
    """Causal attention inside each segment, token-major: q/k/v [N, h, d] -> (o [N, h, d],
    lse [N, h] fp32, extras)."""
    if q.is_cuda and packed_attention() == "varlen":
        cu = seg.cu_dev(q.device)
        if _BACKEND["dense"] == "fa4":   # its lse is [h, N]
            r = _fa4()[0](q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=seg.max_len,
                          max_seqlen_k=seg.max_len, softmax_scale=scale, causal=True, return_lse=True)
            return r[0], r[1].t(), ("fa4",)
        r = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, seg.max_len, seg.max_len, 0.0, True,
                                                    False, scale=scale)
        lse = r[1]
        return r[0], _lse_to_tok(lse, seg, q.shape[0]), (lse, r[2], r[3])
    # the dense kernel once per segment (_flash_fwd: the CPU kernel, or flash/cuDNN on CUDA)
    N, h, d = q.shape
    o, lse, each = torch.empty_like(q), None, []
    for s, e in zip(seg.cu[:-1], seg.cu[1:]):
        os_, ls, ex = _flash_fwd(_seg_view(q, s, e), _seg_view(k, s, e), _seg_view(v, s, e), scale)
        if lse is None:
            lse = torch.empty(N, h, dtype=ls.dtype, device=q.device)
        o[s:e] = os_[0].transpose(0, 1)
        lse[s:e] = ls[0].t()
        each.append(ex)
    return o, lse, ("segments", each)


def _seg_bwd(do, q, k, v, o, lse, seg: Segments, scale, extras):
    if isinstance(extras[0], str) and extras[0] == "fa4":
        cu = seg.cu_dev(q.device)
        do = do if do.stride(-1) == 1 else do.contiguous()
        g = _fa4()[1](q, k, v, o, do, lse.t().contiguous(), scale, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                      max_seqlen_q=seg.max_len, max_seqlen_k=seg.max_len)
        return g[0], g[1], g[2]
    if not isinstance(extras[0], str):   # flash varlen (CUDA): (its lse, rng state, unused)
        like, rng, unused = extras
        cu = seg.cu_dev(q.device)
        do = do if do.stride(-1) == 1 else do.contiguous()
        return torch.ops.aten._flash_attention_backward(
            do, q, k, v, o, _lse_from_tok(lse, like, seg), cu, cu, seg.max_len, seg.max_len, 0.0, True,
            rng, unused, scale=scale)
    do = do if do.stride(-1) == 1 else do.contiguous()
    lse_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    for (s, e), ex in zip(zip(seg.cu[:-1], seg.cu[1:]), extras[1]):
        ts = [_seg_view(t, s, e) for t in (do, q, k, v, o)]
        ls = lse[s:e].t()[None].contiguous().to(lse_dtype)
        g = _flash_bwd(*ts, ls, scale, ex)
        for out, gi in zip((dq, dk, dv), g):
            out[s:e] = gi[0].transpose(0, 1)
    return dq, dk, dv


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


def _diag_grads(do, q, o, lse, ks, vs, scale: float, dq_causal, aks=(), avs=()):
    """Gradients through the diagonal keys, given the merged output and log-sum-exp; dq adds
    the causal part's dq_causal. aks/avs (one per key, or empty): the gradients those keys got
    from later steps, added in (in at least fp32, one rounding) so that the sum leaves as one
    tensor."""
    acc = torch.promote_types(q.dtype, torch.float32)             # fp32 (fp64 stays fp64)
    dof, qf = do.to(acc), q.to(acc)
    D = (dof * o.to(acc)).sum(-1)                                  # [B,h,T]
    dq = dq_causal.to(acc)
    dks, dvs = [], []
    for i, (k, v) in enumerate(zip(ks, vs)):
        kf = k.to(acc)
        p = torch.exp((qf * kf).sum(-1) * scale - lse)             # final softmax weight
        dv = p[..., None] * dof
        ds = p * ((dof * v.to(acc)).sum(-1) - D) * scale
        dq = dq + ds[..., None] * kf
        dk = ds[..., None] * qf
        if aks:
            dk, dv = dk + aks[i].to(acc), dv + avs[i].to(acc)
        dvs.append(dv.to(v.dtype))
        dks.append(dk.to(k.dtype))
    return dq.to(q.dtype), dks, dvs


# ---- the MLP and the linears ------------------------------------------------------------------
def _swiglu(g, u):
    return (F.silu(g.float()) * u.float()).to(g.dtype)


def _swiglu_grads(da, g, u):
    return _swiglu_grads_act(da, g, u, act=False)


def _swiglu_grads_act(da, g, u, act: bool = True):
    """(dg, du) of silu(g) * u given its gradient da, and (act) the product itself, as _swiglu
    computes it in forward (the down projection's weight-gradient operand), from one read of g
    and u."""
    gf, uf, daf = g.float(), u.float(), da.float()
    sg = torch.sigmoid(gf)
    silu = gf * sg
    dg, du = (daf * uf * sg * (1 + gf * (1 - sg))).to(g.dtype), (daf * silu).to(u.dtype)
    return (dg, du, (F.silu(gf) * uf).to(g.dtype)) if act else (dg, du)


def _shift_sum(gs, fill_grad):
    """d(table) from the gradients of its slices: gs[j] [B, T, n] is the gradient of rows
    j..j+T-1; fill_grad (or None) that of the last row. -> [B, T-1+len(gs), n], in one pass."""
    k, acc = len(gs), torch.promote_types(gs[0].dtype, torch.float32)   # summed in at least fp32
    out = F.pad(gs[0].to(acc), (0, 0, 0, k - 1))
    for j in range(1, k):
        out = out + F.pad(gs[j].to(acc), (0, 0, j, k - 1 - j))
    if fill_grad is not None:
        out = out + F.pad(fill_grad.to(acc), (0, 0, out.shape[1] - 1, 0))
    return out.to(gs[0].dtype)


# Swapped for torch.compile'd versions by compile_kernels() (diag kernels: one graph per number
# of diagonal keys).
_KERNELS = {"merge": _diag_merge, "grads": _diag_grads, "swiglu": _swiglu, "swiglu_grads": _swiglu_grads,
            "swiglu_grads_act": _swiglu_grads_act, "shift_sum": _shift_sum}


def allow_recompiles(n: int = 64) -> None:
    """Let a compiled function hold up to n graphs (one per number of diagonal keys, per
    parameter size, ...) before dynamo gives up on it (its default is 8)."""
    import torch._dynamo
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))


# Inductor options for every region and kernel draftport compiles (drafter.compile_regions,
# compile_kernels, ttt.compile_loss_kernels); set before they compile. The default: inductor's
# coordinate-descent tuning (each Triton kernel's block sizes searched when it compiles). On an
# H200, Kimi size, TTT 7, the whole training step against inductor's defaults, 3 alternated
# rounds: x1.005 / x0.999 (lm_head frozen / trained) at T 4,096 and x1.006 / x1.006 on the
# bench's packed mix, each side's blocks apart there; T 2,048 inside its 4% block spread
# (benchmarks/results/2026-12-03-h200-probe-tuning*.json). Its cost: the first steps of each
# shape take longer to compile (~+100 s at one length, ~+200 s over the mix's shapes there).
DEFAULT_COMPILE_OPTIONS = {"coordinate_descent_tuning": True}
_COMPILE_OPTIONS: dict = dict(DEFAULT_COMPILE_OPTIONS)


def set_compile_options(options: dict | None) -> None:
    """Inductor options (torch.compile(options=...)) for what compiles after this call; None or
    {}: inductor's defaults."""
    _COMPILE_OPTIONS.clear()
    _COMPILE_OPTIONS.update(options or {})


def compiled(fn, **kw):
    """torch.compile(fn, **kw) with the options set_compile_options gave (if any)."""
    if _COMPILE_OPTIONS and "options" not in kw:
        kw["options"] = dict(_COMPILE_OPTIONS)
    return torch.compile(fn, **kw)


def compile_kernels():
    """Compile the elementwise diagonal-key kernels (GPU path; call once)."""
    allow_recompiles()
    for name, fn in (("merge", _diag_merge), ("grads", _diag_grads), ("swiglu", _swiglu),
                     ("swiglu_grads", _swiglu_grads), ("swiglu_grads_act", _swiglu_grads_act),
                     ("shift_sum", _shift_sum)):
        # the first shape compiles static; a second length makes T symbolic (one more compile), so
        # variable-length batches (padded to their longest, or packed) do not recompile per length
        _KERNELS[name] = compiled(fn, dynamic=None)


# ---- weight gradients on a second stream (opt-in) ------------------------------------------------
# The in-place weight-gradient GEMMs (accumulate_grad*) depend on nothing that follows them in
# backward but the optimizer: on a side stream they can run beside the input-gradient chain
# (its GEMMs, attention backward and elementwise kernels). The side stream starts after the work
# queued so far on the stream backward runs on, the tensors it reads are recorded on it (the
# caching allocator keeps them until its kernels are done), and the end of that backward pass
# makes the main stream wait for it (an autograd final callback), so whatever reads .grad after
# backward() sees the sums complete.
_WGRAD = {"on": False, "streams": {}, "joins": set()}


def set_wgrad_stream(on: bool) -> None:
    """Run the in-place weight-gradient GEMMs on a second CUDA stream (single process; a no-op
    on the CPU). Off by default: on one H200 it gave +0.7-1.5% at T 2,048 and nothing at 4,096
    or on the packed length mix (benchmarks/probe_wgrad_stream_h200.py)."""
    _WGRAD["on"] = bool(on)


def _join(key, main) -> None:
    main.wait_stream(_WGRAD["streams"][key[0]])
    _WGRAD["joins"].discard(key)


@contextlib.contextmanager
def wgrad_side(*reads: torch.Tensor):
    """Run the block on the weight-gradient stream when it is on (else where it is): `reads` are
    the tensors made on the main stream that the block reads."""
    dev = reads[0].device
    if not (_WGRAD["on"] and dev.type == "cuda"):
        yield
        return
    main = torch.cuda.current_stream(dev)
    side = _WGRAD["streams"].get(dev)
    if side is None:
        side = _WGRAD["streams"][dev] = torch.cuda.Stream(dev)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield
    for t in reads:
        t.record_stream(side)
    task = torch._C._current_graph_task_id()
    if task < 0:          # outside a backward pass: join now
        main.wait_stream(side)
        return
    key = (dev, task, main.cuda_stream)   # one join per backward pass (and stream it ran on)
    if key not in _WGRAD["joins"]:
        _WGRAD["joins"].add(key)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _join(key, main))


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
            if ctx.accum:
                with wgrad_side(dy, x):
                    accumulate_grad(w, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype))
            else:
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
                dw = (dy2.t() @ x2).to(w.dtype)
        return dx, dw, None


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
        return tuple(F.linear(x, w if cols is None else w[:, cols[0]:cols[1]]) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        cols = ctx.cols
        blocks = [w if cols is None else w[:, cols[0]:cols[1]] for w in ws]
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
                with wgrad_side(dy, x):
                    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
                    if cols is None:
                        accumulate_grad(w, dy2, x2)
                    else:
                        accumulate_grad_cols(w, cols[0], cols[1], dy2, x2)
            else:
                dw = (dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(dy.dtype)).to(w.dtype)
                if cols is not None:
                    full = torch.zeros_like(w)
                    full[:, cols[0]:cols[1]] = dw
                    dw = full
                grads[i] = dw
        return (dx, None, None, *grads)


def multi_linear(x, ws, cols: tuple[int, int] | None, accum: bool) -> tuple:
    """x @ w[:, cols]^T (cols None: all of w) for each w in ws, through _MultiLinear (the input
    gradient summed inside the GEMMs)."""
    return _MultiLinear.apply(x, cols, accum, *ws)


def accumulate_grad_cat(ws, dy2: torch.Tensor, x2: torch.Tensor) -> None:
    """accumulate_grad for weights used as one concatenated GEMM (rows of ws stacked): their
    gradients are row slices (views) of one buffer, summed into in place by the GEMM."""
    if ws[0].grad is None:
        buf = dy2.t() @ x2
        off = 0
        for w in ws:
            w.grad = buf[off:off + w.shape[0]].to(w.dtype) if buf.dtype != w.dtype else buf[off:off + w.shape[0]]
            off += w.shape[0]
        return
    base = ws[0].grad._base
    same = (base is not None and base.dtype == dy2.dtype and all(w.grad._base is base for w in ws)
            and ws[0].grad.data_ptr() == base.data_ptr())
    if same:
        base.addmm_(dy2.t(), x2)
        return
    dw = dy2.t() @ x2
    off = 0
    for w in ws:
        w.grad.add_(dw[off:off + w.shape[0]])
        off += w.shape[0]


class _CatLinear(torch.autograd.Function):
    """y = x @ cat(ws)^T as one GEMM (wcat: the concatenation, made once per unroll by the
    caller); the weight gradient is one GEMM too, split (or, with accum, summed in place into
    row views of one buffer: accumulate_grad_cat)."""

    @staticmethod
    def forward(ctx, x, wcat, accum: bool, *ws):
        ctx.save_for_backward(x, wcat)
        ctx.accum, ctx.ws = accum, ws
        return F.linear(x, wcat)

    @staticmethod
    def backward(ctx, dy):
        x, wcat = ctx.saved_tensors
        dx = (dy @ wcat.to(dy.dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grads = [None] * len(ctx.ws)
        if any(ctx.needs_input_grad[3:]):
            if ctx.accum:
                with wgrad_side(dy, x):
                    accumulate_grad_cat(ctx.ws, dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype))
            else:
                dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1]).to(dy.dtype)
                dw = dy2.t() @ x2
                off = 0
                for i, w in enumerate(ctx.ws):
                    grads[i] = dw[off:off + w.shape[0]].to(w.dtype)
                    off += w.shape[0]
        return (dx, None, None, *grads)


def cat_linear(x, wcat, ws, accum: bool):
    """x @ cat(ws)^T through _CatLinear (wcat = torch.cat(ws), detached)."""
    return _CatLinear.apply(x, wcat, accum, *ws)


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
        if ctx.needs_input_grad[2] and not (_WGRAD["on"] and ctx.accum and dy.is_cuda):
            # the product recomputed by the kernel that computes dg and du (it reads g and u anyway)
            dg, du, a = _KERNELS["swiglu_grads_act"](da, g, u)
            a2, dy2 = a.reshape(-1, g.shape[-1]).to(dy.dtype), dy.reshape(-1, dy.shape[-1])
            if ctx.accum:
                accumulate_grad(w, dy2, a2)
            else:
                dw = (dy2.t() @ a2).to(w.dtype)
            return dg, du, dw, None
        if ctx.needs_input_grad[2]:
            # with accum, the product's recompute goes with its GEMM (on the side stream when on)
            with (wgrad_side(dy, g, u) if ctx.accum else contextlib.nullcontext()):
                a2 = _KERNELS["swiglu"](g, u).reshape(-1, g.shape[-1]).to(dy.dtype)
                dy2 = dy.reshape(-1, dy.shape[-1])
                if ctx.accum:
                    accumulate_grad(w, dy2, a2)
                else:
                    dw = (dy2.t() @ a2).to(w.dtype)
        dg, du = _KERNELS["swiglu_grads"](da, g, u)
        return dg, du, dw, None


class _ShiftedSlices(torch.autograd.Function):
    """The `steps` slices y[:, j:j+T] of one table (and, with fill, its last row y[:, -1:]) as
    views. Their gradients meet in one pass (_shift_sum) instead of autograd's per slice: a
    zeroed table-sized buffer, a copy into it and an add into the running sum, seven times."""

    @staticmethod
    def forward(ctx, y, T: int, steps: int, fill: bool):
        ctx.steps, ctx.fill = steps, fill
        outs = [y[:, j:j + T] for j in range(steps)]
        if fill:
            outs.append(y[:, -1:])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *gs):   # autograd hands zeros for an unused slice (materialize_grads)
        fill_grad = gs[ctx.steps] if ctx.fill else None
        return _KERNELS["shift_sum"](list(gs[:ctx.steps]), fill_grad), None, None, None


def shifted_slices(y, T: int, steps: int, fill: bool = False) -> tuple:
    """y[:, j:j+T] for j < steps (and y[:, -1:] with fill): slices of the embedding half's table
    whose gradients are summed in one pass (see _ShiftedSlices)."""
    return _ShiftedSlices.apply(y, T, steps, fill)


# ---- the keys' gradients across TTT steps ------------------------------------------------------
# Step i's keys and values are read by the attention of steps i..K-1 (the step-0 ones by every
# step): autograd would get one gradient per reader and add them, a [B, h, T, d] add each (42 at
# TTT 7). Their readers' backward runs in reverse step order (step j's attention input depends on
# step j-1's output), so step i's own attention is always the last to run: the later steps leave
# their part in a per-unroll accumulator (KVGradSum) and hand autograd no gradient for those keys;
# the diagonal part adds the sum so far inside its compiled kernel, and step i's backward hands
# autograd the whole sum, once.
_KVSUM = {"on": True}


def set_kv_grad_sum(on: bool) -> None:
    """Sum the keys' and values' gradients across TTT steps in a per-unroll accumulator (default
    on) instead of one autograd add per reading step."""
    _KVSUM["on"] = bool(on)


class KVGradSum:
    """The gradients the keys and values of one unroll's steps have had from the steps after
    them so far: index i -> (dk, dv) in the attention's working layout. Tied to the backward pass
    that fills it: a pass that stops before it reached step i (autograd.grad of an intermediate)
    leaves no sum for the next one."""

    def __init__(self):
        self.task, self.sums = None, {}

    def take(self, i: int):
        """(dk, dv) summed for step i's keys so far (None, None if none), removed."""
        self._check()
        return self.sums.pop(i, (None, None))

    def put(self, i: int, dk, dv) -> None:
        self._check()
        self.sums[i] = (dk, dv)

    def _check(self):
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.sums = task, {}


def kv_grad_sum():
    """A new accumulator for one unroll, or None when the lever is off."""
    return KVGradSum() if _KVSUM["on"] else None


# ---- fused TTT attention, as one autograd function ---------------------------------------------
class _TTTAttention(torch.autograd.Function):
    """The step-0 causal part: seg None, dense causal over each row (flash, cudnn or fa4, [B, h, T, d]);
    seg, causal inside each segment of packed rows, token-major ([B*T, h, d]). The diagonal keys
    are merged (and their gradients computed) token-major either way: with q/k/v laid out
    token-major (drafter.heads_rope_tok), which the dense kernels' outputs and gradients follow,
    every change of layout is a view. The output is a [B, h, T, d] view of a token-major tensor.
    acc (a KVGradSum, or None): the keys' gradients summed across steps (the step reading keys
    1..j adds its part for keys 0..j-1 there and hands autograd the sums for its own keys j only)."""

    @staticmethod
    def forward(ctx, scale, seg, acc, q, k0, v0, *kv):
        B, h, T, d = q.shape
        ks, vs = kv[0::2], kv[1::2]
        lse_t, q_t = None, _tok(q)
        if seg is not None:
            o_t, lse_t, extras = _seg_fwd(q_t, _tok(k0), _tok(v0), seg, scale)
        else:
            o, lse, extras = _flash_fwd(q, k0, v0, scale)
            o_t = _tok(o)
        if ks:
            if lse_t is None:
                lse_t = lse.transpose(1, 2).reshape(B * T, h)
            o_t, lse_t = _KERNELS["merge"](q_t, o_t, lse_t, [_tok(k) for k in ks], [_tok(v) for v in vs], scale)
            lse_t = lse_t.contiguous()
            if seg is None:   # the dense backward takes the merged output and lse in its layout
                o, lse = _untok(o_t, B, T), lse_t.view(B, T, h).permute(0, 2, 1).contiguous()
        if seg is not None:
            o, lse = o_t, lse_t
        ctx.save_for_backward(q, k0, v0, o, lse, lse_t, *kv)
        ctx.scale, ctx.extras, ctx.seg, ctx.shape, ctx.acc = scale, extras, seg, (B, T), acc
        return _untok(o_t, B, T)

    @staticmethod
    def backward(ctx, do):
        q, k0, v0, o, lse, lse_t, *kv = ctx.saved_tensors
        seg, acc = ctx.seg, ctx.acc
        B, T = ctx.shape
        do_t, q_t = _tok(do), _tok(q)
        if seg is not None:
            do_t = do_t.contiguous() if do_t.stride(-1) != 1 else do_t
            dq_t, dk0, dv0 = _seg_bwd(do_t, q_t, _tok(k0), _tok(v0), o, lse, seg, ctx.scale, ctx.extras)
        else:
            do = do.contiguous() if do.stride(-1) != 1 else do
            dq, dk0, dv0 = _flash_bwd(do, q, k0, v0, o, lse, ctx.scale, ctx.extras)
            dq_t = _tok(dq)
        ks, vs = kv[0::2], kv[1::2]
        j = len(ks)
        if acc is not None:   # step 0's keys: their sum so far, plus this step's part
            sk, sv = acc.take(0)
            if sk is not None:
                dk0, dv0 = sk + dk0, sv + dv0
        grads = []
        if ks:
            prior = [acc.take(i) for i in range(1, j + 1)] if acc is not None else []
            have = [p[0] is not None for p in prior]
            aks = avs = ()
            if have and all(have):   # a later step has run (none has before the last step's backward)
                aks, avs = [p[0] for p in prior], [p[1] for p in prior]
            o_t = o if seg is not None else _tok(o)
            dq_t, dks, dvs = _KERNELS["grads"](do_t, q_t, o_t, lse_t, [_tok(k) for k in ks],
                                               [_tok(v) for v in vs], ctx.scale, dq_t, aks, avs)
            if any(have) and not all(have):   # not from unroll's step order: add what there is
                dks = [dk if p[0] is None else dk + p[0] for dk, p in zip(dks, prior)]
                dvs = [dv if p[1] is None else dv + p[1] for dv, p in zip(dvs, prior)]
            for dk, dv in zip(dks, dvs):
                grads += [dk, dv]
        dk0_out, dv0_out = dk0, dv0
        if acc is not None:   # keys 0..j-1 are read again by earlier steps: keep their sums
            if j > 0:
                acc.put(0, dk0, dv0)
                dk0_out = dv0_out = None
            for i in range(1, j):
                acc.put(i, grads[2 * (i - 1)], grads[2 * (i - 1) + 1])
                grads[2 * (i - 1)] = grads[2 * (i - 1) + 1] = None
        if seg is not None:
            dk0_out, dv0_out = (None if g is None else _untok(g, B, T) for g in (dk0_out, dv0_out))
        grads = [None if g is None else _untok(g, B, T) for g in grads]
        return (None, None, None, _untok(dq_t, B, T), dk0_out, dv0_out, *grads)


def fused_attention_supported(q: torch.Tensor) -> bool:
    return (not q.is_cuda) or q.dtype in (torch.float16, torch.bfloat16)


def ttt_attention(q, cache_k, cache_v, scale: float, segments: Segments | None = None,
                  acc: KVGradSum | None = None):
    """Fused TTT attention: the same function as Attention.attend_core (right padding; with
    segments, none across the segments of packed rows). acc: one KVGradSum shared by the steps
    of one unroll, called in step order (cache_k[j] made by step j). -> [B,T,h*d]"""
    kv = [t for pair in zip(cache_k[1:], cache_v[1:]) for t in pair]
    o = _TTTAttention.apply(scale, segments, acc, q, cache_k[0], cache_v[0], *kv)
    B, h, T, d = o.shape
    return o.transpose(1, 2).reshape(B, T, h * d)


# ---- rows of a step by index (the unroll's live rows, the loss's counted rows) -----------------
class _SelectRows(torch.autograd.Function):
    """x [B, T, *rest] -> its flattened rows idx, as [1, n, *rest] (idx unique); the gradient goes
    back to those rows, zeros elsewhere (index_copy: no atomics, exact)."""

    @staticmethod
    def forward(ctx, x, idx):
        ctx.shape = x.shape
        ctx.save_for_backward(idx)
        B, T = x.shape[:2]
        return x.reshape(B * T, *x.shape[2:]).index_select(0, idx).unsqueeze(0)

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


# ---- what drafter.py calls on its fused path ------------------------------------------------------
def fused_linear(x, w, accum: bool):
    """x @ w^T through _Linear (with accum, w's gradient summed in place into w.grad)."""
    return _Linear.apply(x, w, accum)


def swiglu_down(g, u, w, accum: bool):
    """down(silu(g) * u) through _SwiGLUDown (g and u kept, the product recomputed in backward)."""
    return _SwiGLUDown.apply(g, u, w, accum)
