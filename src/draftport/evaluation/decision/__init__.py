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
and states the rules word for word; RULES (decision.rules) is that text.

The package, one concern a module: inputs (reading and checking the curves and phases), rules
(RULES and R1-R9), traffic (R10), tables (the phases' and curves' rows, the best configurations,
the hours), text (the headline and render_text); here: decide, load_decision, and every name the
single module held before, re-exported.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftport.errors import DraftportError
from draftport.evaluation.bootstrap import check_boot, paired_diff_ci, tau_ci  # noqa: F401 - re-exported
from draftport.evaluation.decision.inputs import (  # noqa: F401 - re-exported
    INITS,
    PHASES,
    _arm_facts,
    _arm_order,
    _at_depth,
    _cost,
    _curve_depths,
    _curve_groups,
    _per_sample,
    _phase_counts,
)
from draftport.evaluation.decision.rules import (  # noqa: F401 - re-exported
    PHASE_INIT,
    RULES,
    _arm_gain,
    _cfg_fig,
    _contradiction,
    _degenerate,
    _verdict,
    rule_r1_init,
    rule_r2_best,
    rule_r2_data,
    rule_r3_phase2,
    rule_r4_deploy,
    rule_r5_confidence,
    rule_r6_enough,
    rule_r7_regenerate,
    rule_r8_recipe,
    rule_r9_evidence,
)
from draftport.evaluation.decision.tables import (  # noqa: F401 - re-exported
    CURVE_ROW_KEYS,
    _add_best_configs,
    _chosen,
    _curves_table,
    _depth_arm,
    _n_train,
    _payback,
    _phase_gains,
    _phases_table,
    _point,
)
from draftport.evaluation.decision.text import (  # noqa: F401 - re-exported
    _evidence_text,
    _fig,
    _fmt_ci,
    _headline,
    _payback_text,
    _pct,
    _render_traffic,
    render_text,
)
from draftport.evaluation.decision.traffic import (  # noqa: F401 - re-exported
    PHASE_LABEL,
    _add_traffic,
    _against,
    _bucket_problems,
    _limit_text,
    _more_data_text,
    _past_limit,
    _problem,
    _rivals,
    _set_problems,
    _traffic_buckets,
    _traffic_curves,
    _traffic_inputs,
    _traffic_vs,
    recommended_phase,
    rule_r10_traffic,
)
from draftport.evaluation.traffic import strata_of

SCHEMA = "draftport.decision/1"  # the file format's name, not a module path: it stays when code moves
DEFAULT_PATH = Path("artifacts/decision/decision.json")


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


# ---------------------------------------------------------------- reading


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
