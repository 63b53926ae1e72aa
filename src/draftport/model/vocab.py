"""Draft vocabulary maps (d2t / t2d): build, check, compare, remap.

Convention shared by EAGLE-3, SpecForge, speculators, SGLang and vLLM:
  hot set   = the draft_vocab_size most frequent target ids (over assistant tokens), SORTED BY ID
  d2t[i]    = hot[i] - i               (a delta, int64); draft slot i  ->  target id i + d2t[i]
  t2d[id]   = id in hot set            (bool, length vocab_size)

Because the hot set is sorted, one token entering or leaving it shifts every later slot: two maps
built from slightly different data differ "position by position" almost everywhere while sharing
nearly all of their tokens. Compare maps by set overlap, and move lm_head rows by target id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from draftport.errors import DraftportError


def build_maps(counts: np.ndarray, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-N ids by count (ties broken by the lower id), sorted by id -> (d2t delta int64, t2d bool)."""
    counts = np.asarray(counts)
    vocab = counts.shape[0]
    if not 0 < draft_vocab_size <= vocab:
        raise DraftportError(None, f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab}")
    # stable sort on -count keeps lower ids first among equal counts: deterministic maps.
    order = np.argsort(-counts.astype(np.int64), kind="stable")
    hot = np.sort(order[:draft_vocab_size]).astype(np.int64)
    d2t = hot - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[hot] = True
    return d2t, t2d


def hot_ids(d2t: np.ndarray) -> np.ndarray:
    d2t = np.asarray(d2t, dtype=np.int64)
    return np.arange(d2t.shape[0], dtype=np.int64) + d2t


def _valid_ids(ids: np.ndarray, vocab_size: int) -> bool:
    """In range and distinct. Sorted is the convention but engines do not need it."""
    return bool(ids.min() >= 0 and ids.max() < vocab_size and np.unique(ids).size == ids.size)


def d2t_format(d2t: np.ndarray, vocab_size: int, t2d: np.ndarray | None = None) -> str:
    """'delta' (the shared convention), 'absolute' (ids stored directly), or 'invalid'.

    When t2d is given it decides: the reading whose hot set t2d marks wins. Without it:
    absolute storage is strictly increasing (sorted distinct ids); delta storage is only
    non-decreasing and repeats wherever two hot ids are adjacent, which a frequency map always
    has. A strictly increasing, in-range d2t is therefore read as absolute.
    """
    d2t = np.asarray(d2t, dtype=np.int64)
    if d2t.ndim != 1 or d2t.size == 0:
        return "invalid"
    if t2d is not None and np.asarray(t2d).shape == (vocab_size,):
        # Small toy maps can lack adjacent ids, so the heuristic below would misread them.
        if _valid_ids(hot_ids(d2t), vocab_size) and t2d_consistent(d2t, t2d):
            return "delta"
        if _valid_ids(d2t, vocab_size) and t2d_consistent(d2t - np.arange(d2t.size), t2d):
            return "absolute"
    if d2t.size > 1 and bool(np.all(np.diff(d2t) > 0)) and d2t[0] >= 0 and d2t[-1] < vocab_size:
        return "absolute"
    if _valid_ids(hot_ids(d2t), vocab_size):
        return "delta"
    return "invalid"


def check_maps(
    d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int, draft_vocab_size: int, where: Any = None
) -> dict:
    """Validate a (d2t, t2d) pair. Raises DraftportError on what would break an engine."""
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or d2t.shape[0] != draft_vocab_size:
        raise DraftportError(
            where, f"d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}] (draft_vocab_size)"
        )
    ids = hot_ids(d2t)
    bad = np.nonzero((ids < 0) | (ids >= vocab_size))[0]
    if bad.size:
        i = int(bad[0])
        raise DraftportError(
            where,
            f"d2t slot {i} points to target id {int(ids[i])}, outside the vocab of {vocab_size} "
            f"({bad.size} slots out of range)",
        )
    if np.unique(ids).size != ids.size:
        raise DraftportError(where, "d2t maps two draft slots to the same target id")
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.ndim != 1 or t2d.shape[0] != vocab_size:
            raise DraftportError(where, f"t2d has shape {list(t2d.shape)}, expected [{vocab_size}] (vocab_size)")
        if not t2d_consistent(d2t, t2d):
            raise DraftportError(
                where,
                f"t2d disagrees with d2t ({int(t2d.sum())} ids set in t2d, d2t's hot set has {ids.size}, "
                f"{len(set(np.nonzero(t2d)[0]) ^ set(ids.tolist()))} differ)",
            )
    return {"format": "delta", "sorted": bool(np.all(np.diff(ids) > 0))}


