"""The decision under traffic (R10): the held-out sets' and context buckets' accept lengths of the
recommended drafter against its rivals, the problems they show, and the text naming each fix."""

from __future__ import annotations

import json

from draftport.errors import DraftportError
from draftport.evaluation.bootstrap import paired_diff_ci
from draftport.evaluation.decision.inputs import _arm_order, _curve_groups, _phase_counts
from draftport.evaluation.decision.text import _fmt_ci, _pct
from draftport.evaluation.traffic import (
    DEFAULT_SET,
    bucket_counts,
    bucket_diffs,
    bucket_names,
    bucket_taus,
    check_context_limit,
    check_edges,
    fit_sets,
    named_diff,
    set_diffs,
    set_taus,
    strata_of,
)

# ---------------------------------------------------------------- the traffic (R10)

# how the text names a phase the recommended drafter is compared with
PHASE_LABEL = {
    "phase0": "the source as-is (phase0)",
    "phase1_scratch": "the control (phase1_scratch)",
    "phase1": "Phase 1 (phase1)",
    "phase2": "Phase 2 (phase2)",
}


def recommended_phase(init: str, phase2: str, measured) -> str | None:
    """The phase that stands for the recommended drafter in the traffic block (R10): for init
    scratch the control, phase1_scratch (scratch on Phase 1's data); else (source, either) Phase 2
    when R3 says it helps, else Phase 1 (Phase 2 hurts, brings no significant gain or is not
    measured), as publish.choose_phase picks. A source phase not measured falls back to the other; None
    when none is measured."""
    order = (
        ["phase1_scratch"] if init == "scratch" else ["phase2", "phase1"] if phase2 == "helps" else ["phase1", "phase2"]
    )
    return next((ph for ph in order if ph in measured), None)


def _rivals(ph: str) -> tuple[str, str]:
    """What the recommended drafter is compared with: the source as-is and the control (the control: Phase 1)."""
    return ("phase0", "phase1") if ph == "phase1_scratch" else ("phase0", "phase1_scratch")


def _traffic_inputs(curves, phases, sets, bucket_edges, context_limit, min_share) -> dict:
    """The traffic's inputs, checked: the sets on the phases' prompts and on the curves', the
    bucket edges, the context limit, min_share."""
    if isinstance(min_share, bool) or not isinstance(min_share, (int, float)) or not 0.0 <= min_share <= 1.0:
        raise DraftportError("min_share", f"must be a number in [0, 1], got {min_share!r}")
    counts, groups = _phase_counts(phases), _curve_groups(curves)
    P = len(next(iter(counts.values()))[0]) if counts else None
    Pc = len(next(iter(groups.values()))[0][1]) if groups else None
    if sets is None:
        sets = [{"name": DEFAULT_SET, "share": 1.0, "start": 0, "count": P or Pc or 1}]
    psets = fit_sets(sets, P, "phases' evaluations")
    csets = psets
    if groups:
        own = next((pt.get("sets") for pt in curves["points"] if isinstance(pt, dict)), None)
        csets = fit_sets(sets, Pc, "curves' points", own)
    return {
        "sets": psets,
        "curve_sets": csets,
        "edges": None if bucket_edges is None else check_edges(bucket_edges, "bucket_edges"),
        "limit": check_context_limit(context_limit),
        "min_share": float(min_share),
    }


def _traffic_vs(counts: dict, ph: str | None, sets: list[dict], popts: dict) -> dict:
    """rival phase -> the recommended phase minus it: traffic-weighted and per set."""
    out = {}
    for other in _rivals(ph) if ph else ():
        if other in counts:
            where, names = f"phases: {ph} - {other}", (ph, other)
            w = paired_diff_ci(*counts[ph], *counts[other], where=where, **popts)
            out[other] = {
                "weighted": named_diff(w, names),
                "sets": set_diffs(counts[ph], counts[other], sets, popts, where, names),
            }
    return out


