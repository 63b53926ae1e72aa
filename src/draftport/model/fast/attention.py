"""Fused TTT attention: the function of `Attention.attend_core` without a [T, T] tensor.

Step j's row p sees the step-0 keys of rows <= p (causal) and its own keys from steps 1..j
(diagonal). The step-0 causal part runs through a flash-style kernel (FastPath.attention: torch's
FlashAttention 2, cuDNN's fused attention or FlashAttention-4 on CUDA; torch's CPU flash kernel on
the CPU), which also returns its log-sum-exp; the few diagonal keys are merged by log-sum-exp
(fp32). Its backward calls the kernel's backward with the *merged* output and log-sum-exp (the
ring-attention identity: dS = P_final * (dP - rowsum(dO * O_final)) per key block). It assumes
right padding (a valid row's earlier rows are valid), as `data.collate` pads.

Packed rows (draftport.data.packing): the causal part runs inside each sample (Segments), by the
kernel's variable-length form over cu_seqlens or by the dense kernel once per sample
(FastPath.packed), in a token-major layout [B*T, h, d] with the log-sum-exp as [B*T, h]. The
diagonal merge and its gradients run token-major on both paths: q/k/v come token-major from the
drafter (a [B, h, T, d] view of [B, T, h, d]) and the dense kernels keep that layout in their
outputs and gradients, so no step copies to or from the [B, T, h*d] GEMM layout. The keys'
gradients across TTT steps can be summed in one accumulator per unroll (KVGradSum).
"""

from __future__ import annotations

import functools

import torch

from draftport.model.fast.path import FastPath


# ---- the causal part's kernels ------------------------------------------------------------------
@functools.cache
def _fa4():
    """FlashAttention-4's forward and backward (flash_attn.cute), imported at first use: a
    pre-release package for Hopper and Blackwell GPUs only."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except ImportError as e:
        raise RuntimeError(
            f"attention backend fa4: FlashAttention-4 is not importable ({e}); "
            "pip install --pre flash-attn-4 (Hopper or Blackwell GPUs)"
        ) from None
    return _flash_attn_fwd, _flash_attn_bwd


def _flash_fwd(q, k, v, scale, attention: str):
    """Causal attention over the step-0 keys -> (out [B,h,T,d], lse [B,h,T] fp32, extras for the
    backward). attention: the CUDA kernel (FastPath.attention)."""
    if q.is_cuda:
        if attention == "fa4":  # it takes [B, T, h, d]: the token-major tensors q/k/v view
            r = _fa4()[0](
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                softmax_scale=scale,
                causal=True,
                return_lse=True,
            )
            return r[0].transpose(1, 2), r[1], ("fa4",)
        if attention == "cudnn":
            r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
            lse = r[1]
            extras = ("cudnn", tuple(lse.shape), r[6], r[7], r[2], r[3], r[4], r[5])
            return r[0], lse.reshape(q.shape[:-1]), extras
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], ("flash",) + tuple(r[2:8])
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return o, lse, ()


def _cudnn_stats(lse, shape):
    """The log-sum-exp as cuDNN's backward takes its Stats: [B, h, T, 1] with every stride spelled
    out (h*T, T, 1, 1). A reshape of a row with T = 1 (a one-token segment of packed rows) keeps
    whatever strides its size-1 dims had, and cuDNN's frontend refuses a last stride other than 1."""
    B, h, T = shape[0], shape[1], shape[2]
    out = torch.empty_strided((B, h, T, 1), (h * T, T, 1, 1), dtype=lse.dtype, device=lse.device)
    out.copy_(lse.reshape(B, h, T, 1))
    return out if len(shape) == 4 else out.view(shape)


def _flash_bwd(do, q, k, v, o, lse, scale, extras):
    if q.is_cuda:
        if extras[0] == "fa4":
            g = _fa4()[1](*(t.transpose(1, 2) for t in (q, k, v, o, do)), lse.contiguous(), scale, True)
            return tuple(t.transpose(1, 2) for t in g[:3])
        if extras[0] == "cudnn":
            _, shape, seed, off, cq, ck, mq, mk = extras
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o, _cudnn_stats(lse, shape), seed, off, None, cq, ck, mq, mk, 0.0, True, scale=scale
            )
        cq, ck, mq, mk, seed, off = extras[1:]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, off, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, o, lse, 0.0, True, scale=scale
    )


# ---- packed rows: causal attention inside each segment -----------------------------------------
class Segments:
    """The segments of packed rows (draftport.data.packing): cu_seqlens over the B*T token-major rows
    (host ints) and the longest; the device copies are made once and reused by every TTT step."""

    def __init__(self, cu_seqlens: list[int], max_seqlen: int, cu_tensor: torch.Tensor | None = None):
        self.cu = [int(c) for c in cu_seqlens]
        self.max_len = int(max_seqlen)
        self._dev = {}
        if cu_tensor is not None:  # already on its device (PackedBatch.to): no copy per step
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
            idx = torch.cat(
                [torch.arange(e - s) + i * self.max_len for i, (s, e) in enumerate(zip(self.cu[:-1], self.cu[1:]))]
            )
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


