"""The decision: which init, which recipe, whether to regenerate the answers, how much data, whether
Phase 2 pays, and what it costs in hours, from bootstrap CIs on accept length and the cost model's
break-even (decision.json, rules R1-R10).

Accept length over a set of prompts is a ratio of sums, tau = 1 + sum(accepted) / sum(cycles),
pooled over every seed (replicate) and prompt. Its uncertainty is the prompts': a percentile
bootstrap draws P prompt indices with replacement and keeps each drawn prompt's counts from every
seed together. A paired difference (two drafters on the same prompts) uses one draw for both.
With traffic shares per held-out set (R10) the figure is the share-weighted sum of the sets' accept
lengths and the bootstrap draws within each set (draftport.evaluation.traffic).

No torch here (numpy, imported inside the functions). docs/decision.md documents decision.json
and states the rules word for word; RULES below is that text.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from draftport.errors import DraftportError
from draftport.evaluation.bootstrap import check_boot, paired_diff_ci, tau_ci
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

SCHEMA = "draftport.decision/1"  # the file format's name, not a module path: it stays when code moves
INITS = ("source", "scratch")
PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")
DEFAULT_PATH = Path("artifacts/decision/decision.json")

# The rules, word for word as docs/decision.md states them (a test keeps the two equal).
RULES = {
    "R1": "init: N = the largest n measured with both inits. If the gain (source - scratch) at N is "
    "significant, init = its winner. Else, if the gain is significant at some smaller n and every "
    "significant n has the same winner, init = that winner (the text says the advantage is not "
    'significant at N). Else init = "either".',
    "R2": 'data: n_samples = smallest_n_beating_break_even of the recommended init; for "either" the '
    "smaller of the two (null if neither). When it is null, the text says that none of the measured "
    "n reaches break-even with significance and that more data than the largest n is needed (or a "
    "cheaper verify). With the serving inputs (R11) and curves measured to depth (eval.k_max), an n beats "
    "break-even when its best chain k at the smallest served batch size projects a tok/s CI wholly above the "
    "target alone's; the text names that configuration.",
    "R3": 'phase2: phase2_gain significant and > 0 -> "helps"; significant and < 0 -> "hurts"; not '
    'significant -> "no significant gain"; missing -> "not measured".',
    "R4": 'deploy_source_now: phases.phase0.beats_break_even == "yes" (false when phase0 is missing). With '
    "the serving inputs (R11): the source's best configuration at the smallest served batch size, its "
    "projected tok/s CI wholly above the target alone's; the text names that configuration.",
    "R5": 'confidence: "high" when R1\'s init comes from a significant gain at N and R2 found an n; '
    '"medium" when exactly one of those holds; else "low". One level lower (high to medium, medium to '
    "low) when R9 finds a problem in the evidence.",
    "R6": 'enough data: for the recommended init (for "either": source), n_enough = the smallest measured n '
    "whose accept length is not below the largest n's by more than min_gain with significance (the "
    "paired difference, largest n - n, over the same prompts: its CI's lower end <= min_gain); when "
    "every smaller n is, n_enough = the largest n and the text says the curve is still rising there "
    "(more data may still help).",
    "R7": 'regenerate: for the recommended init (for "either": source), at the largest n measured with both '
    "its regenerated and its dataset-answers arm, the paired gain regenerated - dataset. Significant and "
    "> 0 -> regenerate; significant and < 0 -> do not (the dataset's answers train better); not "
    "significant -> do not (no measured gain; the text states the regeneration hours it saves at R2's "
    "n); no dataset arm -> null (not measured).",
    "R8": "recipe: at the largest n measured with every recipe arm, the paired gain of each recipe over "
    "plain fine-tuning of the source. The recipe with the largest significant gain > 0 is chosen; "
    'none significant and > 0 -> "plain" (the text lists each recipe\'s gain). Only for init '
    'source (else "plain"); no recipe arm -> "plain" (not measured).',
    "R9": "evidence: two checks of the measurements themselves. Degenerate: a phase or a curve point whose "
    "CI has zero width (every prompt gave the same accept length: the CI says nothing). Contradicting: a "
    "phase and the curve of its init at the phase's n whose CIs do not overlap (Phase 1 and Phase 2: "
    "source; the control: scratch). Each problem is named in the text with its figures and the evidence "
    "that would fix it, and lowers R5's confidence.",
    "R10": "traffic: with held-out sets (targets.eval_sets), every accept length of R1-R9 is the "
    "traffic-weighted one (the sum over the sets of share x the set's own accept length; the bootstrap "
    "resamples prompts within each set) and the text says so. The recommended drafter is the control "
    "(phase1_scratch) for init scratch, else Phase 2 when R3 says it helps, else Phase 1. Each set with "
    "share >= min_share on which it is significantly worse (the paired difference's CI below 0) than Phase 0 "
    "(the source as-is) or than the control (for the control itself: Phase 1) is named with its figures and "
    "the fix (add that set's kind of prompts to targets.prompts_train); so is each context bucket (add prompts "
    "that reach that context length). When the source's positions stop below the new target's serving length "
    "(context_limit.limited), the text says so and gives the source's accept length past its limit, or that "
    "no held-out prompt reaches it. With more than one set, it states per set what the recommended init's curve "
    "gains from its smallest to its largest n, weighed by the set's share, names the prompts the curve trained on "
    "(targets.prompts_train) and says that more data of another set's kind was not measured. The problems are "
    "listed in traffic_problems; R5's confidence does not change.",
    "R11": "serving: for the recommended drafter (R10's rule) and the source as-is (phase0), at every batch size "
    "of serving.batch_sizes, every chain k the evaluation measured (1..eval.k_max; eval.k alone for an "
    "evaluation without depths) and every offline tree is projected at tau / step_ms(batch, draft tokens) "
    "(serving.step_table, else the cost model at batch 1); the highest is the best configuration, "
    "speculation is off where the target alone (1 / step_ms(batch, 0)) is faster, and the text says "
    "whether a tree beats the chain and whether the best k is past the trained depth (train.ttt_steps). "
    "vLLM's speculative_config (a num_speculative_tokens_per_batch_size table when the best chain k "
    "differs between sizes, 0 where speculation is off) and SGLang's flags are emitted. The headline "
    "trains on n_train: the measured n whose hours pay back soonest at decision.serving_tokens_per_day, "
    "else R6's n_enough, never below R2's n. Where the recommended drafter's best k is past train.ttt_steps, a "
    "curve arm whose recipe raises ttt_steps (curves.recipes), measured to that k, gives its paired gain over "
    "plain fine-tuning of the source at that k and the largest n both measured (serving.depth_arm); without one "
    "the text says how to add it.",
}

# ---------------------------------------------------------------- statistics


def _fmt_ci(ci) -> str:
    return f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _verdict(ci, break_even: float) -> str:
    if ci[0] > break_even:
        return "yes"
    if ci[1] < break_even:
        return "no"
    return "unclear"


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


# ---------------------------------------------------------------- rules


def rule_r1_init(gain: list[dict]) -> tuple[str, bool, str, str]:
    """(init, from_significant_gain_at_N, fired, sentence)."""
    if not gain:
        msg = "no n was measured with both inits, so there is no source-vs-scratch gain to compare"
        return "either", False, msg, f"Init: either ({msg})."
    at_n = gain[-1]
    N = at_n["n_samples"]
    g = f"{at_n['diff']:+.3f}, CI {_fmt_ci(at_n['ci'])}"
    if at_n["significant"]:
        w, other = at_n["better"], ("scratch" if at_n["better"] == "source" else "source")
        return (
            w,
            True,
            f"gain source - scratch at N={N} is {g}, significant: {w} wins",
            f"Init from {w}: at the largest n measured with both inits (n={N}) {w} beats {other} "
            f"by {abs(at_n['diff']):.3f} in accept length (source - scratch {g}).",
        )
    sig = [x for x in gain[:-1] if x["significant"]]
    winners = {x["better"] for x in sig}
    if sig and len(winners) == 1:
        w = winners.pop()
        ns = ", ".join(f"n={x['n_samples']} ({x['diff']:+.3f}, CI {_fmt_ci(x['ci'])})" for x in sig)
        return (
            w,
            False,
            f"gain at N={N} is {g}, not significant; significant at {ns}, all won by {w}",
            f"Init from {w}, with less certainty: its advantage is significant at {ns}, but not "
            f"significant at the largest n={N} (source - scratch {g}).",
        )
    if sig:
        ns = ", ".join(f"n={x['n_samples']} ({x['better']}, {x['diff']:+.3f})" for x in sig)
        why = f"significant gains disagree on the winner: {ns}"
    else:
        why = "no measured n shows a significant gain"
    return (
        "either",
        False,
        f"gain at N={N} is {g}, not significant; {why}",
        f"Init: either; source - scratch at n={N} is {g}, not significant, and {why}.",
    )


def rule_r2_data(init: str, smallest: dict, curves_out: dict, break_even: float) -> tuple[int | None, str, str]:
    """(n_samples, fired, sentence)."""
    if init == "either":
        cands = [(n, i) for i, n in smallest.items() if n is not None]
        n, which = min(cands) if cands else (None, None)
    else:
        n, which = smallest.get(init), init
    if n is not None:
        row = next(r for r in curves_out[which] if r["n_samples"] == n)
        return (
            n,
            f"smallest n with CI lo > break-even {break_even:.3f} for {which}: n={n} "
            f"(tau {row['accept_length']:.3f}, CI {_fmt_ci(row['ci'])})",
            f"Break-even from n={n} samples: the smallest measured n at which {which}'s accept length "
            f"{row['accept_length']:.3f} (CI {_fmt_ci(row['ci'])}) is above the break-even {break_even:.3f}.",
        )
    ns = sorted({r["n_samples"] for i in (INITS if init == "either" else (init,)) for r in curves_out[i]})
    if not ns:
        msg = f"no learning-curve point was measured{'' if init == 'either' else ' for ' + init}"
        return (
            None,
            msg,
            (
                f"Data: {msg}, so no n is known to reach the break-even accept length "
                f"{break_even:.3f} with significance."
            ),
        )
    best = max((r for i in (INITS if init == "either" else (init,)) for r in curves_out[i]), key=lambda r: r["ci"][0])
    return (
        None,
        f"no n up to {ns[-1]} has CI lo > break-even {break_even:.3f} (best CI lo "
        f"{best['ci'][0]:.3f} at n={best['n_samples']})",
        f"None of the measured n (up to n={ns[-1]}) reaches the break-even accept length "
        f"{break_even:.3f} with significance (best: tau {best['accept_length']:.3f}, CI "
        f"{_fmt_ci(best['ci'])} at n={best['n_samples']}): more data than n={ns[-1]} is needed, "
        "or a cheaper verify.",
    )


def _cfg_fig(c: dict) -> str:
    return (
        f"chain k={c['k']} at batch {c['batch_size']}: {c['tok_s']:.1f} tok/s a request "
        f"(CI {_fmt_ci(c['tok_s_ci'])}) against the target alone's {c['target_alone_tok_s']:.1f}"
    )


def rule_r2_best(init: str, smallest: dict, curves_out: dict, break_even: float) -> tuple[int | None, str, str]:
    """R2 with the serving inputs and curves measured to depth: break-even at each n's best chain
    configuration (its row's best_config: the target alone's tok/s stands for break_even) ->
    (n_samples, fired, sentence)."""
    arms = INITS if init == "either" else (init,)
    if init == "either":
        cands = [(n, i) for i, n in smallest.items() if n is not None]
        n, which = min(cands) if cands else (None, None)
    else:
        n, which = smallest.get(init), init
    if n is not None:
        c = next(r for r in curves_out[which] if r["n_samples"] == n)["best_config"]
        return (
            n,
            f"smallest n whose best configuration beats the target alone for {which}: n={n} ({_cfg_fig(c)})",
            f"Break-even from n={n} samples: the smallest measured n at which {which}, served at its best "
            f"configuration, beats the target alone ({_cfg_fig(c)}).",
        )
    rows = [r for i in arms for r in curves_out[i]]
    if not rows:
        return rule_r2_data(init, smallest, curves_out, break_even)  # no point measured
    best = max(rows, key=lambda r: r["best_config"]["tok_s_ci"][0] - r["best_config"]["target_alone_tok_s"])
    top = max(r["n_samples"] for r in rows)
    return (
        None,
        f"no n up to {top} beats the target alone at its best configuration (closest: n={best['n_samples']}, "
        f"{_cfg_fig(best['best_config'])})",
        f"None of the measured n (up to n={top}) beats the target alone with significance at its best "
        f"configuration (closest: n={best['n_samples']}, {_cfg_fig(best['best_config'])}): more data than "
        f"n={top} is needed, or a cheaper verify.",
    )


def rule_r3_phase2(phase2_gain: dict | None) -> tuple[str, str, str]:
    """(verdict, fired, sentence)."""
    if phase2_gain is None:
        return (
            "not measured",
            "phase1 or phase2 has no per-sample evaluation",
            "Phase 2: not measured (phase1 or phase2 has no per-sample evaluation).",
        )
    g = f"{phase2_gain['diff']:+.3f} (CI {_fmt_ci(phase2_gain['ci'])})"
    if not phase2_gain["significant"]:
        return (
            "no significant gain",
            f"phase2 - phase1 = {g}, CI contains 0",
            f"Phase 2: no significant gain over Phase 1 (phase2 - phase1 {g}).",
        )
    v = "helps" if phase2_gain["diff"] > 0 else "hurts"
    return (v, f"phase2 - phase1 = {g}, significant", f"Phase 2 {v}: phase2 - phase1 accept length {g}.")


def rule_r4_deploy(phases_out: dict, break_even: float) -> tuple[bool, str, str]:
    """(deploy_source_now, fired, sentence)."""
    p0 = phases_out.get("phase0")
    if p0 is None:
        return (
            False,
            "phase0 has no per-sample evaluation",
            "Deploy the source drafter now: unknown (Phase 0 not measured).",
        )
    yes = p0["beats_break_even"] == "yes"
    t = f"{p0['accept_length']:.3f} (CI {_fmt_ci(p0['ci'])})"
    fired = f"phase0 tau {t} vs break-even {break_even:.3f}: {p0['beats_break_even']}"
    if yes:
        return (
            True,
            fired,
            f"Deploy the source drafter now: as fetched, its accept length {t} is above "
            f"the break-even {break_even:.3f}.",
        )
    where = "below" if p0["beats_break_even"] == "no" else "not clearly above"
    return (
        False,
        fired,
        (
            f"Do not deploy the source drafter as fetched: its accept length {t} is {where} "
            f"the break-even {break_even:.3f}."
        ),
    )


def rule_r6_enough(
    init: str, groups: dict, opts: dict, min_gain: float = 0.0
) -> tuple[int | None, list[dict], str, str]:
    """(n_enough, the paired differences largest n - each smaller n, fired, sentence)."""
    which = "source" if init == "either" else init
    ns = sorted(n for (i, n) in groups if i == which)
    if not ns:
        return None, [], f"no learning-curve point for {which}", f"Enough data: unknown (no {which} curve)."
    N = ns[-1]
    top = groups[(which, N)]
    steps = []
    for n in ns[:-1]:
        low = groups[(which, n)]
        d = paired_diff_ci(
            [r[1] for r in top],
            [r[2] for r in top],
            [r[1] for r in low],
            [r[2] for r in low],
            where=f"curves: {which} n={N} - n={n}",
            **opts,
        )
        steps.append(
            {
                "n_samples": n,
                "diff_to_largest": d["diff"],
                "ci": d["ci"],
                "significantly_below": bool(d["ci"][0] > min_gain),
            }
        )
    enough = next((x["n_samples"] for x in steps if not x["significantly_below"]), N)
    if enough == N:
        below = (
            f"every smaller n is below n={N} by more than {min_gain:g} with significance"
            if steps
            else f"only n={N} was measured"
        )
        return (
            N,
            steps,
            f"{which}: {below}",
            f"Enough data: the {which} curve is still rising at the largest n={N} ({below}): more data may still help.",
        )
    x = next(x for x in steps if x["n_samples"] == enough)
    return (
        enough,
        steps,
        f"{which}: n={N} - n={enough} is {x['diff_to_largest']:+.3f} (CI {_fmt_ci(x['ci'])}), "
        f"not above min_gain {min_gain:g} with significance",
        f"Enough data: beyond n={enough} the {which} drafter gains no accept length above {min_gain:g} with "
        f"significance: n={N} is {x['diff_to_largest']:+.3f} over it (CI {_fmt_ci(x['ci'])}), and that CI's lower "
        f"end {x['ci'][0]:.3f} is not above {min_gain:g}, so the gain does not count.",
    )


def _arm_gain(groups: dict, a: str, b: str, opts: dict, names: tuple[str, str] | None = None) -> list[dict]:
    """Paired gains arm a - arm b at every n both measured (ascending); `better` names the winner
    by names (default: the arms)."""
    names = names or (a, b)
    out = []
    for n in sorted({n for (x, n) in groups if x == a} & {n for (x, n) in groups if x == b}):
        ra, rb = groups[(a, n)], groups[(b, n)]
        d = paired_diff_ci(
            [r[1] for r in ra],
            [r[2] for r in ra],
            [r[1] for r in rb],
            [r[2] for r in rb],
            where=f"curves: {a} - {b} at n={n}",
            **opts,
        )
        out.append({"n_samples": n, **named_diff(d, names)})
    return out


def rule_r7_regenerate(init: str, groups: dict, opts: dict, regen_hours=None) -> tuple[bool | None, dict, str, str]:
    """(regenerate, the gains per init, fired, sentence). regen_hours: n -> device-hours of
    regenerating n answers (None: unknown)."""
    which = "source" if init == "either" else init
    gains = {i: _arm_gain(groups, i, f"{i}-dataset", opts, ("regenerated", "dataset")) for i in INITS}
    gains = {i: g for i, g in gains.items() if g}
    if which not in gains:
        return (
            None,
            gains,
            f"no {which}-dataset arm measured",
            "Regenerate the answers: not measured (no arm trained on the dataset's own answers).",
        )
    at = gains[which][-1]
    g = f"{at['diff']:+.3f}, CI {_fmt_ci(at['ci'])}"
    where = f"{which} at n={at['n_samples']}"
    if at["significant"] and at["diff"] > 0:
        cost = "" if regen_hours is None else f"; it costs {regen_hours:.3g} device-hours of regeneration"
        return (
            True,
            gains,
            f"regenerated - dataset for {where}: {g}, significant",
            f"Regenerate the answers: the new target's own answers train a better {which} drafter than the "
            f"dataset's (regenerated - dataset {g} at n={at['n_samples']}){cost}.",
        )
    saves = "" if regen_hours is None else f", and saves {regen_hours:.3g} device-hours of regeneration"
    if at["significant"]:
        return (
            False,
            gains,
            f"regenerated - dataset for {where}: {g}, significant, dataset better",
            f"Do not regenerate: the dataset's own answers train a better {which} drafter (regenerated - "
            f"dataset {g} at n={at['n_samples']}){saves}.",
        )
    return (
        False,
        gains,
        f"regenerated - dataset for {where}: {g}, not significant",
        f"Do not regenerate: the new target's own answers bring no significant gain for {which} "
        f"(regenerated - dataset {g} at n={at['n_samples']}){saves}.",
    )


def rule_r8_recipe(init: str, groups: dict, opts: dict) -> tuple[str, dict, str, str]:
    """(recipe, gains per recipe, fired, sentence)."""
    names = sorted({a[len("source-") :] for (a, _) in groups if a.startswith("source-") and a != "source-dataset"})
    gains = {r: _arm_gain(groups, f"source-{r}", "source", opts, (r, "plain")) for r in names}
    gains = {r: g for r, g in gains.items() if g}
    if not gains:
        return "plain", {}, "no recipe arm measured", "Recipe: plain fine-tuning (no recipe was measured)."
    N = min(g[-1]["n_samples"] for g in gains.values())
    at = {r: next(x for x in g if x["n_samples"] == N) for r, g in gains.items()}
    listed = "; ".join(
        f"{r} {x['diff']:+.3f} (CI {_fmt_ci(x['ci'])}{', significant' if x['significant'] else ''})"
        for r, x in at.items()
    )
    if init == "scratch":
        return (
            "plain",
            gains,
            f"init scratch: recipes fine-tune the source ({listed})",
            f"Recipe: plain (the recipes fine-tune the source; init is scratch). Over plain fine-tuning at "
            f"n={N}: {listed}.",
        )
    good = [(x["diff"], r) for r, x in at.items() if x["significant"] and x["diff"] > 0]
    if not good:
        return (
            "plain",
            gains,
            f"no recipe's gain at n={N} is significant and > 0: {listed}",
            f"Recipe: plain fine-tuning; no recipe beats it significantly at n={N} ({listed}).",
        )
    r = max(good)[1]
    return (
        r,
        gains,
        f"largest significant gain at n={N}: {r} ({listed})",
        f"Recipe: {r}: it beats plain fine-tuning at n={N} by {at[r]['diff']:+.3f} (CI {_fmt_ci(at[r]['ci'])}); "
        f"all recipes: {listed}.",
    )


def rule_r5_confidence(init_from_sig_at_n: bool, n_found: bool, evidence_problems: int = 0) -> tuple[str, str]:
    held = int(init_from_sig_at_n) + int(n_found) - int(evidence_problems > 0)
    conf = {2: "high", 1: "medium", 0: "low", -1: "low"}[held]
    lowered = f"; R9 found {evidence_problems} problem(s) in the evidence: one level lower" if evidence_problems else ""
    return conf, (
        f"init from a significant gain at N: {'yes' if init_from_sig_at_n else 'no'}; "
        f"R2 found an n: {'yes' if n_found else 'no'}{lowered} -> {conf}"
    )


# which curve a phase is checked against (R9): the phase's init
PHASE_INIT = {"phase1_scratch": "scratch", "phase1": "source", "phase2": "source"}


def _degenerate(where: str, row: dict) -> dict | None:
    lo, hi = row["ci"]
    if lo != hi:
        return None
    return {
        "kind": "degenerate",
        "where": where,
        "accept_length": row["accept_length"],
        "ci": row["ci"],
        "text": (
            f"The evaluation of {where} is degenerate: every prompt gave accept length {row['accept_length']:.3f} "
            f"(CI {_fmt_ci(row['ci'])}), so its CI says nothing about the traffic. Evaluate on more prompts or "
            "more varied ones (the held-out set), or train it further if it accepts nothing yet."
        ),
    }


def _contradiction(phase: str, n: int, prow: dict, crow: dict, init: str) -> dict | None:
    (plo, phi), (clo, chi) = prow["ci"], crow["ci"]
    if plo <= chi and clo <= phi:
        return None
    return {
        "kind": "contradicting",
        "where": f"{phase} vs curves.{init} at n={n}",
        "phase_accept_length": prow["accept_length"],
        "phase_ci": prow["ci"],
        "curve_accept_length": crow["accept_length"],
        "curve_ci": crow["ci"],
        "text": (
            f"The learning curve contradicts {phase} at the same n={n}: {init}'s curve gives "
            f"{crow['accept_length']:.3f} (CI {_fmt_ci(crow['ci'])}) where {phase} gives "
            f"{prow['accept_length']:.3f} (CI {_fmt_ci(prow['ci'])}), and the CIs do not overlap. The rules on "
            "data (R2, R6) read the curves: give the curve points the phase's training budget (curves.train.steps, "
            "curves.epochs, curves.min_steps) before trusting them."
        ),
    }


def rule_r9_evidence(phases_out: dict, curves_out: dict, phase_n: dict | None) -> tuple[list[dict], str, list[str]]:
    """(the problems found, fired, their sentences)."""
    problems = [_degenerate(f"phase {name}", row) for name, row in phases_out.items()]
    for arm, rows in curves_out.items():
        problems += [_degenerate(f"curve point {arm} n={r['n_samples']}", r) for r in rows]
    for phase, n in (phase_n or {}).items():
        init = PHASE_INIT.get(phase)
        crow = next((r for r in curves_out.get(init, []) if r["n_samples"] == n), None)
        if phase in phases_out and crow is not None:
            problems.append(_contradiction(phase, n, phases_out[phase], crow, init))
    problems = [p for p in problems if p is not None]
    fired = "; ".join(f"{p['kind']}: {p['where']}" for p in problems) or "no degenerate or contradicting evidence"
    return problems, fired, [p["text"] for p in problems]


# ---------------------------------------------------------------- the decision


def _point(tau: dict, cm, break_even: float) -> dict:
    tok_s = cm.tok_s(tau["accept_length"])
    return {
        "accept_length": tau["accept_length"],
        "ci": tau["ci"],
        "projected_tok_s": float(tok_s),
        "speedup_vs_baseline": float(tok_s / cm.baseline_tok_s),
        "beats_break_even": _verdict(tau["ci"], break_even),
    }


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


def decide(
    curves,
    phases,
    *,
    costmodel,
    k: int,
    drift=None,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    min_gain: float = 0.0,
    hours: dict | None = None,
    serving_tokens_per_day: float | None = None,
    phase_n: dict | None = None,
    sets: list[dict] | None = None,
    bucket_edges: list[int] | None = None,
    context_limit: dict | None = None,
    min_share: float = 0.05,
    serving: dict | None = None,
    train_prompts: str | None = None,
) -> dict:
    """decision.json: CIs per (arm, n) and per phase, the paired gains, and the recommendation of
    rules R1-R10 (RULES; docs/decision.md). hours: {"rates": draftport.evaluation.hours.rates,
    "phases": {phase: device-hours split}, "plan": the whole plan's split} (measured; None: the
    decision states no hours); serving_tokens_per_day: the payback of the chosen drafter's hours;
    phase_n: {phase: the n it trained on}, for R9's check of the curves against the phases.

    The traffic (R10; Phase 0's eval.json): sets [{name, share, start, count}] -> every figure is
    the traffic-weighted accept length, bootstrapped within each set; bucket_edges (its
    context_buckets) -> per-bucket figures; context_limit -> the source's positions past its limit.
    With none of the three there is no "traffic" block and no R10 (the file as before them).

    serving: {"table": a serving.StepTable, "batch_sizes", "k": eval.k, "ttt_steps": {role: n},
    "models": {role: path}} -> R11, the best configuration per batch size (draftport.evaluation.serving),
    R4 at the source's best one, and the headline; None: neither (the file as before them)."""
    check_boot(n_boot, level)
    args = (curves, phases, costmodel, k, drift, n_boot, level, seed, min_gain, hours, serving_tokens_per_day, phase_n)
    if sets is None and bucket_edges is None and context_limit is None:
        return _decide(*args, serving=serving)
    tr = _traffic_inputs(curves, phases, sets, bucket_edges, context_limit, min_share)
    tr["train_prompts"] = train_prompts  # what the curves trained on: R10 names it beside their gains
    out = _decide(*args, strata=(strata_of(tr["curve_sets"]), strata_of(tr["sets"])), serving=serving)
    return _add_traffic(out, curves, phases, tr, {"n_boot": n_boot, "level": level, "seed": seed})


def _decide(
    curves,
    phases,
    costmodel,
    k: int,
    drift,
    n_boot: int,
    level: float,
    seed: int,
    min_gain: float,
    hours: dict | None,
    serving_tokens_per_day: float | None,
    phase_n: dict | None,
    strata: tuple = (None, None),
    serving: dict | None = None,
) -> dict:
    """decide's rules R1-R9 (and R11 with serving); strata: (the curves', the phases') for the
    traffic-weighted figures."""
    cm = _cost(costmodel, k)
    be = float(cm.break_even_accept_length)
    opts = {"n_boot": n_boot, "level": level, "seed": seed, "strata": strata[0]}  # the curves'
    popts = {**opts, "strata": strata[1]}  # the phases'
    rates = hours["rates"] if hours else None
    groups = _curve_groups(curves)
    secs, answers_of = _arm_facts(curves)
    curves_out = _curves_table(groups, cm, be, opts, secs, rates, answers_of)
    gain = _arm_gain(groups, "source", "scratch", opts)
    at_best = _add_best_configs(curves, curves_out, opts, serving)
    beats = (lambda r: r["best_config"]["beats_target_alone"]) if at_best else (lambda r: r["beats_break_even"])
    smallest = {i: next((r["n_samples"] for r in curves_out[i] if beats(r) == "yes"), None) for i in INITS}
    counts = _phase_counts(phases)
    phases_out = _phases_table(counts, cm, be, popts, hours)
    p1, p2 = _phase_gains(counts, popts)

    init, init_sig, f1, s1 = rule_r1_init(gain)
    n_rec, f2, s2 = (rule_r2_best if at_best else rule_r2_data)(init, smallest, curves_out, be)
    ph2, f3, s3 = rule_r3_phase2(p2)
    deploy, f4, s4 = rule_r4_deploy(phases_out, be)
    evidence, f9, s9 = rule_r9_evidence(phases_out, curves_out, phase_n)
    conf, f5 = rule_r5_confidence(init_sig, n_rec is not None, len(evidence))
    n_enough, plateau, f6, s6 = rule_r6_enough(init, groups, opts, min_gain)
    recipe, recipe_gain, f8, s8 = rule_r8_recipe(init, groups, opts)
    regen_h = None if rates is None or n_rec is None else n_rec * rates["regenerate_s_per_sample"] / 3600
    regenerate, answers_gain, f7, s7 = rule_r7_regenerate(init, groups, opts, regen_h)
    arm = (init, recipe, regenerate)
    n_train, n_why = _n_train(arm, n_rec, n_enough, curves_out, secs, rates, (cm, hours, serving_tokens_per_day))
    chosen = _chosen(init, recipe, regenerate, n_train, curves_out, secs, rates)
    pay = _payback(chosen, cm, hours, serving_tokens_per_day)
    serve, f11, s11 = None, None, []
    if serving is not None:
        from draftport.evaluation.serving import deploy_source, serving_rule

        serve, f11, s11 = serving_rule(phases or {}, counts, popts, serving, recommended_phase(init, ph2, counts))
        deploy, f4, s4 = deploy_source(serve) or (deploy, f4, s4)
        depth_arm, s_depth = _depth_arm(curves, serve, serving, opts)
        if depth_arm is not None:
            serve["depth_arm"] = depth_arm
            s11 = [*s11, s_depth]
    head = _headline(init, recipe, regenerate, n_train, ph2, deploy, serve, conf)
    text = [
        s1,
        s8,
        s7,
        s2,
        n_why,
        s6,
        s3,
        s4,
        *s11,
        *_evidence_text(chosen, pay, hours, p1, drift),
        *s9,
        f"Confidence: {conf}.",
    ]
    rules = [{"id": f"R{i}", "fired": f} for i, f in enumerate((f1, f2, f3, f4, f5, f6, f7, f8, f9), 1)]
    if f11 is not None:
        rules.append({"id": "R11", "fired": f11})
    return {
        **_settings(level, n_boot, k, min_gain, cm, be),
        "curves": curves_out,
        "gain": gain,
        "smallest_n_beating_break_even": smallest,
        "phases": phases_out,
        "phase1_gain_vs_scratch": p1,
        "phase2_gain": p2,
        "plateau": plateau,
        "answers_gain": answers_gain,
        "recipe_gain": recipe_gain,
        "drift": drift,
        "hours": hours,
        "recommendation": {
            "init": init,
            "recipe": recipe,
            "regenerate": regenerate,
            "n_samples": n_rec,
            "n_enough": n_enough,
            "n_train": n_train,
            "headline": head,
            "phase2": ph2,
            "deploy_source_now": deploy,
            "confidence": conf,
            "chosen": chosen,
            "payback": pay,
            "evidence_problems": evidence,
            "rules": rules,
            "text": [t for t in text if t],
        },
        **({"serving": serve} if serve is not None else {}),
    }


def _phases_table(counts: dict, cm, be: float, opts: dict, hours: dict | None) -> dict:
    """phase -> its tau with the CI over prompts, tok/s and break-even verdict, and its measured hours."""
    phases_out = {name: _point(tau_ci(*ps, where=f"phases: {name}", **opts), cm, be) for name, ps in counts.items()}
    for name, h in ((hours or {}).get("phases") or {}).items():
        if name in phases_out:
            phases_out[name]["hours"] = h
    return phases_out


def _settings(level: float, n_boot: int, k: int, min_gain: float, cm, be: float) -> dict:
    """decision.json's head: its schema, the bootstrap's settings and the cost model."""
    return {
        "schema": SCHEMA,
        "level": float(level),
        "n_boot": n_boot,
        "k": k,
        "min_gain": float(min_gain),
        "costmodel": {
            "baseline_tok_s": cm.baseline_tok_s,
            "verify_ms": cm.verify_ms,
            "draft_ms": cm.draft_ms,
            "break_even_accept_length": be,
        },
    }


# Every curve row's keys, in this order (n_samples first, then the CI, then the seeds, then the verdicts)
CURVE_ROW_KEYS = (
    "n_samples",
    "accept_length",
    "ci",
    "seeds",
    "seed_std",
    "n_seeds",
    "projected_tok_s",
    "speedup_vs_baseline",
    "beats_break_even",
    "hours",
    "best_config",
)


def _curves_table(groups: dict, cm, be: float, opts: dict, secs: dict, rates, answers_of: dict) -> dict:
    """arm -> its rows by n: tau with its CI over prompts, the seeds, tok/s, break-even, hours."""
    # lazy (registry): eval_curves runs this module without evaluation.hours
    from draftport.evaluation.hours import split

    out: dict = {i: [] for i in INITS}
    for arm, n in sorted(groups, key=lambda key: (_arm_order(key[0]), key[1])):
        rows = groups[(arm, n)]
        t = tau_ci([r[1] for r in rows], [r[2] for r in rows], where=f"curves: arm={arm}, n={n}", **opts)
        row = {
            "n_samples": n,
            **_point(t, cm, be),
            "seeds": t["seeds"],
            "seed_std": t["seed_std"],
            "n_seeds": len(rows),
        }
        if rates is not None and (arm, n) in secs:
            row["hours"] = split(n, secs[(arm, n)], rates, answers_of.get(arm, "regenerated"))
        out.setdefault(arm, []).append(row)
    return {
        arm: [{key: r[key] for key in CURVE_ROW_KEYS if key in r} for r in sorted(rows, key=lambda r: r["n_samples"])]
        for arm, rows in out.items()
    }


def _add_best_configs(curves, curves_out: dict, opts: dict, serving: dict | None) -> bool:
    """R2 at R11's configuration: each plain arm's row gets `best_config`, its best chain k at the
    smallest served batch size from the points' per-depth counts, its projected tok/s a request
    with CI and whether that beats the target alone ("yes" / "no" / "unclear"). -> whether the rows
    have it (serving inputs and curves measured to depth)."""
    depths = _curve_depths(curves)
    if serving is None or not depths:
        return False
    from draftport.evaluation.serving import best_per_batch

    b0 = sorted(serving["batch_sizes"])[0]
    by_k = {k: _curve_groups(curves, depth=k) for k in depths}
    for arm in INITS:
        for row in curves_out[arm]:
            n = row["n_samples"]
            taus = {}
            for k, g in by_k.items():
                rows = g[(arm, n)]
                where = f"curves: arm={arm}, n={n}, k={k}"
                taus[k] = tau_ci([r[1] for r in rows], [r[2] for r in rows], where=where, **opts)
            r = best_per_batch(taus, [], serving["table"], [b0], None)[0]
            best, alone = r["best"], r["target_alone_tok_s"]
            row["best_config"] = {
                "batch_size": b0,
                "k": best["k"],
                "accept_length": best["accept_length"],
                "ci": best["ci"],
                "tok_s": best["tok_s"],
                "tok_s_ci": best["tok_s_ci"],
                "target_alone_tok_s": alone,
                "beats_target_alone": _verdict(best["tok_s_ci"], alone),
            }
    return True


def _depth_arm(curves, serve: dict, serving: dict, opts: dict) -> tuple[dict | None, str | None]:
    """R11, past the trained depth: where the recommended drafter's best chain k exceeds its
    train.ttt_steps, the paired gain of a curve arm trained deeper (a curves.recipes entry raising
    ttt_steps) over plain fine-tuning of the source at that k, at the largest n both measured ->
    (the decision's serving.depth_arm, its sentence); (None, None) when no best k is past it."""
    rec = serve["drafters"].get("recommended")
    ttt = (serving.get("ttt_steps") or {}).get("recommended")
    past = [r["best"]["k"] for r in (rec or {}).get("per_batch", []) if r["past_ttt"]]
    if not past or ttt is None:
        return None, None
    k = max(past)
    deeper = {
        name: int(keys["ttt_steps"])
        for name, keys in ((curves or {}).get("recipes") or {}).items()
        if isinstance(keys, dict) and isinstance(keys.get("ttt_steps"), int) and keys["ttt_steps"] > ttt
    }
    if not deeper or k not in _curve_depths(curves):
        why = "no curve arm trained deeper" if not deeper else f"the curves were not measured to k={k}"
        return (
            {"k": k, "measured": False},
            f"Whether training deeper than {ttt} steps pays at k={k} was not measured ({why}): add a recipe "
            f"such as ttt{k}: {{ttt_steps: {k}}} to curves.recipes.",
        )
    name = max(deeper, key=lambda r: deeper[r])
    from draftport.plan.curves import arm_name  # lazy (registry): the steps that only read rows lack it

    arm = arm_name("source", recipe=name)
    gains = _arm_gain(_curve_groups(curves, depth=k), arm, "source", opts, (name, "plain"))
    if not gains:
        return {"k": k, "measured": False, "recipe": name}, (
            f"Whether training deeper pays at k={k} was not measured: the curves have no {arm} point."
        )
    g = gains[-1]
    out = {"k": k, "measured": True, "recipe": name, "ttt_steps": deeper[name], **g}
    verdict = (
        f"pays: {g['diff']:+.3f}"
        if g["significant"] and g["diff"] > 0
        else (f"costs: {g['diff']:+.3f}" if g["significant"] else f"shows no significant gain: {g['diff']:+.3f}")
    )
    return out, (
        f"Training deeper at k={k}: the source fine-tuned to unroll {deeper[name]} steps (recipe {name}) {verdict} "
        f"accept length over {ttt} steps (CI {_fmt_ci(g['ci'])}, n={g['n_samples']}, paired over prompts)."
    )


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


def _phase_gains(counts: dict, opts: dict) -> tuple[dict | None, dict | None]:
    """(Phase 1 - its scratch control, Phase 2 - Phase 1), paired over prompts; None where a phase is missing."""

    def pair(x, y):
        if x not in counts or y not in counts:
            return None
        return paired_diff_ci(*counts[x], *counts[y], where=f"phases: {x} - {y}", **opts)

    p1 = pair("phase1", "phase1_scratch")
    if p1 is not None:
        p1 = named_diff(p1, ("phase1", "phase1_scratch"))
    p2 = pair("phase2", "phase1")
    p2 = None if p2 is None else {"diff": p2["diff"], "ci": p2["ci"], "significant": p2["significant"]}
    return p1, p2


def _payback(chosen, cm, hours, serving_tokens_per_day) -> dict | None:
    """The chosen drafter's hours paid back by serving (and the whole plan's), when a volume is stated."""
    # lazy (registry): eval_curves runs this module without evaluation.hours
    from draftport.evaluation.hours import payback

    h = (chosen or {}).get("hours")
    if chosen is None or serving_tokens_per_day is None or h is None:
        return None
    pay = payback(h["total"], chosen["projected_tok_s"], cm.baseline_tok_s, float(serving_tokens_per_day))
    if (hours or {}).get("plan"):
        pay["plan"] = payback(
            hours["plan"]["total"], chosen["projected_tok_s"], cm.baseline_tok_s, float(serving_tokens_per_day)
        )
    return pay


def _evidence_text(chosen, pay, hours, p1, drift) -> list[str]:
    """The sentences after the rules': the chosen drafter, its payback, the plan's hours, Phase 1
    against its control, the drift probe."""
    text = []
    if chosen is not None:
        h = chosen.get("hours")
        text.append(
            f"The recommended drafter ({chosen['arm']} at n={chosen['n_samples']}"
            f"{'' if chosen['measured'] else ', figures of the plain ' + chosen['figures_from'] + ' arm'}): "
            f"accept length {chosen['accept_length']:.3f} (CI {_fmt_ci(chosen['ci'])}), "
            f"{chosen['projected_tok_s']:.1f} tok/s"
            + (
                ""
                if h is None
                else f", {h['total']:.3g} device-hours (regenerate {h['regenerate']:.3g}, "
                f"capture {h['capture']:.3g}, train {h['train']:.3g})"
            )
            + "."
        )
        if pay is not None:
            text.append(_payback_text(pay))
    if (hours or {}).get("plan"):
        ph = hours["plan"]
        text.append(
            f"This plan's training data and trainings took {ph['total']:.3g} device-hours: regenerate "
            f"{ph['regenerate']:.3g}, capture "
            f"{ph['capture']:.3g}, train {ph['train']:.3g} (the learning curves {ph.get('curves', 0):.3g}"
            + (f"; the adaptive budget's rounds {ph['budget_rounds']:.3g}" if "budget_rounds" in ph else "")
            + "); "
            f"measured ({hours['rates'].get('source', 'this run')})."
        )
    if p1 is not None:
        text.append(
            f"Phase 1 (fine-tuned source) - Phase 1 scratch control: {p1['diff']:+.3f} (CI "
            f"{_fmt_ci(p1['ci'])}), {'significant' if p1['significant'] else 'not significant'}."
        )
    gap = drift.get("tau_gap") if isinstance(drift, dict) else None
    if isinstance(gap, (int, float)) and not isinstance(gap, bool) and math.isfinite(gap):
        text.append(
            f"Drift probe: the source drafter's accept length on the old target's states minus on the "
            f"new target's states of the same tokens is {gap:+.3f} (tau_gap)."
        )
    return text


def _chosen(init, recipe, regenerate, n, curves_out, secs, rates) -> dict | None:
    """The recommended drafter: its arm (init, R8's recipe, R7's answers), R2's n; its figures from
    that arm's point when measured, else from the plain init's at n; its hours from the rates."""
    # lazy (registry): eval_curves runs this module without evaluation.hours
    from draftport.evaluation.hours import split

    if n is None:
        return None
    base = "source" if init == "either" else init
    answers = "dataset" if regenerate is False else "regenerated"
    parts = [base] + (["dataset"] if answers == "dataset" else []) + ([recipe] if recipe != "plain" else [])
    arm = "-".join(parts)
    for cand in (arm, base):
        row = next((r for r in curves_out.get(cand, []) if r["n_samples"] == n), None)
        if row is not None:
            break
    if row is None:
        return None
    out = {
        "arm": arm,
        "answers": answers,
        "n_samples": n,
        "measured": cand == arm,
        "figures_from": cand,
        **{key: row[key] for key in ("accept_length", "ci", "projected_tok_s", "speedup_vs_baseline")},
    }
    train_s = secs.get((cand, n))
    if rates is not None and train_s is not None:
        out["hours"] = split(n, train_s, rates, answers)
    return out


def _n_train(arm: tuple, n_rec, n_enough, curves_out, secs, rates, money: tuple) -> tuple[int | None, str | None]:
    """The headline's n: the measured n of the recommended arm whose hours pay back soonest at the
    stated serving volume; without one, where its curve flattens (R6), never below R2's cheapest n
    above break-even; None when no n beats break-even. -> (n, sentence)."""
    cm, hours, per_day = money
    if n_rec is None:
        return None, None
    if per_day is not None and rates is not None:
        paid = []
        for row in curves_out.get("source" if arm[0] == "either" else arm[0], []):
            chosen = _chosen(*arm, row["n_samples"], curves_out, secs, rates)
            pay = _payback(chosen, cm, hours, per_day)
            if pay is not None and pay["days"] is not None:
                paid.append((pay["days"], row["n_samples"]))
        if paid:
            days, n = min(paid)
            return n, (
                f"Train on n={n}: of the measured n its device-hours pay back soonest at {per_day:.3g} tokens a "
                f"day ({days:.3g} days); n={n_rec} is the cheapest n above break-even (R2)."
            )
    if n_enough is None or n_enough <= n_rec:
        return (
            n_rec,
            f"Train on n={n_rec}: the cheapest n above break-even (R2), where more data also stops paying (R6).",
        )
    return n_enough, (
        f"Train on n={n_enough}: where the curve flattens (R6); n={n_rec} is the cheapest n above break-even (R2). "
        "State decision.serving_tokens_per_day to choose n by payback."
    )


def _headline(init, recipe, regenerate, n, ph2, deploy, serve, conf) -> str:
    """The recommendation in one line: what to train, how to serve it, whether to deploy the source meanwhile."""
    if n is None:
        what = (
            "no measured n beats break-even: collect more new-target data than the largest n (or cut the verify cost)"
        )
    else:
        how = "fine-tune the source drafter" if init != "scratch" else "train a new drafter from scratch"
        answers = "the dataset's answers" if regenerate is False else "answers regenerated by the new target"
        what = (
            f"{how} on n={n} new-target samples ({answers}" + (f", recipe {recipe}" if recipe != "plain" else "") + ")"
        )
        if ph2 == "helps":
            what += ", then continue it on Phase 2's scaled data"
    line = f"Do: {what}"
    rec = ((serve or {}).get("drafters") or {}).get("recommended")
    if rec is not None:
        from draftport.evaluation.serving import describe

        on = [f"{describe(r)} at batch {r['batch_size']}" for r in rec["per_batch"] if r["speculate"]]
        off = [str(r["batch_size"]) for r in rec["per_batch"] if not r["speculate"]]
        if on:
            line += "; serve it as " + ", ".join(on)
        if off:
            line += f"; {'and ' if on else ''}serve the target alone at batch {', '.join(off)} (no draft pays there)"
    if deploy:
        line += "; meanwhile deploy the source drafter as-is"
    return f"{line} (confidence {conf})."


def _payback_text(pay: dict) -> str:
    if pay["days"] is None:
        return (
            f"Payback: never at {pay['tokens_per_day']:.3g} tokens a day: the recommended drafter is not "
            "faster than the break-even."
        )
    plan = pay.get("plan")
    more = (
        ""
        if not plan or plan["days"] is None
        else f"; the whole plan's {plan['port_hours']:.3g} h in {plan['days']:.3g} days"
    )
    return (
        f"Payback: at {pay['tokens_per_day']:.3g} tokens a day the drafter saves {pay['saved_hours_per_day']:.3g} "
        "hours of decoding a day against the break-even (the cost model's per-request speed); an hour of "
        f"decoding counted as a device-hour, its {pay['port_hours']:.3g} device-hours are recovered in "
        f"{pay['days']:.3g} days{more}."
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


def _pct(share: float) -> str:
    return f"{100 * share:.3g}%"


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


# ---------------------------------------------------------------- reading and rendering


def load_decision(path: str | Path = DEFAULT_PATH) -> dict:
    """A decision.json, checked to be one (its schema)."""
    path = Path(path)
    if path.is_dir():
        path = path / "decision.json"
    if not path.is_file():
        raise DraftportError(
            path, "no decision file here; run `snakemake --cores 8 decision` (or `make decision`) first"
        )
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise DraftportError(path, f"cannot read it as JSON ({type(e).__name__})") from None
    schema = obj.get("schema") if isinstance(obj, dict) else None
    if schema != SCHEMA:
        raise DraftportError(path, f"not a draftport decision file (schema {schema!r}, expected {SCHEMA!r})")
    return obj


def render_text(decision: dict) -> str:
    """A few lines for a terminal: the recommendation first, then the numbers behind it."""
    r = decision["recommendation"]
    cmd = decision["costmodel"]
    be = cmd["break_even_accept_length"]
    pct = f"{100 * decision['level']:g}%"
    n = "none" if r["n_samples"] is None else str(r["n_samples"])
    ne = r.get("n_enough")
    regen = {True: "yes", False: "no", None: "not measured"}[r.get("regenerate")]
    out = [r["headline"]] if r.get("headline") else []
    out += [
        f"Recommendation: init {r['init']}, recipe {r.get('recipe', 'plain')}, regenerate {regen}, "
        f"n_samples {n}{'' if ne is None else f' (enough: {ne})'}, phase2 {r['phase2']}, deploy source now "
        f"{'yes' if r['deploy_source_now'] else 'no'} (confidence {r['confidence']})"
    ]
    out += [f"  {s}" for s in r["text"]]
    out.append(
        f"Break-even accept length {be:.3f} (baseline {cmd['baseline_tok_s']:g} tok/s, verify "
        f"{cmd['verify_ms']:g} ms, draft {cmd['draft_ms']:g} ms, k={decision['k']}); {pct} CIs, "
        f"{decision['n_boot']} bootstrap draws over prompts"
    )
    rows = [(arm, p) for arm in sorted(decision["curves"], key=_arm_order) for p in decision["curves"][arm]]
    if rows:
        w = max(8, *(len(a) + 2 for a, _ in rows))
        out.append(
            f"Learning curves:  {'arm':<{w}}{'n':>6}  {'tau':>6}  {'CI':<17}{'seeds':>5}  {'tok/s':>8}  "
            f"{'hours':>8}  beats break-even"
        )
        for arm, p in rows:
            hrs = f"{p['hours']['total']:>8.3g}" if p.get("hours") else f"{'-':>8}"
            out.append(
                f"                  {arm:<{w}}{p['n_samples']:>6}  {p['accept_length']:>6.3f}  "
                f"{_fmt_ci(p['ci']):<17}{p['n_seeds']:>5}  {p['projected_tok_s']:>8.1f}  {hrs}  "
                f"{p['beats_break_even']}"
            )
    if decision["gain"]:
        out.append("Gain source - scratch:")
        for g in decision["gain"]:
            verdict = f"significant ({g['better']})" if g["significant"] else "not significant"
            out.append(f"  n={g['n_samples']:<8} {g['diff']:+.3f} {_fmt_ci(g['ci'])}  {verdict}")
    for key, label in (("answers_gain", "Gain regenerated - dataset answers"), ("recipe_gain", "Gain recipe - plain")):
        for arm, gains in (decision.get(key) or {}).items():
            for g in gains:
                verdict = f"significant ({g['better']})" if g["significant"] else "not significant"
                out.append(f"{label} ({arm}): n={g['n_samples']:<6} {g['diff']:+.3f} {_fmt_ci(g['ci'])}  {verdict}")
    if decision["phases"]:
        out.append("Phases:")
        for name, p in decision["phases"].items():
            hrs = f"  {p['hours']['total']:.3g} device-hours" if p.get("hours") else ""
            out.append(
                f"  {name:<15} tau {p['accept_length']:.3f} {_fmt_ci(p['ci'])}  {p['projected_tok_s']:.1f} "
                f"tok/s (x{p['speedup_vs_baseline']:.2f})  beats break-even: {p['beats_break_even']}{hrs}"
            )
    for key, label in (("phase1_gain_vs_scratch", "Phase 1 - Phase 1 scratch"), ("phase2_gain", "Phase 2 - Phase 1")):
        g = decision.get(key)
        if g is not None:
            out.append(
                f"{label}: {g['diff']:+.3f} {_fmt_ci(g['ci'])}  "
                f"{'significant' if g['significant'] else 'not significant'}"
            )
    out += _render_traffic(decision.get("traffic"))
    if decision.get("serving"):
        from draftport.evaluation.serving import render

        out += render(decision["serving"])
    b = decision.get("data_budget")
    if b:
        out.append(
            f"Adaptive data budget: Phase 2's data {b['why']} ({len(b['rounds'])} rounds, x{b['factor']:g} each):"
        )
        for row in b["rounds"]:
            proj = (
                f", gain {row['gain']:+.3f}; next round projected {row['projected_gain']:+.3f} "
                f"[{row['projected_gain_ci_low']:+.3f}, {row['projected_gain_ci_high']:+.3f}]"
                if "gain" in row
                else ""
            )
            out.append(f"  round {row['round']}: n={row['n_samples']:<8} tau {row['accept_length']:.3f}{proj}")
    return "\n".join(out) + "\n"


def _fig(row: dict | None) -> str:
    if row is None or row.get("accept_length") is None:
        return "not measured"
    return f"{row['accept_length']:.3f} {_fmt_ci(row['ci'])}"


def _render_traffic(t: dict | None) -> list[str]:
    """render_text's lines on the traffic: per set and per bucket, the recommended drafter against its rivals."""
    if not t:
        return []
    ph = t["recommended_phase"]
    out = [
        "Traffic: "
        + ", ".join(f"{s['name']} {_pct(s['share'])} ({s['n_prompts']} prompts)" for s in t["sets"])
        + ("; accept lengths traffic-weighted" if t["weighted"] else "")
        + f"; recommended drafter {ph or 'not measured'}"
    ]
    for name, row in t["phases"].items():
        sets = "  ".join(f"{s}: {_fig(x)}" for s, x in row["sets"].items())
        out.append(f"  {name:<15} weighted {_fig(row['weighted'])}  {sets}")
    for other, v in t["vs"].items():
        sets = "  ".join(f"{s}: {d['diff']:+.3f} {_fmt_ci(d['ci'])}" for s, d in v["sets"].items())
        out.append(f"  {ph} - {other}: weighted {v['weighted']['diff']:+.3f} {_fmt_ci(v['weighted']['ci'])}  {sets}")
    gains = [(s, g) for s, g in t["curve_gain"].items() if g]
    if gains:
        g0 = gains[0][1]
        out.append(
            f"  More data, {g0['arm']} n={g0['from_n']} -> n={g0['to_n']}: "
            + "  ".join(f"{s}: {g['diff']:+.3f} {_fmt_ci(g['ci'])}" for s, g in gains)
        )
    for name, rows in (t["buckets"] or {}).items():
        cells = "  ".join(
            f"{r['bucket']}: {_fig(r)} ({r['num_cycles']} cycles"
            + (", past the source's limit)" if r["beyond_source_limit"] and name == "phase0" else ")")
            for r in rows
        )
        out.append(f"  buckets {name:<15} {cells}")
    for other, rows in (t["buckets_vs"] or {}).items():
        cells = "  ".join(
            f"{r['bucket']}: " + ("not measured" if r["diff"] is None else f"{r['diff']:+.3f} {_fmt_ci(r['ci'])}")
            for r in rows
        )
        out.append(f"  buckets {ph} - {other}: {cells}")
    lim = t.get("context_limit")
    if lim and lim["limited"]:
        out.append(
            f"  Context limit: the source serves positions up to {lim['source_limit']}, the new target "
            f"{lim['serving_length']}"
        )
    return out
