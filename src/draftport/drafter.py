"""The EAGLE-3 drafter (flat layout: fc, midlayer.*, norm, lm_head, d2t, t2d).

Data flow of one draft step at row p (as vLLM's and SGLang's EAGLE-3 heads compute it):

    h      = fc([aux_0 | aux_1 | aux_2])          step 0: target features of position p
           = previous step's pre-norm output       step j > 0: the drafter's own state
    x      = [input_layernorm(embed(tok)) | hidden_norm(h)]     (2H wide)
    resid  = h  (or hidden_norm(h) when norm_before_residual)
    a      = self_attn(x) ; resid = resid + a ; m = mlp(post_attention_layernorm(resid))
    out    = resid + m                             fed back as h of the next step
    logits = lm_head(norm(out))                    over the draft vocab; slot i -> id i + d2t[i]

Attention in step j: row p (standing for position p + j) sees the step-0 keys of rows <= p (the
verified prefix, computed from target features) and its own keys from steps 1..j. That is the
training-time-test mask and also exactly what an engine's drafter KV cache holds while drafting,
so one routine serves training (teacher-forced tokens) and offline evaluation (drafted tokens).

Two implementations of that attention compute the same function. The reference builds the dense
[T, T] mask and a softmax over [step-0 scores | own scores]. The fused one (`fused=True`, used for
training on the GPU) runs the step-0 causal part through flash attention, which also returns its
log-sum-exp, and merges the few diagonal keys (the row's own keys from steps 1..j) by log-sum-exp;
its backward calls the flash backward with the *merged* output and log-sum-exp (the ring-attention
identity: dS = P_final * (dP - rowsum(dO * O_final)) per key block), so no [T, T] tensor ever
exists. It assumes right padding (a valid row's earlier rows are valid), as `data.collate` pads.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def rope_inv_freq(cfg: DrafterConfig) -> torch.Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "linear":
        inv = inv / float(rs["factor"])
    return inv


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype):
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: [B, heads, T, hd]; cos/sin: [B, T, hd] (Llama's rotate_half convention)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * h, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, h, bias=False)

    def qkv(self, x, cos, sin):
        return self.heads_rope(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads_rope(self, q, k, v, cos, sin):
        """Projections [B,T,n*d] -> heads [B,h,T,d], rope on q and k, kv heads repeated."""
        B, T, _ = q.shape
        q = q.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return q, k, v

    def attend(self, q, cache_k, cache_v, attn_bias):
        return self.o_proj(self.attend_core(q, cache_k, cache_v, attn_bias))

    def attend_core(self, q, cache_k, cache_v, attn_bias):
        """Reference attention. q: [B,h,T,d]; cache_k[0]: step-0 keys over all rows (causal by
        attn_bias); cache_k[1:]: this row's own keys from later steps (diagonal). -> [B,T,h*d]"""
        scale = 1.0 / math.sqrt(self.head_dim)
        s0 = torch.matmul(q, cache_k[0].transpose(-1, -2)) * scale + attn_bias  # [B,h,T,T]
        if len(cache_k) == 1:
            p = torch.softmax(s0.float(), dim=-1).to(q.dtype)
            out = torch.matmul(p, cache_v[0])
        else:
            sd = torch.stack([(q * k).sum(-1) for k in cache_k[1:]], dim=-1) * scale  # [B,h,T,j]
            p = torch.softmax(torch.cat([s0, sd], dim=-1).float(), dim=-1).to(q.dtype)
            T = s0.shape[-1]
            out = torch.matmul(p[..., :T], cache_v[0])
            vd = torch.stack(cache_v[1:], dim=-2)  # [B,h,T,j,d]
            out = out + (p[..., T:, None] * vd).sum(-2)
        B, h, T, d = out.shape
        return out.transpose(1, 2).reshape(B, T, h * d)


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


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor | None = None):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} not supported (silu only)")
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(cfg.fc_in, h, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_loaded = False
        # fused path only: sum weight gradients in place across TTT steps (single process; DDP
        # and FSDP need the gradients to pass through autograd, so train() sets this)
        self.accumulate_wgrad = False
        if embed_weight is not None:
            self.set_embedding(embed_weight)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._init_weights()

    def _init_weights(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def set_embedding(self, w: torch.Tensor):
        if tuple(w.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"embed_tokens {list(w.shape)} != expected {list(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(w)
        self.embed_loaded = True

    def set_vocab_maps(self, d2t, t2d):
        with torch.no_grad():
            self.d2t.copy_(torch.as_tensor(d2t, dtype=torch.long))
            self.t2d.copy_(torch.as_tensor(t2d, dtype=torch.bool))

    @property
    def hot_ids(self) -> torch.Tensor:
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    # ---- state dict in the flat naming, exactly the tensors that exist ----------------------
    def export_state(self, include_embed: bool = False) -> dict[str, torch.Tensor]:
        sd = {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}
        if include_embed:
            if not self.embed_loaded:
                raise ValueError("embed_tokens was never loaded from a target: refusing to export random embeddings")
            sd["embed_tokens.weight"] = self.embed_tokens.weight
        return sd

    def load_flat_state(self, state: dict[str, torch.Tensor]):
        state = dict(state)
        emb = state.pop("embed_tokens.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("embed_tokens")]
        if missing or unexpected:
            raise KeyError(f"missing {missing}, unexpected {unexpected}")
        if emb is not None:
            self.set_embedding(emb)

    def forward(self, *args, **kw):
        return self.unroll(*args, **kw)

    # ---- the unrolled forward -----------------------------------------------------------------
    # ---- the step, as compilable elementwise regions around the GEMMs --------------------------
    def _r_in(self, tokens, h):
        """Input norms and the [embed | hidden] concat; -> (x [B,T,2H], residual)."""
        L = self.midlayer
        e = L.input_layernorm(self.embed_tokens(tokens).to(h.dtype))
        hn = L.hidden_norm(h)
        return torch.cat([e, hn], dim=-1), (hn if L.norm_before_residual else h)

    def _r_rope(self, q, k, v, positions):
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)
        return self.midlayer.self_attn.heads_rope(q, k, v, cos, sin)

    def _r_mid(self, o, resid):
        resid = resid + o
        return resid, self.midlayer.post_attention_layernorm(resid)

    def _r_out(self, resid, m):
        out = resid + m
        return out, self.norm(out)

    _REGIONS = ("_r_in", "_r_rope", "_r_mid", "_r_out")

    def compile_regions(self, **kw):
        """torch.compile the elementwise regions of a step (GPU training path).

        Regions, not the whole unrolled step: each compiles once and serves all TTT steps; the
        GEMMs, attention and loss run as their own (custom autograd) functions between them."""
        self._compiled = {n: torch.compile(getattr(self, n), **kw) for n in self._REGIONS}
        compile_kernels()
        return self

    def _regions(self):
        c = self.__dict__.get("_compiled")
        return c if c is not None else {n: getattr(self, n) for n in self._REGIONS}

    def step(self, tokens, h, positions, cache_k, cache_v, attn_bias, *, fused: bool = False,
             head: bool = True):
        """One draft step for all rows. Returns (pre-norm output fed back, logits over draft
        vocab), or (output, normed output) with head=False (the fused loss applies lm_head).

        fused: flash-based attention, and the linears and MLP as custom functions (the MLP keeps
        only gate/up outputs; with self.accumulate_wgrad the weight gradients are summed in
        place across TTT steps)."""
        A, M = self.midlayer.self_attn, self.midlayer.mlp
        R = self._regions()
        if fused:
            acc = self.accumulate_wgrad

            def lin(x, m):
                return _Linear.apply(x, m.weight, acc)
        else:
            def lin(x, m):
                return m(x)
        x, resid = R["_r_in"](tokens, h)
        q, k, v = R["_r_rope"](lin(x, A.q_proj), lin(x, A.k_proj), lin(x, A.v_proj), positions)
        cache_k.append(k)
        cache_v.append(v)
        if fused:
            a = ttt_attention(q, cache_k, cache_v, 1.0 / math.sqrt(self.cfg.head_dim))
        else:
            a = A.attend_core(q, cache_k, cache_v, attn_bias)
        resid, xn = R["_r_mid"](lin(a, A.o_proj), resid)
        if fused:
            m = _SwiGLUDown.apply(lin(xn, M.gate_proj), lin(xn, M.up_proj), M.down_proj.weight, acc)
        else:
            m = M(xn)
        out, normed = R["_r_out"](resid, m)
        return out, (self.lm_head(normed) if head else normed)

    def unroll(self, aux, tokens, steps: int, *, teacher_tokens: bool = True, valid=None,
               fused: bool = False, return_normed: bool = False):
        """Run `steps` draft steps over a batch of sequences.

        aux: [B, T, 3*Ht] target aux states at positions 0..T-1.
        tokens: [B, T] target token ids; step j at row p feeds token tokens[p+1+j] when
        teacher_tokens, else (j > 0) the token drafted at step j-1.
        valid: [B, T] bool, rows allowed as keys (padding off). Returns a list of draft-vocab
        logits [B, T, Vd], one per step; row p of step j predicts the token at p+2+j.
        fused: the fused attention (flash + log-sum-exp merge; right padding only).
        return_normed: return the normed outputs [B, T, H] instead of logits (teacher tokens
        only), for a loss that applies lm_head itself in chunks.
        """
        if return_normed and not teacher_tokens:
            raise ValueError("return_normed needs teacher_tokens (drafting needs the logits)")
        B, T, _ = aux.shape
        dev = aux.device
        h = self.fc(aux)
        attn_bias = None
        if fused and not fused_attention_supported(h):
            fused = False
        if fused:
            if valid is not None:
                # right padding: no valid row after an invalid one (checked without a host sync)
                torch._assert_async(~(valid[:, 1:] & ~valid[:, :-1]).any())
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            keep = causal[None] if valid is None else causal[None] & valid[:, None, :]
            attn_bias = torch.zeros(B, 1, T, T, dtype=h.dtype, device=dev).masked_fill(~keep[:, None], float("-inf"))
            # rows that see nothing (padding at the front) would NaN: let them see themselves.
            eye = torch.eye(T, dtype=torch.bool, device=dev)[None, None]
            attn_bias = torch.where(eye & ~keep[:, None].any(-1, keepdim=True), torch.zeros_like(attn_bias), attn_bias)
        base_pos = torch.arange(T, device=dev)[None].expand(B, T)
        cache_k, cache_v, outs = [], [], []
        tok = shift(tokens, 1)
        for j in range(steps):
            h, res = self.step(tok, h, base_pos + j, cache_k, cache_v, attn_bias, fused=fused,
                               head=not return_normed)
            outs.append(res)
            if j + 1 < steps:
                if teacher_tokens:
                    tok = shift(tokens, j + 2)
                else:
                    tok = self.hot_ids[res.argmax(-1)]
        return outs


def shift(tokens: torch.Tensor, n: int, fill: int = 0) -> torch.Tensor:
    """tokens[:, p + n] at row p (fill past the end)."""
    if n == 0:
        return tokens
    out = torch.full_like(tokens, fill)
    if n < tokens.shape[1]:
        out[:, :-n] = tokens[:, n:]
    return out
