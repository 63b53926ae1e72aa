"""The drafter's unroll on the fast path: the function of Eagle3Drafter.unroll over the same
weights, computed for training on the GPU.

Differences from the reference (the same function each time; tests/model/test_fast_path.py):
- attention: fused TTT attention (draftport.model.fast.attention), no [T, T] mask; right padding
  only; packed rows attend per segment.
- linears: custom autograd functions (draftport.model.fast.linear): q/k/v and gate/up read their
  input once, the MLP keeps only gate/up, weight gradients optionally summed in place
  (FastPath.accumulate_wgrad).
- embed_once (teacher tokens): step j feeds row p the token at p+1+j, so the embedding half of
  q/k/v of every step is a slice of one table computed once per unroll (embedding_table).
- live rows: a row's state at steps >= 1 reaches only that row (its later-step keys are read by
  itself alone), so steps >= 1 may run their GEMMs on the rows some later step still scores
  (`live`, from the fast loss); the attention still runs on the whole batch.
- the elementwise work between the GEMMs runs as regions (input_norms, hidden_half, rope_tables,
  rope_heads, qkv_from_halves, residual_and_norm, output_and_norm), compiled when the FastPath
  compiles: each compiles once and serves every TTT step.

Where the fused attention has no kernel (fp32 on CUDA) the unroll is the reference one.
"""

from __future__ import annotations

import math

import torch

from draftport.model.drafter import Eagle3Drafter, rope_cos_sin, shift
from draftport.model.fast.attention import KVGradSum, Segments, fused_attention_supported, ttt_attention
from draftport.model.fast.linear import (
    fused_linear,
    multi_linear,
    scatter_rows,
    select_rows,
    shifted_slices,
    swiglu_down,
)
from draftport.model.fast.path import FastPath


# ---- the elementwise regions of a step (compiled when the path compiles) -----------------------
def input_norms(d: Eagle3Drafter, tokens, h):
    """Input norms and the [embed | hidden] concat; -> (x [B,T,2H], residual)."""
    L = d.midlayer
    e = L.input_layernorm(d.embed_tokens(tokens).to(h.dtype))
    hn = L.hidden_norm(h)
    return torch.cat([e, hn], dim=-1), (hn if L.norm_before_residual else h)


def embedding_norm(d: Eagle3Drafter, tokens, like):
    """input_layernorm(embed(tokens)) in like's dtype (the embedding half of x)."""
    return d.midlayer.input_layernorm(d.embed_tokens(tokens).to(like.dtype))


def hidden_half(d: Eagle3Drafter, h):
    """The hidden half of x and the residual (x's embedding half comes from the table)."""
    L = d.midlayer
    hn = L.hidden_norm(h)
    return hn, (hn if L.norm_before_residual else h)


def rope_tables(d: Eagle3Drafter, positions, like):
    """The rope's cos and sin [B,T,hd] at these positions, in like's dtype: once per step, so the
    q/k rope reads one row of each per token instead of computing both for every element of
    every head (FastPath.rope_apart)."""
    return rope_cos_sin(positions, d.inv_freq, like.dtype)


def rope_heads(d: Eagle3Drafter, q, k, v, cos, sin):
    """-> q, k, v token-major [B,T,h,d] with the rope on q and k. cos, sin from rope_tables
    (sin None: cos holds the positions, and the tables are computed here)."""
    if sin is None:
        cos, sin = rope_cos_sin(cos, d.inv_freq, q.dtype)
    return d.midlayer.self_attn.heads_rope_tok(q, k, v, cos, sin)


