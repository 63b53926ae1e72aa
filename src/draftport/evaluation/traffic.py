"""The traffic a drafter will serve: named held-out sets with traffic shares (contiguous ranges of an
evaluation's prompts) and context buckets of the verify position. Reads and checks them from an
evaluation result, turns the sets into the bootstrap's strata, and measures accept length (and the
paired difference of two drafters) per set and per bucket with draftport.evaluation.bootstrap.

A set's figures are its own prompts' (seeds pooled, bootstrap over those prompts); a bucket's are
every prompt's cycles at those positions (a prompt's cycles in one bucket resampled together)."""

from __future__ import annotations

import numpy as np

from draftport.errors import DraftportError
from draftport.evaluation.bootstrap import paired_diff_ci, prompt_counts, tau_ci

DEFAULT_SET = "heldout"  # the one set of an evaluation without `sets`: every held-out prompt


def _plain(opts: dict) -> dict:
    """The bootstrap's settings without strata (a set or a bucket is measured on its own)."""
    return {key: v for key, v in opts.items() if key != "strata"}


def _int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def check_sets(sets, P: int, where: str = "sets") -> list[dict]:
    """sets as [{"name", "share", "start", "count"}], checked: contiguous ranges covering the P
    prompts in order, unique names, shares in (0, 1] summing to 1."""
    if not isinstance(sets, (list, tuple)) or not sets:
        raise DraftportError(where, "sets must be a non-empty list of {name, share, start, count}")
    out, at = [], 0
    for i, st in enumerate(sets):
        if not isinstance(st, dict) or any(key not in st for key in ("name", "share", "start", "count")):
            raise DraftportError(where, f"sets[{i}] must be a mapping with name, share, start and count")
        name, share, start, count = st["name"], st["share"], st["start"], st["count"]
        if not isinstance(name, str) or not name or name in {s["name"] for s in out}:
            raise DraftportError(where, f"sets[{i}]: name must be a non-empty string of its own, got {name!r}")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
            raise DraftportError(where, f"sets[{i}] ({name}): share must be a number in (0, 1], got {share!r}")
        if not (_int(start) and _int(count)) or start != at or count < 1:
            raise DraftportError(
                where, f"sets[{i}] ({name}): start {start!r}, count {count!r}: expected start {at} and count >= 1"
            )
        out.append({"name": name, "share": float(share), "start": int(start), "count": int(count)})
        at += int(count)
    if at != P:
        raise DraftportError(where, f"the sets cover {at} prompts but the evaluation has {P}")
    total = sum(s["share"] for s in out)
    if not abs(total - 1.0) <= 1e-6:
        raise DraftportError(where, f"the sets' shares sum to {total:.6g}, not 1")
    return out


def eval_sets(ev: dict, P: int, where: str) -> list[dict]:
    """An evaluation result's `sets`, checked against its P prompts; absent: one set "heldout"."""
    sets = ev.get("sets") if isinstance(ev, dict) else None
    if sets is None:
        return [{"name": DEFAULT_SET, "share": 1.0, "start": 0, "count": P}]
    return check_sets(sets, P, f"{where}: sets")


def fit_sets(sets, P: int | None, where: str, own=None) -> list[dict]:
    """The sets on P prompts (None: the prompts they cover): as given when they cover P; one set
    spans any P; else the evaluation's own `sets` (own) when their names and shares are the same."""
    if not isinstance(sets, (list, tuple)) or not all(isinstance(s, dict) and _int(s.get("count")) for s in sets):
        return check_sets(sets, P or 0, "sets")
    total = sum(s["count"] for s in sets)
    if P is None or total == P:
        return check_sets(sets, total, "sets")
    if len(sets) == 1:
        return check_sets([{**sets[0], "start": 0, "count": P}], P, "sets")
    if own is not None:
        mine = check_sets(own, P, f"{where}: sets")
        if [(s["name"], round(s["share"], 6)) for s in mine] == [
            (s["name"], round(float(s["share"]), 6)) for s in sets
        ]:
            return mine
    raise DraftportError("sets", f"they cover {total} prompts but the {where} have {P}: evaluate them on the same sets")


