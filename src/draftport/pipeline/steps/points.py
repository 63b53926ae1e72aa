"""A step's points trained or evaluated side by side: worker processes of one thread each on the
CPU (one per GPU on GPUs) that die with the step, and each point's nested MLflow run (the learning
curves' and the adaptive budget's rounds)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from pathlib import Path

from draftport.pipeline.runner import RUNS_DIR, StepContext, loaded_modules, note_worker_modules
from draftport.pipeline.tracking import PhaseRun, tracking_uri

POINT_RUNS = Path(RUNS_DIR, "train_curves.points.json")  # nested runs' ids (outside artifacts/)


def child_run(profile: str, parent_id: str, step: str, pt: dict):
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


def point_run(s: StepContext, pt: dict, recorded: dict):
    """The point's nested run train_curves opened (POINT_RUNS), or a new one where it is gone."""
    if recorded.get("uri") == tracking_uri() and pt["name"] in recorded.get("runs", {}):
        try:
            return PhaseRun.attach(recorded["runs"][pt["name"]], where=POINT_RUNS)
        except Exception:  # the run is gone (another store, a deleted experiment): a new child
            pass
    return child_run(s.p["profile"], s.run.run_id, s.name, pt)


def worker_init(log_path: str | None, gpus=None) -> None:
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
    die_with_parent()


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (Linux; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def visible_gpus(device: str) -> list[str]:
    """The GPU ids a step's points spread over under train.device `device` (none: the CPU)."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return []
    ids = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return ids[: torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]


def workers(n_points: int, world: int, gpus: list[str]) -> int:
    """Points trained at once: under torchrun one (each point over every rank); on GPUs one per
    GPU; on the CPU the step's threads (one thread each)."""
    import torch

    if world > 1:
        return 1
    if gpus:
        return max(1, min(len(gpus), n_points))
    return max(1, min(torch.get_num_threads(), n_points))


@contextlib.contextmanager
def _worker_pool(n_workers: int, gpus: list[str]):
    """Worker processes of one thread each (worker_init), or one per GPU, dying with the step."""
    log_fh = getattr(getattr(sys.stdout, "log", None), "fh", None)  # the runner's Tee to logs/<step>.log
    ctx = mp.get_context("spawn")
    queue = None
    if gpus:
        queue = ctx.Queue()
        for g in gpus[:n_workers]:
            queue.put(g)
    with ctx.Pool(n_workers, initializer=worker_init, initargs=(getattr(log_fh, "name", None), queue)) as pool:
        yield pool


def _call(task: tuple) -> tuple:
    """A worker's job: its result, and the draftport modules the worker has run so far."""
    fn, job = task
    return fn(job), sorted(loaded_modules())


def map_points(fn, jobs: list[dict], n_workers: int, gpus: list[str]):
    """fn over the jobs in worker processes, the results yielded in the jobs' order as they finish;
    the modules the workers ran are recorded with the step's own (what reruns it)."""
    with _worker_pool(n_workers, gpus) as pool:
        for res, mods in pool.imap(_call, [(fn, j) for j in jobs], chunksize=1):
            note_worker_modules(mods)
            yield res