def qkv_from_halves(d: Eagle3Drafter, qh, kh, vh, qe, ke, ve, cos, sin, keep=None, fq=None, fk=None, fv=None):
    """q/k/v from their two halves (embedding half qe.. + hidden half qh..), summed in at least
    fp32; with keep (packed rows), rows whose fed token lies past their sample take the fill
    rows fq.. (token 0's projection, as shift feeds 0 there); then the rope (rope_heads)."""
    if keep is not None:
        m = keep[..., None]
        qe, ke, ve = torch.where(m, qe, fq), torch.where(m, ke, fk), torch.where(m, ve, fv)
    acc = torch.promote_types(qh.dtype, torch.float32)
    q = (qh.to(acc) + qe.to(acc)).to(qh.dtype)
    k = (kh.to(acc) + ke.to(acc)).to(kh.dtype)
    v = (vh.to(acc) + ve.to(acc)).to(vh.dtype)
    return rope_heads(d, q, k, v, cos, sin)


def residual_and_norm(d: Eagle3Drafter, o, resid):
    """The attention output added to the residual, and post_attention_layernorm of the sum."""
    resid = resid + o
    return resid, d.midlayer.post_attention_layernorm(resid)


def output_and_norm(d: Eagle3Drafter, resid, m):
    """The step's output (fed back as the next step's h) and its final norm."""
    out = resid + m
    return out, d.norm(out)


# ---- one step ------------------------------------------------------------------------------------
def _rope(d: Eagle3Drafter, fast: FastPath, positions, like):
    """(cos, sin) from their own region, or (positions, None) for rope_heads to compute them."""
    if not fast.rope_apart:
        return positions, None
    return fast.kernel(rope_tables)(d, positions, like)


def step(
    d: Eagle3Drafter,
    fast: FastPath,
    tokens,
    h,
    positions,
    cache_k,
    cache_v,
    *,
    head: bool = True,
    segments=None,
    emb=None,
    kv_sum=None,
    rows=None,
    shape=None,
):
    """One draft step for all rows: Eagle3Drafter.step's function. -> (pre-norm output fed back,
    logits over the draft vocab), or (output, normed output) with head=False (the fast loss
    applies lm_head itself).

    emb (teacher tokens, from embedding_table): this step's embedding half of q/k/v (qe, ke, ve,
    keep, fills); x's other half runs as its own GEMMs and tokens is unused. kv_sum: the unroll's
    KVGradSum (or None). rows (with emb): h [1, n, H] holds only the rows `rows` of the flattened
    batch of `shape` (B, T): every GEMM runs on those n rows; the attention runs on the whole batch
    with the other rows' q/k/v zero (a row reads its own keys of steps >= 1 only, so no kept row
    reads them), and its output is taken at `rows` again. -> ([1, n, H], [1, n, H])."""
    A, M = d.midlayer.self_attn, d.midlayer.mlp
    acc = fast.accumulate_wgrad
    qkv_w = (A.q_proj.weight, A.k_proj.weight, A.v_proj.weight)
    if emb is not None:  # the embedding half came from the unroll's table
        hn, resid = fast.kernel(hidden_half)(d, h)
        H = d.cfg.hidden_size
        qh, kh, vh = multi_linear(hn, qkv_w, (H, 2 * H), acc)
        qe, ke, ve, keep, fills = emb
        if rows is not None:  # this step's slices and positions at the kept rows
            qe, ke, ve = (select_rows(t, rows) for t in (qe, ke, ve))
            positions = positions.reshape(-1).index_select(0, rows)[None]
            if keep is not None:
                # the fill rows are token 0's projection, the same in every batch row
                keep, fills = keep.reshape(-1).index_select(0, rows)[None], tuple(f[:1] for f in fills)
        q, k, v = fast.kernel(qkv_from_halves)(d, qh, kh, vh, qe, ke, ve, *_rope(d, fast, positions, qh), keep, *fills)
        if rows is not None:
            q, k, v = (scatter_rows(t, rows, *shape) for t in (q, k, v))
    else:  # q/k/v over the whole 2H-wide input (the embedding half at every step)
        x, resid = fast.kernel(input_norms)(d, tokens, h)
        qkv = multi_linear(x, qkv_w, None, acc)
        q, k, v = fast.kernel(rope_heads)(d, *qkv, *_rope(d, fast, positions, qkv[0]))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B,h,T,d] views of the token-major tensors
    cache_k.append(k)
    cache_v.append(v)
    a = ttt_attention(q, cache_k, cache_v, 1.0 / math.sqrt(d.cfg.head_dim), segments, kv_sum, fast)
    if rows is not None:
        a = select_rows(a, rows)
    resid, xn = fast.kernel(residual_and_norm)(d, fused_linear(a, A.o_proj.weight, acc), resid)
    g, u = multi_linear(xn, (M.gate_proj.weight, M.up_proj.weight), None, acc)
    m = swiglu_down(g, u, M.down_proj.weight, acc, fast)
    out, normed = fast.kernel(output_and_norm)(d, resid, m)
    return out, (d.lm_head(normed) if head else normed)


