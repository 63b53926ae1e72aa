"""The decision step: which init, recipe and answers, how much data, whether Phase 2 pays, and
the hours, with bootstrap CIs (draftport.evaluation.decision: its rules R1-R10, docs/decision.md;
the hours: draftport.evaluation.hours, measured by the steps) -> decision.json, decision.txt."""

from __future__ import annotations

from pathlib import Path

from draftport.evaluation.decision import decide, render_text
from draftport.evaluation.hours import devices, rates, split
from draftport.evaluation.serving import StepTable, read_step_table, seeds_table
from draftport.pipeline.runner import StepContext, read_json, timing_of, write_json
from draftport.plan.curves import point_name

PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")


def _hours(s: StepContext, curves: dict | None) -> dict | None:
    """The measured device-hours (the steps' timings, logs/<step>.json): the rates per sample,
    each phase's split (the control: its training; Phase 1's data counted in phase1), the plan's
    (its training data, every training, the curves; the held-out sets and the evaluations not
    counted). None, said in the log, when a step's timing is missing (logs/ deleted, an older run).
    The curve points get their training seconds (train_seconds) for the decision's rows."""
    res = s.p["resources"]
    phase2_data = "budget" if "budget" in s.inputs else "features_phase2"  # data.budget adaptive: the rounds'
    steps = [
        "features_new",
        phase2_data,
        *(["features_dataset"] if "data_features_dataset" in s.inputs else []),
        "train_phase1_scratch",
        "train_phase1",
        "train_phase2",
        *(["train_curves"] if curves else []),
    ]
    rec = {st: timing_of(st) for st in steps}
    missing = [st for st, t in rec.items() if not t]
    if missing:
        print(f"decision: no hours (no timing in logs/{missing[0]}.json: rerun that step to measure them)")
        return None
    data = {st: rec[st]["train"] for st in ("features_new", phase2_data, "features_dataset") if st in rec}
    r = {**rates(data, res), "source": "wall seconds of this run's steps x GPUs"}
    train = {
        ph: float(rec[f"train_{ph}"]["train_seconds"]) * devices(res, f"train_{ph}")
        for ph in ("phase1_scratch", "phase1", "phase2")
    }
    point_s = rec["train_curves"]["points"] if curves else {}
    for p in (curves or {}).get("points", []):
        if point_name(p) in point_s:
            p["train_seconds"] = point_s[point_name(p)] * devices(res, "train_curves")
    n1 = data["features_new"]["samples"]
    n2 = n1 + data[phase2_data]["samples"]
    phases = {
        "phase1": split(n1, train["phase1"], r),
        "phase1_scratch": split(0, train["phase1_scratch"], r),
        "phase2": split(n2 - n1, train["phase2"], r),
    }
    curve_train = sum(float(p.get("train_seconds") or 0.0) for p in (curves or {}).get("points", []))
    dataset = split(data.get("features_dataset", {}).get("samples", 0), 0.0, r, "dataset")  # no arm: zeros
    plan = {key: sum(h[key] for h in phases.values()) + dataset[key] for key in ("regenerate", "capture", "train")}
    plan["train"] += curve_train / 3600
    plan["curves"] = curve_train / 3600 + dataset["total"]
    if phase2_data == "budget":  # the rounds' own trainings (their data is Phase 2's, counted there)
        rounds_h = float(rec["budget"]["rounds_train_seconds"]) / 3600
        plan["train"] += rounds_h
        plan["budget_rounds"] = rounds_h
    plan["total"] = plan["regenerate"] + plan["capture"] + plan["train"]
    return {"rates": r, "phases": phases, "plan": plan}


def _phase_n(s: StepContext, budget: dict | None) -> dict:
    """{phase: the n it trained on}, for the phases this plan trains (R9 checks them against the curves)."""
    n1, n2 = s.p["phase1"]["n_samples"], s.p["phase2"]["n_samples"]
    if budget is not None:  # data.budget adaptive: Phase 2 trained on the n where the rounds stopped
        n2 = budget["n_samples"]
    out = {"phase1_scratch": n1, "phase1": n1, "phase2": n2}
    return {ph: n for ph, n in out.items() if ph in s.inputs}


def _traffic(phase0: dict, d: dict) -> dict:
    """decide's traffic inputs: Phase 0's eval sets, context buckets and the source's context limit
    (every phase and curve point is evaluated on the same sets and buckets)."""
    return {
        "sets": phase0.get("sets"),
        "bucket_edges": phase0.get("context_buckets"),
        "context_limit": phase0.get("context_limit"),
        "min_share": d.get("min_share", 0.05),
    }


