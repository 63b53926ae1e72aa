"""The learning curves: fine-tune and scratch at several new-target sample counts, several seeds
each, under one budget rule; trained in `train_curves`, measured in `eval_curves` (so evaluation
settings retrain nothing). Every point reads a prefix of one capture: Phase 1's samples, then
Phase 2's (data.shards.FeatureChain), never a capture of its own. MLflow: the step's run `curves` is
the parent of one nested run per point (tags init, n_samples, seed)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from draftport.evaluation.accept import evaluate_drafter
from draftport.pipeline.runner import RUNS_DIR, StepContext, checkpoints, read_json, write_json
from draftport.pipeline.tracking import PhaseRun, tracking_uri
from draftport.plan.curves import budget_steps, points
from draftport.plan.params import TrainConfig

POINT_RUNS = Path(RUNS_DIR, "train_curves.points.json")  # nested runs' ids (outside artifacts/)


def _child_run(s: StepContext, pt: dict):
    """A nested MLflow run of the step's run for one point."""
    profile = s.p["profile"]
    run = PhaseRun(profile, f"curves {pt['init']} n={pt['n_samples']} seed={pt['seed']}", tags={
        "mlflow.parentRunId": s.run.run_id, "init": pt["init"], "n_samples": pt["n_samples"],
        "seed": pt["seed"], "draftport.step": s.name})
    return run


def train_curves(s: StepContext) -> dict:
    """Train every point (init x n x seed) on the first n samples of Phase 1's + Phase 2's
    capture; a killed step resumes: finished points continue from their last checkpoint (0 steps
    left), the interrupted one from its own."""
    # lazy (registry): eval_curves runs this module and trains nothing
    from draftport.training.phases import train_phase
    from draftport.training.loop import init_distributed
    from draftport.pipeline.steps.train_steps import monitor_of, online_of

    rank, _ = init_distributed()  # under torchrun every rank trains each point on its slice of the batch
    c = s.p["curves"]
    feats = [s.input("features"), s.input("features_phase2")]
    runs = {}
    out = []
    pts = points(c)
    for i, pt in enumerate(pts, 1):
        steps = budget_steps(pt["n_samples"], c)
        cfg = TrainConfig(**{**c["train"], "steps": steps, "seed": pt["seed"],
                             "checkpoint_every": min(c["train"]["checkpoint_every"], steps)})
        kw = dict(features_dir=feats, n_samples=pt["n_samples"], target_dir=s.input("target"),
                  vocab_path=s.input("vocab"), init=pt["init"], source_dir=s.input("source"), train_cfg=cfg,
                  monitor=monitor_of(s, cfg), ckpt_dir=checkpoints(s.name) / pt["name"],
                  verifier=s.p["targets"]["new"], **online_of(s, f"{s.name}-{pt['name']}"))
        if rank > 0:  # rank 0 writes the files, logs and checkpoints
            with tempfile.TemporaryDirectory(prefix=f".{s.name}-rank{rank}-") as scratch:
                train_phase(scratch, logger=None, progress=False, **kw)
            continue
        print(f"curves: point {i}/{len(pts)}: {pt['init']} n={pt['n_samples']} seed={pt['seed']}, {steps} steps",
              flush=True)
        child = _child_run(s, pt) if s.run is not None else None
        if child is not None:
            child.log_params({"init": pt["init"], "n_samples": pt["n_samples"], "seed": pt["seed"],
                              "train_steps": steps, **{f"train.{k}": v for k, v in cfg.model_dump().items()}})
            runs[pt["name"]] = child.run_id
        rep = train_phase(s.path("points", pt["name"]), logger=child.background() if child else None,
                          progress=True, **kw)
        if child is not None:
            child.finish(ok=True)
        out.append({**pt, "dir": f"points/{pt['name']}", "train_steps": rep["train_steps"],
                    "stopped_early": rep["stopped_early"], "curve": rep["curve"],
                    "final_loss": rep["final"].get("loss")})
    if rank > 0:
        return {}
    if runs:
        write_json(POINT_RUNS, {"uri": s.run.uri, "runs": runs})
    write_json(s.path("points.json"), {"budget": {"rule": "same epochs", "epochs": c["epochs"],
                                                  "min_steps": c["min_steps"], "max_steps": c["train"]["steps"],
                                                  "patience": c["train"]["patience"]},
                                       "points": out})
    return {"points": len(out), "steps_total": sum(p["train_steps"] for p in out),
            "stopped_early": sum(bool(p["stopped_early"]) for p in out)}


def _point_run(s: StepContext, pt: dict, recorded: dict):
    if recorded.get("uri") == tracking_uri() and pt["name"] in recorded.get("runs", {}):
        try:
            return PhaseRun.attach(recorded["runs"][pt["name"]], where=POINT_RUNS)
        except Exception:  # the run is gone (another store, a deleted experiment): a new child
            pass
    return _child_run(s, pt)


def eval_curves(s: StepContext) -> dict:
    """Every point's drafter on the new target's held-out set, drafted as an engine drafts;
    curves.json holds each point's tau and its per-prompt counts (the decision's bootstrap)."""
    # lazy (registry): train_curves runs this module without evaluation.decision
    from draftport.evaluation.decision import tau_ci

    e = s.p["eval"]
    trained = read_json(s.input("points"))
    root = Path(s.input("points")).parent
    recorded = json.loads(POINT_RUNS.read_text()) if POINT_RUNS.is_file() else {}
    res_points = []
    for i, pt in enumerate(trained["points"], 1):
        res = evaluate_drafter(root / pt["dir"] / "drafter", s.input("target"), s.input("features"), k=e["k"],
                               batch_size=e["batch_size"], max_samples=e["max_samples"])
        ci = tau_ci([res["per_sample"]["accepted"]], [res["per_sample"]["cycles"]], n_boot=1000)["ci"]
        print(f"curves: {i}/{len(trained['points'])} {pt['init']} n={pt['n_samples']} seed={pt['seed']}: "
              f"tau {res['accept_length']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]", flush=True)
        if s.run is not None:
            run = _point_run(s, pt, recorded)
            run.log_metrics({"accept_length": res["accept_length"], "accept_length_ci_low": ci[0],
                             "accept_length_ci_high": ci[1], "simulated_acc_len": res["simulated_acc_len"],
                             "acceptance_rate": res["acceptance_rate"]}, step=pt["train_steps"])
            run.finish(ok=True)
        res_points.append({k: pt[k] for k in ("init", "n_samples", "seed", "train_steps", "stopped_early", "curve")}
                          | {"accept_length": res["accept_length"], "ci": ci, "per_sample": res["per_sample"]})
    c = s.p["curves"]
    write_json(s.path("curves.json"), {"n_samples": c["n_samples"], "seeds": c["seeds"], "inits": c["inits"],
                                       "budget": trained["budget"], "eval_samples": res["eval_samples"],
                                       "k": e["k"], "points": res_points})
    out: dict = {}
    for pt in res_points:  # the seeds' mean per (init, n): MLflow's compare view and DVC metrics
        out.setdefault(pt["init"], {}).setdefault(f"n{pt['n_samples']}", []).append(pt["accept_length"])
    return {init: {n: sum(v) / len(v) for n, v in d.items()} for init, d in out.items()}