# ---- the embedding half of q/k/v, once per unroll ---------------------------------------------
def embedding_table(d: Eagle3Drafter, fast: FastPath, tokens, steps: int, like, doc=None):
    """The embedding half of q/k/v for every step of a teacher-forced unroll, as one table.

    Step j feeds row p the token at p+1+j (0 past the row's end, and in a packed row past its
    sample's end): the embedding input of step j is rows j..j+T-1 of one table over the tokens
    1..T-1 followed by `steps` zeros. Its input_layernorm and its three GEMMs (the 2H-wide
    input's first H columns of q/k/v) run once per unroll; each step adds its slice to the hidden
    half's GEMMs (qkv_from_halves), and the slices' gradients meet in the table, so the weight
    gradient of that half is one GEMM too. -> table(j): step j's `emb`."""
    A = d.midlayer.self_attn
    B, T = tokens.shape
    H = d.cfg.hidden_size
    ext = torch.cat([tokens[:, 1:], tokens.new_zeros(B, steps)], dim=1)  # [B, T-1+steps]
    e = fast.kernel(embedding_norm)(d, ext, like)
    ys = multi_linear(e, (A.q_proj.weight, A.k_proj.weight, A.v_proj.weight), (0, H), fast.accumulate_wgrad)
    # every step's slice of each table, and (packed rows) its last row, always a fed 0 (steps >= 1
    # zeros follow the tokens): the rows past a sample's end take it. The slices' gradients are
    # summed into the table in one pass
    sl = [shifted_slices(y, T, steps, fill=doc is not None, fast=fast) for y in ys]
    fills = tuple(s[steps] for s in sl) if doc is not None else ()

    def table(j):
        keep = None if doc is None else shift(doc, j + 1, fill=-1) == doc
        return (*(s[j] for s in sl), keep, fills)

    return table


# ---- the unroll ------------------------------------------------------------------------------------
def packed_args(batch) -> dict:
    """The fast unroll's keyword arguments for a packed batch (doc, positions, segments); {}
    otherwise."""
    doc = getattr(batch, "doc", None)
    if doc is None:
        return {}
    seg = Segments(batch.cu_seqlens, batch.max_seqlen, getattr(batch, "cu_seqlens_t", None))
    return {"doc": doc, "positions": batch.positions, "segments": seg}


