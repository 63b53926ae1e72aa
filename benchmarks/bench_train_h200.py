"""Training-step throughput of our EAGLE-3 drafter at a drafter's shape, against speculators 0.9.0
and SpecForge 0.2.0, measured side by side in one call (or a pair of calls: --peers-only, then
--peers-from).

The shape: --shape NAME (SIZES: kimi, Kimi-K2's drafter, the default on CUDA; llama70b,
Llama-3.x-70B's; qwen3-30b-a3b, Qwen3-30B-A3B's) or --shape H,I,heads,kv,head_dim,Vd,V for any
other; the peers' runners build the same shape, the results say its name (config.shape) and a
--json/--log path may hold {date} and {shape} (benchmarks/results/{date}-h200-train-{shape}.json:
the files draftport estimate reads per shape). Goals, per shape: the peer ratios, peak memory,
the length mix, and the MFU: at H >= 4096 an absolute one (75% at 2048, 80% at 4096), below it 90%
of the ceiling the step's own GEMMs reach alone through cuBLAS (gemm_ceiling, timed per length).

One full training step as train.py runs it (TTT loss over `--ttt` unrolled steps, combine,
backward, grad clipping, fused AdamW), on synthetic bf16 aux/final target states already on the
device, with a frozen bf16 target lm_head [vocab, H] for the target distribution and the
full-vocab argmax mask ("computed"), or the greedy choice stored with the features as the data
step stores it ("stored": only the draft rows of the target head remain). Per sequence length
(--seqs, one sample of T tokens per step, as the peers' anchors run) and on a length mix (--mix:
log-normal lengths, mean ~1.5K, max 2048): ours packed (draftport.data.packing: steps of at most
--pack-len tokens, grouped as speculators groups its rows by default, each step one row of its
samples rounded up to 64 tokens as train() packs it, where speculators pads each row to
--pack-len), ours padded (groups of --pad-batch samples right-padded
to the longest, as data.collate does), and each peer as it trains by default; throughput on the
mix counts real (non-padding) tokens, over the median of --mix-passes timed passes (ours and each
peer's alike; the fixed lengths take the median step). Each mix sample opens with a 16-token
prompt in ours (none in the peers'); --mix-prompt-share F makes the first F of each sample's
tokens a prompt, masked in ours and in the peers' losses alike (chat-shaped data, where ours
runs TTT steps >= 1 on fewer rows: FastPath.skip_dead_rows). Each peer also runs the other trainable set (speculators:
lm_head frozen by default, also trained; SpecForge: trained by default, also frozen at the fixed
lengths), so every ratio to "the faster peer" compares equal work at one set. Prints tokens/s,
analytic FLOPs/token, MFU against --peak-tflops (model FLOPs) and the hardware rate of the FLOPs
our step executes (`hfu`: the embedding half of q/k/v runs once per unroll, not once per TTT
step), peak memory, and writes one JSON with every figure, the ratios and the goals.

Order (one device call): the attention probe (flash vs cuDNN for the dense causal part, the faster
one is used), ours at each length (with the embedding half at every step beside it, at each
length) and the levers at the first one (the other attention kernel, fused q/k/v and gate/up
GEMMs), the peers in
subprocesses (benchmarks/peers/*_run.py: each peer's own model, loss, trainer core and optimizer,
wired as the anchors wire them, a process of its own per shape (after 2,048 in the same process,
speculators ran 3-6% slower at 4,096 and on the mix than in a process of its own; likely cause:
torch.compile recompiles with dynamic sizes at a second shape), one at a time on the same GPU), then
ours on the mix (its new shapes compile longest). Parameters are bf16 (no fp32 master copy) for
ours and speculators' anchor; SpecForge keeps its fp32 masters (its default). A ratio to "the
faster peer" is only given when every peer asked for was measured at that shape (score()).

    python benchmarks/bench_train_h200.py                      # kimi on CUDA: ours + both peers
    python benchmarks/bench_train_h200.py --shape qwen3-30b-a3b --peers-only --json PEERS.json
    python benchmarks/bench_train_h200.py --size toy --no-peers --json /tmp/x.json   # CPU
    python benchmarks/bench_train_h200.py --ladder             # what each lever gives
    python benchmarks/bench_train_h200.py --rescore RESULTS.json   # ratios/goals from its records
    python benchmarks/bench_train_h200.py --merge-peers A.json B.json --json PEERS.json  # one machine's
                                    # peer calls as one file (a peer that failed in A, measured in B)

Two device calls instead of one (each call limited to ~600 s; the machine may be a fresh one):
    python benchmarks/bench_train_h200.py --peers-only --json PEERS.json      # the peers alone
    python benchmarks/bench_train_h200.py --peers-from PEERS.json --json RESULTS.json   # ours
--peers-only runs no part of ours (no attention probe, no levers): the whole --budget-s goes to
the peers, speculators first with --speculators-share of it (it compiles at each length and the
mix), SpecForge with the rest; it writes the peers' raw records (`peers_raw`, as a full run
writes them), versions, device, config, mix and wall time. --peers-from FILE (that file, or a
full results file) runs no peer: it loads their records and scores them with this call's own
figures through score() (the code --rescore uses), so the ratios and goals are those of a
single run; the output names the source in `peers_from`. It refuses (one line, exit 1) a FILE
that is missing, not JSON, without peers_raw, or whose config (hidden size, seqs, TTT steps,
the mix: lengths and packed row length) differs from this run's, or whose peers ran several
shapes in one process (files before `peer_process`).

Never asserts timings: it prints figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from draftport.data.packing import ROW_MULTIPLE, pack, plan_rows  # noqa: E402
from draftport.data.shards import Batch, collate  # noqa: E402
from draftport.files import atomic_write_text  # noqa: E402
from draftport.model.config import DrafterConfig  # noqa: E402
from draftport.model.drafter import Attention, Eagle3Drafter  # noqa: E402
from draftport.model.fast import loss as fast_loss  # noqa: E402
from draftport.model.fast.attention import Segments, ttt_attention  # noqa: E402
from draftport.model.fast.path import COMPILE_TUNING, FastPath  # noqa: E402
from draftport.model.fast.unroll import unroll as fast_unroll  # noqa: E402
from draftport.model.flops import flops_per_token as model_flops  # noqa: E402
from draftport.model.flops import shape_of  # noqa: E402
from draftport.training import optim  # noqa: E402
from draftport.training.loop import TrainConfig, train_step  # noqa: E402
from draftport.training.ttt import combine, counted_rows, stats_to_float, ttt_terms  # noqa: E402

# a drafter's shape, in the order --shape H,I,heads,kv,head_dim,Vd,V takes it
SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "draft_vocab_size",
    "vocab_size",
)
SIZES = {
    # H, I, heads, kv heads, head_dim, draft vocab, vocab
    # Kimi-K2's drafter (AQ-MedAI/Kimi-K2-Instruct-eagle3)
    "kimi": dict(
        hidden_size=7168,
        intermediate_size=18432,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
        draft_vocab_size=32000,
        vocab_size=163840,
    ),
    # Llama-3.x-70B's drafter: SpecForge's configs/llama3-70B-ealge3.json (the shape of
    # yuhuili/EAGLE3-LLaMA3.3-Instruct-70B): grouped-query attention, 8 KV heads
    "llama70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        draft_vocab_size=32000,
        vocab_size=128256,
    ),
    # the drafter of a 2048-wide MoE target, Qwen3-30B-A3B: SpecForge's
    # configs/qwen3-30B-A3B-eagle3.json (and its eagle3.1 variant): H 2048, I 12288, 32/4 heads
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        draft_vocab_size=32000,
        vocab_size=151936,
    ),
    "small": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        draft_vocab_size=4096,
        vocab_size=32768,
    ),
    # the anchor script's --toy shapes
    "toy": dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        draft_vocab_size=256,
        vocab_size=1024,
    ),
}


def shape_name(shape: dict) -> str:
    """The name of a shape: a named one's (SIZES), else its sizes (h2048-i12288-a32-kv4-d128-vd32000-v151936)."""
    for name, s in SIZES.items():
        if s == shape:
            return name
    return "h{}-i{}-a{}-kv{}-d{}-vd{}-v{}".format(*(shape[k] for k in SHAPE_KEYS))


def parse_shape(text: str) -> tuple[str, dict]:
    """--shape NAME (a key of SIZES) or H,I,heads,kv,head_dim,Vd,V -> (name, shape); ValueError
    saying why for anything else."""
    text = text.strip()
    if text in SIZES:
        return text, dict(SIZES[text])
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != len(SHAPE_KEYS):
        raise ValueError(
            f"{text!r}: a name ({', '.join(SIZES)}) or {len(SHAPE_KEYS)} integers H,I,heads,kv,head_dim,Vd,V"
        )
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"{text!r}: H,I,heads,kv,head_dim,Vd,V must be integers") from None
    if min(vals) < 1:
        raise ValueError(f"{text!r}: every size must be >= 1")
    shape = dict(zip(SHAPE_KEYS, vals))
    if shape["num_attention_heads"] % shape["num_key_value_heads"]:
        raise ValueError(
            f"{text!r}: heads ({shape['num_attention_heads']}) must be a multiple of the "
            f"key/value heads ({shape['num_key_value_heads']})"
        )
    if shape["draft_vocab_size"] > shape["vocab_size"]:
        raise ValueError(
            f"{text!r}: the draft vocab ({shape['draft_vocab_size']}) exceeds the vocab ({shape['vocab_size']})"
        )
    if shape["head_dim"] % 2:
        raise ValueError(f"{text!r}: head_dim must be even (the rope)")
    return shape_name(shape), shape


def shape_arg(shape: dict) -> str:
    """A shape as --shape takes it (the peers' runners too): H,I,heads,kv,head_dim,Vd,V."""
    return ",".join(str(shape[k]) for k in SHAPE_KEYS)


# each peer runs in a process of its own per shape (run_peers); files of peers measured several
# shapes per process lack the key and are refused by --peers-from
PEER_PROCESS = "per-shape"
# the length mix: log-normal (mu, sigma) in tokens, clipped to [64, max]: mean ~1.5K at max 2048
MIX_MU, MIX_SIGMA = 7.3065, 0.35


# ---- analytic FLOPs ---------------------------------------------------------------------------
def flops_per_token(cfg: DrafterConfig, T: int, steps: int, lm_head_trainable: bool) -> dict:
    """Model FLOPs per trained token (one multiply-add = 2 FLOPs), counted per TTT step.

    Forward, per token and TTT step j (0-based):
      q/k/v   2 * 2H * (heads*hd + 2*kv_heads*hd)      input is [embed | hidden], 2H wide
      o       2 * heads*hd * H
      mlp     2 * 3 * H * I                            gate, up, down
      attn    2 * 2 * heads*hd * ((T+1)/2 + j)         QK^T and PV; the TTT mask lets row p see
                                                       the p+1 causal step-0 keys and its own j
                                                       keys from steps 1..j
      lm_head 2 * H * Vd                               drafter head over the draft vocab
    once per token: fc 2 * 3H * H; target draft rows 2 * H * Vd (frozen, no grad: forward only).
    Training multipliers: weights that train = fwd + input grad + weight grad = 3x; frozen
    weights whose input needs a grad (lm_head when frozen) = 2x; fc's input (the target states)
    needs none = 2x; attention backward = 2x its forward (dQ, dK, dV, dP), so 3x; the target
    head = 1x. Flash recomputation, norms, rope, softmax and the optimizer are not counted.
    The full-vocab argmax mask adds 2 * H * (V - Vd) forward FLOPs (`mask_extra`), counted apart.
    This is the model's count, whatever the implementation skips: `executed` is what our step runs
    with the embedding half of q/k/v once per unroll (FastPath.embed_once: its fwd, input
    grad and weight grad over a table of T-1+steps rows instead of every step's T rows), for a
    hardware FLOP rate beside the MFU.
    """
    H, I = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    Vd, V = cfg.draft_vocab_size, cfg.vocab_size
    qkv = 2 * 2 * H * (q + 2 * kv)
    o = 2 * q * H
    mlp = 2 * 3 * H * I
    head = 2 * H * Vd
    attn = [2 * 2 * q * ((T + 1) / 2 + j) for j in range(steps)]
    fc = 2 * cfg.fc_in * H
    per_step_fwd = qkv + o + mlp + head
    train = model_flops(shape_of(cfg), T, steps, lm_head_trainable)  # the count MFU is measured with: one copy
    emb_half = 2 * H * (q + 2 * kv)
    executed = train - 3 * emb_half * (steps - (T - 1 + steps) / T)
    return {
        "train": train,
        "executed": executed,
        "mask_extra": 2 * H * (V - Vd),
        "target_draft_rows": head,
        "fwd_per_ttt_step_weights": per_step_fwd,
        "attn_fwd_per_ttt_step": attn,
        "fc_fwd": fc,
        "lm_head_trainable": lm_head_trainable,
    }


# ---- setup ------------------------------------------------------------------------------------
# the target head's rows outside the draft vocab scaled by this much: the target's greedy choice
# then lies in the draft vocab at (nearly) every row, as on real data, where the draft vocab holds
# the target's most frequent tokens; a head of equal rows puts it there at Vd / V of the rows only
# (1 in 5 at Kimi size), leaving 4 rows in 5 to no loss at all, which a step that skips uncounted
# rows (FastPath.skip_uncounted) would not compute
OFF_DRAFT_SCALE = 0.5