def _derived(s: StepContext, depth: int) -> StepTable:
    """Step times derived from the real target's config, the serving GPUs and the drafter's bytes."""
    from draftport.profile.estimate import serving_steps, target_config

    srv = s.p["serving"]
    tc, where = target_config(s.p)
    source = Path(s.input("source")).parent  # fetch's lock file sits in the drafter's folder
    draft_bytes = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    ms = serving_steps(
        tc,
        tp=srv["tensor_parallel"],
        batch_sizes=srv["batch_sizes"],
        k_max=depth,
        context=srv["context"],
        draft_bytes=draft_bytes,
        gpu=srv["gpu"],
        where=where,
    )
    note = (
        f"derived for {srv['tensor_parallel']} x {srv['gpu']} a serving instance at a {srv['context']}-token context "
        f"from {where} and the drafter's {draft_bytes / 1e9:.2g} GB (draftport.profile.estimate)"
    )
    return StepTable(ms, "derived", [note])


def _serving(s: StepContext, phases: dict) -> dict:
    """decide's serving inputs (rule R11): the step table (serving.step_table, else the cost model's
    figures at eval.k), the batch sizes, each drafter's trained depth and the names to serve it by."""
    srv, k = s.p["serving"], s.p["eval"]["k"]
    depth = max([k] + [int(c["k"]) for ev in phases.values() for c in ((ev.get("per_sample") or {}).get("by_k") or [])])
    if srv["step_table"]:
        table = read_step_table(srv["step_table"])
    elif s.p["world"]["build"]:  # the embedded world: the seeds' figures
        table = seeds_table(s.p["costmodel"], k, depth, srv["ms_per_draft_token"])
    else:
        table = _derived(s, depth)
    pub = s.p["publish"]
    return {
        "table": table,
        "batch_sizes": srv["batch_sizes"],
        "k": k,
        # the recommended drafter's unroll depth in training (Phase 2 continues Phase 1's settings)
        "ttt_steps": {"recommended": s.p["phase1"]["train"]["ttt_steps"]},
        "models": {
            "recommended": pub["repo_id"] or f"artifacts/publish/{pub['folder']}",
            "source": s.p["source"]["repo_id"],
        },
    }


def decision(s: StepContext) -> dict:
    d = s.p["decision"]
    curves = read_json(s.input("curves")) if "curves" in s.inputs else None
    phases = {ph: read_json(s.input(ph)) for ph in PHASES if ph in s.inputs}
    drift = read_json(s.input("drift")) if "drift" in s.inputs else None
    budget = read_json(s.input("budget")) if "budget" in s.inputs else None
    out = decide(
        curves,
        phases,
        costmodel=s.p["costmodel"],
        k=s.p["eval"]["k"],
        drift=drift,
        n_boot=d["n_boot"],
        level=d["level"],
        seed=d["seed"],
        min_gain=d["min_gain"],
        hours=_hours(s, curves),
        serving_tokens_per_day=d["serving_tokens_per_day"],
        phase_n=_phase_n(s, budget),
        **_traffic(phases.get("phase0") or {}, d),
        serving=_serving(s, phases),
        train_prompts=s.p["targets"]["prompts_train"],
    )
    if budget is not None:  # data.budget adaptive: where the rounds stopped, and why
        out["data_budget"] = {
            **{key: budget[key] for key in ("stop", "why", "n_samples", "factor", "min_gain", "cap")},
            "rounds": [{key: v for key, v in row.items() if key != "per_sample"} for row in budget["rounds"]],
        }
    write_json(s.path("decision.json"), out)
    text = render_text(out)
    s.path("decision.txt").write_text(text + ("" if text.endswith("\n") else "\n"))
    print(text)
    r = out["recommendation"]
    metrics = {
        "init_source": int(r["init"] == "source"),
        "init_scratch": int(r["init"] == "scratch"),
        "confidence": {"low": 0, "medium": 1, "high": 2}[r["confidence"]],
        "deploy_source_now": int(bool(r["deploy_source_now"])),
        "recipe_plain": int(r["recipe"] == "plain"),
    }
    if r["regenerate"] is not None:
        metrics["regenerate"] = int(r["regenerate"])
    for key in ("n_samples", "n_enough"):
        if r.get(key) is not None:
            metrics[key] = r[key]
    if (r.get("chosen") or {}).get("hours"):
        metrics["chosen_device_hours"] = r["chosen"]["hours"]["total"]
    if (r.get("payback") or {}).get("days") is not None:
        metrics["payback_days"] = r["payback"]["days"]
    return metrics
