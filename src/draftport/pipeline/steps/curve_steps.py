"""The learning curves: every arm (plain fine-tuning and scratch at several new-target sample
counts; the dataset-answers and recipe arms at curves.arms_n_samples) with several seeds each,
under one budget rule; trained in `train_curves`, measured in `eval_curves` (so evaluation settings
retrain nothing). A regenerated point reads a prefix of one capture: Phase 1's samples, then Phase
2's (data.shards.FeatureChain); a dataset point a prefix of features_dataset's. MLflow: the step's
run `curves` is the parent of one nested run per point (tags arm, init, answers, recipe, n_samples,
seed)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from draftport.evaluation.accept import evaluate_drafter
from draftport.pipeline.runner import RUNS_DIR, StepContext, checkpoints, read_json, write_json
from draftport.pipeline.tracking import PhaseRun, tracking_uri
from draftport.plan.curves import DATASET, points, train_config
from draftport.plan.params import TrainConfig

POINT_RUNS = Path(RUNS_DIR, "train_curves.points.json")  # nested runs' ids (outside artifacts/)


def _child_run(profile: str, parent_id: str, step: str, pt: dict):
    """A nested MLflow run of the step's run for one point."""
    arm = pt.get("arm", pt["init"])
    return PhaseRun(
        profile,
        f"curves {arm} n={pt['n_samples']} seed={pt['seed']}",
        tags={
            "mlflow.parentRunId": parent_id,
            "init": pt["init"],
            "arm": arm,
            "answers": pt.get("answers", "regenerated"),
            "recipe": pt.get("recipe", "plain"),
            "n_samples": pt["n_samples"],
            "seed": pt["seed"],
            "draftport.step": step,
        },
    )


def _train_point(job: dict) -> dict:
    """One point, trained and saved under job["out"] (in the step's process or a worker's)."""
    # lazy (registry): eval_curves runs this module and trains nothing
    from draftport.training.phases import train_phase

    pt, kw = job["point"], dict(job["kw"])
    cfg = TrainConfig(**job["train"])
    kw["train_cfg"] = cfg
    what = job.get("label", "curves")
    print(
        f"{what}: point {job['i']}/{job['of']}: {pt['arm']} n={pt['n_samples']} seed={pt['seed']}, {cfg.steps} steps",
        flush=True,
    )
    child = _child_run(job["profile"], job["parent"], job["step"], pt) if job["parent"] else None
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
    return {
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


def _worker_init(log_path: str | None, gpus=None) -> None:
    """A worker trains on one thread (a point's floats as in one process), writes its lines to the
    step's log too, and dies with the step (kill -9 of the step leaves no orphan writing
    checkpoints that a resumed step reads). gpus: a queue of GPU ids, one taken per worker before
    CUDA starts, so each worker trains its points on a GPU of its own."""
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus.get())
    import torch

    from draftport.pipeline.runner import Tee
    from draftport.progress import LogWriter

    torch.set_num_threads(1)
    if log_path:  # appended line by line beside the step's own (the runner opened it)
        log = LogWriter(open(log_path, "a", buffering=1))
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
    _die_with_parent()


def visible_gpus(device: str) -> list[str]:
    """The GPU ids a step's points spread over under train.device `device` (none: the CPU)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return []
    ids = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return ids[: torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


def _workers(n_points: int, world: int, gpus: list[str]) -> int:
    """Points trained at once: under torchrun one (each point over every rank); on GPUs one per
    GPU; on the CPU the step's threads (one thread each)."""
    import torch

    if world > 1:
        return 1
    if gpus:
        return max(1, min(len(gpus), n_points))
    return max(1, min(torch.get_num_threads(), n_points))