def build(size, dev, dtype, seed: int = 0, draft_argmax: bool = True):
    """(config, drafter, target head) of a shape (a SIZES name or a shape dict). draft_argmax: the
    head makes the greedy choice a draft id at nearly every row (the timing runs); off, an unbiased
    random head (the correctness checks: many rows masked)."""
    shape = SIZES[size] if isinstance(size, str) else size
    cfg = DrafterConfig(
        **shape, aux_layer_ids=[2, 30, 58], max_position_embeddings=131072, rope_theta=1e6, rms_norm_eps=1e-5
    )
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            d = Eagle3Drafter(cfg)
    finally:
        torch.set_default_dtype(old)
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    hot = torch.sort(torch.randperm(V)[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[hot] = True
    d.set_vocab_maps(hot - torch.arange(Vd), t2d)
    d.embed_loaded = True
    head = torch.randn(V, cfg.hidden_size, device=dev, dtype=dtype) * 0.02
    if draft_argmax:
        head[~t2d.to(dev)] *= OFF_DRAFT_SCALE
    return cfg, d, head.requires_grad_(False)


def argmax_in_draft_share(head, hot, batches, chunk: int = 2048) -> float:
    """The share of rows (valid ones) whose target greedy choice is a draft id."""
    t2d = torch.zeros(head.shape[0], dtype=torch.bool, device=head.device)
    t2d[hot.to(head.device)] = True
    hit = tot = 0
    for b in batches:
        with torch.no_grad():
            arg = fast_loss.target_stats(b.final, head, hot, chunk)[1]
        v = b.valid.bool()
        hit += int((t2d[arg] & v).sum())
        tot += int(v.sum())
    return hit / max(tot, 1)


def make_batch(cfg, B, T, dev, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    H = cfg.hidden_size
    ones = torch.ones(B, T, dtype=torch.bool, device=dev)
    return Batch(
        aux=torch.randn(B, T, cfg.fc_in, device=dev, dtype=dtype, generator=g),
        final=torch.randn(B, T, H, device=dev, dtype=dtype, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (B, T), device=dev, generator=g),
        loss_mask=ones,
        valid=ones.clone(),
        loss_share=1.0,
    )  # as Batch.to() reads a host batch


def sample_flops(cfg, lengths, steps, lm_head_trainable, key="train"):
    """Useful training FLOPs of samples of these lengths (each at its own length's count);
    key="executed": what the step runs with the embedding half once per unroll."""
    return sum(L * flops_per_token(cfg, L, steps, lm_head_trainable)[key] for L in lengths)


def fast_of(a, **kw) -> FastPath:
    """The fast path as this call's arguments set it (--packed-attention, --no-compile-tuning),
    with the fields in kw."""
    return FastPath(packed_attention=a.packed_attention or "auto", compile_tuning=a.compile_tuning, **kw)


class Variant:
    """One way of running our step: which levers are on."""

    def __init__(
        self,
        name,
        attn_fused=True,
        loss_fused=True,
        compiled=True,
        accumulate=True,
        adam="draftport",
        clip_in_adam=True,
        sync_each_step=False,
        lm_head="frozen",
        mask="computed",
        attn="flash",
        layout="seq",
        embed_once=True,
    ):
        self.name, self.attn_fused, self.loss_fused, self.compiled = name, attn_fused, loss_fused, compiled
        self.accumulate, self.adam, self.clip_in_adam = accumulate, adam, clip_in_adam
        self.sync_each_step, self.lm_head, self.mask = sync_each_step, lm_head, mask
        self.attn, self.layout, self.embed_once = attn, layout, embed_once

    def fast(self, a) -> FastPath:
        """How this variant computes the fast parts of its step (the fused unroll, and with
        loss_fused the fused loss)."""
        return fast_of(
            a,
            attention=self.attn,
            compile=self.compiled,
            embed_once=self.embed_once,
            accumulate_wgrad=self.accumulate and self.loss_fused,
        )

    def as_dict(self):
        return dict(
            name=self.name,
            attn_fused=self.attn_fused,
            loss_fused=self.loss_fused,
            compiled=self.compiled,
            accumulate_wgrad=self.accumulate,
            adam=self.adam,
            clip_in_adam=self.clip_in_adam,
            host_sync_each_step=self.sync_each_step,
            lm_head=self.lm_head,
            mask=self.mask,
            attention=self.attn,
            layout=self.layout,
            embed_once=self.embed_once,
        )


def run_variant(v: Variant, d, head, batches, a, dev, cfg, log, *, lengths=None, profile_name=None):
    """Warm up, then time full training steps (train.train_step). -> result dict.

    batches: [one batch] (a fixed shape: --warmup steps, then --iters timed) or several (a mix:
    one untimed pass over all, then --mix-passes timed ones, the rates at the median pass).
    lengths: the samples' lengths (the useful FLOPs); default every row of every batch is one
    sample."""
    cuda = dev.type == "cuda"
    d.lm_head.weight.requires_grad_(v.lm_head == "trainable")
    fast = v.fast(a)
    # the attention lever without the rest: the fast unroll under the reference loss
    if v.attn_fused and not v.loss_fused:
        d.unroll = functools.partial(fast_unroll, d, fast=fast)
    else:
        d.__dict__.pop("unroll", None)
    params = [p for p in d.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]
    if v.adam == "draftport" and cuda:  # what train() runs on CUDA: one compiled kernel per parameter
        opt = optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95))
    else:
        kw = {"fused": True} if (v.adam in ("fused", "draftport") and cuda) else {"foreach": True}
        opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), **kw)
    # both fused AdamWs divide the gradients by grad_scale as they read them: clipping goes there
    clip_inside = v.clip_in_adam and (isinstance(opt, optim.AdamW) or bool(opt.defaults.get("fused")))
    tcfg = TrainConfig(ttt_steps=a.ttt, gamma=a.gamma, grad_clip=1.0, train_lm_head=v.lm_head == "trainable")
    fast = fast if v.loss_fused else None
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(batch):
        # train.py's step: autocast (a no-op on bf16 weights, but what the loop runs), TTT terms,
        # combine, backward, clip, AdamW; no host sync (the loop reads stats at log steps only)
        loss, terms, counts, stats, gnorm = train_step(
            d, batch, head, opt, params, tcfg, fast=fast, use_bf16=cuda, clip_in_optimizer=clip_inside
        )
        if v.sync_each_step:  # what the loop did before: stats, finite check, grad norm each step
            stats = stats_to_float(stats)
            if not torch.isfinite(loss):
                raise RuntimeError("loss is not finite")
            float(gnorm)
        return loss, stats

    fixed = len(batches) == 1
    t_c = time.perf_counter()
    run = step
    for _ in range(a.warmup if fixed else 1):
        for b in batches:
            loss, stats = step(b)
    sync()
    warm_s = time.perf_counter() - t_c
    passes = 1 if fixed else max(1, getattr(a, "mix_passes", 1))
    order = batches * a.iters if fixed else list(batches) * passes
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)]
    t0 = time.perf_counter()
    for i, b in enumerate(order):
        if cuda:
            ev[i].record()
        loss, stats = run(b)
    if cuda:
        ev[-1].record()
    sync()
    wall = time.perf_counter() - t0
    times = (
        [ev[i].elapsed_time(ev[i + 1]) / 1e3 for i in range(len(order))] if cuda else [wall / len(order)] * len(order)
    )
    stats = stats_to_float(stats) if not v.sync_each_step else stats
    loss = float(loss.detach())
    total = sum(times)
    row_tokens = sum(b.tokens.numel() for b in order)
    real_tokens = sum(int(b.valid.sum()) for b in order)
    if lengths is None:
        lengths_run = [b.tokens.shape[1]] * sum(b.tokens.shape[0] for b in order)
    else:
        lengths_run = list(lengths) * (a.iters if fixed else passes)
    useful = sample_flops(cfg, lengths_run, a.ttt, v.lm_head == "trainable")
    # what the hardware ran: the embedding half once per unroll (fused unroll only), the mask
    executed = (
        sample_flops(cfg, lengths_run, a.ttt, v.lm_head == "trainable", "executed")
        if (v.embed_once and v.attn_fused)
        else useful
    )
    H, V, Vd = cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size
    mask_extra = 0 if v.mask != "computed" else 2 * H * (V - Vd) * real_tokens
    executed += mask_extra
    T = batches[0].tokens.shape[1]
    res = dict(
        v.as_dict(),
        trainable_params=n_train,
        rows=batches[0].tokens.shape[0],
        row_len=T,
        steps_timed=len(order),
        step_s=total / len(order),
        step_s_each=times,
        step_s_median=sorted(times)[len(times) // 2],
        tokens_per_s=row_tokens / total,
        real_tokens_per_s=real_tokens / total,
        real_fraction=real_tokens / row_tokens,
        gflop_per_token=useful / real_tokens / 1e9,
        mfu=useful / total / (a.peak_tflops * 1e12),
        mfu_with_mask=(useful + mask_extra) / total / (a.peak_tflops * 1e12),
        executed_gflop_per_token=executed / real_tokens / 1e9,
        hfu=executed / total / (a.peak_tflops * 1e12),
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        warmup_s=warm_s,
        loss=loss,
        acc_0=stats.get("acc_0"),
    )
    if not fixed and passes > 1:  # the mix: its steps summed per pass, the median pass
        n = len(batches)
        pass_s = [sum(times[i : i + n]) for i in range(0, len(times), n)]
        scale = total / passes / statistics.median(pass_s)  # the rates below, at the median pass
        res.update(passes=passes, pass_s=pass_s, step_s=statistics.median(pass_s) / n)
        for k in ("tokens_per_s", "real_tokens_per_s", "mfu", "mfu_with_mask", "hfu"):
            res[k] *= scale
    if fixed:  # one shape: the median step (the mix sums its steps)
        res["tokens_per_s"] = row_tokens / len(order) / res["step_s_median"]
        res["real_tokens_per_s"] = real_tokens / len(order) / res["step_s_median"]
        res["mfu"] = useful / len(order) / res["step_s_median"] / (a.peak_tflops * 1e12)
        res["mfu_with_mask"] = (useful + mask_extra) / len(order) / res["step_s_median"] / (a.peak_tflops * 1e12)
        res["hfu"] = executed / len(order) / res["step_s_median"] / (a.peak_tflops * 1e12)
    log(
        f"[ours] {v.name:52s} {res['real_tokens_per_s']:8.0f} real tok/s ({res['tokens_per_s']:.0f} rows)  "
        f"step {res['step_s_median'] * 1e3:7.1f} ms  mfu {res['mfu']:.3f} (with mask {res['mfu_with_mask']:.3f}, "
        f"hardware {res['hfu']:.3f})  "
        f"peak {res['peak_mem_gib'] or 0:.2f} GiB  warmup {warm_s:.1f}s  loss {loss:.4f}"
    )
    if a.profile_dir and cuda and profile_name:
        try:
            profile(lambda: step(batches[0]), Path(a.profile_dir) / f"profile_{profile_name}.txt", log)
        except Exception as e:  # a profiler problem must not cost the run
            log(f"[profile] failed: {e!r}")
    del opt
    d.zero_grad(set_to_none=True)
    d.__dict__.pop("unroll", None)
    if cuda:
        torch.cuda.empty_cache()
    return res


def safe_variant(*args, **kw):
    try:
        return run_variant(*args, **kw)
    except Exception as e:  # one lever failing must not cost the run
        import traceback

        args[6](f"[ours] {args[0].name}: FAILED {e!r}\n{traceback.format_exc()[-2500:]}")
        d = args[1]
        d.zero_grad(set_to_none=True)
        d.__dict__.pop("unroll", None)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return dict(args[0].as_dict(), failed=repr(e))


# attention first: FlashAttention's kernels carry "cutlass" in their template names
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "cudnn", "attn", "sdpa")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("compiled elementwise (triton)", ("triton_",)),
    ("copy / fill", ("copy", "fill", "memcpy", "memset", "catarray")),
)


ANNOTATIONS = ("Optimizer.", "## ", "Torch-Compiled Region", "ProfilerStep", "CompiledFunction")


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (eager elementwise, reductions)"


