"""Online features: the capture runs beside the trainer as a producer feeding a bounded spool of
feature shards on disk (today's format), each deleted once the trainer has read it; the trainer
reads the spool as it reads a FeatureSet. With features.storage online / hybrid the feature steps
store the answers only (data.write_sequences) and each training step reads them through
OnlineFeatures (train_phase builds it with online_features), which captures as it trains.

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
drafter trained on either with the same seed is the same (tests/training/test_spool.py). With larger
batches the batch-mates, and so the padded width, differ: on the CPU the featurizer masks the
padding, so the states agree to rounding; bit for bit is not guaranteed (it held for the toy
Llama of the tests on the CPU). A resume at a position that starts a batch of its group (a
multiple of batch_size from the group's start) recomputes the very batches of an uninterrupted
run.

Resume: `position` is the data position a checkpoint records (positions of `order` consumed;
train's checkpoints hold it as `data_position`, the steps done x batch_size); a new SpoolFeatures
with start=position produces from there. A spool folder left by a killed run (it holds the
.draftport-spool marker) is cleared at construction; a folder that is not a spool and not empty
is refused. keep=True (hybrid's first-epoch cache) keeps every folder once read, has no bound
(the caller checked the disk) and reuses the folders a killed run completed (hash and sequences
checked). `writer(folder, sequences)` replaces featurize for an engine that writes a feature
folder itself (vLLM: features.capture_writer).

Single-process training only (world size 1), refused otherwise: under torchrun every rank would
read its slice of each batch, which the strict order check cannot follow.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

from draftport.data.features import capture_writer
from draftport.data.shards import DTYPES, FeatureSet, Sequence, bytes_per_token, capture_meta, human, write_features
from draftport.data.storage import check_storage, storage_need
from draftport.errors import DraftportError
from draftport.training.loop import batch_ids, dist_info

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

    def __init__(
        self,
        sequences: list[Sequence],
        featurize=None,
        *,
        order: list[int],
        spool_dir,
        spool_bytes: int,
        shard_samples: int,
        batch_size: int,
        hidden_size: int,
        meta: dict,
        dtype: str = "bfloat16",
        start: int = 0,
        writer=None,
        keep: bool = False,
    ):
        self.spool_dir = Path(spool_dir)
        if (featurize is None) == (writer is None):
            raise DraftportError("spool", "give featurize (the in-process capture) or writer (an engine's), not both")
        self.writer, self.keep = writer, keep
        if not sequences:
            raise DraftportError("features", "no samples to featurize (empty dataset)")
        if dtype not in DTYPES:
            raise DraftportError("features.dtype", f"{dtype!r} is not a storage dtype ({', '.join(DTYPES)})")
        for name, v in (
            ("features.shard_samples", shard_samples),
            ("features.batch_size", batch_size),
            ("hidden_size", hidden_size),
        ):
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
        # keep (hybrid's cache): every group from the first, those a killed run completed reused
        self.groups = list(range(0 if keep else start // shard_samples, -(-len(order) // shard_samples)))
        self._first = 0 if keep else start  # the producer's first position
        largest = max(self.projected(g) for g in self.groups)
        if not keep and self.spool_bytes < largest:
            raise DraftportError(
                "features.spool_gb",
                f"{human(self.spool_bytes)} is less than one shard "
                f"(the largest of {shard_samples} samples: {human(largest)})",
            )
        self._prepare_dir()
        self.max_bytes_seen = 0
        self._cond = threading.Condition()
        self._ready: dict[int, Path] = {}  # group -> its complete folder
        self._bytes: dict[int, int] = {}  # group -> its files' bytes, while on disk
        self._open: tuple[int, FeatureSet] | None = None
        self._error: BaseException | None = None
        self._closed = self._done = False
        self._thread = threading.Thread(target=self._produce, name="draftport-spool", daemon=True)
        self._thread.start()

    # ---- sizes -----------------------------------------------------------------------------
    def _group_range(self, g: int) -> range:
        """The positions of group g (the first group starts at the producer's first position)."""
        S = self.shard_samples
        return range(max(g * S, self._first), min((g + 1) * S, len(self.order)))

    def projected(self, g: int) -> int:
        """An upper bound of the bytes of group g's folder."""
        pos = self._group_range(g)
        n = len(pos)
        length = getattr(self.sequences, "length", None) or (lambda i: len(self.sequences[i].tokens))
        tokens = sum(length(self.order[p]) for p in pos)
        return tokens * self.per_token + 16 * n + 8 + HEADER_BOUND + self.index_bound

    def _prepare_dir(self) -> None:
        d = self.spool_dir
        if d.exists():
            if not d.is_dir():
                raise DraftportError(d, "spool_dir is a file, not a folder")
            if (d / MARKER).is_file() and self.keep:  # a cache: its complete folders are checked as read
                for part in d.iterdir():  # folders a killed write left (temporary names, no index)
                    if part.is_dir() and (part.name.startswith(".") or not (part / "index.json").is_file()):
                        shutil.rmtree(part, ignore_errors=True)
                return
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
                    while not self._closed and not self.keep and sum(self._bytes.values()) + need > self.spool_bytes:
                        self._cond.wait()
                    if self._closed:
                        return
                    held = sum(self._bytes.values())
                folder = self.spool_dir / f"shard_{g:05d}"
                seqs = [self.sequences[self.order[p]] for p in pos]
                if self.keep and (folder / "index.json").is_file():
                    pass  # completed by an earlier (killed) run of the same cache: read with its hashes checked
                elif self.writer is not None:
                    self.writer(folder, seqs)
                else:
                    write_features(
                        folder,
                        seqs,
                        self.featurize,
                        meta=self.meta,
                        shard_samples=len(pos),
                        batch_size=self.batch_size,
                        dtype=self.dtype,
                        progress=self._check_closed,
                        writers=1,
                    )
                got = _files_bytes(folder)
                if got > need:
                    raise DraftportError(
                        folder,
                        f"holds {got} bytes, more than the {need} projected "
                        f"(the hidden size or aux layers differ from the spool's)",
                    )
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
            raise DraftportError(
                self.spool_dir, f"sample {i} read past the end of the order ({len(self.order)} positions)"
            )
        if int(i) != self.order[pos]:
            raise DraftportError(
                self.spool_dir,
                f"the trainer read sample {i} at data position {pos}, where the "
                f"order has {self.order[pos]}: it read out of order",
            )
        g = pos // self.shard_samples
        folder = self._wait(g, pos)
        if self._open is None or self._open[0] != g:
            # written and hashed by this process just now; a kept folder may be a killed run's: checked
            self._open = (g, FeatureSet(folder, verify=self.keep))
            self._check_group(g, self._open[1])
        rng = self._group_range(g)
        out = self._open[1].sample(pos - rng.start)
        self._pos = pos + 1
        if self._pos == rng.stop:  # the group's last position: its folder goes (a cache keeps it)
            self._open = None
            if not self.keep:
                with self._cond:
                    shutil.rmtree(folder)
                    del self._ready[g], self._bytes[g]
                    self._cond.notify_all()
        return out

    def _check_group(self, g: int, fs: FeatureSet) -> None:
        """A group's folder holds its sequences (a cache reused after a kill, an engine's writer)."""
        rng = self._group_range(g)
        if len(fs) != len(rng):
            raise DraftportError(fs.folder, f"holds {len(fs)} samples, the spool's group {g} has {len(rng)}")
        for j in (0, len(rng) - 1):
            want = self.sequences[self.order[rng[j]]].tokens
            if fs.sample(j)["tokens"].tolist() != list(want):
                raise DraftportError(
                    fs.folder, f"sample {j} is not the sequence at data position {rng[j]} (a cache of other data?)"
                )

    def _wait(self, g: int, pos: int) -> Path:
        """Group g's folder once the producer has completed it (its error raised here)."""
        with self._cond:
            while self._error is None and g not in self._ready and not self._done:
                self._cond.wait()
            if self._error is not None:
                raise self._error
            if g not in self._ready:
                raise DraftportError(self.spool_dir, f"the capture stopped before data position {pos}")
            return self._ready[g]

    def kept(self, pos: int) -> tuple[Path, int]:
        """keep: the folder of data position pos's group, once complete, and pos's index in it."""
        g = pos // self.shard_samples
        return self._wait(g, pos), pos - self._group_range(g).start

    def close(self) -> None:
        """Stop the producer (after its current batch) and remove the spool folder."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._open = None
        if not self.keep:
            shutil.rmtree(self.spool_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


# ---- what a training step reads when its data is stored online ----------------------------------
CACHE_MARKER = ".draftport-cache.json"


class _Sequences:
    """A SequenceSet (or a chain of them) as the list of Sequences SpoolFeatures indexes."""

    def __init__(self, seqset):
        self.seqset = seqset

    def __len__(self) -> int:
        return len(self.seqset)

    def __getitem__(self, i: int) -> Sequence:
        return self.seqset.sequence(int(i))

    def length(self, i: int) -> int:
        return self.seqset.length(int(i))


class OnlineFeatures:
    """The samples of a sequences folder (data.SequenceSet, or a FeatureChain of them: storage
    online / hybrid) captured while train() reads them. train() calls begin(step, cfg, position)
    once it knows where it resumes: the consumption order of the run (consumption_order of
    cfg's steps, batch size and seed) is read from data position `position` (= step x batch
    size, which every checkpoint records as `data_position`). Then len() / sample(i) as a
    FeatureSet; close() (train_phase calls it) stops the capture and removes the spool.

    online: every position captured into the bounded spool and deleted once read (more than one
    epoch recomputes). hybrid with `cache` (check_storage said the first epoch fits beside the
    spool) and more than one epoch: the first epoch's positions are captured into `cache_dir`
    and kept, the later epochs read from it (no capture); a resume in the first epoch reuses
    the folders it completed (their hashes and sequences checked). hybrid without the cache runs
    as online."""

    def __init__(
        self,
        seqset,
        *,
        writer,
        spool_dir,
        spool_bytes: int,
        mode: str = "online",
        cache_dir=None,
        cache: bool = False,
        log=print,
    ):
        if mode not in ("online", "hybrid"):
            raise DraftportError("features.storage", f"{mode!r} is not online or hybrid")
        cap = seqset.index.get("capture") or {}
        self.seqset, self.writer, self.mode, self.log = seqset, writer, mode, log
        self.spool_dir, self.spool_bytes = Path(spool_dir), int(spool_bytes)
        self.cache_dir, self.cache = (Path(cache_dir) if cache_dir else None), bool(cache and cache_dir)
        self.index = seqset.index
        self.meta = capture_meta(self.index)
        self.shard_samples = int(cap.get("shard_samples", 256))
        self.batch_size = int(cap.get("batch_size", 16))
        self.hidden_size, self.dtype = int(self.index["hidden_size"]), cap.get("dtype", "bfloat16")
        self._seqs = _Sequences(seqset)  # read as asked: a 200K-sample set is not held as Python lists
        self._spool: SpoolFeatures | None = None
        self._cached: SpoolFeatures | None = None
        self._open: dict[Path, FeatureSet] = {}
        self._verified: set[Path] = set()
        self._order: list[int] = []
        self._pos = 0

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def position(self) -> int:
        """Positions of the consumption order read so far: the data position a checkpoint records."""
        return self._pos

    def begin(self, step: int, cfg, position: int | None = None) -> None:
        n, bs = len(self._seqs), cfg.batch_size
        start = step * bs
        if position is not None and position != start:
            raise DraftportError(
                "checkpoint",
                f"records data position {position}, but step {step} x batch "
                f"{bs} reads from {start}: not a checkpoint of this order",
            )
        self._order = consumption_order(n, cfg.steps, bs, cfg.seed)
        self._first_at = {i: p for p, i in enumerate(self._order[:n])}  # sample -> its first-epoch position
        self._pos = start
        if start >= len(self._order):
            return  # nothing left to read (a finished run resumed)
        common = dict(
            shard_samples=self.shard_samples,
            batch_size=self.batch_size,
            hidden_size=self.hidden_size,
            meta=self.meta,
            dtype=self.dtype,
            writer=self.writer,
        )
        epochs = len(self._order) / n
        if self.mode == "hybrid" and self.cache and epochs > 1:
            self._prepare_cache()
            self._cached = SpoolFeatures(
                self._seqs,
                order=self._order[:n],
                spool_dir=self.cache_dir,
                spool_bytes=0,
                start=min(start, n - 1),
                keep=True,
                **common,
            )
            self._cached._pos = min(start, n)
            if start < n:
                self.log(
                    f"features (hybrid): the first epoch captured into {self.cache_dir}, "
                    f"{epochs - 1:.2f} more epochs read from it"
                )
            else:
                self.log(f"features (hybrid): reading the cached first epoch in {self.cache_dir}")
            return
        if self.mode == "hybrid":
            self.log(
                "features (hybrid): "
                + (
                    "one epoch, nothing to cache"
                    if epochs <= 1
                    else "the first epoch's cache does not fit: online (each epoch recomputed)"
                )
            )
        self._spool = SpoolFeatures(
            self._seqs, order=self._order, spool_dir=self.spool_dir, spool_bytes=self.spool_bytes, start=start, **common
        )

    def _prepare_cache(self) -> None:
        """The cache is this data's, in this order, or it is cleared."""
        parts = getattr(self.seqset, "sets", [self.seqset])  # a chain: each folder's sequences file
        key = {
            "sequences": [p.index.get("sequences") for p in parts],
            "samples": len(self._seqs),
            "order": hashlib.sha256(json.dumps(self._order[: len(self._seqs)]).encode()).hexdigest(),
            "shard_samples": self.shard_samples,
            "capture": self.index.get("capture"),
        }
        d, mark = self.cache_dir, self.cache_dir / CACHE_MARKER
        if d.exists():
            try:
                same = json.loads(mark.read_text()) == key
            except (OSError, json.JSONDecodeError):
                same = False
            if not same:
                if d.is_dir() and ((d / MARKER).is_file() or not any(d.iterdir())):
                    shutil.rmtree(d)
                else:
                    raise DraftportError(d, "exists and is not a feature cache: it would be deleted")
        d.mkdir(parents=True, exist_ok=True)
        (d / MARKER).touch()
        mark.write_text(json.dumps(key))

    def sample(self, i: int) -> dict:
        pos = self._pos
        if self._spool is not None:
            out = self._spool.sample(i)
        elif self._cached is not None and pos < len(self._seqs):
            out = self._cached.sample(i)
        elif self._cached is not None:  # a later epoch: from the kept folders
            if pos >= len(self._order) or int(i) != self._order[pos]:
                raise DraftportError(
                    self.cache_dir, f"the trainer read sample {i} at data position {pos}, out of the order"
                )
            folder, j = self._cached.kept(self._first_at[int(i)])
            fs = self._open.get(folder)
            if fs is None:
                if len(self._open) >= 2:
                    self._open.pop(next(iter(self._open)))
                fs = self._open[folder] = FeatureSet(folder, verify=folder not in self._verified)
                self._verified.add(folder)
                self._cached._check_group(int(folder.name.rsplit("_", 1)[1]), fs)
            out = fs.sample(j)
        else:
            raise DraftportError(self.spool_dir, "online features read before train() began them")
        self._pos = pos + 1
        return out

    def close(self) -> None:
        """Stop the capture and remove the spool; hybrid's cache stays for a resume."""
        for sp in (self._spool, self._cached):
            if sp is not None:
                sp.close()
        self._open.clear()

    def discard_cache(self) -> None:
        """Remove hybrid's first-epoch cache (the run has finished)."""
        if self.cache_dir is not None and (self.cache_dir / MARKER).is_file():
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def online_features(
    fs, *, target_dir, spool_dir, spool_gb: float, cache_dir=None, trust_remote_code: bool = False, log=print
) -> OnlineFeatures:
    """OnlineFeatures for a sequences folder (or chain): the storage need checked at spool_dir
    (storage.check_storage: the spool bound + the ids; hybrid: whether the first epoch's cache
    fits beside it) before the target is loaded for the capture (features.capture_writer, the
    engine the capture settings name)."""
    mode = fs.index.get("storage")
    lengths = [fs.length(i) for i in range(len(fs))]
    cap = fs.index.get("capture") or {}
    hidden, dtype = int(fs.index["hidden_size"]), cap.get("dtype", "bfloat16")
    n_aux = len(fs.index.get("aux_layer_ids") or (0, 0, 0))
    need = storage_need(mode, tokens=sum(lengths), hidden_size=hidden, dtype=dtype, n_aux=n_aux, spool_gb=spool_gb)
    got = check_storage(Path(spool_dir).parent, need, log)
    # a bound below any shard is refused before the target loads (the exact check, on the shards
    # of the run's order, follows once train() knows it: SpoolFeatures)
    S = min(int(cap.get("shard_samples", 256)), len(fs))
    floor = sum(sorted(lengths)[:S]) * (bytes_per_token(hidden, dtype, n_aux) + 4)
    if spool_gb * 1e9 < floor:
        raise DraftportError(
            "features.spool_gb",
            f"{human(spool_gb * 1e9)} is less than one shard (its {S} samples hold at least {human(floor)})",
        )
    writer = capture_writer(target_dir, fs.index, trust_remote_code=trust_remote_code)
    return OnlineFeatures(
        fs,
        writer=writer,
        spool_dir=spool_dir,
        spool_bytes=int(spool_gb * 1e9),
        mode=mode,
        cache_dir=cache_dir,
        cache=bool(got.get("cache")),
        log=log,
    )