def train_jobs(jobs: list[dict], world: int) -> tuple[list[dict], int]:
    """Train every job (_train_point's): on GPUs one at a time per GPU, on the CPU as many at once
    as the step has threads; the results in the jobs' order, and how many trained at once."""
    gpus = visible_gpus(jobs[0]["train"].get("device", "auto")) if jobs else []
    n_workers = _workers(len(jobs), world, gpus)
    if n_workers == 1:
        return [_train_point(j) for j in jobs], 1
    what = jobs[0].get("label", "curves")
    where = f"one per GPU ({', '.join(gpus[:n_workers])})" if gpus else "one thread each"
    print(f"{what}: {len(jobs)} points, {n_workers} at a time ({where})", flush=True)
    by_cost = sorted(jobs, key=lambda j: -j["train"]["steps"])  # the longest first: the workers finish together
    with _pool(n_workers, gpus) as pool:
        done = dict(zip((j["point"]["name"] for j in by_cost), pool.map(_train_point, by_cost, chunksize=1)))
    return [done[j["point"]["name"]] for j in jobs], n_workers


@contextlib.contextmanager
def _pool(n_workers: int, gpus: list[str]):
    """Worker processes of one thread each (_worker_init), or one per GPU, dying with the step."""
    log_fh = getattr(getattr(sys.stdout, "log", None), "fh", None)  # the runner's Tee to logs/<step>.log
    ctx = mp.get_context("spawn")
    queue = None
    if gpus:
        queue = ctx.Queue()
        for g in gpus[:n_workers]:
            queue.put(g)
    with ctx.Pool(n_workers, initializer=_worker_init, initargs=(getattr(log_fh, "name", None), queue)) as pool:
        yield pool


def _eval_point(job: dict) -> dict:
    """One point's drafter on the held-out features (in the step's process or a worker's)."""
    return evaluate_drafter(job["drafter"], job["target"], job["features"], **job["kw"])


def eval_jobs(jobs: list[dict], device: str):
    """Each job's evaluation, yielded in the jobs' order as they finish: on the CPU as many at once
    as the step has threads (one thread each: the same floats as one process), on GPUs one per GPU."""
    gpus = visible_gpus(device)
    n_workers = _workers(len(jobs), 1, gpus)
    if n_workers == 1:
        yield from map(_eval_point, jobs)
        return
    where = f"one per GPU ({', '.join(gpus[:n_workers])})" if gpus else "one thread each"
    print(f"curves: {len(jobs)} points evaluated, {n_workers} at a time ({where})", flush=True)
    with _pool(n_workers, gpus) as pool:
        yield from pool.imap(_eval_point, jobs, chunksize=1)


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
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent
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


def _die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


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
        with tempfile.TemporaryDirectory(prefix=f".curves-rank{rank}-") as scratch:
            train_phase(scratch, logger=None, progress=False, train_cfg=TrainConfig(**job["train"]), **kw)
        return 0
    write_json(f"{job['out']}.result.json", {**_train_point({**job, "kw": kw}), "processes": world})
    return 0


def train_curves(s: StepContext) -> dict:
    """Train every point (arm x n x seed; draftport.plan.curves) on the first n samples of Phase 1's
    + Phase 2's capture (the dataset arms: of features_dataset); on the CPU the step's threads
    train that many points at once. A killed step resumes: finished points continue from their
    last checkpoint (0 steps left), the interrupted ones from their own."""
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
            with tempfile.TemporaryDirectory(prefix=f".{s.name}-rank{rank}-") as scratch:
                train_phase(scratch, logger=None, progress=False, train_cfg=TrainConfig(**job["train"]), **job["kw"])
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


def _point_run(s: StepContext, pt: dict, recorded: dict):
    if recorded.get("uri") == tracking_uri() and pt["name"] in recorded.get("runs", {}):
        try:
            return PhaseRun.attach(recorded["runs"][pt["name"]], where=POINT_RUNS)
        except Exception:  # the run is gone (another store, a deleted experiment): a new child
            pass
    return _child_run(s.p["profile"], s.run.run_id, s.name, pt)


POINT_KEYS = ("arm", "init", "answers", "recipe", "n_samples", "seed", "train_steps", "stopped_early", "curve")


def _log_point(s: StepContext, pt: dict, recorded: dict, res: dict, ci: list) -> None:
    """A point's figures (and each eval set's accept length) in its MLflow child run."""
    run = _point_run(s, pt, recorded)
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
    # lazy (registry): train_curves runs this module without evaluation.decision
    from draftport.evaluation.decision import tau_ci
    from draftport.evaluation.traffic import strata_of

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


if __name__ == "__main__":
    raise SystemExit(_run_job_file(sys.argv[1]))