def unroll(
    d: Eagle3Drafter,
    aux,
    tokens,
    steps: int,
    *,
    fast: FastPath,
    teacher_tokens: bool = True,
    valid=None,
    return_normed: bool = False,
    doc=None,
    positions=None,
    segments=None,
    live=None,
):
    """Eagle3Drafter.unroll's function on the fast path (see the module docstring).

    Called as unroll(drafter, ...), or through the drafter's forward (drafter(..., impl=unroll,
    fast=...)) where DDP's hooks must see the call. segments (packed rows, with doc and
    positions): a Segments or (cu_seqlens, longest). live (return_normed with teacher tokens and
    embed_once): live.rows(j) for j >= 1 is None (every row) or the rows of the flattened [B*T]
    that step j still needs, each step's a prefix of the previous one's (draftport.model.fast.loss:
    rows some step >= j scores). Steps from the first one it names run their GEMMs on those rows
    only; their normed outputs come back [B, T, H] with zeros at the other rows. A row's state at
    step j >= 1 reaches no other row, so the scored rows' losses and every gradient are the same
    function as without it."""
    if return_normed and not teacher_tokens:
        raise ValueError("return_normed needs teacher_tokens (drafting needs the logits)")
    B, T, _ = aux.shape
    h = d.fc(aux)
    if not fused_attention_supported(h):
        return _reference_unroll(d, aux, tokens, steps, teacher_tokens, valid, return_normed, doc, positions)
    seg = _packed_segments(doc, segments)
    if valid is not None:
        # right padding: no valid row after an invalid one (checked without a host sync)
        torch._assert_async(~(valid[:, 1:] & ~valid[:, :-1]).any())
    base_pos = torch.arange(T, device=aux.device)[None].expand(B, T) if positions is None else positions
    table = embedding_table(d, fast, tokens, steps, h, doc) if (teacher_tokens and fast.embed_once) else None
    kv_sum = KVGradSum() if fast.kv_grad_sum else None
    # the tokens fed at each step; with the table its slices stand for them (step reads no tokens)
    tok = shift(tokens, 1, doc=doc) if table is None else None
    use_live = live is not None and table is not None and return_normed
    held = None  # the rows h holds (None: all B*T)
    cache_k, cache_v, outs = [], [], []
    for j in range(steps):
        emb = None if table is None else table(j)
        rows = live.rows(j) if use_live and j > 0 else None
        h, held = _hold_rows(h, held, rows)
        h, res = step(
            d,
            fast,
            tok,
            h,
            base_pos + j,
            cache_k,
            cache_v,
            head=not return_normed,
            segments=seg,
            emb=emb,
            kv_sum=kv_sum,
            rows=rows,
            shape=(B, T),
        )
        if rows is not None:
            res = scatter_rows(res, rows, B, T)
        outs.append(res)
        if j + 1 < steps and table is None:
            tok = _next_tokens(d, tokens, res, j, teacher_tokens, doc)
    return outs


def _reference_unroll(d: Eagle3Drafter, aux, tokens, steps: int, teacher_tokens, valid, return_normed, doc, positions):
    """Eagle3Drafter.unroll, where the fused attention has no kernel."""
    return Eagle3Drafter.unroll(
        d,
        aux,
        tokens,
        steps,
        teacher_tokens=teacher_tokens,
        valid=valid,
        return_normed=return_normed,
        doc=doc,
        positions=positions,
    )


def _packed_segments(doc, segments) -> Segments | None:
    """The packed rows' Segments (segments as given, or its (cu_seqlens, longest)); None unpacked."""
    if doc is None:
        return None
    if segments is None:
        raise ValueError("packed rows on the fused path need their segments (cu_seqlens)")
    return segments if isinstance(segments, Segments) else Segments(*segments)


def _hold_rows(h, held, rows):
    """h at step j for live.rows(j) `rows`: all rows (None), or the kept rows, selected at the first
    reduced step and a prefix of the rows held after it. -> (h, the rows it holds)."""
    if rows is None and held is not None:
        raise ValueError("live.rows: a step after a reduced one must be reduced too")
    if rows is None:
        return h, held
    if held is None:
        h = select_rows(h, rows)
    else:  # a prefix of the rows held, copied: a slice's strides are its parent's, and a
        # compiled region guards them (each new row count would compile again)
        h = h[:, : rows.numel()].clone()
    return h, rows


def _next_tokens(d: Eagle3Drafter, tokens, res, j: int, teacher_tokens: bool, doc):
    """The tokens fed at step j + 1: the teacher's, or the drafter's greedy choice at step j."""
    if teacher_tokens:
        return shift(tokens, j + 2, doc=doc)
    return d.hot_ids[res.argmax(-1)]