def _traffic_curves(groups: dict, sets: list[dict], copts: dict, init: str) -> dict:
    """Per set: every arm's curve on the set's prompts, and the recommended init's paired gain from
    its smallest to its largest n (where more data pays)."""
    per: dict = {s["name"]: {} for s in sets}
    for arm, n in sorted(groups, key=lambda key: (_arm_order(key[0]), key[1])):
        rows = groups[(arm, n)]
        taus = set_taus([r[1] for r in rows], [r[2] for r in rows], sets, copts, f"curves: arm={arm}, n={n}")
        for name, t in taus.items():
            per[name].setdefault(arm, []).append({"n_samples": n, "accept_length": t["accept_length"], "ci": t["ci"]})
    which = "source" if init == "either" else init
    ns = sorted(n for (a, n) in groups if a == which)
    gain: dict = {s["name"]: None for s in sets}
    if len(ns) >= 2:
        top, low = groups[(which, ns[-1])], groups[(which, ns[0])]
        d = set_diffs(
            ([r[1] for r in top], [r[2] for r in top]),
            ([r[1] for r in low], [r[2] for r in low]),
            sets,
            copts,
            f"curves: {which} n={ns[-1]} - n={ns[0]}",
        )
        keep = ("diff", "ci", "significant")
        gain = {
            name: {"arm": which, "from_n": ns[0], "to_n": ns[-1], **{k: x[k] for k in keep}} for name, x in d.items()
        }
    return {"curves": per, "curve_gain": gain}


def _traffic_buckets(phases: dict, counts: dict, ph: str | None, tr: dict, opts: dict) -> dict:
    """Per phase its figures per context bucket; the recommended phase minus each rival per bucket."""
    edges = tr["edges"]
    if edges is None:
        return {"context_buckets": None, "buckets": None, "buckets_vs": None}
    got = {name: bucket_counts(phases[name], len(edges), f"phases: {name}") for name in counts}
    table = {name: bucket_taus(got[name], edges, tr["limit"], opts, f"phases: {name}") for name in counts}
    vs = {
        other: bucket_diffs(got[ph], got[other], edges, opts, f"phases: {ph} - {other}", (ph, other))
        for other in (_rivals(ph) if ph else ())
        if other in counts
    }
    return {"context_buckets": {"edges": edges, "names": bucket_names(edges)}, "buckets": table, "buckets_vs": vs}


def _add_traffic(out: dict, curves, phases, tr: dict, opts: dict) -> dict:
    """decision.json's "traffic" block and R10: its problems, its line in rules, its sentences (before the
    confidence's)."""
    groups, counts = _curve_groups(curves), _phase_counts(phases)
    popts = {**opts, "strata": strata_of(tr["sets"])}
    rec = out["recommendation"]
    ph = recommended_phase(rec["init"], rec["phase2"], counts)
    block = {
        "sets": [{"name": s["name"], "share": s["share"], "n_prompts": s["count"]} for s in tr["sets"]],
        "weighted": len(tr["sets"]) > 1,
        "min_share": tr["min_share"],
        "recommended_phase": ph,
        "phases": {
            name: {
                "weighted": {key: out["phases"][name][key] for key in ("accept_length", "ci")},
                "sets": set_taus(*counts[name], tr["sets"], popts, f"phases: {name}"),
            }
            for name in counts
        },
        "vs": _traffic_vs(counts, ph, tr["sets"], popts),
        **_traffic_curves(groups, tr["curve_sets"], {**opts, "strata": strata_of(tr["curve_sets"])}, rec["init"]),
        **_traffic_buckets(phases, counts, ph, tr, opts),
        "context_limit": tr["limit"],
        "train_prompts": tr.get("train_prompts"),
    }
    problems, fired, sentences = rule_r10_traffic(block)
    rec["traffic_problems"] = problems
    at = next((i for i, r in enumerate(rec["rules"]) if r["id"] == "R11"), len(rec["rules"]))
    rec["rules"].insert(at, {"id": "R10", "fired": fired})  # in order: R11's line, when there is one, after it
    rec["text"][-1:-1] = sentences  # before "Confidence: ..."
    out["traffic"] = block
    return out


