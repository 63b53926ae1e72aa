"""The learning curves measured (step `eval_curves`): every point train_curves saved, drafted on
the new target's held-out sets as an engine drafts; curves.json holds each point's tau, CI and
per-prompt counts (the decision's bootstrap), each point's figures go to its nested MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

from draftport.evaluation.accept import evaluate_drafter
from draftport.evaluation.bootstrap import tau_ci
from draftport.evaluation.traffic import strata_of
from draftport.pipeline.runner import StepContext, read_json, write_json
from draftport.pipeline.steps.points import POINT_RUNS, map_points, point_run, visible_gpus, workers


def _eval_point(job: dict) -> dict:
    """One point's drafter on the held-out features (in the step's process or a worker's)."""
    return evaluate_drafter(job["drafter"], job["target"], job["features"], **job["kw"])


def eval_jobs(jobs: list[dict], device: str):
    """Each job's evaluation, yielded in the jobs' order as they finish: on the CPU as many at once
    as the step has threads (one thread each: the same floats as one process), on GPUs one per GPU."""
    gpus = visible_gpus(device)
    n_workers = workers(len(jobs), 1, gpus)
    if n_workers == 1:
        yield from map(_eval_point, jobs)
        return
    where = f"one per GPU ({', '.join(gpus[:n_workers])})" if gpus else "one thread each"
    print(f"curves: {len(jobs)} points evaluated, {n_workers} at a time ({where})", flush=True)
    yield from map_points(_eval_point, jobs, n_workers, gpus)


POINT_KEYS = ("arm", "init", "answers", "recipe", "n_samples", "seed", "train_steps", "stopped_early", "curve")


def _log_point(s: StepContext, pt: dict, recorded: dict, res: dict, ci: list) -> None:
    """A point's figures (and each eval set's accept length) in its MLflow child run."""
    run = point_run(s, pt, recorded)
    run.log_metrics(
        {
            "accept_length": res["accept_length"],
            "accept_length_ci_low": ci[0],
            "accept_length_ci_high": ci[1],
            "simulated_acc_len": res["simulated_acc_len"],
            "acceptance_rate": res["acceptance_rate"],
            **{
                f"accept_length/{name}": v["accept_length"]
                for name, v in res["by_set"].items()
                if v["accept_length"] is not None
            },
        },
        step=pt["train_steps"],
    )
    run.finish(ok=True)


def _point_record(pt: dict, res: dict, ci: list) -> dict:
    """A point's row of curves.json: what it is, its tau and CI, its per-prompt counts and eval sets."""
    return {key: pt[key] for key in POINT_KEYS if key in pt} | {
        "accept_length": res["accept_length"],
        "ci": ci,
        "per_sample": res["per_sample"],
        "sets": res["sets"],
    }


def eval_curves(s: StepContext) -> dict:
    """Every point's drafter on the new target's held-out set, drafted as an engine drafts;
    curves.json holds each point's tau and its per-prompt counts (the decision's bootstrap)."""
    e = s.p["eval"]
    trained = read_json(s.input("points"))
    root = Path(s.input("points")).parent
    recorded = json.loads(POINT_RUNS.read_text()) if POINT_RUNS.is_file() else {}
    res_points = []
    kw = dict(
        k=e["k"],
        batch_size=e["batch_size"],
        max_samples=e["max_samples"],
        device=e["device"],
        buckets=e.get("context_buckets"),
        k_max=e["k_max"],  # every chain depth from one pass: R2's break-even at the best configuration
    )
    jobs = [
        {
            "drafter": root / pt["dir"] / "drafter",
            "target": s.input("target"),
            "features": s.input("features"),
            "kw": kw,
        }
        for pt in trained["points"]
    ]
    for i, (pt, res) in enumerate(zip(trained["points"], eval_jobs(jobs, e["device"])), 1):
        s.timing.setdefault("points_run", {})[pt["name"]] = res.pop("run")
        ci = tau_ci(
            [res["per_sample"]["accepted"]],
            [res["per_sample"]["cycles"]],
            n_boot=1000,
            strata=strata_of(res["sets"]),  # more than one eval set: the traffic-weighted figure's CI
        )["ci"]
        print(
            f"curves: {i}/{len(trained['points'])} {pt.get('arm', pt['init'])} n={pt['n_samples']} seed={pt['seed']}: "
            f"tau {res['accept_length']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]",
            flush=True,
        )
        if s.run is not None:
            _log_point(s, pt, recorded, res, ci)
        res_points.append(_point_record(pt, res, ci))
    c = s.p["curves"]
    write_json(
        s.path("curves.json"),
        {
            "n_samples": c["n_samples"],
            "seeds": c["seeds"],
            "inits": c["inits"],
            "arms_n_samples": c["arms_n_samples"],
            "recipes": c["recipes"],
            "budget": trained["budget"],
            "eval_samples": res["eval_samples"],
            "k": e["k"],
            "points": res_points,
        },
    )
    out: dict = {}
    for pt in res_points:  # the seeds' mean per (init, n): MLflow's compare view and DVC metrics
        out.setdefault(pt.get("arm", pt["init"]), {}).setdefault(f"n{pt['n_samples']}", []).append(pt["accept_length"])
    return {init: {n: sum(v) / len(v) for n, v in d.items()} for init, d in out.items()}
