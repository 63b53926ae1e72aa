"""The disk a capture or an online training needs, by storage mode, and the check each runs
before any weights load (draftport.profile.estimate prints the same figures for a whole profile).

Modes (features.storage): `disk` every state on disk at features.dtype; `online` the training
step recomputes the states into a bounded spool (features.spool_gb) deleted as read, only the
answers' token ids stay; `hybrid` online, plus the first epoch's states cached on disk when they
fit beside the spool (then later epochs read them instead of recomputing).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from draftport.errors import DraftportError

MODES = ("disk", "online", "hybrid")
SPOOL_GB = 64.0  # features.spool_gb's default: the online spool bound
TOKEN_BYTES = 4 + 1  # a stored token: its id (int32) and its loss-mask bit (bool)
DISK_MARGIN = 1.05  # check_storage refuses unless 5% more than the need is free


def _positive(name: str, value, *, at_most: float | None = None) -> None:
    if (
        value is None
        or isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or (at_most is not None and value > at_most)
    ):
        rng = f"in (0, {at_most:g}]" if at_most is not None else "> 0"
        raise DraftportError(name, f"must be {rng}, got {value!r}")


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", n_aux: int = 3) -> tuple[int, str]:
    """(bytes per stored token, how): draftport.data.shards's, the writer's own size (fp8_e4m3: 1 B per
    element + a float32 scale per token per state)."""
    # lazy: data.shards imports torch; `draftport estimate` imports this module and stays torch-free
    from draftport.data import shards as data

    try:
        return data.bytes_per_token(hidden_size, dtype, n_aux), "data.bytes_per_token"
    except KeyError:
        raise DraftportError("features.dtype", f"{dtype!r}: no storage size known") from None


def storage_need(
    mode: str, *, tokens: int, hidden_size: int, dtype: str = "bfloat16", n_aux: int = 3, spool_gb: float = SPOOL_GB
) -> dict:
    """Bytes a capture (or an online training) needs on disk before it starts, by storage mode:
    disk: tokens x bytes per token at dtype; online: the spool bound + the answers as token ids;
    hybrid: online's need, plus the first epoch's cache (tokens x bytes per token) when it fits."""
    if mode not in MODES:
        raise DraftportError("features.storage", f"{mode!r}: expected one of {', '.join(MODES)}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise DraftportError("storage", f"tokens must be an integer >= 0, got {tokens!r}")
    per_tok, how = bytes_per_token(hidden_size, dtype, n_aux)
    full = tokens * per_tok
    if mode == "disk":
        return {
            "mode": mode,
            "need_bytes": full,
            "tokens": tokens,
            "bytes_per_token": per_tok,
            "dtype": dtype,
            "formula": f"{tokens:,} tokens x {per_tok:,} B/token ({dtype}, {how})",
        }
    _positive("features.spool_gb", spool_gb)
    spool = min(int(spool_gb * 1e9), full)  # the spool never holds more than all the states
    ids = tokens * TOKEN_BYTES
    out = {
        "mode": mode,
        "need_bytes": spool + ids,
        "tokens": tokens,
        "spool_bytes": spool,
        "ids_bytes": ids,
        "formula": f"spool min({spool_gb:g} GB, all states {full:,} B) + {tokens:,} tokens x {TOKEN_BYTES} B "
        "(ids + mask)",
    }
    if mode == "hybrid":
        out.update(
            cache_bytes=full,
            bytes_per_token=per_tok,
            dtype=dtype,
            formula=out["formula"] + f"; first-epoch cache {tokens:,} x {per_tok:,} B/token ({dtype})",
        )
    return out


def check_storage(folder, need: dict, log=print) -> dict:
    """Refuse (one line) when the disk at folder cannot hold `need` (storage_need's) with 5% to
    spare; hybrid: refuse below online's need, and say whether the first epoch's cache fits.
    Returns need with `free_bytes` (and, for hybrid, `cache`: true when the cache fits)."""
    # lazy: data.shards imports torch; `draftport estimate` imports this module and stays torch-free
    from draftport.data.shards import human

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    mode, n = need["mode"], need["need_bytes"]
    out = dict(need, free_bytes=free)
    if mode == "hybrid":
        out["cache"] = (n + need["cache_bytes"]) * DISK_MARGIN <= free
        log(
            f"storage ({mode}): need ~{human(n)} ({need['formula']}), free {human(free)} at {folder}; first epoch "
            + ("cached" if out["cache"] else f"not cached (~{human(need['cache_bytes'])} does not fit): online")
        )
    else:
        log(f"storage ({mode}): need ~{human(n)} ({need['formula']}), free {human(free)} at {folder}")
    if n * DISK_MARGIN > free:
        what = "the features" if mode == "disk" else f"the {mode} spool"
        raise DraftportError(
            folder, f"not enough disk for {what}: need ~{human(n)}, {human(free)} free (features.storage {mode})"
        )
    return out
