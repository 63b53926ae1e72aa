"""Training-time test: the K-step unrolled loss of EAGLE-3.

Targets come from the target model itself: its final hidden state (after the last norm) through
its lm_head gives full-vocab logits at every position. The drafter learns the target's softmax
restricted to the draft vocab (soft cross-entropy); positions whose full-vocab argmax lies outside
the draft vocab are masked (the drafter cannot propose that token anyway); step j is weighted
gamma**j.

Here the loss is written out whole (target logits, soft-CE, masks): the definition.
`ttt_terms(..., fast=FastPath(...))` computes the same terms on the fast path
(draftport.model.fast.loss: row-chunked target side and lm_head, fused attention and linears,
compiled regions), as training on the GPU runs it.

Packed batches (draftport.data.packing.PackedBatch, several samples per row) give the same terms as
the padded batch of the same samples: the drafter keeps attention, positions and token shifts per
sample, and row p of step j counts only when p + j + 2 lies in p's own sample.
"""

from __future__ import annotations

import torch

from draftport.data.shards import Batch
from draftport.model.drafter import Eagle3Drafter, shift
from draftport.model.fast import loss as fast_loss
from draftport.model.fast.path import FastPath
from draftport.model.target import target_logits


def ttt_terms(
    drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, steps: int, fast: FastPath | None = None
):
    """Per-step (summed soft-CE, rows counted, rows where the argmax agrees), unnormalized, so
    that data-parallel ranks can normalize by the global row count.

    fast: compute them on the fast path (the same terms; draftport.model.fast.loss); None: the
    reference below."""
    if fast is not None:
        return fast_loss.ttt_terms(drafter, batch, target_head, steps, fast, counted_rows)
    hot = drafter.hot_ids
    t2d = drafter.t2d
    with torch.no_grad():
        full = target_logits(batch.final, target_head)  # [B, T, V]
        t_arg = full.argmax(-1) if batch.target_arg is None else batch.target_arg  # target's choice
        in_draft = t2d[t_arg]  # argmax inside draft vocab?
        t_prob = torch.softmax(full[..., hot], dim=-1)  # restricted + renormalized
        del full
    logits = drafter.unroll(
        batch.aux, batch.tokens, steps, teacher_tokens=True, valid=batch.valid, **packed_args(batch)
    )
    terms = []
    for j, lg in enumerate(logits):
        q = j + 1  # row p of step j is scored against the target's prediction at position p + q
        ok = counted_rows(batch, in_draft, q)
        per_row = -(shift_rows(t_prob, q) * torch.log_softmax(lg.float(), dim=-1)).sum(-1)
        with torch.no_grad():
            correct = ((hot[lg.argmax(-1)] == shift(t_arg, q)) & ok).sum()
        terms.append(((per_row * ok).sum(), ok.sum(), correct))
    return terms


def packed_args(batch) -> dict:
    """The reference unroll's keyword arguments for a packed batch (doc, positions); {} otherwise."""
    doc = getattr(batch, "doc", None)
    if doc is None:
        return {}
    return {"doc": doc, "positions": batch.positions}


def counted_rows(batch: Batch, in_draft: torch.Tensor, q: int) -> torch.Tensor:
    """Rows of step q-1 that count: the position scored (p + q + 1) is a valid assistant token of
    row p's own sample (packed rows: the same doc), and the target's argmax there is a draft id."""
    T = batch.tokens.shape[1]
    ok = (
        shift(batch.loss_mask.long(), q + 1).bool()
        & shift(batch.valid.long(), q + 1).bool()
        & shift(in_draft.long(), q).bool()
    )
    doc = getattr(batch, "doc", None)
    if doc is not None:
        ok = ok & (shift(doc, q + 1, fill=-1) == doc)
    return torch.zeros_like(ok) if T <= q + 1 else ok


def combine(terms, gamma: float, counts=None, scale: float = 1.0, sync: bool = True):
    """Weighted loss from ttt_terms; `counts` overrides the row counts (global under DDP).

    sync=False leaves the stats as 0-dim tensors (no host sync; see stats_to_float)."""
    total = 0.0
    stats = {}
    for j, (loss_sum, n, correct) in enumerate(terms):
        denom = (counts[j] if counts is not None else n).clamp_min(1)
        total = total + (gamma**j) * loss_sum / denom
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


def ttt_loss(
    drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, steps: int, gamma: float
) -> tuple[torch.Tensor, dict]:
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
