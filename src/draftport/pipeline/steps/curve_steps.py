"""The learning curves' trainings: every arm (plain fine-tuning and scratch at several new-target
sample counts; the dataset-answers and recipe arms at curves.arms_n_samples) with several seeds
each, under one budget rule (step `train_curves`; `eval_curves`, in curve_eval_steps, measures
them, so evaluation settings and code retrain nothing). A regenerated point reads a prefix of one
capture: Phase 1's samples, then Phase 2's (data.shards.FeatureChain); a dataset point a prefix of
features_dataset's. MLflow: the step's run `curves` is the parent of one nested run per point (tags
arm, init, answers, recipe, n_samples, seed)."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from draftport.pipeline.runner import StepContext, checkpoints, read_json, write_json
from draftport.pipeline.steps.points import POINT_RUNS, child_run, die_with_parent, map_points, visible_gpus, workers
from draftport.plan.curves import DATASET, points, train_config
from draftport.plan.params import TrainConfig


def _train_point(job: dict) -> dict:
    """One point, trained and saved under job["out"] (in the step's process or a worker's)."""
    # lazy (registry): eval_curves runs this module and trains nothing
    from draftport.training.phases import train_phase

    pt, kw = job["point"], dict(job["kw"])
    what = job.get("label", "curves")
    done = finished(job)
    if done is not None:  # a point a killed step had finished
        print(f"{what}: point {job['i']}/{job['of']} ({pt['name']}) finished before", flush=True)
        return done
    cfg = TrainConfig(**job["train"])
    kw["train_cfg"] = cfg
    print(
        f"{what}: point {job['i']}/{job['of']}: {pt['arm']} n={pt['n_samples']} seed={pt['seed']}, {cfg.steps} steps",
        flush=True,
    )
    child = child_run(job["profile"], job["parent"], job["step"], pt) if job["parent"] else None
    if child is not None:
        child.log_params(
            {
                "init": pt["init"],
                "arm": pt["arm"],
                "answers": pt["answers"],
                "recipe": pt["recipe"],
                "n_samples": pt["n_samples"],
                "seed": pt["seed"],
                "train_steps": cfg.steps,
                **{f"train.{k}": v for k, v in cfg.model_dump().items()},
            }
        )
    t0 = time.perf_counter()
    rep = train_phase(job["out"], logger=child.background() if child else None, progress=True, **kw)
    seconds = round(time.perf_counter() - t0, 3)
    print(f"{what}: point {job['i']}/{job['of']} ({pt['name']}) done in {seconds:.1f} s", flush=True)
    if child is not None:
        child.finish(ok=True)
    res = {
        **pt,
        "dir": f"points/{pt['name']}",
        "train_steps": rep["train_steps"],
        "stopped_early": rep["stopped_early"],
        "curve": rep["curve"],
        "final_loss": rep["final"].get("loss"),
        "train_seconds": seconds,
        "run_id": child.run_id if child else None,
        "run": rep["run"],
    }
    # the point's drafter is saved: its record replaces its checkpoints (a drafter's weights and
    # moments, ~6 GB at a real shape each; on a 64 GB GPU node the sixth point filled the disk)
    write_json(done_path(job), {"job": job_key(job), "result": res})
    shutil.rmtree(kw["ckpt_dir"], ignore_errors=True)
    return res


def done_path(job: dict) -> Path:
    """A finished point's record, beside the step's checkpoints (which go once the step finishes)."""
    ckpt = Path(job["kw"]["ckpt_dir"])
    return ckpt.parent / f"{ckpt.name}.done.json"


def job_key(job: dict) -> str:
    """What a point's training depends on: its point, training config, data and init."""
    kw = job["kw"]
    what = {"point": job["point"], "train": job["train"], "init": kw["init"], "n_samples": kw["n_samples"]}
    return json.dumps({**what, "features": [str(f) for f in kw["features_dir"]]}, sort_keys=True, default=str)


