"""The adaptive data budget (data.budget adaptive; the step replaces features_phase2): Phase 2's data
captured in rounds, n grown by data.factor from Phase 1's, each round's n trained (the source
fine-tuned, data.seeds, the curves' budget rule and curves.train) and scored on the new target's
held-out set; the rounds stop when the next one's projected gain cannot reach decision.min_gain,
at the cap (phase2.n_samples) or at data.max_hours (draftport.evaluation.budget). Phase 2 then
trains on what was captured: train/ is a chain folder of the rounds' captures.

Rounds resume: each one lives under checkpoints/budget/r<k>/ (its capture, its trainings'
checkpoints) and is done once its round.json is written; a killed step redoes only the unfinished
round (its trainings from their last checkpoint), a round made under other values is redone. MLflow:
the step's run `budget` logs each round's figures with the round as the step."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from draftport.data.fetch import place
from draftport.data.shards import write_chain
from draftport.evaluation.accept import evaluate_drafter
from draftport.evaluation.budget import explain, next_n, project_next_gain, stop_reason
from draftport.evaluation.hours import devices
from draftport.evaluation.traffic import strata_of
from draftport.pipeline.runner import StepContext, checkpoints, read_json, write_json
from draftport.plan.cluster import rule_resources
from draftport.plan.curves import train_config
from draftport.plan.params import TrainConfig


def _fingerprint(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _link_tree(src: Path, dst: Path) -> None:
    """dst as src's files hard-linked (a copy across file systems): the round's capture stays in
    checkpoints/ until the step has finished."""
    shutil.copytree(src, dst, copy_function=place)


def _round(s: StepContext, k: int, n_prev: int, n: int, parts: list[Path], root: Path) -> dict:
    """Round k: capture prompts [n_prev, n) (k > 0), train every seed at n, score each one."""
    # lazy (registry): the features step's capture and the training run only here
    from draftport.pipeline.steps.curve_steps import train_jobs, train_jobs_torchrun
    from draftport.training.loop import init_distributed

    d = s.p["data"]
    rdir = root / f"r{k}"
    spec = _round_spec(s, n_prev, n, parts)
    fp, done = _fingerprint(spec), rdir / "round.json"
    if done.is_file() and json.loads(done.read_text()).get("spec") == fp:
        print(f"budget: round {k} (n = {n:,}) finished before: kept", flush=True)
        return json.loads(done.read_text())
    _begin(rdir, k, fp)
    timing = {"samples": 0, "regenerate": 0.0, "capture": 0.0}
    if k > 0:
        timing = _capture(s, rdir, k, n_prev, n)
        parts = [*parts, rdir / "data"]
    _, world = init_distributed(spec["train"][d["seeds"][0]].get("device", "auto"))
    jobs = _jobs(s, k, n, parts, rdir, spec)
    launch = rule_resources(s.p, s.name)
    trained = train_jobs_torchrun(jobs, launch["gpu"]) if launch["torchrun"] else train_jobs(jobs, world)[0]
    acc, cyc, taus, sets = _scores(s, jobs)
    rec = {
        "spec": fp,
        "round": k,
        "n_samples": n,
        "offset": n_prev,
        "seeds": d["seeds"],
        "seed_taus": taus,
        "train_steps": [t["train_steps"] for t in trained],
        "train_processes": [t.get("processes", 1) for t in trained],
        "accepted": acc,
        "cycles": cyc,
        "sets": sets,
        "seconds": {**timing, "train": sum(t["train_seconds"] for t in trained)},
    }
    shutil.rmtree(rdir / "drafters", ignore_errors=True)  # the round's figures are what it keeps
    done.write_text(json.dumps(rec) + "\n")
    return rec


def _round_spec(s: StepContext, n_prev: int, n: int, parts: list[Path]) -> dict:
    """What a round computes with: a finished round is kept only when its spec is this one."""
    d, c = s.p["data"], s.p["curves"]
    return {
        "n_samples": n,
        "offset": n_prev,
        "seeds": d["seeds"],
        "features": s.p["features"],
        "train": {seed: train_config(c, {"n_samples": n, "seed": seed, "recipe": "plain"}) for seed in d["seeds"]},
        # what a round's scoring reads (chains of eval.k): eval.k_max and eval.trees edits rerun no round
        "eval": {key: v for key, v in s.p["eval"].items() if key not in ("k_max", "trees")},
        "inputs": [_fingerprint(read_json(Path(p) / "index.json")) for p in parts],
    }


def _begin(rdir: Path, k: int, fp: str) -> None:
    """A round's folder, marked with its spec: one begun under other values is begun again."""
    mark = rdir / "spec.json"
    if rdir.exists() and (not mark.is_file() or json.loads(mark.read_text()) != fp):
        print(f"budget: round {k} was begun under other values: begun again", flush=True)
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True, exist_ok=True)
    mark.write_text(json.dumps(fp) + "\n")


