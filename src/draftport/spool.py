"""Online features: the capture runs beside the trainer as a producer feeding a bounded spool of
feature shards on disk (today's format), each deleted once the trainer has read it; the trainer
reads the spool as it reads a FeatureSet. The building block of an online storage mode for the
training steps; no step uses it yet (they capture to disk first).

SpoolFeatures(sequences, featurize, order=..., ...) is what train() reads in place of a
FeatureSet: train() only calls len(features) and features.sample(i) for the ids of
batch_ids(step, len(features), ...), so when `order` is consumption_order(...) of the same run
(seed, batch size, steps) the trainer asks for exactly the samples of `order`, one after another.

A producer thread walks `order` from position `start`; each group of `shard_samples` consecutive
positions (groups aligned to multiples of shard_samples from position 0, so a resume produces the
same groups, the first one cut at `start`) becomes one folder of spool_dir written by
data.write_features (today's shard format, its hashing, its atomic rename; batches of
`batch_size` sequences within the group, in position order). Before each group it waits
(threading.Condition) until the bytes of the spool's files plus the group's projected bytes fit
`spool_bytes`; the projection is an upper bound of the folder's files (bytes_per_token + 4 bytes
of target_arg per token, the offsets, a header and an index.json), and every written folder is
checked against it. Bytes are the files' sizes, as bytes_per_token counts them (directories and
the filesystem's block rounding aside). The consumer reads each position's shard once it is
complete and deletes its folder once it has returned the last of its positions, so the spool
never holds more than spool_bytes and the producer never waits on a spool the trainer cannot
drain (spool_bytes must hold the largest group: checked at construction).

Equality with disk-trained features: the states of a sample are those featurize computes for it
in its batch. write_features over the whole dataset batches samples in input order; the spool
batches them in consumption order. With batch_size 1 (or a featurize whose states for a sequence
do not depend on its batch-mates) the spool's samples are the disk folder's bit for bit, so a
drafter trained on either with the same seed is the same (tests/test_spool.py). With larger
batches the batch-mates, and so the padded width, differ: on the CPU the featurizer masks the
padding, so the states agree to rounding; bit for bit is not guaranteed (it held for the toy
Llama of the tests on the CPU). A resume at a position that starts a batch of its group (a
multiple of batch_size from the group's start) recomputes the very batches of an uninterrupted
run.

Resume: `position` is the data position a checkpoint records (positions of `order` consumed);
a new SpoolFeatures with start=position produces from there. Under train() it is the steps done
x batch_size (train's checkpoints do not record it yet: a caller passes step x batch_size). A
spool folder left by a killed run (it holds the .draftport-spool marker) is cleared at
construction; a folder that is not a spool and not empty is refused.

Single-process training only (world size 1), refused otherwise: under torchrun every rank would
read its slice of each batch, which the strict order check cannot follow.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

from .data import DTYPES, FeatureSet, Sequence, bytes_per_token, human, write_features
from .errors import DraftportError
from .train import batch_ids, dist_info

MARKER = ".draftport-spool"
HEADER_BOUND = 2048  # a shard's safetensors header (at most 9 tensors) + its 8-byte length
INDEX_FIELDS_BOUND = 1024  # index.json's own fields and its one shard entry, beside the meta


def consumption_order(n: int, steps: int, batch_size: int, seed: int, start_step: int = 0) -> list[int]:
    """The sample ids train() reads over steps [start_step, steps) of a run over n samples: the
    concatenation of train.batch_ids of each step."""
    return [i for s in range(start_step, steps) for i in batch_ids(s, n, batch_size, seed)]


def _files_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:  # a file of a folder being replaced
                pass
    return total


class _Closed(Exception):
    """Raised from write_features' progress callback: close() stops the capture between batches."""


