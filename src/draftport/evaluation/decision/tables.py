"""The decision's tables and hours: the phases' and curves' rows with their CIs and verdicts, the best
serving configurations, the depth arm, and the drafter to train with its payback."""

from __future__ import annotations

from draftport.evaluation.bootstrap import paired_diff_ci, tau_ci
from draftport.evaluation.decision.inputs import INITS, _arm_order, _curve_depths, _curve_groups
from draftport.evaluation.decision.rules import _arm_gain, _verdict
from draftport.evaluation.decision.text import _fmt_ci
from draftport.evaluation.traffic import named_diff

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


def _phases_table(counts: dict, cm, be: float, opts: dict, hours: dict | None) -> dict:
    """phase -> its tau with the CI over prompts, tok/s and break-even verdict, and its measured hours."""
    phases_out = {name: _point(tau_ci(*ps, where=f"phases: {name}", **opts), cm, be) for name, ps in counts.items()}
    for name, h in ((hours or {}).get("phases") or {}).items():
        if name in phases_out:
            phases_out[name]["hours"] = h
    return phases_out


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