def _seg_fwd(q, k, v, seg: Segments, scale, fast: FastPath):
    """Causal attention inside each segment, token-major: q/k/v [N, h, d] -> (o [N, h, d],
    lse [N, h] fp32, extras)."""
    if q.is_cuda and fast.packed == "varlen":
        cu = seg.cu_dev(q.device)
        if fast.attention == "fa4":  # its lse is [h, N]
            r = _fa4()[0](
                q,
                k,
                v,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=seg.max_len,
                max_seqlen_k=seg.max_len,
                softmax_scale=scale,
                causal=True,
                return_lse=True,
            )
            return r[0], r[1].t(), ("fa4",)
        r = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, seg.max_len, seg.max_len, 0.0, True, False, scale=scale
        )
        lse = r[1]
        return r[0], _lse_to_tok(lse, seg, q.shape[0]), (lse, r[2], r[3])
    # the dense kernel once per segment (_flash_fwd: the CPU kernel, or flash/cuDNN on CUDA)
    N, h, d = q.shape
    o, lse, each = torch.empty_like(q), None, []
    for s, e in zip(seg.cu[:-1], seg.cu[1:]):
        os_, ls, ex = _flash_fwd(_seg_view(q, s, e), _seg_view(k, s, e), _seg_view(v, s, e), scale, fast.attention)
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
        g = _fa4()[1](
            q,
            k,
            v,
            o,
            do,
            lse.t().contiguous(),
            scale,
            True,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=seg.max_len,
            max_seqlen_k=seg.max_len,
        )
        return g[0], g[1], g[2]
    if not isinstance(extras[0], str):  # flash varlen (CUDA): (its lse, rng state, unused)
        like, rng, unused = extras
        cu = seg.cu_dev(q.device)
        do = do if do.stride(-1) == 1 else do.contiguous()
        return torch.ops.aten._flash_attention_backward(
            do,
            q,
            k,
            v,
            o,
            _lse_from_tok(lse, like, seg),
            cu,
            cu,
            seg.max_len,
            seg.max_len,
            0.0,
            True,
            rng,
            unused,
            scale=scale,
        )
    do = do if do.stride(-1) == 1 else do.contiguous()
    lse_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    for (s, e), ex in zip(zip(seg.cu[:-1], seg.cu[1:]), extras[1]):
        ts = [_seg_view(t, s, e) for t in (do, q, k, v, o)]
        # a fresh [1, h, L] with standard strides: a contiguous() of a one-token segment's
        # transposed view keeps its odd strides, which the CUDA kernels read literally
        ls = torch.empty((1, lse.shape[1], e - s), dtype=lse_dtype, device=lse.device)
        ls[0].copy_(lse[s:e].t())
        g = _flash_bwd(*ts, ls, scale, ex)
        for out, gi in zip((dq, dk, dv), g):
            out[s:e] = gi[0].transpose(0, 1)
    return dq, dk, dv


# ---- the diagonal keys: merged by log-sum-exp ---------------------------------------------------
def diag_merge(q, o0, lse0, ks, vs, scale: float):
    """Merge the causal result (o0, lse0) with the row's own keys ks/vs by log-sum-exp (fp32)."""
    qf = q.float()
    s = [(qf * k.float()).sum(-1) * scale for k in ks]  # [B,h,T] each
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