class SpoolFeatures:
    """The samples of `order` captured on the fly into a bounded spool (see the module's
    docstring). len(): the number of samples `order` was drawn from (len(sequences));
    sample(i): the sample at the next position, which must be order[position]; the dict
    FeatureSet.sample returns. `max_bytes_seen`: the most bytes the spool's files ever held
    (an upper bound, kept under the lock). Single-process training only (world size 1)."""

    def __init__(self, sequences: list[Sequence], featurize, *, order: list[int], spool_dir, spool_bytes: int,
                 shard_samples: int, batch_size: int, hidden_size: int, meta: dict, dtype: str = "bfloat16",
                 start: int = 0):
        self.spool_dir = Path(spool_dir)
        if not sequences:
            raise DraftportError("features", "no samples to featurize (empty dataset)")
        if dtype not in DTYPES:
            raise DraftportError("features.dtype", f"{dtype!r} is not a storage dtype ({', '.join(DTYPES)})")
        for name, v in (("features.shard_samples", shard_samples), ("features.batch_size", batch_size),
                        ("hidden_size", hidden_size)):
            if not isinstance(v, int) or v < 1:
                raise DraftportError(name, f"{v!r} is not a positive integer")
        order = [int(i) for i in order]
        if not order:
            raise DraftportError("order", "no positions to read (an empty consumption order)")
        bad = next((i for i in order if not 0 <= i < len(sequences)), None)
        if bad is not None:
            raise DraftportError("order", f"sample id {bad} is not one of the {len(sequences)} sequences")
        if not 0 <= start < len(order):
            raise DraftportError("start", f"position {start} is outside the order's {len(order)} positions")
        if dist_info()[1] != 1:
            raise DraftportError("features.storage", "online features are single-process only (world size 1)")
        self.sequences, self.featurize, self.order = sequences, featurize, order
        self.shard_samples, self.batch_size, self.dtype, self.meta = shard_samples, batch_size, dtype, dict(meta)
        self.spool_bytes, self.start, self._pos = int(spool_bytes), start, start
        n_aux = len(meta.get("aux_layer_ids") or (0, 0, 0))
        self.per_token = bytes_per_token(hidden_size, dtype, n_aux) + 4  # + target_arg int32
        self.index_bound = len(json.dumps(self.meta, indent=2)) + INDEX_FIELDS_BOUND
        self.groups = list(range(start // shard_samples, -(-len(order) // shard_samples)))
        largest = max(self.projected(g) for g in self.groups)
        if self.spool_bytes < largest:
            raise DraftportError("features.spool_gb", f"{human(self.spool_bytes)} is less than one shard "
                                 f"(the largest of {shard_samples} samples: {human(largest)})")
        self._prepare_dir()
        self.max_bytes_seen = 0
        self._cond = threading.Condition()
        self._ready: dict[int, Path] = {}   # group -> its complete folder
        self._bytes: dict[int, int] = {}    # group -> its files' bytes, while on disk
        self._open: tuple[int, FeatureSet] | None = None
        self._error: BaseException | None = None
        self._closed = self._done = False
        self._thread = threading.Thread(target=self._produce, name="draftport-spool", daemon=True)
        self._thread.start()

    # ---- sizes -----------------------------------------------------------------------------
    def _group_range(self, g: int) -> range:
        """The positions of group g (the first group starts at `start`)."""
        S = self.shard_samples
        return range(max(g * S, self.start), min((g + 1) * S, len(self.order)))

    def projected(self, g: int) -> int:
        """An upper bound of the bytes of group g's folder."""
        pos = self._group_range(g)
        n = len(pos)
        tokens = sum(len(self.sequences[self.order[p]].tokens) for p in pos)
        return tokens * self.per_token + 16 * n + 8 + HEADER_BOUND + self.index_bound

    def _prepare_dir(self) -> None:
        d = self.spool_dir
        if d.exists():
            if not d.is_dir():
                raise DraftportError(d, "spool_dir is a file, not a folder")
            if (d / MARKER).is_file():
                shutil.rmtree(d)  # a spool a killed run left: its shards are not trusted
            elif any(d.iterdir()):
                raise DraftportError(d, "spool_dir exists and is not a spool (not empty): it would be deleted at close")
        d.mkdir(parents=True, exist_ok=True)
        (d / MARKER).touch()

    # ---- producer --------------------------------------------------------------------------
    def _produce(self) -> None:
        try:
            for g in self.groups:
                pos = self._group_range(g)
                need = self.projected(g)
                with self._cond:
                    while not self._closed and sum(self._bytes.values()) + need > self.spool_bytes:
                        self._cond.wait()
                    if self._closed:
                        return
                    held = sum(self._bytes.values())
                folder = self.spool_dir / f"shard_{g:05d}"
                write_features(folder, [self.sequences[self.order[p]] for p in pos], self.featurize,
                               meta=self.meta, shard_samples=len(pos), batch_size=self.batch_size,
                               dtype=self.dtype, progress=self._check_closed, writers=1)
                got = _files_bytes(folder)
                if got > need:
                    raise DraftportError(folder, f"holds {got} bytes, more than the {need} projected "
                                         f"(the hidden size or aux layers differ from the spool's)")
                with self._cond:
                    self._bytes[g], self._ready[g] = got, folder
                    self.max_bytes_seen = max(self.max_bytes_seen, held + got)
                    self._cond.notify_all()
        except _Closed:
            return
        except BaseException as e:  # noqa: BLE001 (raised again in the consumer's thread)
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()

    def _check_closed(self, _n: int) -> None:
        if self._closed:
            raise _Closed()

    # ---- consumer --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def position(self) -> int:
        """Positions of `order` consumed so far: the data position a checkpoint records."""
        return self._pos

    def sample(self, i: int) -> dict:
        pos = self._pos
        if self._closed:
            raise DraftportError(self.spool_dir, "the spool is closed")
        if pos >= len(self.order):
            raise DraftportError(self.spool_dir, f"sample {i} read past the end of the order "
                                 f"({len(self.order)} positions)")
        if int(i) != self.order[pos]:
            raise DraftportError(self.spool_dir, f"the trainer read sample {i} at data position {pos}, where the "
                                 f"order has {self.order[pos]}: it read out of order")
        g = pos // self.shard_samples
        with self._cond:
            while self._error is None and g not in self._ready and not self._done:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if g not in self._ready:
                raise DraftportError(self.spool_dir, f"the capture stopped before data position {pos}")
            folder = self._ready[g]
        if self._open is None or self._open[0] != g:
            self._open = (g, FeatureSet(folder, verify=False))  # written and hashed by this process just now
        rng = self._group_range(g)
        out = self._open[1].sample(pos - rng.start)
        self._pos = pos + 1
        if self._pos == rng.stop:  # the group's last position: its folder goes
            self._open = None
            with self._cond:
                shutil.rmtree(folder)
                del self._ready[g], self._bytes[g]
                self._cond.notify_all()
        return out

    def close(self) -> None:
        """Stop the producer (after its current batch) and remove the spool folder."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._open = None
        shutil.rmtree(self.spool_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
