"""Training-time test: the K-step unrolled loss of EAGLE-3.

Targets come from the target model itself: its final hidden state (after the last norm) through
its lm_head gives full-vocab logits at every position. The drafter learns the target's softmax
restricted to the draft vocab (soft cross-entropy); positions whose full-vocab argmax lies outside
the draft vocab are masked (the drafter cannot propose that token anyway); step j is weighted
gamma**j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafter import Eagle3Drafter, shift


@dataclass
class Batch:
    aux: torch.Tensor        # [B, T, 3*Ht]
    final: torch.Tensor      # [B, T, Ht] target's last hidden state after its final norm
    tokens: torch.Tensor     # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool: token t is an assistant token
    valid: torch.Tensor      # [B, T] bool: not padding

    def to(self, device, dtype=None):
        f = (lambda t: t.to(device=device, dtype=dtype)) if dtype else (lambda t: t.to(device))
        return Batch(f(self.aux), f(self.final), self.tokens.to(device), self.loss_mask.to(device),
                     self.valid.to(device))


def target_logits(final: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
    """Full-vocab target logits [B, T, V] in fp32."""
    return final.float() @ target_head.float().t()


def ttt_terms(drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, steps: int):
    """Per-step (summed soft-CE, rows counted, rows where the argmax agrees), unnormalized, so
    that data-parallel ranks can normalize by the global row count."""
    hot = drafter.hot_ids
    t2d = drafter.t2d
    with torch.no_grad():
        full = target_logits(batch.final, target_head)            # [B, T, V]
        t_arg = full.argmax(-1)                                    # target's next-token choice
        in_draft = t2d[t_arg]                                      # argmax inside draft vocab?
        t_prob = torch.softmax(full[..., hot], dim=-1)             # restricted + renormalized
        del full
    logits = drafter.unroll(batch.aux, batch.tokens, steps, teacher_tokens=True, valid=batch.valid)
    T = batch.tokens.shape[1]
    terms = []
    for j, lg in enumerate(logits):
        q = j + 1  # row p of step j is scored against the target's prediction at position p + q
        ok = (shift(batch.loss_mask.long(), q + 1).bool() & shift(batch.valid.long(), q + 1).bool()
              & shift(in_draft.long(), q).bool())
        if T <= q + 1:
            ok = torch.zeros_like(ok)
        per_row = -(shift_rows(t_prob, q) * torch.log_softmax(lg.float(), dim=-1)).sum(-1)
        with torch.no_grad():
            correct = ((hot[lg.argmax(-1)] == shift(t_arg, q)) & ok).sum()
        terms.append(((per_row * ok).sum(), ok.sum(), correct))
    return terms


def combine(terms, gamma: float, counts=None, scale: float = 1.0):
    """Weighted loss from ttt_terms; `counts` overrides the row counts (global under DDP)."""
    total = 0.0
    stats = {}
    for j, (loss_sum, n, correct) in enumerate(terms):
        denom = (counts[j] if counts is not None else n).clamp_min(1)
        total = total + (gamma ** j) * loss_sum / denom
        stats[f"loss_{j}"] = float(loss_sum.detach() / denom)
        stats[f"acc_{j}"] = float(correct / denom)
        stats[f"n_{j}"] = float(denom)
    return total * scale, stats


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
