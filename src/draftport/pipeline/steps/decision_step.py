"""The decision step: which init, recipe and answers, how much data, whether Phase 2 pays, and
the hours, with bootstrap CIs (draftport.evaluation.decision: its rules R1-R8, docs/decision.md;
the hours: draftport.evaluation.hours, measured by the steps) -> decision.json, decision.txt."""

from __future__ import annotations

from draftport.evaluation.decision import decide, render_text
from draftport.evaluation.hours import devices, rates, split
from draftport.pipeline.runner import StepContext, read_json, write_json

PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")


def _hours(s: StepContext, curves: dict | None) -> dict:
    """The measured device-hours: the rates per sample, each phase's split (the control: its
    training; Phase 1's data counted in phase1), the plan's (its training data, every training,
    the curves; the held-out sets and the evaluations not counted)."""
    res = s.p["resources"]
    data = {st: read_json(s.input(f"data_{st}")) for st in ("features_new", "features_phase2", "features_dataset")
            if f"data_{st}" in s.inputs}
    r = {**rates(data, res), "source": "wall seconds of this run's steps x GPUs"}
    train = {ph: float(read_json(s.input(f"train_{ph}")).get("seconds") or 0.0) * devices(res, f"train_{ph}")
             for ph in ("phase1_scratch", "phase1", "phase2")}
    n1 = data["features_new"]["train"]["samples"]
    n2 = n1 + (data["features_phase2"]["train"]["samples"] if "features_phase2" in data else 0)
    phases = {"phase1": split(n1, train["phase1"], r), "phase1_scratch": split(0, train["phase1_scratch"], r),
              "phase2": split(n2 - n1, train["phase2"], r)}
    curve_train = sum(float(p.get("train_seconds") or 0.0) for p in (curves or {}).get("points", [])) \
        * devices(res, "train_curves")
    dataset = split(data["features_dataset"]["train"]["samples"], 0.0, r, "dataset") if "features_dataset" in data \
        else {"regenerate": 0.0, "capture": 0.0, "train": 0.0, "total": 0.0}
    plan = {key: sum(h[key] for h in phases.values()) + dataset[key] for key in ("regenerate", "capture", "train")}
    plan["train"] += curve_train / 3600
    plan["curves"] = curve_train / 3600 + dataset["total"]
    plan["total"] = plan["regenerate"] + plan["capture"] + plan["train"]
    return {"rates": r, "phases": phases, "plan": plan}


def decision(s: StepContext) -> dict:
    d = s.p["decision"]
    curves = read_json(s.input("curves")) if "curves" in s.inputs else None
    phases = {ph: read_json(s.input(ph)) for ph in PHASES if ph in s.inputs}
    drift = read_json(s.input("drift")) if "drift" in s.inputs else None
    out = decide(curves, phases, costmodel=s.p["costmodel"], k=s.p["eval"]["k"], drift=drift,
                 n_boot=d["n_boot"], level=d["level"], seed=d["seed"], min_gain=d["min_gain"],
                 hours=_hours(s, curves), serving_tokens_per_day=d["serving_tokens_per_day"])
    write_json(s.path("decision.json"), out)
    text = render_text(out)
    s.path("decision.txt").write_text(text + ("" if text.endswith("\n") else "\n"))
    print(text)
    r = out["recommendation"]
    metrics = {"init_source": int(r["init"] == "source"), "init_scratch": int(r["init"] == "scratch"),
               "confidence": {"low": 0, "medium": 1, "high": 2}[r["confidence"]],
               "deploy_source_now": int(bool(r["deploy_source_now"])),
               "recipe_plain": int(r["recipe"] == "plain")}
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
