"""The EAGLE-3 drafter (flat layout: fc, midlayer.*, norm, lm_head, d2t, t2d) and its reference
unroll.

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
Here that attention is a dense [T, T] mask and a softmax over [step-0 scores | own scores]: read
it to understand EAGLE-3. draftport.model.fast computes the same unroll for training on the GPU
(fused attention, custom-autograd linears, compiled regions) over these weights.

Packed rows (draftport.data.packing: several samples per row) pass `doc` and `positions` to
unroll: attention stays inside each sample in every step (doc equality in the mask), RoPE
positions restart per sample, and the token fed at row p of step j is 0 once p + 1 + j lies past
its sample's end, as past a padded row's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from draftport.model.config import DrafterConfig


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


def apply_rope(x, cos, sin, heads_dim: int = 1):
    # x: [B, heads, T, hd] (heads_dim 1) or [B, T, heads, hd] (heads_dim 2); cos/sin: [B, T, hd]
    # (Llama's rotate_half convention)
    cos, sin = cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim)
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
        return _heads(self.heads_rope_tok(q, k, v, cos, sin))

    def heads_rope_tok(self, q, k, v, cos, sin):
        """heads_rope laid out token-major: [B,T,h,d] (contiguous where computed). Its transpose is
        heads_rope's [B,h,T,d] with the token-major strides the fused attention kernels keep
        (draftport.model.fast): no transposing copies to and from the [B,T,h*d] GEMMs."""
        B, T, _ = q.shape
        q = q.view(B, T, self.heads, self.head_dim)
        k = k.view(B, T, self.kv_heads, self.head_dim)
        v = v.view(B, T, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin, heads_dim=2), apply_rope(k, cos, sin, heads_dim=2)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return q, k, v.contiguous()

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

    def forward(self, *args, impl=None, **kw):
        """The reference unroll, or impl(self, *args, **kw): another computation of it over these
        weights (draftport.model.fast.unroll.unroll), called here so that DDP's hooks see it."""
        if impl is None:
            return self.unroll(*args, **kw)
        return impl(self, *args, **kw)

    # ---- the reference step and unroll -----------------------------------------------------------
    def step(self, tokens, h, positions, cache_k, cache_v, attn_bias, head: bool = True):
        """One draft step for all rows: tokens [B, T] fed, h [B, T, H] the state, cache_k/cache_v
        the keys and values of the earlier steps (this step's are appended), attn_bias the step-0
        mask. -> (pre-norm output fed back, logits over the draft vocab), or (output, normed
        output) with head=False."""
        L, A = self.midlayer, self.midlayer.self_attn
        e = L.input_layernorm(self.embed_tokens(tokens).to(h.dtype))
        hn = L.hidden_norm(h)
        x = torch.cat([e, hn], dim=-1)
        resid = hn if L.norm_before_residual else h
        q, k, v = A.q_proj(x), A.k_proj(x), A.v_proj(x)
        cos, sin = rope_cos_sin(positions, self.inv_freq, q.dtype)
        q, k, v = A.heads_rope(q, k, v, cos, sin)
        cache_k.append(k)
        cache_v.append(v)
        resid = resid + A.attend(q, cache_k, cache_v, attn_bias)
        out = resid + L.mlp(L.post_attention_layernorm(resid))
        normed = self.norm(out)
        return out, (self.lm_head(normed) if head else normed)

    def unroll(
        self,
        aux,
        tokens,
        steps: int,
        *,
        teacher_tokens: bool = True,
        valid=None,
        return_normed: bool = False,
        doc=None,
        positions=None,
    ):
        """Run `steps` draft steps over a batch of sequences.

        aux: [B, T, 3*Ht] target aux states at positions 0..T-1.
        tokens: [B, T] target token ids; step j at row p feeds token tokens[p+1+j] when
        teacher_tokens, else (j > 0) the token drafted at step j-1.
        valid: [B, T] bool, rows allowed as keys (padding off). Returns a list of draft-vocab
        logits [B, T, Vd], one per step; row p of step j predicts the token at p+2+j.
        return_normed: return the normed outputs [B, T, H] instead of logits (teacher tokens
        only), for a loss that applies lm_head itself.
        doc, positions [B, T]: packed rows (draftport.data.packing.PackedBatch); attention,
        positions and token shifts stay per sample.
        """
        if return_normed and not teacher_tokens:
            raise ValueError("return_normed needs teacher_tokens (drafting needs the logits)")
        B, T, _ = aux.shape
        dev = aux.device
        h = self.fc(aux)
        attn_bias = prefix_bias(B, T, valid, doc, h.dtype, dev)
        base_pos = torch.arange(T, device=dev)[None].expand(B, T) if positions is None else positions
        cache_k, cache_v, outs = [], [], []
        tok = shift(tokens, 1, doc=doc)
        for j in range(steps):
            h, res = self.step(tok, h, base_pos + j, cache_k, cache_v, attn_bias, head=not return_normed)
            outs.append(res)
            if j + 1 < steps:
                if teacher_tokens:
                    tok = shift(tokens, j + 2, doc=doc)
                else:
                    tok = self.hot_ids[res.argmax(-1)]
        return outs

    # ---- drafting along explicit branches (the offline tree evaluator) -----------------------
    def draft_start(self, aux, tokens, valid=None) -> tuple[DraftState, torch.Tensor]:
        """Step 0 of drafting from every row, as unroll's first step: (the state to branch from,
        its draft-vocab logits [B, T, Vd]). aux, tokens, valid: as unroll's."""
        B, T, _ = aux.shape
        dev = aux.device
        h = self.fc(aux)
        attn_bias = prefix_bias(B, T, valid, None, h.dtype, dev)
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        cache_k, cache_v = [], []
        h, logits = self.step(shift(tokens, 1), h, pos, cache_k, cache_v, attn_bias)
        return DraftState(h[None], cache_k, cache_v, attn_bias, pos), logits

    def draft_next(self, state: DraftState, parent: torch.Tensor, fed: torch.Tensor) -> tuple[DraftState, torch.Tensor]:
        """One more draft step for N new branches at every row: branch n at row p continues
        state's branch parent[n, b, p] (its hidden state and its own keys) and is fed token
        fed[n, b, p]. parent, fed: [N, B, T] long. -> (the state of the N branches, their logits
        [N, B, T, Vd]). Fed its own argmax along one branch, this is unroll(teacher_tokens=False)."""
        N, B, T = fed.shape
        j = len(state.cache_k)  # the step about to run
        h = torch.gather(state.h, 0, parent[..., None].expand(N, B, T, state.h.shape[-1]))

        def pick(c):  # a branch's own keys (or values) of an earlier step: its parent's
            c = c.view(-1, B, *c.shape[1:])
            idx = parent[:, :, None, :, None].expand(N, B, c.shape[2], T, c.shape[-1])
            return torch.gather(c, 0, idx).flatten(0, 1)

        # step-0 keys (the verified prefix) are shared: every branch attends to the same ones
        cache_k = [state.cache_k[0].repeat(N, 1, 1, 1), *(pick(c) for c in state.cache_k[1:])]
        cache_v = [state.cache_v[0].repeat(N, 1, 1, 1), *(pick(c) for c in state.cache_v[1:])]
        bias = state.attn_bias.repeat(N, 1, 1, 1)
        pos = (state.positions + j).repeat(N, 1)
        out, logits = self.step(fed.flatten(0, 1), h.flatten(0, 1), pos, cache_k, cache_v, bias)
        cache_k[0], cache_v[0] = state.cache_k[0], state.cache_v[0]
        nxt = DraftState(out.view(N, B, T, -1), cache_k, cache_v, state.attn_bias, state.positions)
        return nxt, logits.view(N, B, T, -1)


