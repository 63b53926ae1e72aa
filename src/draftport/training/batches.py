"""What each training step trains on: the sample ids of a step, the step's batch, and the batch
of the next step made on a host thread while the GPU runs this one.

Two ways to size a step (train.batch_size, train.tokens_per_step):
- batch_size samples: batch_ids(step) of the seeded epoch permutations, split over the processes;
- a token budget (with packing): the same seeded order read as one stream, each process's part of
  a step the next samples whose tokens fit the budget, packed into one row of exactly that many
  tokens. Every step then has one shape, so the compiled regions never see a new length, and a
  step holds as many tokens as the GPU is fed with, whatever the samples' lengths.
Both are pure functions of (seed, step) and the samples' lengths: a resumed run draws what the
uninterrupted one drew.
"""

from __future__ import annotations

import bisect
from concurrent.futures import ThreadPoolExecutor

import torch

from draftport.data.shards import collate
from draftport.errors import DraftportError
from draftport.plan.params import TrainConfig


def batch_ids(step: int, n: int, batch: int, seed: int) -> list[int]:
    """Sample ids of global batch `step`: epochs of seeded permutations, concatenated."""
    out = []
    pos = step * batch
    while len(out) < batch:
        epoch, off = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        take = perm[off : off + batch - len(out)]
        out.extend(take)
        pos += len(take)
    return out


class TokenBudget:
    """The token-budget plan: the seeded order as one stream of sample ids, and where each
    process's part of each step begins in it. Parts are cut greedily (the next samples while
    they fit) and computed on demand from the first step, so a resume at step s finds the same
    cut; lengths come from the shards' offsets, no states are read."""

    def __init__(self, lengths: list[int], budget: int, seed: int, world: int):
        too_long = [(n, i) for i, n in enumerate(lengths) if n > budget]
        if too_long:
            n, i = max(too_long)
            raise DraftportError(
                "train.tokens_per_step",
                f"{budget} is smaller than sample {i} ({n} tokens): packing never cuts a sample; raise it to >= {n}",
            )
        self.lengths, self.budget, self.seed, self.world = lengths, budget, seed, world
        self.perms: dict[int, list[int]] = {}
        self.cuts = [0]  # stream position where part p (= step * world + rank) begins

    def _id(self, pos: int) -> int:
        epoch, off = divmod(pos, len(self.lengths))
        if epoch not in self.perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self.perms = {epoch: torch.randperm(len(self.lengths), generator=g).tolist()}  # one epoch held
        return self.perms[epoch][off]

    def _extend(self, part: int) -> None:
        while len(self.cuts) <= part + 1:
            pos, fill = self.cuts[-1], 0
            while fill + self.lengths[self._id(pos)] <= self.budget:
                fill += self.lengths[self._id(pos)]
                pos += 1
            self.cuts.append(pos)

    def ids(self, step: int, rank: int) -> list[int]:
        part = step * self.world + rank
        self._extend(part)
        return [self._id(p) for p in range(self.cuts[part], self.cuts[part + 1])]

    def consumed(self, step: int) -> int:
        """Samples the steps before `step` took (all processes)."""
        self._extend(step * self.world)
        return self.cuts[step * self.world]

    def step_of(self, consumed: int) -> int:
        """The first step whose parts begin at or past `consumed` samples (for spool-like readers)."""
        return bisect.bisect_left(self.cuts, consumed) // self.world


def make_batch(samples: list[dict], cfg: TrainConfig):
    """samples -> the step's host batch. Packing: end to end in one row, of exactly
    tokens_per_step tokens with a budget, else of their total rounded up to ROW_MULTIPLE (fewer
    shapes for the compiled regions); the same loss as the padded batch either way."""
    if not cfg.packing:
        return collate(samples)[0]
    from draftport.data.packing import ROW_MULTIPLE, pack  # only then: a step that never packs does not run the module

    if cfg.tokens_per_step:
        return pack(samples, row_len=cfg.tokens_per_step)[0]
    return pack(samples, multiple=ROW_MULTIPLE)[0]


class StepBatches:
    """The batches of a training's steps on its device, in step order. On CUDA the next step's
    batch is read, packed and pinned on a host thread while the GPU runs the current step, and
    copied without holding the host (the loop queues step s+1 while step s computes); on the CPU
    each batch is made when asked for (the same batches either way)."""

    def __init__(
        self, features, cfg: TrainConfig, rank: int, world: int, device: torch.device, ahead: bool | None = None
    ):
        self.features, self.cfg, self.rank, self.world, self.device = features, cfg, rank, world, device
        self.budget = None
        if cfg.tokens_per_step:
            if not cfg.packing:
                raise DraftportError("train.tokens_per_step", f"{cfg.tokens_per_step} needs train.packing: true")
            if getattr(features, "begin", None) is not None:
                raise DraftportError(
                    "train.tokens_per_step",
                    "online features (features.storage online/hybrid) are captured batch_size samples "
                    "a step: use batch_size",
                )
            lengths = [features.length(i) for i in range(len(features))]
            self.budget = TokenBudget(lengths, cfg.tokens_per_step, cfg.seed, world)
        # online features capture on this process's GPU as they are read: never from a second thread
        online = getattr(features, "begin", None) is not None
        self.ahead = (device.type == "cuda" if ahead is None else ahead) and not online
        self.pinned = device.type == "cuda"
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="draftport-batch") if self.ahead else None
        self.next = None  # (step, future of (lengths, host batch))

    def ids(self, step: int) -> list[int]:
        if self.budget is not None:
            return self.budget.ids(step, self.rank)
        return batch_ids(step, len(self.features), self.cfg.batch_size, self.cfg.seed)[self.rank :: self.world]

    def _host(self, step: int):
        samples = [self.features.sample(i) for i in self.ids(step)]
        batch = make_batch(samples, self.cfg)
        return [int(s["tokens"].shape[0]) for s in samples], (batch.pin() if self.ahead and self.pinned else batch)

    def get(self, step: int):
        """-> (the samples' lengths, the step's batch on the device); starts on step + 1's."""
        if self.pool is None:
            lengths, batch = self._host(step)
            return lengths, batch.to(self.device)
        if self.next is not None and self.next[0] == step:
            lengths, batch = self.next[1].result()
        else:
            lengths, batch = self._host(step)
        self.next = (step + 1, self.pool.submit(self._host, step + 1))
        return lengths, batch.to(self.device, non_blocking=self.pinned)

    def position(self, step: int) -> int:
        """Samples the steps before `step` took (the checkpoint's data position)."""
        if self.budget is not None:
            return self.budget.consumed(step)
        return step * self.cfg.batch_size

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