def _against(ph: str, mine: float, worse: list[dict]) -> str:
    """ "than A and B: accept length x against a (ph - A d, CI) and b (...)"."""
    rivals = " and ".join(PHASE_LABEL.get(w["phase"], w["phase"]) for w in worse)
    figs = " and ".join(
        f"{w['accept_length']:.3f} ({ph} - {w['phase']} {w['diff']:+.3f}, CI {_fmt_ci(w['ci'])})" for w in worse
    )
    return f"than {rivals}: accept length {mine:.3f} against {figs}"


def _set_problems(t: dict) -> list[dict]:
    """R10 (a): each set with share >= min_share where the recommended drafter is significantly worse than a rival."""
    ph, out = t["recommended_phase"], []
    for s in t["sets"]:
        name = s["name"]
        worse = [
            {"phase": o, "accept_length": t["phases"][o]["sets"][name]["accept_length"], **v["sets"][name]}
            for o, v in t["vs"].items()
            if v["sets"][name]["ci"][1] < 0
        ]
        if s["share"] < t["min_share"] or not worse:
            continue
        mine = t["phases"][ph]["sets"][name]["accept_length"]
        text = (
            f"On the set {name} ({_pct(s['share'])} of the traffic) the recommended drafter (measured as "
            f"{ph}) is significantly worse {_against(ph, mine, worse)}. Add {name}'s kind of prompts to the "
            "training data (targets.prompts_train)."
        )
        out.append(_problem("set", name, ph, mine, worse, text, share=s["share"]))
    return out


def _problem(kind: str, where, ph: str, mine: float, worse: list[dict], text: str, **extra) -> dict:
    """One R10 finding: where (a set or a bucket), the recommended phase's figure, its rivals' and the text."""
    return {
        "kind": kind,
        "where": where,
        **extra,
        "phase": ph,
        "accept_length": mine,
        "against": [{k: w[k] for k in ("phase", "accept_length", "diff", "ci")} for w in worse],
        "text": text,
    }


def _bucket_problems(t: dict) -> list[dict]:
    """R10 (b): each context bucket where the recommended drafter is significantly worse than a rival."""
    ph, out = t["recommended_phase"], []
    for j, row in enumerate((t["buckets"] or {}).get(ph) or []):
        worse = [
            {"phase": o, "accept_length": t["buckets"][o][j]["accept_length"], **rows[j]}
            for o, rows in (t["buckets_vs"] or {}).items()
            if rows[j]["ci"] is not None and rows[j]["ci"][1] < 0
        ]
        if not worse:
            continue
        text = (
            f"At verify positions {row['bucket']} ({row['num_cycles']} cycles) the recommended drafter "
            f"(measured as {ph}) is significantly worse {_against(ph, row['accept_length'], worse)}. Add "
            "prompts that reach that context length to the training data (targets.prompts_train)."
        )
        out.append(
            _problem("bucket", row["bucket"], ph, row["accept_length"], worse, text, num_cycles=row["num_cycles"])
        )
    return out


def _past_limit(t: dict, limit: int) -> str:
    """The source's (Phase 0's) accept length past its limit, bucket by bucket, or why it is not measured."""
    rows = (t["buckets"] or {}).get("phase0")
    if t["buckets"] is None:
        return "its accept length there is not measured (no context buckets: eval.context_buckets)"
    if not rows or not rows[0]["measured"]:
        return "its accept length there is not measured (Phase 0 has no per-bucket counts)"
    past = [r for r in rows if r["beyond_source_limit"]]
    if not past:
        return (
            f"its accept length there is not measured (no context bucket starts at or past {limit}: add that "
            "edge to eval.context_buckets)"
        )
    parts = [
        f"{r['bucket']}: not measured (no held-out prompt reaches it)"
        if r["accept_length"] is None
        else f"{r['bucket']}: {r['accept_length']:.3f} (CI {_fmt_ci(r['ci'])}, {r['num_cycles']} cycles, part of "
        "Phase 0's pooled figure)"
        for r in past
    ]
    return "its accept length there, reported apart: " + "; ".join(parts)


