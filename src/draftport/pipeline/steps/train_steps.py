"""The training steps: each makes one drafter for the new target (drafter/, its loss history),
logged live to the phase's MLflow run. Evaluation is a step of its own (steps.eval_steps), so
evaluation settings never retrain a drafter."""

from __future__ import annotations

import csv
import json
import tempfile
import time

from draftport.data.capture import trusted
from draftport.errors import DraftportError
from draftport.model.device import pick as pick_device
from draftport.pipeline.runner import StepContext, checkpoints, read_json
from draftport.plan.params import TrainConfig
from draftport.training.loop import dist_info, init_distributed
from draftport.training.phases import train_phase


def _train(s: StepContext, group: str, *, init, vocab_policy: str = "remap") -> dict:
    """Train, save drafter/ (flat format), train_history.json and history.csv; the metrics."""
    cfg = TrainConfig(**s.p[group]["train"])
    pick_device(cfg.device, f"{group}.train.device")  # cuda without a GPU: refused before any work
    if init == "scratch":  # the control: the group's budget without its port recipes (no weights to anchor or keep)
        cfg = cfg.model_copy(update={"l2sp_lambda": 0.0, "freeze": []})
    kw = dict(
        features_dir=s.input("features"),
        target_dir=s.input("target"),
        vocab_path=s.input("vocab"),
        init=init,
        source_dir=s.input("source"),
        vocab_policy=vocab_policy,
        train_cfg=cfg,
        ckpt_dir=checkpoints(s.name),
        monitor=monitor_of(s, cfg),
        verifier=s.p["targets"]["new"],
        **online_of(s),
    )
    rank, _ = init_distributed(cfg.device)  # under torchrun: every rank trains on its slice of each batch
    if rank > 0:  # the same run, its files written by rank 0 (checkpoints: shared ckpt_dir)
        with tempfile.TemporaryDirectory(prefix=f".{s.name}-rank{rank}-") as scratch:
            train_phase(scratch, logger=None, progress=False, **kw)
        return {}
    t0 = time.perf_counter()
    rep = train_phase(s.dir, logger=s.run.background() if s.run else None, progress=True, **kw)
    seconds = round(time.perf_counter() - t0, 3)
    hist = json.loads(s.path("train_history.json").read_text())
    cols = ["step", "loss", "acc_0", "lr", "accept_length"]  # accept_length: held-out tau, at eval steps
    with open(s.path("history.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for h in hist:
            w.writerow([h.get(c, "") for c in cols])
    fin = rep.get("final", {})
    out = {
        "train_processes": dist_info()[1],  # > 1 under torchrun (resources.<rule>.torchrun)
        "train_steps": rep["train_steps"],
        "final_loss": fin.get("loss"),
        "final_acc_0": fin.get("acc_0"),
        "resumed_from_step": rep["resumed_from_step"],
    }
    s.timing["train_seconds"] = seconds  # this run's own part after a resume; the decision's hours
    s.record_run("train", rep.get("run"), step=rep["train_steps"])
    if rep["curve"]:  # the held-out tau by step (DVC plots read curve.csv)
        out.update(
            held_out_accept_length=rep["curve"][-1]["accept_length"],
            best_held_out_accept_length=max(c["accept_length"] for c in rep["curve"]),
            stopped_early=rep["stopped_early"],
        )
        with open(s.path("curve.csv"), "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["step", "accept_length"])
            w.writerows([c["step"], c["accept_length"]] for c in rep["curve"])
    if "vocab" in rep:
        out["lm_head_rows_kept"] = rep["vocab"].get("kept_rows")
        out["lm_head_rows_new"] = rep["vocab"].get("new_rows")
    print(f"{s.name}: {rep['train_steps']} steps in {rep['train_seconds']:.1f} s, final loss {fin.get('loss')}")
    return {k: v for k, v in out.items() if v is not None}


def online_of(s: StepContext, name: str | None = None) -> dict:
    """train_phase's spool settings (used when the features are stored online / hybrid): the
    bound features.spool_gb, in features.spool_dir/<step> or beside the step's checkpoints."""
    f = s.p["features"]
    name = name or s.name
    sdir = f"{f['spool_dir'].rstrip('/')}/{name}" if f["spool_dir"] else None
    return {
        "spool": {"gb": f["spool_gb"], "dir": sdir},
        "trust_remote_code": trusted(s.input("target"), s.p["targets"]["trust_remote_code"]),
    }


def monitor_of(s: StepContext, cfg) -> dict | None:
    """train_phase's monitor when the train group asks for held-out tau (eval_every > 0)."""
    if not cfg.eval_every:
        return None
    m = s.p["monitor"]
    return {"features": s.input("monitor"), "k": m["k"], "batch_size": m["batch_size"]}


def train_phase1_scratch(s: StepContext) -> dict:
    """The control: the same architecture, data and budget as Phase 1, from a random init on the
    new map: what fine-tuning the source must beat (Phase 1's port recipes, l2sp_lambda and
    freeze, do not apply to random weights: the control trains without them)."""
    return _train(s, "phase1", init="scratch")


def train_phase1(s: StepContext) -> dict:
    """Fine-tune the source drafter on the new target's data (its lm_head moved onto the new map
    by target id, or the source map kept: phase1.vocab_policy)."""
    verdict = read_json(s.input("compare"))["verdict"]
    if not verdict["compatible_architecture"]:
        raise DraftportError(
            "compare", "the source drafter does not load into the new layout: " + "; ".join(verdict["reasons"])
        )
    return _train(s, "phase1", init="source", vocab_policy=s.p["phase1"]["vocab_policy"])


def train_phase2(s: StepContext) -> dict:
    """Continue Phase 1's drafter (its map kept) on the scaled data."""
    return _train(s, "phase2", init=str(s.input("init")))
