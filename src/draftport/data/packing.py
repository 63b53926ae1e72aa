"""Sequence packing: several samples per row, kept apart in every TTT step.

`data.collate` right-pads each sample to the longest of its batch, so a batch of real answers
(up to 2048 tokens, ~1.5K on average) spends a quarter of its compute on padding. `pack` lays
the same samples end to end instead, in as few rows as fit (first-fit decreasing), and records
where each one starts, so that training computes exactly what it would on the padded batch:

- attention never crosses samples, in any unrolled step: a row sees the step-0 keys of the rows
  of its own sample at or before it (the reference builds that dense mask from `doc`; the fused
  path runs variable-length flash attention over `cu_seqlens`), and its own diagonal keys;
- positions restart at 0 with each sample (RoPE);
- the next-token shifts of TTT stop at a sample's end (past it a row is fed token 0, as past
  the end of a padded row), and the loss counts row p of step j only when the position it is
  scored against (p + j + 2) lies in the same sample.

A PackedBatch is a data.Batch (same fields, same meaning of valid / loss_mask / target_arg) plus
doc [B, T] (a sample's id at each of its rows; each row's padding tail has an id of its own, with
valid False), positions [B, T], and the segments as host ints: cu_seqlens over the B*T rows taken
row after row (every sample and every padding tail is one segment) and the longest segment.
The loss and gradients equal those of the padded batch of the same samples (tests/data/test_packing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftport.data.shards import Batch, batch_buffers


@dataclass
class PackedBatch(Batch):
    doc: torch.Tensor | None = None  # [B, T] long: segment id of each row
    positions: torch.Tensor | None = None  # [B, T] long: position inside its sample
    cu_seqlens: list[int] = field(default_factory=list)  # segment starts over B*T, + B*T
    max_seqlen: int = 0
    n_samples: int = 0
    cu_seqlens_t: torch.Tensor | None = None  # the same as int32, on the batch's device

    def to(self, device, dtype=None, non_blocking: bool = False):
        b = Batch.to(self, device, dtype, non_blocking)
        cu = torch.tensor(self.cu_seqlens, dtype=torch.int32) if self.cu_seqlens_t is None else self.cu_seqlens_t
        return PackedBatch(
            b.aux,
            b.final,
            b.tokens,
            b.loss_mask,
            b.valid,
            b.target_arg,
            b.loss_share,
            doc=self.doc.to(device, non_blocking=non_blocking),
            positions=self.positions.to(device, non_blocking=non_blocking),
            cu_seqlens=list(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            n_samples=self.n_samples,
            cu_seqlens_t=cu.to(device, non_blocking=non_blocking),
        )

    @property
    def real_tokens(self) -> int:
        return int(self.valid.sum())


def plan_rows(lengths: list[int], row_len: int | None = None) -> list[list[int]]:
    """Sample indices per row. row_len None: one row holding all the samples (in order).
    Else first-fit decreasing into rows of row_len tokens (a sample longer than row_len is
    refused: packing never cuts a sample)."""
    if row_len is None:
        return [list(range(len(lengths)))]
    too_long = [n for n in lengths if n > row_len]
    if too_long:
        raise ValueError(f"a sample of {max(too_long)} tokens does not fit a packed row of {row_len}")
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, f in enumerate(fill):
            if f + lengths[i] <= row_len:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return [sorted(r) for r in rows]  # samples in their original order inside a row


# train() packs a step's samples into one row of their total length rounded up to this many
# tokens (fewer distinct shapes for the compiled regions)
ROW_MULTIPLE = 64


def pack(
    samples: list[dict], row_len: int | None = None, multiple: int = 1, dtype=torch.float32
) -> tuple[PackedBatch, list[int]]:
    """Pack samples (FeatureSet.sample dicts, as data.collate takes) into rows; -> (PackedBatch,
    response starts in the order given). Every row has the same length: row_len when given,
    else the fullest row's fill; rounded up to `multiple` (fewer distinct shapes to compile)."""
    lengths = [int(s["tokens"].shape[0]) for s in samples]
    rows = plan_rows(lengths, row_len)
    T = row_len if row_len is not None else max(sum(lengths[i] for i in r) for r in rows)
    T = -(-T // multiple) * multiple
    B = len(rows)
    aux, final, tokens, mask, valid, t_arg = batch_buffers(samples, B, T, dtype)
    has_arg = t_arg is not None
    doc = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    cu, longest, seg = [0], 0, 0
    for b, r in enumerate(rows):
        o = 0
        for i in r:
            s, n = samples[i], lengths[i]
            aux[b, o : o + n], final[b, o : o + n] = s["aux"].to(dtype), s["final"].to(dtype)
            tokens[b, o : o + n], mask[b, o : o + n], valid[b, o : o + n] = s["tokens"], s["loss_mask"], True
            if has_arg:
                t_arg[b, o : o + n] = s["target_arg"]
            doc[b, o : o + n] = seg
            pos[b, o : o + n] = torch.arange(n)
            o += n
            seg += 1
            cu.append(b * T + o)
            longest = max(longest, n)
        if o < T:  # the row's padding tail: a segment of its own (valid False)
            doc[b, o:] = seg
            pos[b, o:] = torch.arange(T - o)
            seg += 1
            cu.append((b + 1) * T)
            longest = max(longest, T - o)
    batch = PackedBatch(
        aux,
        final,
        tokens,
        mask,
        valid,
        t_arg,
        doc=doc,
        positions=pos,
        cu_seqlens=cu,
        max_seqlen=longest,
        n_samples=len(samples),
        cu_seqlens_t=torch.tensor(cu, dtype=torch.int32),
    )
    return batch, [s["response_start"] for s in samples]