def _capture(s: StepContext, rdir: Path, k: int, n_prev: int, n: int) -> dict:
    """Round k's data: prompts [n_prev, n) regenerated and captured (kept when a killed round had
    finished it); -> its seconds."""
    # lazy (registry): the features step's capture runs only here
    from draftport.pipeline.steps.data_steps import _features

    data = rdir / "data"
    if (data / "index.json").is_file():  # a killed capture left no folder (atomic): captured again
        return json.loads((rdir / "capture.json").read_text())
    print(f"budget: round {k}: regenerating and capturing prompts {n_prev:,}..{n:,}", flush=True)
    _features(s, data, s.input("target"), s.p["targets"]["prompts_train"], n=n - n_prev, offset=n_prev, training=True)
    timing = dict(s.timing.pop("data"))  # _features records the capture's seconds by its folder's name
    (rdir / "capture.json").write_text(json.dumps(timing) + "\n")
    return timing


def _jobs(s: StepContext, k: int, n: int, parts: list[Path], rdir: Path, spec: dict) -> list[dict]:
    """One training job per seed: the source fine-tuned on the first n samples of the captures."""
    from draftport.pipeline.steps.train_steps import monitor_of, online_of

    seeds = s.p["data"]["seeds"]
    jobs = []
    for i, seed in enumerate(seeds, 1):
        tc = spec["train"][seed]
        name = f"round{k}_n{n}_s{seed}"
        pt = {
            "name": name,
            "arm": "source",
            "init": "source",
            "answers": "regenerated",
            "recipe": "plain",
            "n_samples": n,
            "seed": seed,
        }
        kw = dict(
            features_dir=[str(p) for p in parts],
            n_samples=n,
            target_dir=s.input("target"),
            vocab_path=s.input("vocab"),
            init="source",
            source_dir=s.input("source"),
            monitor=monitor_of(s, TrainConfig(**tc)),
            ckpt_dir=rdir / "ckpt" / f"s{seed}",
            verifier=s.p["targets"]["new"],
            **online_of(s, f"{s.name}-{name}"),
        )
        jobs.append(
            {
                "i": i,
                "of": len(seeds),
                "point": pt,
                "kw": kw,
                "train": tc,
                "label": f"budget round {k}",
                "out": str(rdir / "drafters" / f"s{seed}"),
                "profile": s.p["profile"],
                "parent": None,
                "step": s.name,
            }
        )
    return jobs


def _scores(s: StepContext, jobs: list[dict]) -> tuple[list, list, list, list]:
    """Each seed's drafter on the new target's held-out set: (accepted, cycles per prompt, tau, the eval sets)."""
    e = s.p["eval"]
    acc, cyc, taus, sets = [], [], [], []
    for j in jobs:
        res = evaluate_drafter(
            Path(j["out"]) / "drafter",
            s.input("target"),
            s.input("eval"),
            k=e["k"],
            batch_size=e["batch_size"],
            max_samples=e["max_samples"],
            device=e["device"],
            buckets=e.get("context_buckets"),
        )
        acc.append(res["per_sample"]["accepted"])
        cyc.append(res["per_sample"]["cycles"])
        taus.append(res["accept_length"])
        sets = res["sets"]
    return acc, cyc, taus, sets


def budget(s: StepContext) -> dict:
    d, dec = s.p["data"], s.p["decision"]
    n1, cap = s.p["phase1"]["n_samples"], s.p["phase2"]["n_samples"]
    dev = devices(s.p["resources"], s.name)
    root = checkpoints(s.name)
    parts: list[Path] = [s.input("features")]
    rounds, hours = [], 0.0
    n_prev, n = 0, n1
    while True:
        k = len(rounds)
        rec = _round(s, k, n_prev, n, parts, root)
        if k > 0:
            parts.append(root / f"r{k}" / "data")
        rounds.append(rec)
        sec = rec["seconds"]
        hours += (sec["regenerate"] + sec["capture"] + sec["train"]) * dev / 3600
        row, proj, nn, next_h, reason = _next(s, rounds, n, cap, hours, dev)
        if s.run is not None:
            s.run.log_metrics({**{key: v for key, v in row.items() if key != "round"}, "device_hours": hours}, step=k)
        rec["row"] = row
        if reason is not None:
            break
        n_prev, n = n, nn
    why = explain(
        reason,
        n=n,
        projection=proj,
        min_gain=dec["min_gain"],
        next_n_=nn,
        hours_spent=hours,
        next_hours=next_h,
        max_hours=d["max_hours"],
    )
    print(f"budget: {why}", flush=True)
    _write(s, rounds, root, n1, n, cap, reason, why, dev)
    return {"n_samples": n, "rounds": len(rounds), "stopped_flattened": int(reason == "flattened")}