def kernel_breakdown(prof, wall_s: float, steps: int) -> dict:
    """GPU kernel time per step by kind (one stream: the rest of the wall time is the GPU idle)."""
    by, n = {}, {}
    gpu = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    # the optimizer's own range on the GPU timeline: draftport's AdamW runs compiled (triton_*)
    # kernels, which only their place in that range tells from the step's other compiled kernels
    opt_ranges = [(e.time_range.start, e.time_range.end) for e in gpu if e.name.startswith("Optimizer.step")]
    for e in gpu:
        # a kernel (or memcpy/memset) on the GPU; record_function ranges (Optimizer.step, compiled
        # regions) also appear on the GPU timeline as annotations over their kernels: not counted
        annotation = getattr(e, "is_user_annotation", False) or e.name.startswith(ANNOTATIONS)
        if not annotation:
            t = e.time_range.elapsed_us()
            k = kernel_kind(e.name)
            if any(s <= e.time_range.start < f for s, f in opt_ranges):
                k = "optimizer"
            by[k] = by.get(k, 0.0) + t / 1e6 / steps
            n[k] = n.get(k, 0) + 1
    busy = sum(by.values())
    step = wall_s / steps
    return {
        "step_s": step,
        "kernel_s": busy,
        "idle_s": max(0.0, step - busy),
        "by_kind_s": dict(sorted(by.items(), key=lambda kv: -kv[1])),
        "kernels_per_step": {k: v // steps for k, v in n.items()},
    }


def profile(step, path: Path, log):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    path.parent.mkdir(parents=True, exist_ok=True)
    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    try:
        table = ka.table(sort_by="device_time_total", row_limit=40, max_name_column_width=70)
    except Exception:
        table = ka.table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    try:  # the kernels themselves, by their own time (the table above mixes in the ops' ranges)
        kern = ka.table(sort_by="self_device_time_total", row_limit=90, max_name_column_width=90)
    except Exception:
        kern = ""
    table = table + "\n\n" + kern
    bd = kernel_breakdown(prof, wall, 2)
    lines = [
        f"per step (profiled, 2 steps): wall {bd['step_s'] * 1e3:.1f} ms, kernels {bd['kernel_s'] * 1e3:.1f} ms, "
        f"GPU idle {bd['idle_s'] * 1e3:.1f} ms"
    ]
    lines += [
        f"  {k:40s} {v * 1e3:8.2f} ms  {v / bd['step_s'] * 100:5.1f}%  ({bd['kernels_per_step'][k]} kernels)"
        for k, v in bd["by_kind_s"].items()
    ]
    summary = "\n".join(lines)
    path.write_text(summary + "\n\n" + table)
    log(f"[profile] {path.name}\n{summary}\n" + "\n".join(table.splitlines()[:22]))
    return bd


def gemm_probe(cfg, T, log):
    """cuBLAS bf16 rate at this model's GEMM shapes (M = tokens), against the peak used for MFU."""
    H, I, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim
    shapes = {
        "q/k/v fwd [T,2H]x[2H,q]": (T, 2 * H, q),
        "mlp up fwd [T,H]x[H,I]": (T, H, I),
        "mlp down fwd [T,I]x[I,H]": (T, I, H),
        "lm_head fwd [T,H]x[H,Vd]": (T, H, cfg.draft_vocab_size),
        "q/k/v wgrad [q,T]x[T,2H]": (q, T, 2 * H),
        "mlp wgrad [I,T]x[T,H]": (I, T, H),
        "8192^3": (8192, 8192, 8192),
    }
    out = {}
    for name, (m, k, n) in shapes.items():
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            x @ w
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            x @ w
        torch.cuda.synchronize()
        out[name] = 2 * m * k * n * 20 / (time.perf_counter() - t0) / 1e12
        del x, w
    log("[gemm] TFLOP/s " + "; ".join(f"{k} {v:.0f}" for k, v in out.items()))
    return out


def gemm_set(cfg, T: int, steps: int, lm_head_trainable: bool) -> list[tuple]:
    """The step's GEMMs as the model count has them (flops_per_token without the attention):
    (name, kind, M, K, N, count) with kind fwd (x[M,K] w^T), dgrad (dy[M,N] w) or wgrad
    (dy^T x: [N,M] x [M,K]), M the T rows of one sample. Per TTT step: q, k, v (over the
    [embed | hidden] input), o, gate, up, down, lm_head (its weight gradient when trained); once:
    fc (no input gradient: the target states) and the target's draft rows (forward only)."""
    H, I, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    out = []
    for name, K, N in (
        ("q", 2 * H, q),
        ("k", 2 * H, kv),
        ("v", 2 * H, kv),
        ("o", q, H),
        ("gate", H, I),
        ("up", H, I),
        ("down", I, H),
        ("lm_head", H, Vd),
    ):
        kinds = ("fwd", "dgrad") + (("wgrad",) if name != "lm_head" or lm_head_trainable else ())
        out += [(name, kind, T, K, N, steps) for kind in kinds]
    out += [("fc", "fwd", T, cfg.fc_in, H, 1), ("fc", "wgrad", T, cfg.fc_in, H, 1), ("target", "fwd", T, H, Vd, 1)]
    return out


def gemm_ceiling(cfg, T: int, steps: int, peak_tflops: float, log, reps: int = 10, dev=None) -> dict:
    """The step's GEMMs alone through cuBLAS (bf16, torch.mm, each shape timed apart: CUDA events
    around each of `reps` runs after 3 warm-ups, the median): per trainable set, the time they
    take summed over the step, their rate, and that rate over the peak: the MFU a step would
    reach if every model FLOP ran at cuBLAS's rate for these GEMMs (`mfu_ceiling`; the
    attention's FLOPs are not in the set). dev cpu (the tests): fp32, host clock. -> dict."""
    dev = torch.device(dev or "cuda")
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=dev).manual_seed(11)
    times = {}

    def rand(*size):
        return torch.randn(*size, device=dev, dtype=dt, generator=g)

    def time_one(kind, M, K, N):
        if kind == "fwd":  # x [M, K] @ w[N, K]^T
            a, b = rand(M, K), rand(N, K).t()
        elif kind == "dgrad":  # dy [M, N] @ w [N, K]
            a, b = rand(M, N), rand(N, K)
        else:  # dy^T [N, M] @ x [M, K]
            a, b = rand(M, N).t(), rand(M, K)
        for _ in range(3):
            torch.mm(a, b)
        if not cuda:
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.mm(a, b)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2 * reps)]
        for i in range(reps):
            ev[2 * i].record()
            torch.mm(a, b)
            ev[2 * i + 1].record()
        torch.cuda.synchronize()
        return statistics.median(ev[2 * i].elapsed_time(ev[2 * i + 1]) / 1e3 for i in range(reps))

    out = {"rows": T, "how": f"each GEMM shape alone, torch.mm {str(dt)[6:]}, the median of {reps} timings", "sets": {}}
    for trained in (False, True):
        total_s = total_f = 0.0
        rows = []
        for name, kind, M, K, N, count in gemm_set(cfg, T, steps, trained):
            key = (kind, M, K, N)
            if key not in times:
                times[key] = time_one(*key)
            f = 2 * M * K * N
            total_s += count * times[key]
            total_f += count * f
            rows.append(
                {
                    "gemm": name,
                    "kind": kind,
                    "M": M,
                    "K": K,
                    "N": N,
                    "count": count,
                    "s": times[key],
                    "tflops": f / times[key] / 1e12,
                }
            )
        rate = total_f / total_s
        out["sets"]["trainable" if trained else "frozen"] = {
            "gemm_s": total_s,
            "gemm_flop": total_f,
            "tflops": rate / 1e12,
            "mfu_ceiling": rate / (peak_tflops * 1e12),
            "gemm_only_tokens_per_s": T / total_s,
            "gemms": rows,
        }
    fr, tr = out["sets"]["frozen"], out["sets"]["trainable"]
    log(
        f"[ceiling] T {T}: the step's GEMMs alone through cuBLAS: lm_head frozen {fr['gemm_s'] * 1e3:.1f} ms at "
        f"{fr['tflops']:.0f} TFLOP/s (MFU ceiling {fr['mfu_ceiling']:.3f}), trained {tr['gemm_s'] * 1e3:.1f} ms at "
        f"{tr['tflops']:.0f} TFLOP/s ({tr['mfu_ceiling']:.3f}); slowest per FLOP: "
        + ", ".join(
            f"{r['gemm']} {r['kind']} {r['tflops']:.0f}" for r in sorted(tr["gemms"], key=lambda r: r["tflops"])[:4]
        )
    )
    return out


def mix_gemm_ceiling(cfg, batches, a, log, dev=None) -> dict:
    """The real-token rate of the mix's packed rows if each step were its GEMMs alone at cuBLAS's
    rate (gemm_ceiling at each row's token count, stored mask), per trainable set."""
    by_rows, real, secs = {}, 0, {"frozen": 0.0, "trainable": 0.0}
    for b in batches:
        M = b.tokens.numel()
        if M not in by_rows:
            by_rows[M] = gemm_ceiling(cfg, M, a.ttt, a.peak_tflops, log, dev=dev)["sets"]
        for k in secs:
            secs[k] += by_rows[M][k]["gemm_s"]
        real += int(b.valid.sum())
    out = {k: {"gemm_s": v, "real_tokens_per_s": real / v} for k, v in secs.items()}
    log(
        f"[ceiling] mix ({len(batches)} packed steps, {real} real tokens): the GEMMs alone at cuBLAS's rate "
        f"{out['frozen']['real_tokens_per_s']:.0f} real tok/s lm_head frozen, "
        f"{out['trainable']['real_tokens_per_s']:.0f} trained"
    )
    return out