def diag_grads(do, q, o, lse, ks, vs, scale: float, dq_causal, aks=(), avs=()):
    """Gradients through the diagonal keys, given the merged output and log-sum-exp; dq adds
    the causal part's dq_causal. aks/avs (one per key, or empty): the gradients those keys got
    from later steps, added in (in at least fp32, one rounding) so that the sum leaves as one
    tensor."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 (fp64 stays fp64)
    dof, qf = do.to(acc), q.to(acc)
    D = (dof * o.to(acc)).sum(-1)  # [B,h,T]
    dq = dq_causal.to(acc)
    dks, dvs = [], []
    for i, (k, v) in enumerate(zip(ks, vs)):
        kf = k.to(acc)
        p = torch.exp((qf * kf).sum(-1) * scale - lse)  # final softmax weight
        dv = p[..., None] * dof
        ds = p * ((dof * v.to(acc)).sum(-1) - D) * scale
        dq = dq + ds[..., None] * kf
        dk = ds[..., None] * qf
        if aks:
            dk, dv = dk + aks[i].to(acc), dv + avs[i].to(acc)
        dvs.append(dv.to(v.dtype))
        dks.append(dk.to(k.dtype))
    return dq.to(q.dtype), dks, dvs


# ---- the keys' gradients across TTT steps ------------------------------------------------------
# Step i's keys and values are read by the attention of steps i..K-1 (the step-0 ones by every
# step): autograd would get one gradient per reader and add them, a [B, h, T, d] add each (42 at
# TTT 7). Their readers' backward runs in reverse step order (step j's attention input depends on
# step j-1's output), so step i's own attention is always the last to run: the later steps leave
# their part in a per-unroll accumulator (KVGradSum) and hand autograd no gradient for those keys;
# the diagonal part adds the sum so far inside its kernel, and step i's backward hands autograd
# the whole sum, once.
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


# ---- fused TTT attention, as one autograd function ---------------------------------------------
class _TTTAttention(torch.autograd.Function):
    """The step-0 causal part: seg None, dense causal over each row ([B, h, T, d]); seg, causal
    inside each segment of packed rows, token-major ([B*T, h, d]). The diagonal keys are merged
    (and their gradients computed) token-major either way: with q/k/v laid out token-major
    (Attention.heads_rope_tok), which the dense kernels' outputs and gradients follow, every
    change of layout is a view. The output is a [B, h, T, d] view of a token-major tensor.
    acc (a KVGradSum, or None): the keys' gradients summed across steps (the step reading keys
    1..j adds its part for keys 0..j-1 there and hands autograd the sums for its own keys j only)."""

    @staticmethod
    def forward(ctx, scale, seg, acc, fast, q, k0, v0, *kv):
        B, h, T, d = q.shape
        ks, vs = kv[0::2], kv[1::2]
        lse_t, q_t = None, _tok(q)
        if seg is not None:
            o_t, lse_t, extras = _seg_fwd(q_t, _tok(k0), _tok(v0), seg, scale, fast)
        else:
            o, lse, extras = _flash_fwd(q, k0, v0, scale, fast.attention)
            o_t = _tok(o)
        if ks:
            if lse_t is None:
                lse_t = lse.transpose(1, 2).reshape(B * T, h)
            o_t, lse_t = fast.kernel(diag_merge)(q_t, o_t, lse_t, [_tok(k) for k in ks], [_tok(v) for v in vs], scale)
            lse_t = lse_t.contiguous()
            if seg is None:  # the dense backward takes the merged output and lse in its layout
                o, lse = _untok(o_t, B, T), lse_t.view(B, T, h).permute(0, 2, 1).contiguous()
        if seg is not None:
            o, lse = o_t, lse_t
        ctx.save_for_backward(q, k0, v0, o, lse, lse_t, *kv)
        ctx.scale, ctx.extras, ctx.seg, ctx.shape, ctx.acc, ctx.fast = scale, extras, seg, (B, T), acc, fast
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
        if acc is not None:  # step 0's keys: their sum so far, plus this step's part
            sk, sv = acc.take(0)
            if sk is not None:
                dk0, dv0 = sk + dk0, sv + dv0
        grads = []
        if ks:
            prior = [acc.take(i) for i in range(1, j + 1)] if acc is not None else []
            have = [p[0] is not None for p in prior]
            aks = avs = ()
            if have and all(have):  # a later step has run (none has before the last step's backward)
                aks, avs = [p[0] for p in prior], [p[1] for p in prior]
            o_t = o if seg is not None else _tok(o)
            dq_t, dks, dvs = ctx.fast.kernel(diag_grads)(
                do_t, q_t, o_t, lse_t, [_tok(k) for k in ks], [_tok(v) for v in vs], ctx.scale, dq_t, aks, avs
            )
            if any(have) and not all(have):  # not from unroll's step order: add what there is
                dks = [dk if p[0] is None else dk + p[0] for dk, p in zip(dks, prior)]
                dvs = [dv if p[1] is None else dv + p[1] for dv, p in zip(dvs, prior)]
            for dk, dv in zip(dks, dvs):
                grads += [dk, dv]
        dk0_out, dv0_out = dk0, dv0
        if acc is not None:  # keys 0..j-1 are read again by earlier steps: keep their sums
            if j > 0:
                acc.put(0, dk0, dv0)
                dk0_out = dv0_out = None
            for i in range(1, j):
                acc.put(i, grads[2 * (i - 1)], grads[2 * (i - 1) + 1])
                grads[2 * (i - 1)] = grads[2 * (i - 1) + 1] = None
        if seg is not None:
            dk0_out, dv0_out = (None if g is None else _untok(g, B, T) for g in (dk0_out, dv0_out))
        grads = [None if g is None else _untok(g, B, T) for g in grads]
        return (None, None, None, None, _untok(dq_t, B, T), dk0_out, dv0_out, *grads)


def fused_attention_supported(q: torch.Tensor) -> bool:
    """The kernels take fp16/bf16 on CUDA, any float dtype on the CPU."""
    return (not q.is_cuda) or q.dtype in (torch.float16, torch.bfloat16)


def ttt_attention(
    q,
    cache_k,
    cache_v,
    scale: float,
    segments: Segments | None = None,
    acc: KVGradSum | None = None,
    fast: FastPath = FastPath(),
):
    """Fused TTT attention: the same function as Attention.attend_core (right padding; with
    segments, none across the segments of packed rows). acc: one KVGradSum shared by the steps
    of one unroll, called in step order (cache_k[j] made by step j). -> [B,T,h*d]"""
    kv = [t for pair in zip(cache_k[1:], cache_v[1:]) for t in pair]
    o = _TTTAttention.apply(scale, segments, acc, fast, q, cache_k[0], cache_v[0], *kv)
    B, h, T, d = o.shape
    return o.transpose(1, 2).reshape(B, T, h * d)
