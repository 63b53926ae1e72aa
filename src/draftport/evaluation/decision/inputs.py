"""The decision's inputs, read and checked: the curves' points (per sample, per depth, grouped by
arm and n), the phases' counts, the cost model, and the arms the curves measured."""

from __future__ import annotations

from draftport.errors import DraftportError

INITS = ("source", "scratch")
PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")


def _cost(costmodel, k):
    # lazy (registry): eval_curves runs this module without evaluation.costmodel
    from draftport.evaluation.costmodel import CostModel

    if not isinstance(costmodel, dict):
        raise DraftportError(
            "costmodel", f"expected a mapping with baseline_tok_s, verify_ms, draft_ms, got {type(costmodel).__name__}"
        )
    missing = [key for key in ("baseline_tok_s", "verify_ms", "draft_ms") if key not in costmodel]
    if missing:
        raise DraftportError("costmodel", f"missing key(s) {missing}")
    try:
        vals = {key: float(costmodel[key]) for key in ("baseline_tok_s", "verify_ms", "draft_ms")}
    except (TypeError, ValueError):
        raise DraftportError("costmodel", "baseline_tok_s, verify_ms and draft_ms must be numbers") from None
    if isinstance(k, bool) or not isinstance(k, int):
        raise DraftportError("k", f"must be an integer >= 1, got {k!r}")
    try:
        return CostModel(vals["baseline_tok_s"], vals["verify_ms"], vals["draft_ms"], k=k)
    except DraftportError as e:
        raise DraftportError("costmodel", e.problem) from None


def _per_sample(ev, where: str):
    ps = ev.get("per_sample") if isinstance(ev, dict) else None
    if ps is None:
        return None
    if not isinstance(ps, dict) or "accepted" not in ps or "cycles" not in ps:
        raise DraftportError(where, "per_sample must be a mapping with lists 'accepted' and 'cycles'")
    acc, cyc = list(ps["accepted"]), list(ps["cycles"])
    if len(acc) != len(cyc):
        raise DraftportError(where, f"per_sample has {len(acc)} 'accepted' but {len(cyc)} 'cycles'")
    return acc, cyc


def _curve_depths(curves) -> list[int]:
    """The chain depths every curve point measured (per_sample.by_k; eval.k_max), ascending; []
    when a point has none (curves evaluated at eval.k alone)."""
    pts = (curves or {}).get("points") or []
    common = None
    for pt in pts:
        by_k = ((pt.get("per_sample") if isinstance(pt, dict) else None) or {}).get("by_k") or []
        ks = {int(c["k"]) for c in by_k if isinstance(c, dict) and "k" in c}
        common = ks if common is None else common & ks
    return sorted(common or ())


def _at_depth(pt: dict, depth: int) -> dict:
    """A curve point with its per-prompt counts at chain depth `depth` (from per_sample.by_k)."""
    c = next(c for c in pt["per_sample"]["by_k"] if int(c["k"]) == depth)
    return {**pt, "per_sample": {"accepted": c["accepted"], "cycles": c["cycles"]}}


def _curve_groups(curves, depth: int | None = None) -> dict:
    """{(arm, n): [(seed, accepted, cycles), ...] sorted by seed}, every row on the same P prompts
    (a point's arm: its `arm`, else its init); depth: the counts at that chain depth (_curve_depths)."""
    if curves is not None and depth is not None:
        curves = {**curves, "points": [_at_depth(pt, depth) for pt in curves.get("points", [])]}
    if curves is None:
        return {}
    if not isinstance(curves, dict) or not isinstance(curves.get("points", []), list):
        raise DraftportError("curves", "expected a mapping with a list 'points'")
    groups: dict = {}
    P = None
    for i, pt in enumerate(curves.get("points", [])):
        if not isinstance(pt, dict):
            raise DraftportError("curves", f"points[{i}] is not a mapping")
        init, n, sd = pt.get("init"), pt.get("n_samples"), pt.get("seed", i)
        if init not in INITS:
            raise DraftportError("curves", f"points[{i}]: init must be 'source' or 'scratch', got {init!r}")
        arm = pt.get("arm", init)
        if not isinstance(arm, str) or not arm.startswith(init):
            raise DraftportError(
                "curves", f"points[{i}]: arm must be a name starting with its init {init!r}, got {arm!r}"
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise DraftportError("curves", f"points[{i}]: n_samples must be an integer >= 0, got {n!r}")
        ps = _per_sample(pt, f"curves: points[{i}] (init={init}, n={n})")
        if ps is None:
            raise DraftportError("curves", f"points[{i}] (init={init}, n={n}, seed={sd}) has no per_sample counts")
        if P is None:
            P, first = len(ps[0]), (init, n, sd)
        elif len(ps[0]) != P:
            raise DraftportError(
                "curves",
                f"points[{i}] (init={init}, n={n}, seed={sd}) has {len(ps[0])} prompts, "
                f"but init={first[0]}, n={first[1]}, seed={first[2]} has {P}: every "
                "point must be evaluated on the same prompts",
            )
        rows = groups.setdefault((arm, n), [])
        if any(r[0] == sd for r in rows):
            raise DraftportError("curves", f"two points for arm={arm}, n={n}, seed={sd}")
        rows.append((sd, *ps))
    for rows in groups.values():
        rows.sort(key=lambda r: (str(type(r[0])), r[0]))
    return groups


def _arm_facts(curves) -> tuple[dict, dict]:
    """({(arm, n): mean training seconds over its seeds, when recorded}, {arm: its answers})."""
    secs: dict = {}
    answers: dict = {}
    for pt in (curves or {}).get("points", []):
        arm = pt.get("arm", pt.get("init"))
        answers[arm] = pt.get("answers", "regenerated")
        if isinstance(pt.get("train_seconds"), (int, float)):
            secs.setdefault((arm, pt["n_samples"]), []).append(float(pt["train_seconds"]))
    return {key: sum(v) / len(v) for key, v in secs.items()}, answers


def _arm_order(arm: str) -> tuple:
    return (arm not in INITS, INITS.index(arm) if arm in INITS else 0, arm)


def _phase_counts(phases) -> dict:
    """phase -> its per-prompt counts, the known phases first; every phase on the same prompts."""
    if phases is None:
        phases = {}
    if not isinstance(phases, dict):
        raise DraftportError("phases", f"expected a mapping phase name -> evaluation, got {type(phases).__name__}")
    counts, P_ph, first = {}, None, None
    for name in [*[p for p in PHASES if p in phases], *sorted(p for p in phases if p not in PHASES)]:
        ps = _per_sample(phases[name], f"phases: {name}")
        if ps is None:
            continue
        if P_ph is None:
            P_ph, first = len(ps[0]), name
        elif len(ps[0]) != P_ph:
            raise DraftportError(
                "phases",
                f"{name} has {len(ps[0])} prompts but {first} has {P_ph}: the phases "
                "must be evaluated on the same prompts",
            )
        counts[name] = ps
    return counts