def _limit_text(t: dict) -> str | None:
    """R10 (c): the source cannot be served as-is past its positions' limit."""
    lim = t["context_limit"]
    if not lim or not lim["limited"]:
        return None
    x, rope = lim["source_limit"], lim["source_rope_scaling"]
    how = (
        f"max_position_embeddings {lim['source_max_position_embeddings']}, "
        f"rope_scaling {json.dumps(rope, sort_keys=True) if rope else 'none'}"
    )
    return (
        f"The source config allows positions up to {x} ({how}) while the new target serves "
        f"{lim['serving_length']}, so the source drafter cannot be served as-is past {x} (vLLM clamps its RoPE "
        f"there); {_past_limit(t, x)}."
    )


def _more_data_text(t: dict) -> str | None:
    """R10 (d): per set, what the recommended init gains from its smallest to its largest n there,
    weighed by the set's share (with more than one set), and what the curves trained on."""
    shares = {s["name"]: s["share"] for s in t["sets"]}
    gains = [(s["name"], g) for s in t["sets"] if (g := (t.get("curve_gain") or {}).get(s["name"]))]
    if len(t["sets"]) < 2 or not gains:
        return None
    g0 = gains[0][1]
    parts = ", ".join(
        f"{g['diff']:+.3f} (CI {_fmt_ci(g['ci'])}) on {name}, "
        f"{shares[name]:g} x that = {shares[name] * g['diff']:+.3f} of the traffic-weighted gain"
        for name, g in gains
    )
    paying = [(shares[name] * g["diff"], name) for name, g in gains if g["significant"] and g["diff"] > 0]
    tail = (
        f"weighed by the shares, {max(paying)[1]} gains most"
        if paying
        else "more data brings no significant gain on any set"
    )
    trained = t.get("train_prompts")
    unmeasured = "what more data of another set's kind would bring was not measured"
    what = (
        f" Every point of that curve trained on {trained}: {unmeasured}."
        if trained
        else f" The curve's points share one training set: {unmeasured}."
    )
    return f"From n={g0['from_n']} to n={g0['to_n']} the {g0['arm']} curve gains {parts}: {tail}.{what}"


def rule_r10_traffic(t: dict) -> tuple[list[dict], str, list[str]]:
    """(the set and bucket problems, fired, sentences: the weighting, the context limit, each problem)."""
    problems = _set_problems(t) + _bucket_problems(t)
    shares = ", ".join(f"{s['name']} {_pct(s['share'])}" for s in t["sets"])
    weighting = (
        f"Every accept length in this decision is traffic-weighted: the sum over the held-out sets of share x "
        f"the set's own accept length ({shares}; targets.eval_sets), its CI from a bootstrap that resamples "
        "prompts within each set."
        if t["weighted"]
        else None
    )
    text = [s for s in (weighting, _limit_text(t), _more_data_text(t)) if s] + [p["text"] for p in problems]
    lim = t["context_limit"]
    fired = "; ".join(
        [
            f"recommended drafter {t['recommended_phase'] or 'not measured'}",
            f"sets {shares or 'none'}" + (" (traffic-weighted)" if t["weighted"] else ""),
            ", ".join(
                f"{p['kind']} {p['where']} worse than {'/'.join(a['phase'] for a in p['against'])}" for p in problems
            )
            or "no set (share >= min_share) or bucket significantly worse",
            *(
                [f"source limit {lim['source_limit']} < serving {lim['serving_length']}"]
                if lim and lim["limited"]
                else []
            ),
        ]
    )
    return problems, fired, text
