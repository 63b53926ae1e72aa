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

Two implementations of that attention compute the same function. The reference, here, builds
the dense [T, T] mask and a softmax over [step-0 scores | own scores]: read it to understand
EAGLE-3. The fused one (`fused=True`, used for training on the GPU; draftport.model.fast.kernels) runs the
step-0 causal part through flash attention and merges the row's own keys by log-sum-exp, with
the linears and the MLP as custom autograd functions; no [T, T] tensor ever exists. It assumes
right padding (a valid row's earlier rows are valid), as `data.collate` pads. With teacher
tokens it also computes the embedding half of q/k/v once per unroll (`embed_once`, default on):
step j feeds row p the token at p+1+j, so that half of every step is a slice of one table.

A row's state at steps >= 1 reaches only that row (its later-step keys are read by itself alone):
the fused loss passes `live` to unroll, and steps >= 1 run their GEMMs on the rows some later
step still scores (not a sample's prompt, padding or last rows; draftport.training.ttt.set_skip_dead_rows).

Packed rows (draftport.data.packing: several samples per row) pass `doc`, `positions` and `segments`
to unroll: attention stays inside each sample in every step (the reference adds doc equality to
its mask, the fused path attends per segment), RoPE positions restart per sample, and the token
fed at row p of step j is 0 once p + 1 + j lies past its sample's end, as past a padded row's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from draftport.model.fast import kernels
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


# the rope's cos/sin in a region of their own, once per step (on, the default), or inside the
# q/k rope region (off: per element of every head)
_ROPE_APART = {"on": True}


def set_rope_apart(on: bool) -> None:
    """Compute the rope's cos/sin [B, T, hd] once per step in a compiled region of their own
    (on, the default) or inside the q/k rope region (off): the same values."""
    _ROPE_APART["on"] = bool(on)


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
        heads_rope's [B,h,T,d] with the token-major strides the attention kernels keep: their
        outputs and gradients then need no transposing copies to and from the [B,T,h*d] GEMMs."""
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
        # fused path only: sum weight gradients in place across TTT steps (single process; DDP
        # and FSDP need the gradients to pass through autograd, so train() sets this)
        self.accumulate_wgrad = False
        # fused path only: q/k/v and gate/up as one GEMM each (their weights concatenated once
        # per unroll; gradients as row views of one buffer): an opt-in lever, single process
        self.fuse_projections = False
        # fused path with teacher tokens: the embedding half of q/k/v once per unroll instead of
        # once per step (step j feeds row p the token at p+1+j: one table, shifted; see
        # _embed_half). The same function; off runs the 2H-wide GEMMs of every step
        self.embed_once = True
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

    def _r_emb(self, tokens, like):
        """input_layernorm(embed(tokens)) in like's dtype (the embedding half of x)."""
        return self.midlayer.input_layernorm(self.embed_tokens(tokens).to(like.dtype))

    def _r_hid(self, h):
        """The hidden half of x and the residual (x's embedding half comes from _embed_half)."""
        L = self.midlayer
        hn = L.hidden_norm(h)
        return hn, (hn if L.norm_before_residual else h)

    def _r_rope_e(self, qh, kh, vh, qe, ke, ve, cos, sin, keep=None, fq=None, fk=None, fv=None):
        """q/k/v from their two halves (embedding half qe.. + hidden half qh..), summed in at least
        fp32; with keep (packed rows), rows whose fed token lies past their sample take the fill
        rows fq.. (token 0's projection, as shift feeds 0 there); then rope (cos/sin: _r_cs)."""
        if keep is not None:
            m = keep[..., None]
            qe, ke, ve = torch.where(m, qe, fq), torch.where(m, ke, fk), torch.where(m, ve, fv)
        acc = torch.promote_types(qh.dtype, torch.float32)
        q = (qh.to(acc) + qe.to(acc)).to(qh.dtype)
        k = (kh.to(acc) + ke.to(acc)).to(kh.dtype)
        v = (vh.to(acc) + ve.to(acc)).to(vh.dtype)
        return self._r_rope(q, k, v, cos, sin)

    def _r_cs(self, positions, like):
        """The rope's cos and sin [B,T,hd] at these positions, in like's dtype: a region of their
        own (set_rope_apart), so the q/k rope reads one row of each per token instead of
        computing both for every element of every head (64 times over at Kimi size). Off:
        (positions, None), and the rope region computes them itself."""
        if not _ROPE_APART["on"]:
            return positions, None
        return rope_cos_sin(positions, self.inv_freq, like.dtype)

    def _r_rope(self, q, k, v, cos, sin):
        """-> q, k, v token-major [B,T,h,d] (step() hands the attention their [B,h,T,d] views).
        cos, sin from _r_cs (sin None: cos holds the positions)."""
        if sin is None:
            cos, sin = rope_cos_sin(cos, self.inv_freq, q.dtype)
        return self.midlayer.self_attn.heads_rope_tok(q, k, v, cos, sin)

    def _r_mid(self, o, resid):
        resid = resid + o
        return resid, self.midlayer.post_attention_layernorm(resid)

    def _r_out(self, resid, m):
        out = resid + m
        return out, self.norm(out)

    _REGIONS = ("_r_in", "_r_cs", "_r_rope", "_r_mid", "_r_out", "_r_emb", "_r_hid", "_r_rope_e")

    def compile_regions(self, **kw):
        """torch.compile the elementwise regions of a step (GPU training path).

        Regions, not the whole unrolled step: each compiles once and serves all TTT steps; the
        GEMMs, attention and loss run as their own (custom autograd) functions between them."""
        self._compiled = {n: kernels.compiled(getattr(self, n), **kw) for n in self._REGIONS}
        kernels.compile_kernels()
        return self

    def _regions(self):
        c = self.__dict__.get("_compiled")
        return c if c is not None else {n: getattr(self, n) for n in self._REGIONS}

    def step(self, tokens, h, positions, cache_k, cache_v, attn_bias, *, fused: bool = False,
             head: bool = True, segments=None, cats=None, emb=None, kv_sum=None, rows=None, shape=None):
        """One draft step for all rows. Returns (pre-norm output fed back, logits over draft
        vocab), or (output, normed output) with head=False (the fused loss applies lm_head).

        fused: flash-based attention, and the linears and MLP as custom functions (the MLP keeps
        only gate/up outputs; with self.accumulate_wgrad the weight gradients are summed in
        place across TTT steps): draftport.model.fast.kernels. emb (fused, from _embed_half): this step's
        embedding half of q/k/v (qe, ke, ve, keep, fills); x's other half runs as its own GEMMs.
        kv_sum (fused): the unroll's kernels.KVGradSum (the keys' gradients summed across steps).
        rows (fused, with emb): h [1, n, H] holds only the rows `rows` of the flattened batch of
        `shape` (B, T): every GEMM runs on those n rows; the attention runs on the whole batch with
        the other rows' q/k/v zero (a row reads its own keys of steps >= 1 only, so no kept row
        reads them), and its output is taken at `rows` again. -> ([1, n, H], [1, n, H])."""
        A, M = self.midlayer.self_attn, self.midlayer.mlp
        R = self._regions()
        if fused:
            acc = self.accumulate_wgrad

            def lin(x, m):
                return kernels.fused_linear(x, m.weight, acc)
        else:
            def lin(x, m):
                return m(x)
        if emb is not None:    # the embedding half came from the unroll's table
            hn, resid = R["_r_hid"](h)
            H = self.cfg.hidden_size
            qh, kh, vh = kernels.multi_linear(hn, (A.q_proj.weight, A.k_proj.weight, A.v_proj.weight), (H, 2 * H), acc)
            qe, ke, ve, keep, fills = emb
            if rows is not None:   # this step's slices and positions at the kept rows
                qe, ke, ve = (kernels.select_rows(t, rows) for t in (qe, ke, ve))
                positions = positions.reshape(-1).index_select(0, rows)[None]
                if keep is not None:
                    # the fill rows are token 0's projection, the same in every batch row
                    keep, fills = keep.reshape(-1).index_select(0, rows)[None], tuple(f[:1] for f in fills)
            q, k, v = R["_r_rope_e"](qh, kh, vh, qe, ke, ve, *R["_r_cs"](positions, qh), keep, *fills)
            if rows is not None:
                q, k, v = (kernels.scatter_rows(t, rows, *shape) for t in (q, k, v))
            q, k, v = _heads((q, k, v))
        else:
            x, resid = R["_r_in"](tokens, h)
            if cats is not None:   # fused projections: one GEMM for q, k, v
                ws = (A.q_proj.weight, A.k_proj.weight, A.v_proj.weight)
                qkv = kernels.cat_linear(x, cats["qkv"], ws, acc)
                q, k, v = _heads(R["_r_rope"](*qkv.split([w.shape[0] for w in ws], dim=-1),
                                              *R["_r_cs"](positions, qkv)))
            elif fused:   # q/k/v over the whole 2H-wide input (the embedding half at every step)
                qkv = kernels.multi_linear(x, (A.q_proj.weight, A.k_proj.weight, A.v_proj.weight), None, acc)
                q, k, v = _heads(R["_r_rope"](*qkv, *R["_r_cs"](positions, qkv[0])))
            else:
                qkv = (lin(x, A.q_proj), lin(x, A.k_proj), lin(x, A.v_proj))
                q, k, v = _heads(R["_r_rope"](*qkv, *R["_r_cs"](positions, qkv[0])))
        cache_k.append(k)
        cache_v.append(v)
        if fused:
            a = kernels.ttt_attention(q, cache_k, cache_v, 1.0 / math.sqrt(self.cfg.head_dim), segments, kv_sum)
            if rows is not None:
                a = kernels.select_rows(a, rows)
        else:
            a = A.attend_core(q, cache_k, cache_v, attn_bias)
        resid, xn = R["_r_mid"](lin(a, A.o_proj), resid)
        if cats is not None:   # one GEMM for gate and up
            ws = (M.gate_proj.weight, M.up_proj.weight)
            g, u = kernels.cat_linear(xn, cats["gate_up"], ws, acc).split([w.shape[0] for w in ws], dim=-1)
            m = kernels.swiglu_down(g, u, M.down_proj.weight, acc)
        elif fused:
            g, u = kernels.multi_linear(xn, (M.gate_proj.weight, M.up_proj.weight), None, acc)
            m = kernels.swiglu_down(g, u, M.down_proj.weight, acc)
        else:
            m = M(xn)
        out, normed = R["_r_out"](resid, m)
        return out, (self.lm_head(normed) if head else normed)

    def unroll(self, aux, tokens, steps: int, *, teacher_tokens: bool = True, valid=None,
               fused: bool = False, return_normed: bool = False, doc=None, positions=None,
               segments=None, live=None):
        """Run `steps` draft steps over a batch of sequences.

        aux: [B, T, 3*Ht] target aux states at positions 0..T-1.
        tokens: [B, T] target token ids; step j at row p feeds token tokens[p+1+j] when
        teacher_tokens, else (j > 0) the token drafted at step j-1.
        valid: [B, T] bool, rows allowed as keys (padding off). Returns a list of draft-vocab
        logits [B, T, Vd], one per step; row p of step j predicts the token at p+2+j.
        fused: the fused attention (flash + log-sum-exp merge; right padding only).
        return_normed: return the normed outputs [B, T, H] instead of logits (teacher tokens
        only), for a loss that applies lm_head itself in chunks.
        doc, positions [B, T], segments (cu_seqlens over the B*T rows, longest): packed rows
        (draftport.data.packing.PackedBatch); attention, positions and token shifts stay per sample.
        live (fused, return_normed, embed_once): live.rows(j) for j >= 1 is None (every row) or
        the rows of the flattened [B*T] that step j still needs, each step's a prefix of the
        previous one's (ttt's _LiveRows: rows some step >= j scores). Steps from the first one
        it names run their GEMMs on those rows only; their normed outputs come back [B, T, H]
        with zeros at the other rows. A row's state at step j >= 1 reaches no other row (the
        attention reads a row's later-step keys from that row alone), so the scored rows' losses
        and every gradient are the same function as without it.
        """
        if return_normed and not teacher_tokens:
            raise ValueError("return_normed needs teacher_tokens (drafting needs the logits)")
        B, T, _ = aux.shape
        dev = aux.device
        h = self.fc(aux)
        attn_bias = None
        if fused and not kernels.fused_attention_supported(h):
            fused = False
        seg = None
        if fused and doc is not None:
            if segments is None:
                raise ValueError("packed rows on the fused path need their segments (cu_seqlens)")
            seg = segments if isinstance(segments, kernels.Segments) else kernels.Segments(*segments)
        if fused:
            if valid is not None:
                # right padding: no valid row after an invalid one (checked without a host sync)
                torch._assert_async(~(valid[:, 1:] & ~valid[:, :-1]).any())
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            keep = causal[None] if valid is None else causal[None] & valid[:, None, :]
            if doc is not None:  # packed rows: never across samples
                keep = keep & (doc[:, :, None] == doc[:, None, :])
            attn_bias = torch.zeros(B, 1, T, T, dtype=h.dtype, device=dev).masked_fill(~keep[:, None], float("-inf"))
            # rows that see nothing (padding at the front) would NaN: let them see themselves.
            eye = torch.eye(T, dtype=torch.bool, device=dev)[None, None]
            attn_bias = torch.where(eye & ~keep[:, None].any(-1, keepdim=True), torch.zeros_like(attn_bias), attn_bias)
        base_pos = torch.arange(T, device=dev)[None].expand(B, T) if positions is None else positions
        cats = None
        if fused and self.fuse_projections:
            A, M = self.midlayer.self_attn, self.midlayer.mlp
            with torch.no_grad():
                cats = {"qkv": torch.cat([A.q_proj.weight, A.k_proj.weight, A.v_proj.weight]),
                        "gate_up": torch.cat([M.gate_proj.weight, M.up_proj.weight])}
        table = None
        if fused and teacher_tokens and self.embed_once and cats is None:
            table = self._embed_half(tokens, steps, h, doc)
        cache_k, cache_v, outs = [], [], []
        kv_sum = kernels.kv_grad_sum() if fused else None
        # the tokens fed at each step; with the table its slices stand for them (step reads no tokens)
        tok = shift(tokens, 1, doc=doc) if table is None else None
        use_live = live is not None and table is not None and return_normed
        held = None   # the rows h holds (None: all B*T)
        for j in range(steps):
            emb = None if table is None else table(j)
            rows = live.rows(j) if use_live and j > 0 else None
            if rows is None and held is not None:
                raise ValueError("live.rows: a step after a reduced one must be reduced too")
            if rows is not None:
                if held is None:
                    h = kernels.select_rows(h, rows)
                elif rows.numel() < held.numel():
                    h = h[:, :rows.numel()]   # a prefix of the rows held
                held = rows
            h, res = self.step(tok, h, base_pos + j, cache_k, cache_v, attn_bias, fused=fused,
                               head=not return_normed, segments=seg, cats=cats, emb=emb, kv_sum=kv_sum,
                               rows=rows, shape=(B, T))
            if rows is not None:
                res = kernels.scatter_rows(res, rows, B, T)
            outs.append(res)
            if j + 1 < steps and table is None:
                if teacher_tokens:
                    tok = shift(tokens, j + 2, doc=doc)
                else:
                    tok = self.hot_ids[res.argmax(-1)]
        return outs

    def _embed_half(self, tokens, steps: int, like, doc=None):
        """The embedding half of q/k/v for every step of a teacher-forced unroll, as one table.

        Step j feeds row p the token at p+1+j (0 past the row's end, and in a packed row past
        its sample's end): the embedding input of step j is rows j..j+T-1 of one table over the
        tokens 1..T-1 followed by `steps` zeros. Its input_layernorm and its three GEMMs (the
        2H-wide input's first H columns of q/k/v) run once per unroll; each step adds its slice
        to the hidden half's GEMMs (_r_rope_e), and the slices' gradients meet in the table, so
        the weight gradient of that half is one GEMM too. -> table(j): step j's `emb`."""
        A = self.midlayer.self_attn
        R = self._regions()
        B, T = tokens.shape
        H = self.cfg.hidden_size
        ext = torch.cat([tokens[:, 1:], tokens.new_zeros(B, steps)], dim=1)      # [B, T-1+steps]
        e = R["_r_emb"](ext, like)
        acc = self.accumulate_wgrad
        ys = kernels.multi_linear(e, (A.q_proj.weight, A.k_proj.weight, A.v_proj.weight), (0, H), acc)
        # every step's slice of each table, and (packed rows) its last row, always a fed 0 (steps >= 1
        # zeros follow the tokens): the rows past a sample's end take it. The slices' gradients are
        # summed into the table in one pass
        sl = [kernels.shifted_slices(y, T, steps, fill=doc is not None) for y in ys]
        fills = tuple(s[steps] for s in sl) if doc is not None else ()

        def table(j):
            keep = None if doc is None else shift(doc, j + 1, fill=-1) == doc
            return (*(s[j] for s in sl), keep, fills)
        return table


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