def strata_of(sets: list[dict]) -> list[tuple] | None:
    """The bootstrap's strata of checked sets (None for one set: the unstratified bootstrap)."""
    if len(sets) <= 1:
        return None
    return [(np.arange(s["start"], s["start"] + s["count"]), s["share"]) for s in sets]


def check_edges(edges, where: str = "context_buckets") -> list[int]:
    if (
        not isinstance(edges, (list, tuple))
        or not edges
        or not all(_int(e) for e in edges)
        or edges[0] != 0
        or any(b <= a for a, b in zip(edges, edges[1:]))
    ):
        raise DraftportError(where, f"must be a list of integers starting at 0, strictly increasing, got {edges!r}")
    return [int(e) for e in edges]


def _edge_name(e: int) -> str:
    return f"{e // 1024}K" if e and e % 1024 == 0 else str(e)


def bucket_names(edges) -> list[str]:
    """ "0-64", "64-128", "128+"; multiples of 1024 with K: "0-512", "512-2K", "2K-8K", "8K+"."""
    edges = check_edges(edges)
    return [f"{_edge_name(a)}-{_edge_name(b)}" for a, b in zip(edges, edges[1:])] + [f"{_edge_name(edges[-1])}+"]


def bucket_counts(ev: dict, nb: int, where: str):
    """(accepted [P, NB], cycles [P, NB]) of an evaluation's per_sample.bucket_*, checked to add up
    to its totals per prompt; None when it has none (an older file)."""
    ps = ev.get("per_sample") if isinstance(ev, dict) else None
    if not isinstance(ps, dict) or ps.get("bucket_accepted") is None or ps.get("bucket_cycles") is None:
        return None
    try:
        a = np.asarray(ps["bucket_accepted"], dtype=float)
        c = np.asarray(ps["bucket_cycles"], dtype=float)
    except (TypeError, ValueError):
        raise DraftportError(where, f"bucket_accepted and bucket_cycles must be [prompts][{nb}] numbers") from None
    P = len(ps["accepted"])
    if a.shape != (P, nb) or c.shape != (P, nb):
        raise DraftportError(
            where,
            f"bucket_accepted and bucket_cycles must have shape [{P}, {nb}] (prompts, context buckets), "
            f"got {list(a.shape)} and {list(c.shape)}",
        )
    if not (np.isfinite(a).all() and np.isfinite(c).all()) or (a < 0).any() or (c < 0).any():
        raise DraftportError(where, "bucket_accepted and bucket_cycles must be finite counts >= 0")
    if (a.sum(axis=1) != np.asarray(ps["accepted"], dtype=float)).any() or (
        c.sum(axis=1) != np.asarray(ps["cycles"], dtype=float)
    ).any():
        raise DraftportError(where, "a prompt's bucket_accepted / bucket_cycles do not add up to its accepted / cycles")
    return a, c


def check_context_limit(limit, where: str = "context_limit") -> dict | None:
    """Phase 0's context_limit, checked (None: not stated)."""
    if limit is None:
        return None
    keys = ("source_max_position_embeddings", "source_rope_scaling", "source_limit", "serving_length", "limited")
    if not isinstance(limit, dict) or any(key not in limit for key in keys):
        raise DraftportError(where, f"must be a mapping with {', '.join(keys)}")
    for key in ("source_max_position_embeddings", "source_limit", "serving_length"):
        if limit[key] is not None and not _int(limit[key]):
            raise DraftportError(where, f"{key} must be an integer or null, got {limit[key]!r}")
    if not isinstance(limit["limited"], bool):
        raise DraftportError(where, f"limited must be true or false, got {limit['limited']!r}")
    if limit["limited"] and (limit["source_limit"] is None or limit["serving_length"] is None):
        raise DraftportError(where, "limited is true but source_limit or serving_length is null")
    return {key: limit[key] for key in keys}