def finished(job: dict) -> dict | None:
    """The result of a point a killed step had finished (its record matches the job), else None."""
    try:
        rec = json.loads(done_path(job).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec["result"] if rec.get("job") == job_key(job) else None


def train_jobs(jobs: list[dict], world: int) -> tuple[list[dict], int]:
    """Train every job (_train_point's): on GPUs one at a time per GPU, on the CPU as many at once
    as the step has threads; the results in the jobs' order, and how many trained at once."""
    gpus = visible_gpus(jobs[0]["train"].get("device", "auto")) if jobs else []
    n_workers = workers(len(jobs), world, gpus)
    if n_workers == 1:
        return [_train_point(j) for j in jobs], 1
    what = jobs[0].get("label", "curves")
    where = f"one per GPU ({', '.join(gpus[:n_workers])})" if gpus else "one thread each"
    print(f"{what}: {len(jobs)} points, {n_workers} at a time ({where})", flush=True)
    by_cost = sorted(jobs, key=lambda j: -j["train"]["steps"])  # the longest first: the workers finish together
    done = dict(zip((j["point"]["name"] for j in by_cost), map_points(_train_point, by_cost, n_workers, gpus)))
    return [done[j["point"]["name"]] for j in jobs], n_workers


JOB_PATHS = ("target_dir", "vocab_path", "source_dir", "ckpt_dir")  # a job's kw entries that are paths


def train_jobs_torchrun(jobs: list[dict], nproc: int) -> list[dict]:
    """Each job trained by torchrun over nproc processes (one per GPU, every batch split), one job
    after another: the trainings of a step that is itself one process (budget: it holds the
    capture). A job's file (<out>.job.json) is what the processes read; rank 0 writes the result."""
    import subprocess

    from draftport.errors import DraftportError

    out = []
    for j in jobs:
        f = Path(f"{j['out']}.job.json")
        f.parent.mkdir(parents=True, exist_ok=True)
        write_json(f, j)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "draftport.pipeline.steps.curve_steps",
            str(f),
        ]
        # the agent dies with the step (kill -9 of the step leaves no training writing checkpoints)
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=die_with_parent
        )
        for line in p.stdout:  # through the step's own stdout: its log gets them
            print(line, end="", flush=True)
        if p.wait() != 0:
            raise DraftportError(
                f"training {j['point']['name']}",
                f"torchrun over {nproc} processes exited {p.returncode} (its lines are above in the step's log)",
            )
        out.append(read_json(f"{j['out']}.result.json"))
    return out


def _run_job_file(path: str) -> int:
    """`python -m draftport.pipeline.steps.curve_steps JOB.json` under torchrun: one job, every rank
    training on its slice of each batch; rank 0 writes <out>.result.json."""
    from draftport.training.loop import init_distributed
    from draftport.training.phases import train_phase

    job = read_json(path)
    kw = {k: (Path(v) if k in JOB_PATHS and v is not None else v) for k, v in job["kw"].items()}
    if kw.get("monitor"):
        kw["monitor"] = {**kw["monitor"], "features": Path(kw["monitor"]["features"])}
    rank, world = init_distributed(job["train"].get("device", "auto"))
    if rank > 0:
        if finished(job) is not None:  # rank 0 reads its record and trains nothing either
            return 0
        with tempfile.TemporaryDirectory(prefix=f".curves-rank{rank}-") as scratch:
            train_phase(scratch, logger=None, progress=False, train_cfg=TrainConfig(**job["train"]), **kw)
        return 0
    write_json(f"{job['out']}.result.json", {**_train_point({**job, "kw": kw}), "processes": world})
    return 0


