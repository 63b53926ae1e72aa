"""The decision step: which init, how much data, whether Phase 2 pays, with bootstrap CIs
(draftport.evaluation.decision: its rules R1-R6, docs/decision.md) -> decision.json, decision.txt."""

from __future__ import annotations

from draftport.evaluation.decision import decide, render_text
from draftport.pipeline.runner import StepContext, read_json, write_json

PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")


def decision(s: StepContext) -> dict:
    d = s.p["decision"]
    curves = read_json(s.input("curves")) if "curves" in s.inputs else None
    phases = {ph: read_json(s.input(ph)) for ph in PHASES if ph in s.inputs}
    drift = read_json(s.input("drift")) if "drift" in s.inputs else None
    out = decide(curves, phases, costmodel=s.p["costmodel"], k=s.p["eval"]["k"], drift=drift,
                 n_boot=d["n_boot"], level=d["level"], seed=d["seed"], min_gain=d["min_gain"])
    write_json(s.path("decision.json"), out)
    text = render_text(out)
    s.path("decision.txt").write_text(text + ("" if text.endswith("\n") else "\n"))
    print(text)
    r = out["recommendation"]
    metrics = {"init_source": int(r["init"] == "source"), "init_scratch": int(r["init"] == "scratch"),
               "confidence": {"low": 0, "medium": 1, "high": 2}[r["confidence"]],
               "deploy_source_now": int(bool(r["deploy_source_now"]))}
    for key in ("n_samples", "n_enough"):
        if r.get(key) is not None:
            metrics[key] = r[key]
    return metrics