def t2d_consistent(d2t: np.ndarray, t2d: np.ndarray) -> bool:
    ids = hot_ids(d2t)
    t2d = np.asarray(t2d).astype(bool)
    if ids.min(initial=0) < 0 or ids.max(initial=0) >= t2d.shape[0]:
        return False
    return int(t2d.sum()) == ids.size and bool(t2d[ids].all())


def compare_maps(src_d2t: np.ndarray, dst_d2t: np.ndarray) -> dict:
    """Position-by-position differences AND set overlap of two maps (same draft vocab size or not)."""
    a, b = hot_ids(src_d2t), hot_ids(dst_d2t)
    n = min(a.size, b.size)
    positions_differ = int(np.count_nonzero(a[:n] != b[:n])) + abs(a.size - b.size)
    sa, sb = set(a.tolist()), set(b.tolist())
    inter = len(sa & sb)
    union = len(sa | sb)
    src_only, dst_only = len(sa - sb), len(sb - sa)
    sorted_both = bool(np.all(np.diff(a) > 0) and np.all(np.diff(b) > 0))
    first_diff = int(np.argmax(a[:n] != b[:n])) if positions_differ and n else None
    # The position count is an artifact when the maps are sorted and the set difference is far
    # smaller than the count: a few tokens in/out shift every later slot.
    artifact = sorted_both and positions_differ > 2 * max(src_only, dst_only)
    return {
        "positions_differ": positions_differ,
        "positions_compared": n,
        "first_differing_slot": first_diff,
        "overlap": inter,
        "jaccard": inter / union if union else 1.0,
        "src_only": src_only,
        "dst_only": dst_only,
        "overlap_frac_of_src": inter / len(sa) if sa else 1.0,
        "sorted": sorted_both,
        "positions_artifact_of_sorting": artifact,
    }


def remap_lm_head(lm_head, src_d2t, dst_d2t, init_rows=None, *, policy: str = "remap"):
    """Move trained lm_head rows from one map onto another, by target id.

    policy 'remap': the result is laid out by dst's map. Tokens in both maps keep their trained
    row; tokens only in dst get `init_rows[target_id]` when given (the target's own lm_head row,
    scaled to the drafter's row norm), else the mean of the trained rows. Returns
    (new_lm_head, dst_d2t, stats).
    policy 'keep': the source map and head are kept unchanged (the drafter keeps predicting
    over the old hot set). Returns (lm_head, src_d2t, stats).
    """
    import torch

    with torch.no_grad():  # weight surgery, not part of any graph
        return _remap_rows(lm_head, src_d2t, dst_d2t, init_rows, policy)


def _remap_rows(lm_head, src_d2t, dst_d2t, init_rows, policy):
    import torch

    src_ids, dst_ids = hot_ids(np.asarray(src_d2t)), hot_ids(np.asarray(dst_d2t))
    if policy == "keep":
        return lm_head, np.asarray(src_d2t), {"policy": "keep", "kept_rows": int(src_ids.size), "new_rows": 0}
    if policy != "remap":
        raise DraftportError(None, f"unknown vocab policy {policy!r} (remap or keep)")
    pos_in_src = {int(t): i for i, t in enumerate(src_ids.tolist())}
    out = torch.empty((dst_ids.size, lm_head.shape[1]), dtype=lm_head.dtype, device=lm_head.device)
    kept = [(j, pos_in_src[int(t)]) for j, t in enumerate(dst_ids.tolist()) if int(t) in pos_in_src]
    new = [j for j, t in enumerate(dst_ids.tolist()) if int(t) not in pos_in_src]
    if kept:
        dj, si = zip(*kept)
        out[list(dj)] = lm_head[list(si)]
    if new:
        if init_rows is not None:
            rows = init_rows[torch.as_tensor(dst_ids[new])].to(lm_head.dtype)
            scale = lm_head.float().norm(dim=1).mean() / rows.float().norm(dim=1).mean().clamp_min(1e-12)
            out[new] = (rows.float() * scale).to(lm_head.dtype)
        else:
            out[new] = lm_head.float().mean(0, keepdim=True).to(lm_head.dtype)
    return (
        out,
        np.asarray(dst_d2t, dtype=np.int64),
        {
            "policy": "remap",
            "kept_rows": len(kept),
            "new_rows": len(new),
            "init": "target_lm_head" if init_rows is not None else "mean_row",
        },
    )