def _next(s: StepContext, rounds: list[dict], n: int, cap: int, hours: float, dev: int) -> tuple:
    """The last round's row (n, tau, its gain and the next round's projected gain), the next n, the
    next round's hours and why the rounds stop (None: go on)."""
    d, dec = s.p["data"], s.p["decision"]
    k, rec = len(rounds) - 1, rounds[-1]
    sec = rec["seconds"]
    tau = sum(rec["seed_taus"]) / len(rec["seed_taus"])
    row = {"round": k, "n_samples": n, "accept_length": tau}
    if k == 0:
        proj, nn, next_h, reason = None, next_n(n, d["factor"], cap), 0.0, None
    else:
        # at the cap, what one more round would still have bought (the text: "still rising")
        nn = next_n(n, d["factor"], cap) if n < cap else next_n(n, d["factor"], 2 * n + 1)
        strata = strata_of(rec.get("sets") or [])  # eval sets: the traffic-weighted gain
        proj = project_next_gain(rounds, nn, n_boot=dec["n_boot"], level=dec["level"], seed=dec["seed"], strata=strata)
        per_sample = (sec["regenerate"] + sec["capture"]) * dev / max(1, sec["samples"])
        steps = train_config(s.p["curves"], {"n_samples": nn, "seed": 0, "recipe": "plain"})["steps"]
        next_h = ((nn - n) * per_sample + sec["train"] * dev * steps / max(1, rec["train_steps"][0])) / 3600
        reason = stop_reason(
            proj,
            n=n,
            cap=cap,
            min_gain=dec["min_gain"],
            hours_spent=hours,
            next_hours=next_h,
            max_hours=d["max_hours"],
        )
        row.update(
            gain=proj["gains"][-1],
            projected_gain=proj["projected_gain"],
            projected_gain_ci_low=proj["ci"][0],
            projected_gain_ci_high=proj["ci"][1],
        )
    print(
        f"budget: round {k}: n = {n:,}, tau {tau:.3f}"
        + (
            f", gain {row['gain']:+.3f}, next round (n = {nn:,}) projects {proj['projected_gain']:+.3f} "
            f"[{proj['ci'][0]:+.3f}, {proj['ci'][1]:+.3f}]"
            if proj
            else ""
        )
        + f"; {hours:.3g} device-h so far",
        flush=True,
    )
    return row, proj, nn, next_h, reason


def _write(s: StepContext, rounds: list[dict], root: Path, n1: int, n: int, cap: int, reason, why: str, dev: int):
    """Phase 2's data as a chain of the rounds' captures, the rounds' seconds, budget.json."""
    d, dec = s.p["data"], s.p["decision"]
    names = []
    for r in rounds[1:]:  # the captures: Phase 2's data, one part per round
        names.append(f"r{r['round']}")
        _link_tree(root / names[-1] / "data", s.path("train", names[-1]))
    idx = [read_json(s.path("train", p, "index.json")) for p in names]
    write_chain(
        s.path("train"),
        names,
        {
            "samples": sum(i["samples"] for i in idx),
            "tokens": sum(i["tokens"] for i in idx),
            "samples_file": idx[0].get("samples_file"),
            "offset": n1,
            "regenerated": idx[0].get("regenerated"),
        },
    )
    sec = [r["seconds"] for r in rounds]
    s.timing["train"] = {key: sum(x[key] for x in sec) for key in ("samples", "regenerate", "capture")}
    s.timing["rounds_train_seconds"] = sum(x["train"] for x in sec) * dev  # device-seconds of the rounds' trainings
    write_json(
        s.path("budget.json"),
        {
            "rule": "project the next round's gain from the last two slopes per e-fold of n; stop when its upper CI "
            "bound < decision.min_gain, at phase2.n_samples, or at data.max_hours",
            "factor": d["factor"],
            "seeds": d["seeds"],
            "min_gain": dec["min_gain"],
            "cap": cap,
            "max_hours": d["max_hours"],
            "level": dec["level"],
            "stop": reason,
            "why": why,
            "n_samples": n,
            "rounds": [
                {
                    **r["row"],
                    "seed_taus": r["seed_taus"],
                    "train_steps": r["train_steps"],
                    "train_processes": r["train_processes"],
                    "per_sample": {"accepted": r["accepted"], "cycles": r["cycles"]},
                }
                for r in rounds
            ],
        },
    )