def beyond_limit(edges: list[int], limit: dict | None) -> list[bool]:
    """Per bucket: does it start at or past the source's limit (only when that limit is below serving)."""
    if not limit or not limit["limited"]:
        return [False] * len(edges)
    return [e >= limit["source_limit"] for e in edges]


def set_taus(accepted, cycles, sets: list[dict], opts: dict, where: str) -> dict:
    """set name -> {"accept_length", "ci", "n_prompts"} on the set's own prompts (seeds pooled)."""
    a, c = prompt_counts(accepted, cycles, where)
    out = {}
    for s in sets:
        sl = slice(s["start"], s["start"] + s["count"])
        t = tau_ci(a[:, sl].sum(axis=0), c[:, sl].sum(axis=0), where=f"{where}, set {s['name']}", **_plain(opts))
        out[s["name"]] = {"accept_length": t["accept_length"], "ci": t["ci"], "n_prompts": s["count"]}
    return out


def named_diff(d: dict, names: tuple[str, str]) -> dict:
    """A paired_diff_ci result with `better` named (names: a's, b's)."""
    return {
        "diff": d["diff"],
        "ci": d["ci"],
        "significant": d["significant"],
        "better": {"a": names[0], "b": names[1], None: None}[d["better"]],
    }


def set_diffs(a_counts, b_counts, sets: list[dict], opts: dict, where: str, names=("a", "b")) -> dict:
    """set name -> the paired difference a - b on the set's prompts ({"diff", "ci", "significant", "better"})."""
    a, ac = prompt_counts(*a_counts, f"{where} (a)")
    b, bc = prompt_counts(*b_counts, f"{where} (b)")
    out = {}
    for s in sets:
        sl = slice(s["start"], s["start"] + s["count"])
        d = paired_diff_ci(a[:, sl], ac[:, sl], b[:, sl], bc[:, sl], where=f"{where}, set {s['name']}", **_plain(opts))
        out[s["name"]] = named_diff(d, names)
    return out


def bucket_taus(buckets, edges: list[int], limit: dict | None, opts: dict, where: str) -> list[dict]:
    """Per bucket: its name, edges, accept length + CI over prompts (null: no cycle there, not
    measured), num_cycles and beyond_source_limit."""
    names, beyond = bucket_names(edges), beyond_limit(edges, limit)
    out = []
    for j, (name, lo) in enumerate(zip(names, edges)):
        row = {"bucket": name, "lower": lo, "upper": edges[j + 1] if j + 1 < len(edges) else None}
        cyc = 0 if buckets is None else int(buckets[1][:, j].sum())
        if cyc == 0:
            row |= {"accept_length": None, "ci": None}
        else:
            t = tau_ci(buckets[0][:, j], buckets[1][:, j], where=f"{where}, bucket {name}", **_plain(opts))
            row |= {"accept_length": t["accept_length"], "ci": t["ci"]}
        out.append(row | {"num_cycles": cyc, "measured": buckets is not None, "beyond_source_limit": beyond[j]})
    return out


def bucket_diffs(a_buckets, b_buckets, edges: list[int], opts: dict, where: str, names=("a", "b")) -> list[dict]:
    """Per bucket: the paired difference a - b over prompts; diff null where either has no cycle there."""
    out = []
    for j, name in enumerate(bucket_names(edges)):
        row = {"bucket": name}
        if a_buckets is None or b_buckets is None or not a_buckets[1][:, j].sum() or not b_buckets[1][:, j].sum():
            out.append(row | {"diff": None, "ci": None, "significant": False, "better": None})
            continue
        d = paired_diff_ci(
            a_buckets[0][:, j],
            a_buckets[1][:, j],
            b_buckets[0][:, j],
            b_buckets[1][:, j],
            where=f"{where}, bucket {name}",
            **_plain(opts),
        )
        out.append(row | named_diff(d, names))
    return out
