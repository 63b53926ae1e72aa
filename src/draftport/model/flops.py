"""Model FLOPs of a drafter's training, the count MFU is measured with (the training benchmark's,
benchmarks/bench_train_h200.py `flops_per_token`'s "train" figure; tests/profile/test_rates.py
checks that they agree). No torch: `draftport estimate` reads it too.

Per trained token at length T, one multiply-add = 2 FLOPs, per TTT step j: q/k/v over the 2H-wide
input, o, the MLP, the attention over (T+1)/2 + j keys, the draft-vocab head; once per token fc
and the target's draft rows. Trained weights count 3x (forward, input and weight gradients),
frozen ones whose input needs a gradient 2x, the attention 3x, the target head 1x.
"""

from __future__ import annotations

from collections.abc import Iterable

SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "draft_vocab_size",
)


def shape_of(cfg) -> dict:
    """The sizes the count reads, from a DrafterConfig (or anything with those attributes)."""
    return {k: int(getattr(cfg, k)) for k in SHAPE_KEYS} | {"fc_in": int(getattr(cfg, "fc_in", 0) or 0)}


def flops_per_token(shape: dict, T: int, steps: int, lm_head_trainable: bool, fc_in: int | None = None) -> float:
    """Model FLOPs per trained token of a sample of length T, unrolled over `steps` TTT steps."""
    H, I = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    Vd = shape["draft_vocab_size"]
    qkv, o, mlp, head = 2 * 2 * H * (q + 2 * kv), 2 * q * H, 2 * 3 * H * I, 2 * H * Vd
    attn = sum(2 * 2 * q * ((T + 1) / 2 + j) for j in range(steps))
    fc = 2 * (fc_in or shape.get("fc_in") or 3 * H) * H
    return steps * 3 * (qkv + o + mlp) + 3 * attn + steps * (3 if lm_head_trainable else 2) * head + 2 * fc + head


def sample_flops(shape: dict, lengths: Iterable[int], steps: int, lm_head_trainable: bool) -> float:
    """Model FLOPs of training samples of these lengths, each at its own length's count."""
    return sum(L * flops_per_token(shape, L, steps, lm_head_trainable) for L in lengths)