def train_curves(s: StepContext) -> dict:
    """Train every point (arm x n x seed; draftport.plan.curves) on the first n samples of Phase 1's
    + Phase 2's capture (the dataset arms: of features_dataset); on the CPU the step's threads
    train that many points at once. A killed step resumes: finished points are read from their
    records (their checkpoints are gone by then), the interrupted ones continue from their own."""
    # lazy (registry): eval_curves runs this module and trains nothing
    from draftport.model.device import pick as pick_device
    from draftport.training.loop import init_distributed
    from draftport.training.phases import feature_dirs, train_phase

    pick_device(s.p["curves"]["train"].get("device", "auto"), "curves.train.device")  # before any work
    # under torchrun every rank trains each point on its slice of the batch
    rank, world = init_distributed(s.p["curves"]["train"].get("device", "auto"))
    c = s.p["curves"]
    regenerated = feature_dirs([s.input("features"), s.input("features_phase2")])
    have = sum(int(read_json(Path(d) / "index.json")["samples"]) for d in regenerated)
    pts = [p for p in points(c) if p["answers"] == DATASET or p["n_samples"] <= have]
    beyond = sorted({p["n_samples"] for p in points(c)} - {p["n_samples"] for p in pts})
    if beyond:  # data.budget adaptive stopped below them
        print(
            f"curves: n = {', '.join(map(str, beyond))} not trained: beyond the {have:,} samples captured "
            "(the adaptive data budget stopped there)",
            flush=True,
        )
    jobs = []
    for i, pt in enumerate(pts, 1):
        job = _curve_job(s, i, len(pts), pt, regenerated)
        if rank > 0:  # rank 0 writes the files, logs and checkpoints
            if finished(job) is None:  # rank 0 reads a finished point's record (_train_point)
                with tempfile.TemporaryDirectory(prefix=f".{s.name}-rank{rank}-") as scratch:
                    cfg = TrainConfig(**job["train"])
                    train_phase(scratch, logger=None, progress=False, train_cfg=cfg, **job["kw"])
            continue
        jobs.append(job)
    if rank > 0:
        return {}
    out, n_workers = train_jobs(jobs, world)
    runs = {r["name"]: r.pop("run_id") for r in out}
    s.timing["points"] = {r["name"]: r.pop("train_seconds") for r in out}  # the decision's hours
    s.timing["points_run"] = {r["name"]: r.pop("run") for r in out}  # device and rate: never artifacts
    if s.run is not None:
        write_json(POINT_RUNS, {"uri": s.run.uri, "runs": runs})
    write_json(
        s.path("points.json"),
        {
            "budget": {
                "rule": "same epochs",
                "epochs": c["epochs"],
                "min_steps": c["min_steps"],
                "max_steps": c["train"]["steps"],
                "patience": c["train"]["patience"],
            },
            "points": out,
            **({"beyond_data": beyond} if beyond else {}),
        },
    )
    return {
        "points": len(out),
        "steps_total": sum(p["train_steps"] for p in out),
        "stopped_early": sum(bool(p["stopped_early"]) for p in out),
        "workers": n_workers,
    }


def _curve_job(s: StepContext, i: int, of: int, pt: dict, regenerated: list) -> dict:
    """A point's training job (_train_point's): its data (a prefix of the regenerated captures, or
    the dataset's own answers), init, budget, monitor, checkpoints and MLflow parent."""
    # lazy (registry): eval_curves runs this module and trains nothing
    from draftport.pipeline.steps.train_steps import monitor_of, online_of

    tc = train_config(s.p["curves"], pt)
    kw = dict(
        features_dir=[s.input("features_dataset")] if pt["answers"] == DATASET else regenerated,
        n_samples=pt["n_samples"],
        target_dir=s.input("target"),
        vocab_path=s.input("vocab"),
        init=pt["init"],
        source_dir=s.input("source"),
        monitor=monitor_of(s, TrainConfig(**tc)),
        ckpt_dir=checkpoints(s.name) / pt["name"],
        verifier=s.p["targets"]["new"],
        **online_of(s, f"{s.name}-{pt['name']}"),
    )
    return {
        "i": i,
        "of": of,
        "point": pt,
        "kw": kw,
        "train": tc,
        "out": str(s.path("points", pt["name"])),
        "profile": s.p["profile"],
        "parent": s.run.run_id if s.run is not None else None,
        "step": s.name,
    }


if __name__ == "__main__":
    raise SystemExit(_run_job_file(sys.argv[1]))