@dataclass
class DraftState:
    """Drafting from every row, several branches at once: each branch's pre-norm state h
    [N, B, T, H], the keys and values of each step (step 0's [B, heads, T, d], shared by every
    branch; later steps' [N*B, heads, T, d], branch-major), the step-0 mask and the positions."""

    h: torch.Tensor
    cache_k: list
    cache_v: list
    attn_bias: torch.Tensor
    positions: torch.Tensor


def prefix_bias(B: int, T: int, valid, doc, dtype, dev) -> torch.Tensor:
    """The step-0 attention bias [B, 1, T, T]: causal, padding (valid) and, for packed rows
    (doc), other samples masked."""
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    keep = causal[None] if valid is None else causal[None] & valid[:, None, :]
    if doc is not None:  # packed rows: never across samples
        keep = keep & (doc[:, :, None] == doc[:, None, :])
    attn_bias = torch.zeros(B, 1, T, T, dtype=dtype, device=dev).masked_fill(~keep[:, None], float("-inf"))
    # rows that see nothing (padding at the front) would NaN: let them see themselves.
    eye = torch.eye(T, dtype=torch.bool, device=dev)[None, None]
    return torch.where(eye & ~keep[:, None].any(-1, keepdim=True), torch.zeros_like(attn_bias), attn_bias)


def _heads(qkv):
    """Token-major q, k, v [B,T,h,d] -> their [B,h,T,d] views (no copy)."""
    return tuple(t.transpose(1, 2) for t in qkv)


def shift(tokens: torch.Tensor, n: int, fill: int = 0, doc=None) -> torch.Tensor:
    """tokens[:, p + n] at row p (fill past the end; with doc [B, T], also past the end of
    row p's sample in a packed row)."""
    if n == 0:
        return tokens
    out = torch.full_like(tokens, fill)
    if n < tokens.shape[1]:
        out[:, :-n] = tokens[:, n:]
    if doc is not None:
        out = out.masked_fill(shift(doc, n, fill=-1) != doc, fill)
    return out
