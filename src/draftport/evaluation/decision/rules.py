"""The decision's rules R1-R9 (and R2 at the best serving configuration): RULES, word for word as
docs/decision.md states them, and one function per rule returning its value and its text."""

from __future__ import annotations

from draftport.evaluation.bootstrap import paired_diff_ci
from draftport.evaluation.decision.inputs import INITS
from draftport.evaluation.decision.text import _fmt_ci
from draftport.evaluation.traffic import named_diff

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


def _verdict(ci, break_even: float) -> str:
    if ci[0] > break_even:
        return "yes"
    if ci[1] < break_even:
        return "no"
    return "unclear"


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


def _r2_pick(init: str, smallest: dict) -> tuple[int | None, str | None]:
    """R2's n and the arm it comes from: the init's smallest n, for "either" the smaller of the two."""
    if init != "either":
        return smallest.get(init), init
    cands = [(n, i) for i, n in smallest.items() if n is not None]
    return min(cands) if cands else (None, None)


def rule_r2_data(init: str, smallest: dict, curves_out: dict, break_even: float) -> tuple[int | None, str, str]:
    """(n_samples, fired, sentence)."""
    n, which = _r2_pick(init, smallest)
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
    lo, hi = c["tok_s_ci"]
    return (
        f"chain k={c['k']} at batch {c['batch_size']}: {c['tok_s']:.1f} tok/s a request "
        f"(CI [{lo:.1f}, {hi:.1f}]) against the target alone's {c['target_alone_tok_s']:.1f}"
    )


def rule_r2_best(init: str, smallest: dict, curves_out: dict, break_even: float) -> tuple[int | None, str, str]:
    """R2 with the serving inputs and curves measured to depth: break-even at each n's best chain
    configuration (its row's best_config: the target alone's tok/s stands for break_even) ->
    (n_samples, fired, sentence)."""
    arms = INITS if init == "either" else (init,)
    n, which = _r2_pick(init, smallest)
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