def check_equivalence(a, dev, log):
    """Fused path vs reference on one small problem: loss and gradients.

    On CUDA both run in bf16 and are compared with the reference in fp32 on the same weights
    (bf16 rounding alone moves gradients by percents; the fused path must not move them more);
    the attention alone is compared with an fp32 reference too. On CPU both run in fp32."""
    cuda = dev.type == "cuda"
    size = "small" if cuda else "toy"
    cfg, d, head = build(size, dev, torch.float32, seed=1, draft_argmax=False)
    d.lm_head.weight.requires_grad_(True)
    batch = make_batch(cfg, 2, 256 if cuda else 24, dev, torch.float32, seed=1)
    batch.valid[1, -17:] = False
    batch.loss_mask[1, -17:] = False

    def run(fused, dtype):
        d.to(dtype)
        b = Batch(batch.aux.to(dtype), batch.final.to(dtype), batch.tokens, batch.loss_mask, batch.valid)
        d.zero_grad(set_to_none=True)
        fast = fast_of(a, accumulate_wgrad=True, target_chunk=96, loss_chunk=96) if fused else None
        terms = ttt_terms(d, b, head.to(dtype), a.ttt, fast)
        loss, _ = combine(terms, a.gamma)
        loss.backward()
        return float(loss.detach()), {n: p.grad.float().clone() for n, p in d.named_parameters() if p.grad is not None}

    def err(g, ref):
        rel = {k: float((g[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)) for k in ref}
        worst = max(rel, key=rel.get)
        return rel[worst], worst, sum(rel.values()) / len(rel)

    res = {"size": size}
    if cuda:
        l32, g32 = run(False, torch.float32)
        lr, gr = run(False, torch.bfloat16)
        lf, gf = run(True, torch.bfloat16)
        er, ef = err(gr, g32), err(gf, g32)
        res.update(
            loss_fp32_reference=l32,
            loss_reference=lr,
            loss_fused=lf,
            loss_rel_err=abs(lf - l32) / abs(l32),
            grad_rel_err_max=ef[0],
            grad_rel_err_worst_param=ef[1],
            grad_rel_err_mean=ef[2],
            ref_bf16_grad_rel_err_max=er[0],
            ref_bf16_grad_rel_err_mean=er[2],
        )
        # the attention alone, bf16 fused vs fp32 reference on the same (upcast) inputs
        g = torch.Generator(device=dev).manual_seed(3)
        B, h, T, hd = 1, 4, 512, 128
        qkv = [torch.randn(B, h, T, hd, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(9)]
        q, ks, vs = qkv[0], qkv[1:5], qkv[5:9]
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        bias = torch.zeros(1, 1, T, T, device=dev).masked_fill(~causal, float("-inf"))
        outs = []
        for name, tensors in (("fp32", [t.float() for t in qkv]), ("fused", list(qkv))):
            ts = [t.clone().requires_grad_(True) for t in tensors]
            if name == "fp32":
                o = d.midlayer.self_attn.attend_core(ts[0], ts[1:5], ts[5:9], bias)
            else:
                o = ttt_attention(ts[0], ts[1:5], ts[5:9], 1 / math.sqrt(hd), fast=fast_of(a))
            go = torch.ones_like(o) * torch.linspace(-1, 1, o.shape[-1], device=dev, dtype=o.dtype)
            grads = torch.autograd.grad((o * go).sum(), ts)
            outs.append((o.detach().float(), [x.float() for x in grads]))
        (o32, g32a), (of, gfa) = outs
        res["attn_out_rel_err"] = float((of - o32).norm() / o32.norm())
        res["attn_grad_rel_err_max"] = max(float((x - y).norm() / y.norm()) for x, y in zip(gfa, g32a))
        log(
            f"[check] {size}: loss fp32 {l32:.5f} ref-bf16 {lr:.5f} fused-bf16 {lf:.5f}; grad rel err vs fp32: "
            f"fused max {ef[0]:.2e} mean {ef[2]:.2e} ({ef[1]}), ref-bf16 max {er[0]:.2e} mean {er[2]:.2e}; "
            f"attention alone: out {res['attn_out_rel_err']:.2e}, grads max {res['attn_grad_rel_err_max']:.2e}"
        )
    else:
        lr, gr = run(False, torch.float32)
        lf, gf = run(True, torch.float32)
        ef = err(gf, gr)
        res.update(
            loss_reference=lr,
            loss_fused=lf,
            loss_rel_err=abs(lf - lr) / abs(lr),
            grad_rel_err_max=ef[0],
            grad_rel_err_worst_param=ef[1],
            grad_rel_err_mean=ef[2],
        )
        log(f"[check] {size}: loss ref {lr:.5f} fused {lf:.5f}; worst grad rel err {ef[0]:.2e} ({ef[1]})")
    del d, head
    return res


def time_target_side(cfg, head, batch, hot, a, dev, log):
    """The target side alone: full-vocab head (argmax mask + draft softmax) vs draft rows only."""
    if dev.type != "cuda":
        return None
    sub = head.index_select(0, hot)
    out = {}
    for name, h in (("full_vocab_head", head), ("draft_rows_only", sub)):
        for _ in range(2):
            fast_loss.target_stats(batch.final, h, torch.arange(hot.numel(), device=dev) if h is sub else hot, a.chunk)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fast_loss.target_stats(batch.final, h, torch.arange(hot.numel(), device=dev) if h is sub else hot, a.chunk)
        torch.cuda.synchronize()
        out[name + "_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    log(
        f"[target] full-vocab head {out['full_vocab_head_ms']:.2f} ms/step, draft rows only "
        f"{out['draft_rows_only_ms']:.2f} ms/step"
    )
    del sub
    return out


def check_packed(a, dev, log):
    """Packed rows vs the padded batch of the same samples: loss and gradients.

    CUDA: the fused path in bf16 on packed rows (variable-length flash over cu_seqlens) and on
    the padded batch, each against the reference in fp32 on the padded batch; the packed error
    must stay at the padded one's (bf16 rounding). CPU: fp32, both fused paths against the
    reference. Also the attention alone: per-segment kernel vs a dense document mask (fp32)."""
    cuda = dev.type == "cuda"
    size = "small" if cuda else "toy"
    cfg, d, head = build(size, dev, torch.float32, seed=2, draft_argmax=False)
    d.lm_head.weight.requires_grad_(True)
    lens = [200, 131, 300, 90, 257] if cuda else [19, 7, 24, 11]
    g = torch.Generator(device=dev).manual_seed(4)
    H = cfg.hidden_size
    samples = []
    for n in lens:
        lm = torch.zeros(n, dtype=torch.bool, device=dev)
        lm[3:] = True
        samples.append(
            {
                "tokens": torch.randint(0, cfg.vocab_size, (n,), device=dev, generator=g),
                "loss_mask": lm,
                "aux": torch.randn(n, cfg.fc_in, device=dev, generator=g),
                "final": torch.randn(n, H, device=dev, generator=g),
                "response_start": 3,
            }
        )

    def run(batch, fused, dtype):
        d.to(dtype)
        b = batch.to(dev, dtype)
        d.zero_grad(set_to_none=True)
        fast = fast_of(a, accumulate_wgrad=True, target_chunk=96, loss_chunk=96) if fused else None
        loss, _ = combine(ttt_terms(d, b, head.to(dtype), a.ttt, fast), a.gamma)
        loss.backward()
        return float(loss.detach()), {n: p.grad.float().clone() for n, p in d.named_parameters() if p.grad is not None}

    def err(r, ref):
        rel = [float((r[1][k] - ref[1][k]).norm() / ref[1][k].norm().clamp_min(1e-30)) for k in ref[1]]
        return abs(r[0] - ref[0]) / abs(ref[0]), max(rel)

    padded = collate([{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()} for s in samples])[0]
    packed = pack(
        [{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()} for s in samples],
        row_len=sum(lens) // 2 + 16 if not cuda else 512,
    )[0]
    dt = torch.bfloat16 if cuda else torch.float32
    ref = run(padded, False, torch.float32)
    e_pad = err(run(padded, True, dt), ref)
    e_pack = err(run(packed, True, dt), ref)
    res = {
        "size": size,
        "lengths": lens,
        "packed_rows": list(packed.tokens.shape),
        "dtype": str(dt),
        "padded_fused_loss_rel_err": e_pad[0],
        "padded_fused_grad_rel_err_max": e_pad[1],
        "packed_fused_loss_rel_err": e_pack[0],
        "packed_fused_grad_rel_err_max": e_pack[1],
    }
    # the attention alone: per-segment kernel (dtype) vs dense document mask (fp32)
    B, h, T, hd = 2, 4, 384 if cuda else 40, cfg.head_dim
    cu = [0, 100, 250, T, T + 17, 2 * T] if cuda else [0, 9, 30, T, T + 5, 2 * T]
    doc = torch.zeros(B * T, dtype=torch.long, device=dev)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        doc[s:e] = i
    doc = doc.view(B, T)
    ts = [torch.randn(B, h, T, hd, device=dev, generator=g) for _ in range(7)]
    keep = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & (doc[:, :, None] == doc[:, None, :])
    bias = torch.zeros(B, 1, T, T, device=dev).masked_fill(~keep[:, None], float("-inf"))
    outs = []
    for name, dtype in (("fp32", torch.float32), ("seg", dt)):
        x = [t.to(dtype).clone().requires_grad_(True) for t in ts]
        if name == "fp32":
            o = d.midlayer.self_attn.attend_core(x[0], x[1:4], x[4:7], bias)
        else:
            o = ttt_attention(
                x[0],
                x[1:4],
                x[4:7],
                1 / math.sqrt(hd),
                Segments(cu, max(e - s for s, e in zip(cu[:-1], cu[1:]))),
                fast=fast_of(a),
            )
        go = torch.linspace(-1, 1, o.shape[-1], device=dev, dtype=o.dtype).expand_as(o)
        grads = torch.autograd.grad((o * go).sum(), x)
        outs.append((o.detach().float(), [t.float() for t in grads]))
    (o32, g32), (os_, gs) = outs
    res["seg_attn_out_rel_err"] = float((os_ - o32).norm() / o32.norm())
    res["seg_attn_grad_rel_err_max"] = max(float((x - y).norm() / y.norm()) for x, y in zip(gs, g32))
    log(
        f"[check-packed] {size} {dt}: vs fp32 reference on the padded batch: padded fused loss {e_pad[0]:.2e} "
        f"grads {e_pad[1]:.2e}; packed fused loss {e_pack[0]:.2e} grads {e_pack[1]:.2e}; segment attention "
        f"out {res['seg_attn_out_rel_err']:.2e} grads {res['seg_attn_grad_rel_err_max']:.2e}"
    )
    del d, head
    return res


class _HeadDim:
    def __init__(self, hd):
        self.head_dim = hd


def attention_probe(seqs, dev, log, h=64, hd=128, n_diag=3, reps=5):
    """The dense causal part's kernel: flash vs cuDNN, TTT attention fwd+bwd with n_diag diagonal
    keys at each length (bf16), h heads of hd (the shape's), and each one's error against fp32
    at 512 rows. -> dict."""
    out = {}
    if dev.type != "cuda":
        return out
    g = torch.Generator(device=dev).manual_seed(5)
    for backend in ("flash", "cudnn"):
        fast = FastPath(attention=backend)
        r = {}
        try:
            T = 512
            xs = [torch.randn(1, h, T, hd, device=dev, generator=g) for _ in range(1 + 2 * (n_diag + 1))]
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
            bias = torch.zeros(1, 1, T, T, device=dev).masked_fill(~causal, float("-inf"))
            res = []
            for fp in (True, False):
                x = [t.clone().requires_grad_(True) if fp else t.to(torch.bfloat16).requires_grad_(True) for t in xs]
                ks, vs = x[1 : 2 + n_diag], x[2 + n_diag :]
                if fp:
                    o = Attention.attend_core(_HeadDim(hd), x[0], ks, vs, bias)
                else:
                    o = ttt_attention(x[0], ks, vs, 1 / math.sqrt(hd), fast=fast)
                go = torch.linspace(-1, 1, o.shape[-1], device=dev).to(o.dtype).expand_as(o)
                grads = torch.autograd.grad((o * go).sum(), x)
                res.append((o.detach().float(), [t.float() for t in grads]))
            (o32, g32), (ob, gb) = res
            r["out_rel_err"] = float((ob - o32).norm() / o32.norm())
            r["grad_rel_err_max"] = max(float((a_ - b_).norm() / b_.norm()) for a_, b_ in zip(gb, g32))
            for T in seqs:
                xs = [
                    torch.randn(1, h, T, hd, device=dev, generator=g, dtype=torch.bfloat16).requires_grad_(True)
                    for _ in range(1 + 2 * (n_diag + 1))
                ]
                ks, vs = xs[1 : 2 + n_diag], xs[2 + n_diag :]
                go = torch.randn(1, T, h * hd, device=dev, dtype=torch.bfloat16, generator=g)

                def fb():
                    o = ttt_attention(xs[0], ks, vs, 1 / math.sqrt(hd), fast=fast)
                    torch.autograd.grad(o, xs, go)

                for _ in range(2):
                    fb()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fb()
                torch.cuda.synchronize()
                r[f"fwd_bwd_ms_{T}"] = (time.perf_counter() - t0) / reps * 1e3
                del xs, ks, vs, go
        except Exception as e:
            r["failed"] = repr(e)[:500]
        out[backend] = r
    ok = "failed" not in out.get("cudnn", {"failed": 1}) and (
        out["cudnn"]["grad_rel_err_max"] <= 1.5 * out["flash"]["grad_rel_err_max"] + 1e-3
    )
    faster = ok and all(out["cudnn"][f"fwd_bwd_ms_{T}"] < 0.97 * out["flash"][f"fwd_bwd_ms_{T}"] for T in seqs)
    out["chosen"] = "cudnn" if faster else "flash"
    log(
        "[attn] TTT attention fwd+bwd (3 diagonal keys), ms: "
        + "; ".join(
            f"{b} "
            + ", ".join(f"{k[11:]}: {v:.2f}" for k, v in out[b].items() if k.startswith("fwd_bwd"))
            + (
                f" (err out {out[b].get('out_rel_err', 0):.1e} grads {out[b].get('grad_rel_err_max', 0):.1e})"
                if "failed" not in out[b]
                else f" FAILED {out[b]['failed'][:200]}"
            )
            for b in ("flash", "cudnn")
        )
        + f" -> {out['chosen']}"
    )
    return out


def mix_lengths(n, max_len, seed, min_len=64):
    """n sample lengths, log-normal (MIX_MU, MIX_SIGMA) clipped to [min_len, max_len] (max_len < 2048:
    the same shape scaled to it, for toy runs)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(MIX_MU + MIX_SIGMA * torch.randn(n, generator=g, dtype=torch.float64)) * (max_len / 2048)
    return [int(v) for v in x.round().clamp(min(min_len, max_len // 4), max_len).tolist()]


def mix_prompts(lengths, prompt_share=0.0) -> list[int]:
    """The prompt (no-loss) rows at the head of each mix sample: 16 tokens (a quarter of a
    shorter sample), or with prompt_share > 0 that share of the sample's tokens, at least that."""
    return [max(min(16, n // 4), int(round(prompt_share * n))) for n in lengths]


def mix_samples(cfg, lengths, dev, dtype, seed=7, prompt_share=0.0):
    """Synthetic samples (FeatureSet.sample dicts) of these lengths, on the device: assistant
    tokens after the prompt mix_prompts gives."""
    g = torch.Generator(device=dev).manual_seed(seed)
    out = []
    for n, rs in zip(lengths, mix_prompts(lengths, prompt_share)):
        lm = torch.zeros(n, dtype=torch.bool, device=dev)
        lm[rs:] = True
        out.append(
            {
                "tokens": torch.randint(0, cfg.vocab_size, (n,), device=dev, generator=g),
                "loss_mask": lm,
                "aux": torch.randn(n, cfg.fc_in, device=dev, dtype=dtype, generator=g),
                "final": torch.randn(n, cfg.hidden_size, device=dev, dtype=dtype, generator=g),
                "response_start": rs,
            }
        )
    return out


def layout_mix(samples, pack_len, pad_batch, dtype):
    """-> (packed: one PackedBatch of one row per step, padded: one collate Batch of pad_batch
    samples per step, in the mix's order), each with the samples' lengths in step order.

    Packed: the samples grouped first-fit decreasing into steps of at most pack_len tokens (as
    speculators' sampler groups them into its rows), each step's samples in one row as train()
    packs them: their total length rounded up to packing.ROW_MULTIPLE, not padded to pack_len."""
    lens = [int(s["tokens"].shape[0]) for s in samples]
    packed, packed_lens = [], []
    for row in plan_rows(lens, pack_len):
        b, _ = pack([samples[i] for i in row], multiple=ROW_MULTIPLE, dtype=dtype)
        packed.append(b)
        packed_lens += [lens[i] for i in row]
    padded, padded_lens = [], []
    for s in range(0, len(samples), pad_batch):
        grp = samples[s : s + pad_batch]
        padded.append(collate(grp, dtype)[0])
        padded_lens += [int(x["tokens"].shape[0]) for x in grp]
    return (packed, packed_lens), (padded, padded_lens)


def with_stored_mask(batches, head, hot, chunk):
    """The batches with the target's greedy choice attached (as the data step stores it)."""
    for b in batches:
        with torch.no_grad():
            b.target_arg = fast_loss.target_stats(b.final, head, hot, chunk)[1]
    return batches


def counted_share(batches, t2d, steps: int) -> float:
    """The share of row slots the TTT loss counts, over the steps (batches with target_arg)."""
    hit = tot = 0
    for b in batches:
        in_draft = t2d.to(b.target_arg.device)[b.target_arg]
        for j in range(steps):
            hit += int(counted_rows(b, in_draft, j + 1).sum())
            tot += b.tokens.numel()
    return hit / max(tot, 1)


def run_peer(name, cmd, timeout, log, info=None) -> list[dict]:
    """A peer's runner in a subprocess; -> its JSON records (those printed before any timeout).
    info (a dict): gets wall_s, status ("done", "timed out", "failed (rc N)")."""
    log(f"[{name}] {' '.join(cmd)}  (timeout {timeout:.0f}s)")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timed_out = False
    try:
        out, err = p.communicate(timeout=max(timeout, 10))
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        timed_out = True
    recs = []
    for ln in (out or "").splitlines():
        if ln.startswith("{"):
            try:
                recs.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
    wall = time.perf_counter() - t0
    for r in recs:
        tag = r.get("config") + (f"/{r['set']}" if "set" in r else "")
        log(
            f"[{name}] {tag:16s} {r['real_tokens_per_s']:8.0f} real tok/s  "
            f"step {r.get('step_s_median', r.get('step_s_total', 0)) * 1e3:7.1f} ms  trainable "
            f"{r['trainable_params'] / 1e6:.1f}M  lm_head {'trained' if r['lm_head_trainable'] else 'frozen'}  "
            f"peak {r.get('peak_mem_gib') or 0:.2f} GiB  warmup {r.get('warmup_s', 0):.1f}s"
        )
    if info is not None:
        info.update(
            wall_s=wall,
            records=len(recs),
            status="timed out" if timed_out else ("done" if p.returncode == 0 else f"failed (rc {p.returncode})"),
        )
    if timed_out or p.returncode != 0:
        log(
            f"[{name}] {'timed out' if timed_out else f'failed (rc {p.returncode})'} after {wall:.0f}s; "
            f"stderr tail:\n{(err or '')[-2500:]}"
        )
    else:
        log(f"[{name}] done in {wall:.0f}s")
    return recs


def versions():
    out = {"torch": torch.__version__, "python": platform.python_version()}
    from importlib.metadata import version

    for pkg in ("speculators", "specforge", "transformers", "triton"):
        try:
            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    try:
        out["cudnn"] = torch.backends.cudnn.version()
    except Exception:
        pass
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape",
        default=None,
        metavar="NAME|H,I,heads,kv,head_dim,Vd,V",
        help="the drafter's shape: a name (" + ", ".join(SIZES) + ") or its sizes; default kimi on "
        "CUDA, toy on CPU; the peers' runners get the same",
    )
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="a named shape (--shape NAME)")
    ap.add_argument("--seqs", type=int, nargs="*", default=None, help="2048 4096 on CUDA, 64 on CPU")
    ap.add_argument("--seq", type=int, default=None, help="one length only (--seqs T)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=2048, help="rows per chunk of the fused loss / target")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--lm-head", choices=["frozen", "trainable", "both"], default="both")
    ap.add_argument(
        "--impl",
        choices=["compiled", "fused", "reference"],
        default=None,
        help="compiled (CUDA default): fused attention + fused loss + compiled regions",
    )
    ap.add_argument(
        "--attn-backend",
        choices=["auto", "flash", "cudnn", "fa4"],
        default="auto",
        help="the dense causal part's kernel; auto: the faster of flash and cudnn at these "
        "lengths (timed first), flash if cuDNN fails its check; fa4: FlashAttention-4 "
        "(flash-attn-4 installed; packed rows through its varlen kernel)",
    )
    ap.add_argument(
        "--packed-attention",
        choices=["auto", "varlen", "segments"],
        default=None,
        help="packed rows' causal part on CUDA: the varlen kernel (flash's, or fa4's under fa4) or "
        "the dense kernel (--attn-backend's) once per segment; auto (draftport's default): "
        "segments under cudnn",
    )
    ap.add_argument("--mix", type=int, default=None, help="samples in the length mix (0: none; 20 on CUDA, 8 on CPU)")
    ap.add_argument("--mix-max", type=int, default=None, help="longest sample (2048; 64 on CPU)")
    ap.add_argument("--mix-seed", type=int, default=1)
    ap.add_argument(
        "--mix-prompt-share",
        type=float,
        default=0.0,
        help="each mix sample's first share of tokens a prompt, no loss there, ours and the peers' "
        "(0: 16-token prompts in ours, none in the peers')",
    )
    ap.add_argument(
        "--mix-passes",
        type=int,
        default=3,
        help="timed passes over the mix, ours and the peers' (each figure: real tokens over its median pass)",
    )
    ap.add_argument(
        "--pack-len",
        type=int,
        default=None,
        help="tokens per packed step (8192 as speculators' default total_seq_len; 128 on CPU)",
    )
    ap.add_argument("--pad-batch", type=int, default=4, help="samples per padded step on the mix")
    ap.add_argument("--levers-all", action="store_true", help="levers at every length (default: the first)")
    ap.add_argument(
        "--no-levers",
        dest="levers",
        action="store_false",
        help="skip the levers timed at every length (the embedding half at every step, torch's fused AdamW)",
    )
    ap.add_argument(
        "--no-compile-tuning",
        dest="compile_tuning",
        action="store_false",
        help="compile ours with inductor's defaults, not draftport's coordinate-descent tuning "
        "(FastPath.compile_tuning, train.fast.compile_tuning; the eighth pair and earlier ran "
        "without it)",
    )
    ap.add_argument("--mix-computed", action="store_true", help="also the mix with the mask computed")
    ap.add_argument("--ladder", action="store_true", help="also time each lever on and off")
    ap.add_argument("--check", action="store_true", help="fused vs reference (and packed vs padded) first")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument(
        "--gemm-probe",
        action="store_true",
        help="also time cuBLAS at a few of the model's GEMM "
        "shapes and 8192^3 (the GEMM ceiling of the whole step is timed on CUDA whatever this says)",
    )
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-speculators", action="store_true")
    ap.add_argument("--no-specforge", action="store_true")
    ap.add_argument("--peer-iters", type=int, default=5)
    ap.add_argument("--peer-warmup", type=int, default=2)
    ap.add_argument("--spec-loss", default="eager", help="speculators' --loss-impl (fused fails on torch 2.11)")
    ap.add_argument("--spec-attn", default=None, help="speculators' attention (simple_flex_attention)")
    ap.add_argument("--sf-attn", default=None, help="SpecForge's attention backend (flex_attention)")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall budget of the whole run (peers' timeouts shrink to fit it; default 560 on CUDA)",
    )
    ap.add_argument(
        "--peers-only",
        action="store_true",
        help="run only the peers (none of ours, no "
        "probe, no levers) and write their records to --json, for --peers-from in a later call",
    )
    ap.add_argument(
        "--peers-from",
        default=None,
        metavar="FILE",
        help="run no peer: score ours against the "
        "peers' records in FILE (from --peers-only, or a full results file) as if they had run here",
    )
    ap.add_argument(
        "--speculators-share",
        type=float,
        default=0.55,
        help="--peers-only: the part of the "
        "budget left that speculators (run first) may use when SpecForge runs after it",
    )
    ap.add_argument(
        "--json",
        default=None,
        help="write the result here ({date} and {shape} in it are "
        "filled in: benchmarks/results/{date}-h200-train-{shape}.json)",
    )
    ap.add_argument(
        "--merge-peers",
        nargs="+",
        default=None,
        metavar="FILE",
        help="merge the peer files of "
        "several calls on one machine (each peer from the last file that measured it) into --json; "
        "nothing runs",
    )
    ap.add_argument(
        "--rescore",
        default=None,
        help="recompute the ratios and goals of this results file "
        "from its records, in place (no run); with --peers-from, against that file's peers",
    )
    ap.add_argument("--log", default=None, help="also write the printed lines here ({date}, {shape} as --json)")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.shape and a.size:
        ap.error("--shape and --size name the same thing: give one")
    try:
        a.size, a.shape = parse_shape(a.shape or a.size or ("kimi" if cuda else "toy"))
    except ValueError as e:
        ap.error(f"--shape {e}")
    # the lengths follow the device: a CPU runs toy lengths whatever the shape
    small = not cuda
    a.seqs = [a.seq] if a.seq else (a.seqs or ([64] if small else [2048, 4096]))
    a.impl = a.impl or ("compiled" if cuda else "fused")
    a.mix = (8 if small else 20) if a.mix is None else a.mix
    a.mix_max = a.mix_max or (64 if small else 2048)
    a.pack_len = a.pack_len or (128 if small else 8192)
    stamp = {"date": time.strftime("%Y-%m-%d"), "shape": a.size}
    a.json = a.json.format(**stamp) if a.json else a.json
    a.log = a.log.format(**stamp) if a.log else a.log
    a.budget_s = a.budget_s or (560.0 if cuda else 3600.0)
    if a.no_peers:
        a.no_speculators = a.no_specforge = True
    if a.peers_only and a.peers_from:
        ap.error("--peers-only and --peers-from exclude each other")
    if a.peers_only and a.no_speculators and a.no_specforge:
        ap.error("--peers-only with no peer to run")
    return a


def requested_peers(a) -> list[str]:
    return [p for p, off in (("speculators", a.no_speculators), ("specforge", a.no_specforge)) if not off]


def run_key(a) -> dict:
    """What the peers' figures depend on in this run: a --peers-from file must have the same."""
    mix = None
    if a.mix:
        mix = {
            "lengths": mix_lengths(a.mix, a.mix_max, a.mix_seed),
            "pack_len": a.pack_len,
            "timed_passes": a.mix_passes,
            "prompt_share": a.mix_prompt_share,
        }
    return {
        "shape": {k: a.shape[k] for k in SHAPE_KEYS},
        "seqs": [int(t) for t in a.seqs],
        "ttt_steps": a.ttt,
        "mix": mix,
        "target_off_draft_scale": OFF_DRAFT_SCALE,
        "peer_process": PEER_PROCESS,
    }


def file_key(res: dict) -> dict:
    """run_key() of a results file (--peers-only or a full run): its config and mix."""
    c, m = res.get("config") or {}, res.get("mix")
    # every file's config holds the shape's sizes (those of SIZES[config.size] before --shape)
    return {
        "shape": {k: c.get(k) for k in SHAPE_KEYS},
        "seqs": [int(t) for t in (c.get("seqs") or [])],
        "ttt_steps": c.get("ttt_steps"),
        "mix": None
        if not m
        else {
            "lengths": m.get("lengths"),
            "pack_len": m.get("pack_len"),
            "timed_passes": m.get("timed_passes", 1),
            "prompt_share": m.get("prompt_share", 0.0),
        },
        "target_off_draft_scale": c.get("target_off_draft_scale"),
        "peer_process": c.get("peer_process"),
    }


def read_peer_file(path: str, refuse) -> dict:
    """A results file holding peers' records, or refuse(why) when it is missing, is not JSON or
    has no peers_raw."""
    p = Path(path)
    if not p.is_file():
        refuse("no such file")
    try:
        src = json.loads(p.read_text())
    except (ValueError, OSError) as e:
        refuse(f"not JSON ({str(e).splitlines()[0][:120]})")
    if not isinstance(src, dict) or not isinstance(src.get("peers_raw"), dict):
        refuse("no peers_raw in it")
    return src


def load_peers(path: str, a) -> dict:
    """The peers' records of a --peers-only (or full) results file; a one-line SystemExit (exit 1)
    when the file is missing, is not JSON, has no peers_raw, or measured other work."""

    def refuse(why):
        raise SystemExit(f"bench_train_h200.py: --peers-from {path}: {why}")

    src = read_peer_file(path, refuse)
    want, got = run_key(a), file_key(src)
    diff = [k for k in want if want[k] != got[k]]
    if diff:

        def short(v):
            s = json.dumps(v)
            return s if len(s) <= 60 else s[:57] + "..."

        refuse(
            "its config differs from this run's (the ratios would compare different work): "
            + "; ".join(f"{k} {short(got[k])} there, {short(want[k])} here" for k in diff)
        )
    return src


def merge_peers(files: list[str], dest: str | None) -> dict:
    """--merge-peers: peer files of several calls on one machine as one (each peer's records and
    run from the last file that measured it; a run that failed with no records fills nothing),
    written to dest for --peers-from. A one-line SystemExit for a file that is missing, not
    JSON, without peers_raw, or of other work or another device than the first."""
    srcs = []
    for f in files:

        def refuse(why, f=f):
            raise SystemExit(f"bench_train_h200.py: --merge-peers {f}: {why}")

        src = read_peer_file(f, refuse)
        if srcs and file_key(src) != file_key(srcs[0][1]):
            refuse(f"its config differs from {files[0]}'s (different work)")
        if srcs and src.get("device") != srcs[0][1].get("device"):
            refuse(f"measured on {src.get('device')}, {files[0]} on {srcs[0][1].get('device')}")
        srcs.append((f, src))
    out = json.loads(json.dumps(srcs[0][1]))
    out["peers_raw"], out["peer_runs"], out["merged_from"] = {}, {}, []
    for f, src in srcs:
        got = [name for name, recs in src["peers_raw"].items() if recs]
        for name in got:
            out["peers_raw"][name] = src["peers_raw"][name]
            out["peer_runs"][name] = (src.get("peer_runs") or {}).get(name)
        for name in src["peers_raw"]:
            out["peers_raw"].setdefault(name, [])
            out["peer_runs"].setdefault(name, (src.get("peer_runs") or {}).get(name))
        out["merged_from"].append({"file": f, "date": src.get("date"), "wall_s": src.get("wall_s"), "peers": got})
    out["peers_requested"] = list(dict.fromkeys(p for _, src in srcs for p in src.get("peers_requested") or []))
    out["wall_s"] = sum(float(src.get("wall_s") or 0) for _, src in srcs)
    for name in out["peers_requested"]:
        print(
            f"[merge] {name}: {len(out['peers_raw'].get(name, []))} records"
            + "".join(f" from {m['file']}" for m in out["merged_from"] if name in m["peers"])
        )
    if dest:
        write_results(dest, out)
    return out


def write_results(path, out: dict) -> None:
    """A results or peers file, written to a temp name and renamed: a call killed mid-write (or a
    --rescore in place) never leaves a half-written file where the earlier one was."""
    atomic_write_text(path, json.dumps(out, indent=2, default=str) + "\n")


def try_gemm_ceiling(cfg, T: int, a, log) -> dict | None:
    """gemm_ceiling at T tokens a sample (the run's batch); None, logged, when the probe fails: a
    probe's failure must not cost the run."""
    try:
        return gemm_ceiling(cfg, T * a.batch, a.ttt, a.peak_tflops, log)
    except Exception as e:
        log(f"[ceiling] T {T}: FAILED {e!r}")
        return None


def ratio(x, y):
    return None if (x is None or not y) else x / y


def rescore(path: str, peers_path: str | None = None) -> dict:
    """Recompute a results file's ratios and goals from its own records (score), in place; with
    peers_path (--peers-from), against that file's peer records instead (the peers measured in
    the call after ours, on the same machine), which must be of the same work."""
    out = json.loads(Path(path).read_text())
    note = (
        "ratios and goals recomputed from this file's records by bench_train_h200.py --rescore "
        "(a faster-peer ratio needs every peer asked for measured at that shape)"
    )
    if peers_path:

        def refuse(why):
            raise SystemExit(f"bench_train_h200.py: --rescore {path} --peers-from {peers_path}: {why}")

        src = read_peer_file(peers_path, refuse)
        if "config" not in out:
            # a call killed at its limit before it wrote its config (bench files before 2026-12-04's
            # third round): the config of the peer file that call itself checked as the same work
            used = Path((out.get("peers_from") or {}).get("file", "")).name
            if used != Path(peers_path).name:
                refuse(
                    "the results file has no config, and it was not scored against this peer file "
                    f"(its peers_from: {used or 'none'})"
                )
            out["config"] = dict(src["config"])
            note += (
                "; config taken from the peer file the call checked as the same work "
                "(the call was killed before writing its own)"
            )
        if file_key(src) != file_key(out):
            refuse("its config differs from the results file's (the ratios would compare different work)")
        if src.get("device") != out.get("device"):
            refuse(f"measured on {src.get('device')}, the results file on {out.get('device')}")
        out["peers_raw"] = src["peers_raw"]
        note_peers_from(out, src, peers_path, src.get("peers_requested") or list(src["peers_raw"]))
        note += f"; the peers' records replaced by those of {Path(peers_path).name}"
    c = out.get("config") or {}
    if "shape" not in c and all(k in c for k in SHAPE_KEYS):  # a file from before --shape: its shape named
        c["shape"] = shape_name({k: c[k] for k in SHAPE_KEYS})
        note += f"; config.shape {c['shape']} added (named from its sizes)"
    goals = score(out)
    out["rescored"] = note
    for gl in goals:
        print(goal_line(gl))
    write_results(path, out)
    return out


def main(argv=None) -> dict:
    a = parse(argv)
    if a.rescore:
        return rescore(a.rescore, a.peers_from)
    if a.merge_peers:
        return merge_peers(a.merge_peers, a.json)
    src = load_peers(a.peers_from, a) if a.peers_from else None  # refuse before any work
    t_start = time.perf_counter()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        if a.log:
            Path(a.log).parent.mkdir(parents=True, exist_ok=True)
            Path(a.log).write_text("\n".join(lines) + "\n")

    def left():
        return a.budget_s - (time.perf_counter() - t_start)

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": versions(),
        "compile_options": dict(COMPILE_TUNING) if a.compile_tuning else {},
    }
    log(f"device {out['device']}; {out['versions']}")

    def save():
        """The results so far, scored once the peers are in (a call killed at its limit keeps the
        rows and goals done), written to a temp name and renamed."""
        if not a.json:
            return
        if "peers_raw" in out and "by_length" in out:
            score(out)
        write_results(a.json, out)

    if a.peers_only:
        return peers_only(a, out, cuda, left, log, save, t_start)

    def save_peers(peers, runs):
        out["peers_raw"], out["peer_runs"] = peers, runs
        save()

    out["check"] = check_equivalence(a, dev, log) if a.check else None
    out["check_packed"] = check_packed(a, dev, log) if a.check else None
    # at the shape's heads: the step's attention sees every query head (key/value heads repeated)
    probe = (
        attention_probe(a.seqs, dev, log, h=a.shape["num_attention_heads"], hd=a.shape["head_dim"])
        if (cuda and a.attn_backend == "auto")
        else {}
    )
    attn = probe.get("chosen", a.attn_backend if a.attn_backend != "auto" else "flash")
    out["attention_probe"] = probe
    save()

    cfg, d, head = build(a.shape, dev, dtype)
    hot = d.hot_ids
    out["target_argmax_in_draft"] = argmax_in_draft_share(head, hot, [make_batch(cfg, 1, 2048, dev, dtype, seed=3)])
    out["skip_uncounted"] = {"on": fast_of(a).skip_uncounted, "min_share": fast_loss.SKIP_MIN}
    log(
        f"target: greedy choice in the draft vocab at {out['target_argmax_in_draft']:.4f} of rows; the lm_head "
        f"skips uncounted rows: {'on' if out['skip_uncounted']['on'] else 'off'} (when >= {fast_loss.SKIP_MIN:.4f} "
        "of a step's)"
    )
    comp = a.impl == "compiled"
    fused = a.impl in ("compiled", "fused")
    heads = ["frozen", "trainable"] if a.lm_head == "both" else [a.lm_head]
    log(
        f"shape {a.size}: H {cfg.hidden_size} I {cfg.intermediate_size} heads {cfg.num_attention_heads}x{cfg.head_dim} "
        f"kv {cfg.num_key_value_heads} Vd {cfg.draft_vocab_size} V {cfg.vocab_size}; B {a.batch} T {a.seqs} "
        f"TTT {a.ttt} {dtype}; attention {attn}"
    )
    for T in a.seqs:
        fl = flops_per_token(cfg, T, a.ttt, False)
        log(
            f"FLOPs/token at T {T}: train {fl['train'] / 1e9:.2f} G (lm_head frozen), "
            f"{flops_per_token(cfg, T, a.ttt, True)['train'] / 1e9:.2f} G (trainable); target draft rows "
            f"{fl['target_draft_rows'] / 1e9:.3f} G; "
            f"full-vocab mask extra {fl['mask_extra'] / 1e9:.3f} G (counted apart); "
            f"executed with the embedding half once per unroll {fl['executed'] / 1e9:.2f} G (lm_head frozen)"
        )
    out["gemm_tflops"] = gemm_probe(cfg, a.seqs[0] * a.batch, log) if (a.gemm_probe and cuda) else None
    results = []

    def run(v, batches, hd, **kw):
        r = safe_variant(v, d, hd, batches, a, dev, cfg, log, **kw)
        results.append(r)
        return r

    def V(name, **kw):
        return Variant(name, attn_fused=fused, loss_fused=fused, compiled=comp, attn=attn, **kw)

    main_fast = V("main").fast(a)  # how the main variant computes its step (the config records it)

    def run_config() -> dict:
        """The run's config (set before the first row: a call killed at its limit keeps it, and
        --rescore / --peers-from read its shape)."""
        return {
            "size": a.size,
            "shape": a.size,
            **a.shape,
            "fc_in": cfg.fc_in,
            "batch": a.batch,
            "seqs": a.seqs,
            "seq": a.seqs[0],
            "ttt_steps": a.ttt,
            "gamma": a.gamma,
            "dtype": str(dtype).replace("torch.", ""),
            "params_dtype": str(dtype).replace("torch.", ""),
            "impl": a.impl,
            "chunk": a.chunk,
            "attention": attn,
            "optimizer": "AdamW: draftport.training.optim (CUDA; torch's fused AdamW as a lever), betas (0.9, 0.95)",
            "grad_clip": 1.0,
            "target": "frozen target lm_head [V, H]: full-vocab argmax mask (computed) or the stored "
            "greedy choice + draft rows (stored); draft-vocab softmax",
            "iters": a.iters,
            "warmup": a.warmup,
            "peer_iters": a.peer_iters,
            "peer_warmup": a.peer_warmup,
            "fast_path": {
                "kv_grad_sum": main_fast.kv_grad_sum,
                "skip_uncounted_rows": main_fast.skip_uncounted,
                "skip_dead_rows": main_fast.skip_dead_rows,
                "rope_apart": main_fast.rope_apart,
                "packed_attention": main_fast.packed,
            },
            "peak_tflops": a.peak_tflops,
            "target_off_draft_scale": OFF_DRAFT_SCALE,
            "peer_process": PEER_PROCESS,
            "pipeline_trains_with": "mask stored (features.build_features "
            "stores the greedy choice), lm_head trained (train.train_lm_head true), packing per train.packing "
            "(the kimi profile: true), the attention kernel per train.fast.attention (the kimi profile: cudnn)",
        }

    out["config"] = run_config()

    # ---- the ladder: each lever on and off (first length) ----
    if a.ladder:
        batch = make_batch(cfg, a.batch, a.seqs[0], dev, dtype)
        old_loop = dict(
            adam="fused",
            clip_in_adam=False,
            sync_each_step=True,  # train.py before
            embed_once=False,
        )
        ladder = [
            Variant(
                "L0 reference (old loop)",
                attn_fused=False,
                loss_fused=False,
                compiled=False,
                accumulate=False,
                **old_loop,
            ),
            Variant(
                "L1 +fused attention", attn_fused=True, loss_fused=False, compiled=False, accumulate=False, **old_loop
            ),
            Variant("L2 +fused loss/linears/swiglu", compiled=False, accumulate=False, **old_loop),
            Variant("L3 +in-place wgrad accumulation", compiled=False, **old_loop),
        ]
        if cuda:
            ladder += [
                Variant("L4 +compiled regions", **old_loop),
                Variant("L5 +clip inside fused AdamW", adam="fused", sync_each_step=True, embed_once=False),
                Variant("L6 +embedding half once per unroll", adam="fused", sync_each_step=True),
                Variant("L7 +AdamW as one compiled kernel per parameter", sync_each_step=True),
                Variant("X  main with foreach AdamW + clip_grad_norm_", adam="foreach", clip_in_adam=False),
            ]
        for v in ladder:
            r = run(v, [batch], head)
            r["seq"] = a.seqs[0]
        del batch

    # ---- fixed lengths: lm_head frozen / trainable x mask computed / stored, and the levers
    # (the other attention kernel, the embedding half at every step) at the same
    # shape ----
    by_len, levers = {}, {}
    head_cpu = None
    other = "cudnn" if attn == "flash" else "flash"
    other_ok = cuda and "failed" not in probe.get(other, {"failed": 1})
    for i, T in enumerate(a.seqs):
        batch = make_batch(cfg, a.batch, T, dev, dtype)
        rec = by_len.setdefault(str(T), {"ours": {}})
        if cuda:  # what the step's GEMMs alone reach at this shape (the MFU goal below H 4096)
            ceiling = try_gemm_ceiling(cfg, T, a, log)
            if ceiling:
                rec["gemm_ceiling"] = ceiling
            torch.cuda.empty_cache()
        lv = levers.setdefault(str(T), {})
        for lh in heads:
            r = run(V(f"T{T} lm_head {lh}, mask computed", lm_head=lh), [batch], head)
            r["seq"] = T
            rec["ours"][f"{lh}_computed"] = r
        if cuda and fused and other_ok:
            v = Variant(
                f"T{T} lm_head frozen, mask computed, attention {other}",
                attn_fused=fused,
                loss_fused=fused,
                compiled=comp,
                attn=other,
            )
            lv[f"attention_{other}_computed"] = run(v, [batch], head)
        if fused:
            # the greedy choice captured with the features: the full-vocab head leaves the GPU
            batch = with_stored_mask([batch], head, hot, a.chunk)[0]
            rows = head.index_select(0, hot).contiguous()
            head_cpu = head.cpu()
            del head
            if cuda:
                torch.cuda.empty_cache()
            for lh in heads:
                r = run(V(f"T{T} lm_head {lh}, mask stored", lm_head=lh, mask="stored"), [batch], rows)
                r["seq"] = T
                rec["ours"][f"{lh}_stored"] = r
            if cuda and a.levers:  # what the embedding half once per unroll gives, at every length
                lv["embed_every_step_stored"] = run(
                    V(f"T{T} lm_head frozen, mask stored, embedding half every step", mask="stored", embed_once=False),
                    [batch],
                    rows,
                )
                # what draftport's AdamW gives over torch's fused one, where the optimizer is largest
                lv["torch_fused_adamw_trainable_stored"] = run(
                    V(
                        f"T{T} lm_head trainable, mask stored, torch's fused AdamW",
                        lm_head="trainable",
                        mask="stored",
                        adam="fused",
                    ),
                    [batch],
                    rows,
                )
            if a.profile_dir and cuda:
                # the embedding half at every step beside the lever's own timing only (--no-levers: its
                # regions would compile for one profile)
                for lh, once in (
                    (("frozen", True), ("frozen", False), ("trainable", True))
                    if a.levers
                    else (("frozen", True), ("trainable", True))
                ):
                    tag = f"{lh}_stored" + ("" if once else "_embed_every_step")
                    bd = profile_fixed(
                        d,
                        rows,
                        batch,
                        a,
                        cfg,
                        Path(a.profile_dir) / f"profile_T{T}_{tag}.txt",
                        log,
                        V("profile", embed_once=once).fast(a),
                        lm_head=lh,
                    )
                    out.setdefault("profiles", {})[f"T{T}_{tag}"] = bd
            del rows
            head = head_cpu.to(dev)
            head_cpu = None
        del batch
        if cuda:
            torch.cuda.empty_cache()
        out["by_length"], out["levers"] = by_len, levers
        save()

    # ---- the length mix: its lengths, our two layouts ----
    mix = mix_spec(a, log)
    if mix is not None:
        out["mix"] = mix

    # ---- the peers, one at a time, in subprocesses (or their records from --peers-from) ----
    if src is None:
        peers, requested = run_peers(a, mix, cuda, left, log, save_peers), requested_peers(a)
    else:
        peers, requested = use_peers(src, a, out, log)
        out["peers_raw"] = peers
        save()

    # ---- ours on the mix, after the peers: its compiles (new shapes) are the slowest part ----
    mix_res = {}
    if mix is not None and fused:
        samples = mix_samples(cfg, mix["lengths"], dev, dtype, prompt_share=a.mix_prompt_share)
        samples = [{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()} for s in samples]
        (pk, pk_lens), (pd, pd_lens) = layout_mix(samples, a.pack_len, a.pad_batch, dtype)
        del samples
        pk = [b.to(dev) for b in pk]
        pd = [b.to(dev) for b in pd]
        mix.update(
            packed_rows=len(pk),
            padded_steps=len(pd),
            packed_real_fraction=sum(int(b.valid.sum()) for b in pk) / sum(b.tokens.numel() for b in pk),
            padded_real_fraction=sum(int(b.valid.sum()) for b in pd) / sum(b.tokens.numel() for b in pd),
        )
        out["mix_results"] = mix_res

        def run_mix(key, *args, **kw):  # the JSON rewritten after each row: a timeout keeps the rows done
            mix_res[key] = run(*args, **kw)
            save()

        if cuda:  # the bound of the mix goal: the packed rows' GEMMs alone at cuBLAS's rate
            try:
                mix["gemm_ceiling"] = mix_gemm_ceiling(cfg, pk, a, log)
            except Exception as e:  # a probe's failure must not cost the run
                log(f"[ceiling] mix: FAILED {e!r}")
            torch.cuda.empty_cache()
            save()
        if a.mix_computed:
            run_mix(
                "packed_frozen_computed",
                V("mix packed, lm_head frozen, mask computed", layout="packed"),
                pk,
                head,
                lengths=pk_lens,
            )
            run_mix(
                "padded_frozen_computed",
                V("mix padded, lm_head frozen, mask computed", layout="padded"),
                pd,
                head,
                lengths=pd_lens,
            )
        with_stored_mask(pk, head, hot, a.chunk)
        with_stored_mask(pd, head, hot, a.chunk)
        mix.update(
            packed_counted_fraction=counted_share(pk, d.t2d, a.ttt),
            padded_counted_fraction=counted_share(pd, d.t2d, a.ttt),
        )
        rows = head.index_select(0, hot).contiguous()
        head_cpu = head.cpu()
        del head
        if cuda:
            torch.cuda.empty_cache()
        for lh in heads:
            run_mix(
                f"packed_{lh}_stored",
                V(f"mix packed, lm_head {lh}, mask stored", lm_head=lh, mask="stored", layout="packed"),
                pk,
                rows,
                lengths=pk_lens,
            )
            run_mix(
                f"padded_{lh}_stored",
                V(f"mix padded, lm_head {lh}, mask stored", lm_head=lh, mask="stored", layout="padded"),
                pd,
                rows,
                lengths=pd_lens,
            )
        del pk, pd, rows
        head = head_cpu.to(dev)
        head_cpu = None
        if cuda:
            torch.cuda.empty_cache()
        out["mix_results"] = mix_res
        save()

    for r in results:
        r.setdefault("seq", None)

    out.update(by_length=by_len, mix=mix, mix_results=mix_res, peers_raw=peers, peers_requested=requested)
    goals = score(out)
    mix_ratios = out.get("mix_ratios", {})

    # ---- the summary fields ----
    first = by_len.get(str(a.seqs[0]), {"ours": {}})["ours"]
    ours = first.get("frozen_computed") or next(iter(first.values()), {})
    out.update(
        {
            "flops_per_token": {
                str(T): {
                    "train_lm_head_frozen": flops_per_token(cfg, T, a.ttt, False)["train"],
                    "train_lm_head_trainable": flops_per_token(cfg, T, a.ttt, True)["train"],
                    "mask_extra": flops_per_token(cfg, T, a.ttt, False)["mask_extra"],
                    "executed_lm_head_frozen": flops_per_token(cfg, T, a.ttt, False)["executed"],
                }
                for T in a.seqs
            },
            "tokens_per_s": ours.get("tokens_per_s"),
            "mfu": ours.get("mfu"),
            "mfu_with_mask": ours.get("mfu_with_mask"),
            "hfu": ours.get("hfu"),
            "peak_mem_gib": ours.get("peak_mem_gib"),
            "lm_head": ours.get("lm_head"),
            "trainable_params": ours.get("trainable_params"),
            "tokens_per_s_lm_head_trainable": (first.get("trainable_computed") or {}).get("tokens_per_s"),
            "tokens_per_s_mask_stored": (first.get("frozen_stored") or {}).get("tokens_per_s"),
            "by_length": by_len,
            "mix": mix,
            "mix_results": mix_res,
            "mix_ratios": mix_ratios,
            "levers": levers,
            "goals": goals,
            "ours": results,
            # the figure `draftport estimate` should use: real tokens/s on the length mix, packed, as the
            # pipeline trains (lm_head trained, greedy choice stored with the features)
            "packed_real_tokens_per_s": _tps(mix_res.get("packed_trainable_stored")),
            "packed_real_tokens_per_s_lm_head_frozen": _tps(mix_res.get("packed_frozen_stored")),
            "padded_real_tokens_per_s": _tps(mix_res.get("padded_trainable_stored")),
            "fp32_target_logits_via_mm_out_dtype": fast_loss.mm_keeps_fp32(dev, dtype) if cuda else None,
            "wall_s": time.perf_counter() - t_start,
        }
    )
    if src is not None:
        log(
            f"[peers] the peer figures in these ratios come from {a.peers_from} ({src.get('date')}, "
            f"{src.get('device')}), not from this call"
        )
    for gl in goals:
        log(goal_line(gl))
    log(
        "summary: "
        + json.dumps(
            {
                k: out.get(k)
                for k in (
                    "tokens_per_s",
                    "mfu",
                    "mfu_with_mask",
                    "peak_mem_gib",
                    "tokens_per_s_lm_head_trainable",
                    "tokens_per_s_mask_stored",
                    "speedup_vs_best_peer",
                    "packed_real_tokens_per_s",
                    "packed_real_tokens_per_s_lm_head_frozen",
                    "padded_real_tokens_per_s",
                    "wall_s",
                )
            },
            default=str,
        )
        + (f" (peer figures from {a.peers_from})" if src is not None else "")
    )
    save()
    return out


def mix_spec(a, log) -> dict | None:
    """The length mix's lengths and layouts (None without one)."""
    if not a.mix:
        return None
    lens = mix_lengths(a.mix, a.mix_max, a.mix_seed)
    mix = {
        "distribution": f"log-normal(mu {MIX_MU}, sigma {MIX_SIGMA}) tokens, x {a.mix_max}/2048, clipped to "
        f"[{min(64, a.mix_max // 4)}, {a.mix_max}]; seed {a.mix_seed}",
        "n": len(lens),
        "lengths": lens,
        "mean": sum(lens) / len(lens),
        "max": max(lens),
        "total_tokens": sum(lens),
        "pack_len": a.pack_len,
        "pad_batch": a.pad_batch,
        "timed_passes": a.mix_passes,
        "figure": "real tokens of one pass over its median timed pass (ours and each peer's)",
        "prompt_share": a.mix_prompt_share,
        "prompts": (
            "16 tokens per sample (a quarter of a shorter one); the peers' loss takes every row"
            if not a.mix_prompt_share
            else f"the first {a.mix_prompt_share:g} of each sample's tokens (at least 16), in ours' loss "
            "masks and the peers'"
        ),
        "packed_layout": f"steps of <= {a.pack_len} tokens (first-fit decreasing), each one row of its "
        f"samples rounded up to {ROW_MULTIPLE} tokens (as train() packs)",
    }
    log(
        f"[mix] {len(lens)} samples, mean {mix['mean']:.0f}, max {mix['max']}, {sum(lens)} tokens; "
        f"packed: steps of <= {a.pack_len} tokens, one row each rounded up to {ROW_MULTIPLE} (as train() packs); "
        f"padded groups of {a.pad_batch}"
    )
    return mix


def run_peers(a, mix, cuda, left, log, on_peer, peers_only=False) -> dict:
    """The peers asked for, one at a time, in subprocesses on the same GPU, speculators first,
    each in a process of its own per shape (each length, then the mix).
    -> peers_raw {name: [records]}; on_peer(peers, runs) after each (runs: timeout, wall, status,
    and the same per shape).

    Timeouts: in a full run speculators gets 150-220 s and SpecForge what is left but the mix's
    share; with --peers-only the whole budget is theirs: speculators (it compiles at each length
    and on the mix: minutes) up to --speculators-share of what is left, SpecForge the rest (all
    that speculators did not use)."""
    peers, runs = {}, {}
    mix_file = None
    if mix is not None:
        fd, mix_file = tempfile.mkstemp(prefix="mix_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            spec = {"lengths": mix["lengths"]}
            if mix.get("prompt_share"):  # the peers mask the same prompt rows as ours
                spec["prompts"] = mix_prompts(mix["lengths"], mix["prompt_share"])
            json.dump(spec, f)
    try:
        env_py = sys.executable
        # the peers build the same shape (a namespace without one: a named --size)
        shape = getattr(a, "shape", None) or SIZES[a.size]
        common = [
            "--ttt",
            str(a.ttt),
            "--iters",
            str(a.peer_iters),
            "--warmup",
            str(a.peer_warmup),
            "--shape",
            shape_arg(shape),
        ]
        # one process per shape: after 2,048 in the same process, speculators' step ran 6% slower at
        # 4,096 and 3% on the mix than in a process of its own (H200, 2026-12-02: results/*-peers-5
        # against *-peers-6-speculators); likely cause: torch.compile recompiles with dynamic sizes
        shapes = [["--seqs", str(t)] for t in a.seqs] + (
            [["--seqs", "--mix", mix_file, "--mix-passes", str(a.mix_passes)]] if mix_file else []
        )

        def per_shape(name, tail, t_all):
            """The peer once per shape, each with an even share of what is left of t_all."""
            recs, info, t0 = [], {"timeout_s": t_all, "shapes": []}, time.perf_counter()
            runs[name] = info
            short = None  # the timeout a shape of this peer ran out of
            for i, shape in enumerate(shapes):
                t = (t_all - (time.perf_counter() - t0)) / (len(shapes) - i)
                if short is not None and t < 1.25 * short:
                    # each shape compiles anew: one that ran out of `short` s will again; its time
                    # is left to the next peer
                    one = {
                        "timeout_s": t,
                        "status": f"skipped: {shape[-1] if shape[1] != '--mix' else 'mix'} "
                        f"(a shape before timed out at {short:.0f}s; rerun with a larger --budget-s)",
                    }
                    log(f"[{name}] {one['status']}")
                    info["shapes"].append(one)
                    continue
                one = {"timeout_s": t}
                recs += run_peer(name, [*tail[:2], *shape, *common, *tail[2:]], t, log, one)
                info["shapes"].append(one)
                if one.get("status") == "timed out":
                    short = t
            info.update(
                wall_s=time.perf_counter() - t0,
                records=len(recs),
                status="done"
                if all(s["status"] == "done" for s in info["shapes"])
                else "; ".join(sorted({s["status"] for s in info["shapes"] if s["status"] != "done"})),
            )
            return recs

        if not a.no_speculators:
            tail = [
                env_py,
                str(HERE / "peers" / "speculators_run.py"),
                "--total-seq-len",
                str(a.pack_len),
                "--loss-impl",
                a.spec_loss,
                "--sets",
                "frozen",
                "trained",
            ] + (["--attn", a.spec_attn] if a.spec_attn else [])
            if peers_only:
                t = left() * a.speculators_share if not a.no_specforge else left() - 8.0
            else:
                t = max(150.0, min(220.0, left() * 0.4))
            peers["speculators"] = per_shape("speculators", tail, t)
            on_peer(peers, runs)
        if not a.no_specforge:
            tail = (
                [
                    env_py,
                    str(HERE / "peers" / "specforge_run.py"),
                    "--sets",
                    "trained",
                    "frozen",
                    "--off-draft-scale",
                    str(OFF_DRAFT_SCALE),
                ]
                + (["--attn", a.sf_attn] if a.sf_attn else [])
                + ([] if cuda else ["--cpu-test"])
            )
            t = left() - 8.0 if peers_only else max(170.0, left() - (160.0 if mix else 0.0) - 8.0)
            peers["specforge"] = per_shape("specforge", tail, t)
            on_peer(peers, runs)
    finally:
        if mix_file:
            os.unlink(mix_file)
    return peers


def note_peers_from(out: dict, src: dict, path: str, asked: list[str]) -> None:
    """Where the peer records came from (out["peers_from"]), and the peers' package versions in
    out["versions"]."""
    sv = src.get("versions") or {}
    out["peers_from"] = {
        "file": str(Path(path).resolve()),
        "date": src.get("date"),
        "device": src.get("device"),
        "mode": src.get("mode", "full run"),
        "wall_s": src.get("wall_s"),
        "peers_requested": asked,
        "versions": {k: sv.get(k) for k in ("speculators", "specforge", "torch", "transformers", "triton")},
        "peer_runs": src.get("peer_runs"),
        "gemm_s": peer_gemm_s(src),
    }
    for k in ("speculators", "specforge"):
        out.setdefault("versions", {})[k] = sv.get(k)


def peer_gemm_s(src: dict) -> dict:
    """{T: seconds} the peers' GPU took for the step's GEMMs alone (gemm_ceiling, lm_head frozen),
    from a --peers-only file (its own probe) or a full run's (ours, timed on the same GPU)."""
    by_t = dict(src.get("gemm_ceiling") or {})
    for T, rec in (src.get("by_length") or {}).items():
        by_t.setdefault(T, rec.get("gemm_ceiling"))
    return {
        T: c["sets"]["frozen"]["gemm_s"]
        for T, c in by_t.items()
        if c and "gemm_s" in ((c.get("sets") or {}).get("frozen") or {})
    }


def use_peers(src: dict, a, out: dict, log) -> tuple[dict, list[str]]:
    """--peers-from: the file's peer records and the peers asked for in both calls; records where
    they came from in out["peers_from"] and the peers' package versions in out["versions"]."""
    peers = src["peers_raw"]
    asked = src.get("peers_requested") or list(peers)
    requested = [p for p in requested_peers(a) if p in asked]
    note_peers_from(out, src, a.peers_from, asked)
    for name in requested:
        for r in peers.get(name, []):
            tag = r.get("config", "?") + (f"/{r['set']}" if "set" in r else "")
            log(f"[{name}] {tag:16s} {r.get('real_tokens_per_s') or 0:8.0f} real tok/s  (from {a.peers_from})")
    log(
        f"[peers] figures from {a.peers_from} ({src.get('date')}, {src.get('device')}, "
        f"{out['peers_from']['mode']}), not measured in this call: "
        + ", ".join(f"{p} {len(peers.get(p, []))} records" for p in requested)
        + (
            ""
            if src.get("device") == out["device"]
            else f"; WARNING: measured on {src.get('device')}, this call runs on {out['device']}"
        )
    )
    return peers, requested


def peers_only(a, out, cuda, left, log, save, t_start) -> dict:
    """--peers-only: the peers alone, the whole budget theirs; their records, versions, device,
    config, mix and wall time to --json (what --peers-from reads)."""
    cfg = DrafterConfig(**a.shape, aux_layer_ids=[2, 30, 58])
    requested = requested_peers(a)
    out.update(
        {
            "mode": "peers-only",
            "config": {
                "size": a.size,
                "shape": a.size,
                **a.shape,
                "fc_in": cfg.fc_in,
                "seqs": a.seqs,
                "seq": a.seqs[0],
                "ttt_steps": a.ttt,
                "dtype": "bfloat16" if cuda else "float32",
                "peer_iters": a.peer_iters,
                "peer_warmup": a.peer_warmup,
                "pack_len": a.pack_len,
                "spec_loss": a.spec_loss,
                "spec_attn": a.spec_attn,
                "sf_attn": a.sf_attn,
                "budget_s": a.budget_s,
                "speculators_share": a.speculators_share,
                "target_off_draft_scale": OFF_DRAFT_SCALE,
                "peer_process": PEER_PROCESS,
            },
            "peers_requested": requested,
            "peers_raw": {},
            "peer_runs": {},
        }
    )
    log(
        f"peers only: {', '.join(requested)}; shape {a.size} ({shape_arg(a.shape)}), T {a.seqs}, TTT {a.ttt}; "
        f"budget {a.budget_s:.0f}s"
    )
    mix = mix_spec(a, log)
    out["mix"] = mix
    if cuda:  # this GPU's rate at the step's GEMMs: a later call scoring ours names the two GPUs' ratio
        out["gemm_ceiling"] = {str(T): c for T in a.seqs if (c := try_gemm_ceiling(cfg, T, a, log))}
        torch.cuda.empty_cache()
    save()

    def on_peer(peers, runs):
        out["peers_raw"], out["peer_runs"] = peers, runs
        out["wall_s"] = time.perf_counter() - t_start
        save()

    peers = run_peers(a, mix, cuda, left, log, on_peer, peers_only=True)
    out["peers_raw"] = peers
    out["wall_s"] = time.perf_counter() - t_start
    want = [f"seq{T}" for T in a.seqs] + (["mix"] if mix else [])
    for p in requested:
        got = {r.get("config") for r in peers.get(p, [])}
        log(
            f"[peers] {p}: {len(peers.get(p, []))} records; shapes missing: "
            f"{', '.join(c for c in want if c not in got) or 'none'}"
        )
    log(f"summary: peers only, wall {out['wall_s']:.0f}s; score with --peers-from {a.json or 'FILE'}")
    save()
    return out


# model-FLOPs MFU goals: at H >= MFU_GOAL_MIN_H an absolute one by length; below it the step's
# GEMMs are small and the goal is CEILING_GOAL of what they alone reach through cuBLAS (gemm_ceiling)
MFU_GOAL_MIN_H = 4096
CEILING_GOAL = 0.9


def mfu_goal(T: int) -> float:
    """The MFU goal at length T (H >= MFU_GOAL_MIN_H): 80% at 4096 and longer, 75% below."""
    return 0.80 if int(T) >= 4096 else 0.75


def _tps(r):
    return None if (r is None or "failed" in r) else r["real_tokens_per_s"]


def goal_line(gl) -> str:
    v = gl["value"]
    return (
        f"[goal] {gl['goal']:72s} {'-' if v is None else f'{v:.3f}'} (>= {gl['target']}) "
        f"{'MET' if gl['met'] else ('n/a' if gl['met'] is None else 'missed')} {gl['note']}"
    )


def ceiling_tps(rec: dict, k: str, mode: str, cfg: dict) -> float | None:
    """Tokens/s of a step that were its GEMMs alone at cuBLAS's rate (by_length[T].gemm_ceiling, set
    k), mask computed adding the target logits' GEMM over the non-draft vocab at that rate; None
    when no ceiling was timed."""
    c = ((rec.get("gemm_ceiling") or {}).get("sets") or {}).get(k)
    if not c or "gemm_s" not in c or "rows" not in rec["gemm_ceiling"]:
        return None
    s = c["gemm_s"]
    if mode == "computed" and cfg.get("vocab_size") and cfg.get("draft_vocab_size"):
        s += (
            2
            * cfg["hidden_size"]
            * (cfg["vocab_size"] - cfg["draft_vocab_size"])
            * rec["gemm_ceiling"]["rows"]
            / (c["tflops"] * 1e12)
        )
    return rec["gemm_ceiling"]["rows"] / s


def at_ceiling(x) -> str:
    """A goal's note part: the ratio at the bound ("" when no ceiling was timed)."""
    return "" if x is None else f"at the step's GEMMs alone (cuBLAS ceiling): {x:.3f}"


def join_note(*parts) -> str:
    return "; ".join(p for p in parts if p)


def score(out: dict) -> list[dict]:
    """Ratios and goals from a run's records (out: by_length, mix, mix_results, peers_raw,
    peers_requested); sets by_length[T]["ratios"], mix_ratios, speedup_vs_best_peer and goals.

    A ratio to "the faster peer" exists only when every peer asked for was measured at that shape
    (a peer that timed out leaves it None and is named in `missing_peers`): the faster one is
    never chosen among the ones that happened to finish."""
    by_len, mix, mix_res = out.get("by_length") or {}, out.get("mix"), out.get("mix_results") or {}
    peers = out.get("peers_raw") or {}
    cfg_shape = out.get("config") or {}
    hidden = cfg_shape.get("hidden_size")
    requested = out.get("peers_requested") or list(peers)

    def peer_rec(name, config, which=None):
        for r in peers.get(name, []):
            # speculators' records before it ran a second set carry none: its default, frozen
            rs = r.get("set", "frozen" if name == "speculators" else None)
            if r.get("config") == config and (which is None or rs == which):
                return r
        return None

    def faster(cands):
        """(name, rate, missing) of the faster of the peers asked for; (None, None, missing)
        when any of them was not measured."""
        cands = {k: v for k, v in cands.items() if k in requested}
        missing = [k for k, v in cands.items() if not v]
        if not cands or missing:
            return None, None, missing
        best = max(cands, key=cands.get)
        return best, cands[best], missing

    tps = _tps
    goals = []

    def goal(name, value, target, note=""):
        goals.append(
            {
                "goal": name,
                "target": target,
                "value": value,
                "met": None if value is None else value >= target,
                "note": note,
            }
        )

    for T, rec in by_len.items():
        sp = tps(peer_rec("speculators", f"seq{T}", "frozen"))
        spt = tps(peer_rec("speculators", f"seq{T}", "trained"))
        sff = tps(peer_rec("specforge", f"seq{T}", "frozen"))
        sft = tps(peer_rec("specforge", f"seq{T}", "trained"))
        rec["peers"] = {
            "speculators": peer_rec("speculators", f"seq{T}", "frozen"),
            "speculators_lm_head_trained": peer_rec("speculators", f"seq{T}", "trained"),
            "specforge_lm_head_frozen": peer_rec("specforge", f"seq{T}", "frozen"),
            "specforge_lm_head_trained": peer_rec("specforge", f"seq{T}", "trained"),
        }
        best, best_v, missing = faster({"speculators": sp, "specforge": sff})
        best_t, best_t_v, missing_t = faster({"speculators": spt, "specforge": sft})
        r = {
            "best_peer_lm_head_frozen": best,
            "missing_peers": missing,
            "best_peer_lm_head_trained": best_t,
            "missing_peers_lm_head_trained": missing_t,
        }
        # peers from another call (another GPU): how its GEMMs ran against this one's, same shapes
        own_g = ((((rec.get("gemm_ceiling") or {}).get("sets") or {}).get("frozen")) or {}).get("gemm_s")
        r["peer_gpu_gemm_time_vs_ours"] = ratio(((out.get("peers_from") or {}).get("gemm_s") or {}).get(T), own_g)
        gpu_note = (
            ""
            if r["peer_gpu_gemm_time_vs_ours"] is None
            else f"the peers' GPU took {r['peer_gpu_gemm_time_vs_ours']:.3f}x this one's time at the step's GEMMs"
        )
        for mode in ("computed", "stored"):
            o_f, o_t = tps(rec["ours"].get(f"frozen_{mode}")), tps(rec["ours"].get(f"trainable_{mode}"))
            r[f"speedup_vs_best_peer_{mode}"] = ratio(o_f, best_v) if best else None
            r[f"vs_speculators_{mode}"] = ratio(o_f, sp)
            r[f"vs_specforge_lm_head_frozen_{mode}"] = ratio(o_f, sff)
            r[f"vs_specforge_lm_head_trained_{mode}"] = ratio(o_t, sft)
            r[f"vs_speculators_lm_head_trained_{mode}"] = ratio(o_t, spt)
            # lm_head trained on both sides: against the faster peer at that set
            r[f"lm_head_trainable_vs_best_peer_{mode}"] = ratio(o_t, best_t_v) if best_t else None
            # ours trained (more work) against each peer at its own default set (speculators:
            # lm_head frozen; SpecForge: trained), reported beside the same-set ratio
            defaults = {"speculators": sp, "specforge": sft}
            defaults = [v for k, v in defaults.items() if k in requested]
            r[f"lm_head_trainable_vs_best_peer_default_sets_{mode}"] = (
                ratio(o_t, max(defaults)) if defaults and all(defaults) else None
            )
            r[f"lm_head_trainable_vs_speculators_{mode}"] = ratio(o_t, sp)
            for k in ("frozen", "trainable"):
                o = rec["ours"].get(f"{k}_{mode}")
                if o and "failed" not in o:
                    r[f"mfu_{k}_{mode}"] = o["mfu"]
                    if o.get("hfu") is not None:
                        r[f"hfu_{k}_{mode}"] = o["hfu"]
                    r[f"peak_mem_gib_{k}_{mode}"] = o["peak_mem_gib"]
            # the bound: the ratio a step made of its GEMMs alone (at cuBLAS's rate) would reach
            c_f, c_t = ceiling_tps(rec, "frozen", mode, cfg_shape), ceiling_tps(rec, "trainable", mode, cfg_shape)
            r[f"speedup_vs_best_peer_{mode}_at_gemm_ceiling"] = ratio(c_f, best_v) if best else None
            r[f"vs_specforge_lm_head_trained_{mode}_at_gemm_ceiling"] = ratio(c_t, sft)
            goal(
                f"T{T} vs the faster peer, lm_head frozen, mask {mode}",
                r[f"speedup_vs_best_peer_{mode}"],
                1.3,
                join_note(
                    f"faster peer: {best}",
                    f"not measured: {', '.join(missing)}" if missing else "",
                    at_ceiling(r[f"speedup_vs_best_peer_{mode}_at_gemm_ceiling"]),
                    gpu_note,
                ),
            )
            goal(
                f"T{T} vs SpecForge, lm_head trained, mask {mode}",
                r[f"vs_specforge_lm_head_trained_{mode}"],
                1.6,
                join_note(at_ceiling(r[f"vs_specforge_lm_head_trained_{mode}_at_gemm_ceiling"]), gpu_note),
            )
            hf = r.get(f"hfu_frozen_{mode}")
            ceil = (rec.get("gemm_ceiling") or {}).get("sets", {})
            for k in ("frozen", "trainable"):
                c = (ceil.get(k) or {}).get("mfu_ceiling")
                if c and r.get(f"mfu_{k}_{mode}") is not None:
                    r[f"mfu_over_gemm_ceiling_{k}_{mode}"] = r[f"mfu_{k}_{mode}"] / c
            if hidden is not None and hidden < MFU_GOAL_MIN_H:
                # small GEMMs: the goal is a share of what the step's GEMMs alone reach through cuBLAS
                c = (ceil.get("frozen") or {}).get("mfu_ceiling")
                goal(
                    f"T{T} MFU over the step's cuBLAS GEMM ceiling, lm_head frozen, mask {mode}",
                    r.get(f"mfu_over_gemm_ceiling_frozen_{mode}"),
                    CEILING_GOAL,
                    (f"ceiling {c:.3f} (the step's GEMMs alone at cuBLAS's rate); " if c else "no ceiling timed; ")
                    + f"MFU {r.get(f'mfu_frozen_{mode}') or 0:.3f}",
                )
            else:
                goal(
                    f"T{T} MFU, lm_head frozen, mask {mode}",
                    r.get(f"mfu_frozen_{mode}"),
                    mfu_goal(T),
                    "model FLOPs; " + (f"hardware FLOPs executed: {hf:.3f}" if hf is not None else ""),
                )
            dflt = r[f"lm_head_trainable_vs_best_peer_default_sets_{mode}"]
            goal(
                f"T{T} lm_head trainable vs the faster peer with lm_head trained, mask {mode}",
                r[f"lm_head_trainable_vs_best_peer_{mode}"],
                1.25,
                f"faster peer: {best_t}"
                + (f"; not measured: {', '.join(missing_t)}" if missing_t else "")
                + ("" if dflt is None else f"; vs the faster peer at its default set: {dflt:.3f}"),
            )
        peak_peer = (
            min([x["peak_mem_gib"] for x in rec["peers"].values() if x and x.get("peak_mem_gib")] or [None])
            if any(rec["peers"].values())
            else None
        )
        r["peer_peak_mem_gib_min"] = peak_peer
        for mode in ("computed", "stored"):  # memory: ours against the peers at the same trainable set
            for k, peer in (
                ("frozen", rec["peers"]["speculators"]),
                ("frozen", rec["peers"]["specforge_lm_head_frozen"]),
                ("trainable", rec["peers"]["speculators_lm_head_trained"]),
                ("trainable", rec["peers"]["specforge_lm_head_trained"]),
            ):
                o = rec["ours"].get(f"{k}_{mode}")
                if peer and peer.get("peak_mem_gib") and o and o.get("peak_mem_gib"):
                    name = f"{peer['impl'].split('-')[0]}_{'trained' if peer['lm_head_trainable'] else 'frozen'}"
                    r[f"peak_mem_peer_over_ours_{name}_{mode}"] = peer["peak_mem_gib"] / o["peak_mem_gib"]
            pm = [v for k_, v in r.items() if k_.startswith("peak_mem_peer_over_ours_") and k_.endswith(mode)]
            goal(
                f"T{T} peak memory no worse than the peers (peer/ours, same set), mask {mode}",
                min(pm) if pm else None,
                1.0,
            )
        rec["ratios"] = r

    mix_ratios = {}
    if mix is not None:
        spm = tps(peer_rec("speculators", "mix", "frozen"))
        spmt = tps(peer_rec("speculators", "mix", "trained"))
        sfm = tps(peer_rec("specforge", "mix", "trained"))
        mix_ratios = {
            "speculators_real_tokens_per_s": spm,
            "speculators_lm_head_trained_real_tokens_per_s": spmt,
            "specforge_real_tokens_per_s": sfm,
        }
        for k, r in mix_res.items():
            mix_ratios[f"{k}_real_tokens_per_s"] = tps(r)
        # the faster peer at each set: lm_head frozen speculators (SpecForge's frozen set is not
        # run on the mix: slower than speculators at every fixed length); trained, the faster of both
        best_t, best_t_v, missing_t = faster({"speculators": spmt, "specforge": sfm})
        mix_ratios["best_peer_lm_head_trained"] = best_t

        def mix_speedup(frozen_rate, trainable_rate):
            """The mix goal's figure: the smaller of frozen / speculators and trainable / the faster
            peer with lm_head trained (each where those peers were asked for); None if one is missing."""
            eq = []
            if "speculators" in requested:
                eq.append(ratio(frozen_rate, spm))
            if any(k in requested for k in ("speculators", "specforge")):
                eq.append(ratio(trainable_rate, best_t_v) if best_t else None)
            return min(eq) if eq and all(x is not None for x in eq) else None

        for mode in ("computed", "stored"):
            f = tps(mix_res.get(f"packed_frozen_{mode}"))
            t = tps(mix_res.get(f"packed_trainable_{mode}"))
            mix_ratios[f"packed_frozen_{mode}_vs_speculators"] = ratio(f, spm)
            mix_ratios[f"packed_trainable_{mode}_vs_specforge"] = ratio(t, sfm)
            mix_ratios[f"packed_trainable_{mode}_vs_speculators_lm_head_trained"] = ratio(t, spmt)
            mix_ratios[f"packed_trainable_{mode}_vs_best_peer_lm_head_trained"] = ratio(t, best_t_v) if best_t else None
            mix_ratios[f"packed_frozen_{mode}_vs_padded"] = ratio(f, tps(mix_res.get(f"padded_frozen_{mode}")))
        mix_ratios["speedup_vs_best_peer"] = mix_speedup(
            tps(mix_res.get("packed_frozen_stored")), tps(mix_res.get("packed_trainable_stored"))
        )
        mc = mix.get("gemm_ceiling") or {}
        mix_ratios["speedup_vs_best_peer_at_gemm_ceiling"] = (
            mix_speedup(mc["frozen"]["real_tokens_per_s"], mc["trainable"]["real_tokens_per_s"]) if mc else None
        )
        mix_ratios["missing_peers"] = [
            label
            for peer, label, v in (
                ("speculators", "speculators", spm),
                ("speculators", "speculators lm_head trained", spmt),
                ("specforge", "specforge", sfm),
            )
            if peer in requested and v is None
        ]
        goal(
            "length mix: real-token rate vs the faster peer (same trainable set each, mask stored)",
            mix_ratios["speedup_vs_best_peer"],
            1.5,
            join_note(
                "min of ours-frozen/speculators and ours-trainable/the faster peer with lm_head trained"
                + (f" ({best_t})" if best_t else ""),
                f"not measured: {', '.join(mix_ratios['missing_peers'])}" if mix_ratios["missing_peers"] else "",
                at_ceiling(mix_ratios["speedup_vs_best_peer_at_gemm_ceiling"]),
            ),
        )
        out["mix_ratios"] = mix_ratios
    out["goals"] = goals
    out["speedup_vs_best_peer"] = {
        T: {m: rec.get("ratios", {}).get(f"speedup_vs_best_peer_{m}") for m in ("computed", "stored")}
        for T, rec in by_len.items()
    }
    return goals


def profile_fixed(d, head, batch, a, cfg, path, log, fast: FastPath, lm_head="frozen"):
    """A profile of two steps of the main variant on this batch, computed as `fast` says (e.g.
    embed_once False: the embedding half of q/k/v at every step). -> the kernel breakdown."""
    d.lm_head.weight.requires_grad_(lm_head == "trainable")
    params = [p for p in d.parameters() if p.requires_grad]
    opt = optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)  # as run_variant's main
    tcfg = TrainConfig(ttt_steps=a.ttt, gamma=a.gamma, grad_clip=1.0, train_lm_head=lm_head == "trainable")

    def step():
        return train_step(d, batch, head, opt, params, tcfg, fast=fast, use_bf16=True)

    try:
        for _ in range(2):
            step()
        return profile(step, path, log)
    finally:
        del opt
        d.zero_grad(set_to_none=True)
        d.lm_head.weight.requires_grad_(False)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
