"""Glue between the game plan's steps and the two tools that run them (Snakemake, DVC).

How the two coexist (the traps are in DESIGN.md):

* One command per step, `python scripts/<step>.py --logfile logs/<step>.log`, run by a Snakemake
  `shell:` rule and, verbatim, by the DVC stage of the same name. dvc.yaml is generated from the
  Snakefile's rules (`python -m draftport.pipeline dvc-yaml`), never edited by hand; a test fails
  when it drifts.
* Values come from params.yaml. A rule passes the values of its step through `params:`
  (Snakemake's params trigger) and dvc.yaml lists the same dotted keys (DVC's params); the
  script sees exactly those (params.STEP_KEYS). Under another profile (`--configfile`) the
  Snakemake command gains `--params <file>` holding that step's values; DVC tracks params.yaml.
* Each step owns artifacts/<step>/. DVC tracks the folder; Snakemake sees one small file in it,
  metrics.json, written last. Downstream rules take upstream metrics.json files as input: small
  files are compared by checksum when their mtime moves, so `dvc checkout` rewriting mtimes makes
  Snakemake rerun nothing.
* After Snakemake succeeds, `dvc commit` records the steps of its DAG in dvc.lock (the Snakefile's
  onsuccess), so `dvc status` finds nothing to do. When DVC runs a step (DVC_STAGE is set), the
  script drops Snakemake's records of that step's files first (an older run's params would make
  Snakemake redo it) and, once done, has Snakemake record the new run (`snakemake --touch` of
  that one rule writes params, input checksums and code without running anything), so a later
  `snakemake` plans nothing, even after `dvc checkout` rewrote the mtimes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from base64 import urlsafe_b64decode, urlsafe_b64encode
from pathlib import Path
from typing import Any, Callable

import yaml

from . import params as P
from .errors import DraftportError

ARTIFACTS = "artifacts"
TRACKED = ("phase0", "phase1", "phase1_scratch", "phase2")  # one MLflow run each
ONLINE = tuple(f"online_{ph}" for ph in P.ONLINE_PHASES)  # vLLM serving a phase's drafter
# Snakemake-only steps: no DVC stage (they need the vLLM venv; `dvc repro` must run without it)
SNAKEMAKE_ONLY = ONLINE
RUN_FILE = "mlflow_run.json"  # in a phase's folder: its MLflow run, which the online step extends
UNCACHED = ("features_new", "features_eval", "features_phase2")  # DVC outs not cached
# Training checkpoints live outside the step folders: `dvc repro` deletes a stage's outs before it
# runs and a step empties its folder, and a resumed run needs them. Neither tool tracks this
# folder; a step removes its own checkpoints once it has finished (metrics.json written).
CHECKPOINTS = "checkpoints"
SMK_PARAMS_DIR = ".snakemake/draftport/params"
REPORT_PLOTS = ("tau.png", "positions.png", "loss.png")


def art(step: str, *parts: str) -> str:
    return str(Path(ARTIFACTS, step, *parts))


def checkpoints(step: str) -> Path:
    return Path(CHECKPOINTS, step)


def done(step: str) -> str:
    """The file Snakemake sees for a step: written last, so it exists only for a finished step."""
    return art(step, "metrics.json")


# ---- Snakefile side ------------------------------------------------------------------------
def configure(config: dict, base_file: str = P.PARAMS_FILE) -> tuple[dict, dict]:
    """(effective params, params.yaml alone), both validated; one-line error otherwise."""
    try:
        cfg = P.validate(config)
        base = P.load(base=base_file)
    except DraftportError as e:
        # One line, no traceback: Snakemake prints a WorkflowError with its stack.
        print(f"error: bad parameters: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return cfg, base


def params_arg(cfg: dict, base: dict, step: str) -> str:
    """'' when the step's values are params.yaml's; else ' --params <file>' holding them.

    The file is named by its content, so it changes (and Snakemake reruns the step) exactly
    when one of the step's values changes.
    """
    vals = P.step_params(cfg, step)
    if vals == P.step_params(base, step):
        return ""
    text = yaml.safe_dump(vals, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(SMK_PARAMS_DIR, f"{step}-{digest}.yaml")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return f" --params {path}"


# ---- Snakemake's lock after a kill -9 -----------------------------------------------------------
# A Snakemake process killed hard (kill -9, a preempted machine) leaves .snakemake/locks behind,
# and the next identical command stops with a LockException asking for --unlock. The onstart hook
# records which lock files this process holds and who it is (pid, its start time, boot id, host);
# at parse time, before Snakemake checks its lock, the lock files of a recorded process that is
# gone are removed. A lock of a live process, of another host, or not recorded is left alone.
LOCK_OWNERS = ".snakemake/draftport/lock-owners"


def _proc_identity(pid: int) -> str | None:
    """'<boot id>:<start ticks>' of a live process, None when there is none with that pid (or
    only its zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else f"{boot}:{fields[19]}"


def _lock_id(path) -> str:
    st = os.stat(path)
    return f"{st.st_ino}:{st.st_mtime_ns}"


def note_lock_owner(persistence, root: str = LOCK_OWNERS) -> None:
    """onstart (the lock is held by then): record this process as the owner of its lock files."""
    import socket

    locks = [str(f) for f in getattr(persistence, "_lockfile", {}).values() if Path(f).is_file()]
    if not locks:
        return
    pid = os.getpid()
    rec = {"pid": pid, "process": _proc_identity(pid), "host": socket.gethostname(),
           "locks": {f: _lock_id(f) for f in locks}}
    from .checkpoint import atomic_write_text

    atomic_write_text(Path(root, f"{pid}.json"), json.dumps(rec) + "\n")


def clear_stale_locks(root: str = LOCK_OWNERS, log=None) -> int:
    """Parse time: remove the lock files of recorded Snakemake processes that died holding them."""
    import socket

    base = Path(root)
    if not base.is_dir():
        return 0
    n, gone = 0, []
    for rec_file in sorted(base.glob("*.json")):
        try:
            rec = json.loads(rec_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("host") != socket.gethostname():
            continue  # a shared folder: that host's processes cannot be seen from here
        if rec.get("process") is not None and _proc_identity(rec["pid"]) == rec["process"]:
            continue  # still running: its lock stands
        for f, ident in rec.get("locks", {}).items():
            with contextlib.suppress(OSError):
                if _lock_id(f) == ident:  # the very file it wrote, not a later run's
                    os.unlink(f)
                    n += 1
        gone.append(str(rec["pid"]))
        rec_file.unlink(missing_ok=True)
    if n:
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"removed {n} Snakemake lock file(s) left by killed run(s) (pid {', '.join(gone)}); "
            f"their unfinished steps run again and resume from their checkpoints")
    return n


def uses_params_yaml(cfg: dict, base: dict, steps) -> bool:
    return all(P.step_params(cfg, s) == P.step_params(base, s) for s in steps)


def dvc_commit(stages: list[str], log=print) -> None:
    """Record finished Snakemake steps in dvc.lock (so `dvc status` agrees with Snakemake)."""
    stages = [s for s in stages if Path(done(s)).is_file() and s not in SNAKEMAKE_ONLY]
    if not stages or not Path(".dvc").is_dir() or not Path("dvc.yaml").is_file():
        return
    if _lock_current(stages):
        return
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    t = time.time()
    r = subprocess.run([dvc, "commit", "--force", "--quiet", *stages], capture_output=True, text=True,
                       env={**os.environ, "DVC_NO_ANALYTICS": "1"})
    if r.returncode:
        log(f"dvc commit failed (dvc.lock not updated): {(r.stderr or r.stdout).strip()}")
    else:
        log(f"dvc.lock: committed {len(stages)} stages in {time.time() - t:.1f} s")


def _lock_current(stages: list[str]) -> bool:
    """Cheap check: dvc.lock newer than every file of the stages and than params.yaml/dvc.yaml."""
    lock = Path("dvc.lock")
    if not lock.is_file():
        return False
    try:
        locked = yaml.safe_load(lock.read_text()).get("stages", {})
    except Exception:
        return False
    if any(s not in locked for s in stages):
        return False
    t = lock.stat().st_mtime
    if any(Path(f).stat().st_mtime > t for f in (P.PARAMS_FILE, "dvc.yaml") if Path(f).exists()):
        return False
    for s in stages:
        for root, _, files in os.walk(art(s)):
            for f in files:
                if os.stat(os.path.join(root, f)).st_mtime > t:
                    return False
    return True


# ---- script side ---------------------------------------------------------------------------
class Tee:
    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, s):
        self.stream.write(s)
        self.log.write(s)
        return len(s)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def isatty(self):
        return self.stream.isatty()

    def fileno(self):
        return self.stream.fileno()


class Step:
    """What a step script gets: its params (only its keys), its folder, its MLflow run."""

    def __init__(self, name: str, params: dict, folder: Path):
        self.name, self.p, self.dir = name, params, folder
        self.run = None  # tracking.PhaseRun for the phases

    def path(self, *parts) -> Path:
        return self.dir.joinpath(*parts)


def drop_snakemake_records(step: str, root: str = ".snakemake/metadata") -> int:
    """Forget Snakemake's provenance of artifacts/<step>/* (file persistence backend).

    Called when DVC runs the step: the files about to be written will not match what an older
    Snakemake run recorded (params, input checksums); without a record Snakemake judges them by
    time stamps alone, which DVC's ordered run keeps consistent.
    """
    base = Path(root)
    if not base.is_dir():
        return 0
    prefix = art(step) + os.sep
    n = 0
    for rec in list(base.rglob("*")):
        if not rec.is_file():
            continue
        rel = rec.relative_to(base).parts
        try:
            name = urlsafe_b64decode("".join(p.lstrip("@") for p in rel).encode()).decode()
        except Exception:
            continue
        if name.startswith(prefix):
            rec.unlink()
            n += 1
            with contextlib.suppress(OSError):
                if rec.parent != base:
                    rec.parent.rmdir()
    return n


def record_for_snakemake(step: str) -> None:
    """After DVC ran the step: let Snakemake record it as its own run would (`--touch` records
    params, input checksums and code of the rule without running it), so a later `snakemake`
    finds nothing to do, even after `dvc checkout` rewrote every mtime."""
    smk = shutil.which("snakemake") or str(Path(sys.executable).with_name("snakemake"))
    t = time.time()
    r = subprocess.run([smk, done(step), "--touch", "--forcerun", step, "--allowed-rules", step,
                        "--cores", "1", "--quiet", "all"], capture_output=True, text=True)
    if r.returncode:
        print(f"{step}: could not record the DVC run for Snakemake (a later snakemake run may redo "
              f"it): {(r.stderr or r.stdout).strip().splitlines()[-1:]}", file=sys.stderr)
    else:
        print(f"{step}: recorded for Snakemake in {time.time() - t:.1f} s")


def record_name(path: str) -> str:  # for tests: the file persistence's record name of a path
    return urlsafe_b64encode(path.encode()).decode()


def load_step_params(step: str, params_file: str | None) -> dict:
    """The step's values: params.yaml's, or the --params file's (a profile's, written and fully
    validated by the Snakefile: here only each value is checked, the profile's other values are
    not in the file)."""
    base = P.read_yaml(P.PARAMS_FILE)
    if params_file:
        base = P.merge(base, P.read_yaml(params_file))
    return P.step_params(P.validate(base, cross=not params_file), step)


def run_step(step: str, fn: Callable[[Step], dict], argv: list[str] | None = None) -> int:
    """Parse the step's command line, run fn in a fresh folder, write metrics.json last, then
    let that folder replace artifacts/<step>/.

    fn returns the step's metrics (numbers, nested dicts of numbers); MLflow phases get their
    run in step.run before any compute. A DraftportError is one line on stderr, exit code 2; a
    run that fails leaves artifacts/<step>/ as it was (no partial file, the older run kept).
    """
    import argparse

    ap = argparse.ArgumentParser(prog=f"scripts/{step}.py")
    ap.add_argument("--params", help="the step's values (a profile's; default: params.yaml)")
    # --logfile: torchrun reads a bare --log as an abbreviation of its own --log-dir
    ap.add_argument("--logfile", "--log", dest="log", help="also write stdout/stderr to this file")
    a = ap.parse_args(argv)
    if torchrun_rank() > 0:
        return _run_worker(step, fn, a.params)
    log_fh = None
    if a.log:
        Path(a.log).parent.mkdir(parents=True, exist_ok=True)
        log_fh = open(a.log, "w")
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log_fh), Tee(sys.__stderr__, log_fh)
    t0 = time.time()
    _set_threads()
    building = None
    try:
        p = load_step_params(step, a.params)
        if os.environ.get("DVC_STAGE"):
            n = drop_snakemake_records(step)
            if n:
                print(f"{step}: run by DVC; dropped {n} Snakemake record(s) of {art(step)}/")
        folder = Path(art(step))
        s = Step(step, p, folder)
        if step in TRACKED:
            s.run = _start_run(step, p)  # before any compute: an unreachable server fails here
        final = folder
        folder = s.dir = building = _prepare_folder(final, p)
        if s.run is not None:
            (folder / RUN_FILE).write_text(json.dumps({"run_id": s.run.run_id, "uri": s.run.uri,
                                                       "experiment_id": s.run.exp_id}) + "\n")
        try:
            metrics = fn(s)
        except BaseException:
            if s.run is not None:
                s.run.finish(ok=False)
            raise
        metrics = {**metrics, "seconds": round(time.time() - t0, 1)}
        if s.run is not None:
            s.run.log_metrics(P.flatten(metrics), step=int(metrics.get("train_steps", 0)))
            s.run.finish(ok=True)
        from .checkpoint import atomic_write_text

        atomic_write_text(folder / "metrics.json", json.dumps(metrics, indent=2, default=_jsonable) + "\n")
        _publish(folder, final)
        folder = s.dir = final
        if checkpoints(step).is_dir():  # finished: the step's outputs replace its resume state
            shutil.rmtree(checkpoints(step), ignore_errors=True)
        if os.environ.get("DVC_STAGE") and Path(".snakemake").is_dir():
            record_for_snakemake(step)
        print(f"{step}: done in {time.time() - t0:.1f} s -> {folder}/")
        return 0
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if building is not None and building.exists():  # the step failed: drop what it wrote
            shutil.rmtree(building, ignore_errors=True)
        if log_fh is not None:
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            log_fh.close()


def torchrun_rank() -> int:
    """This process's rank when a training rule runs under torchrun (resources.<rule>.torchrun)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def _run_worker(step: str, fn: Callable[[Step], dict], params_file: str | None) -> int:
    """A torchrun rank other than 0: it joins the training (fn), and leaves the step's folder,
    its log, MLflow and metrics.json to rank 0."""
    _set_threads()
    try:
        fn(Step(step, load_step_params(step, params_file), Path(art(step))))
        return 0
    except DraftportError as e:
        print(f"error: [rank {torchrun_rank()}] {e}", file=sys.stderr)
        return 2


def _set_threads() -> None:
    """Intra-op threads: the rule's `threads` (Snakemake exports OMP_NUM_THREADS), else 1.

    Under DVC nothing sets it: one thread, because OpenMP threads spin while they wait and, on
    shared cores, 2 spinning threads ran 5-20x slower than 1 (the Snakefile sets
    OMP_WAIT_POLICY=PASSIVE for its jobs, which makes 2 threads pay off).
    """
    n = int(os.environ.get("OMP_NUM_THREADS") or 1)
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def _start_run(step: str, p: dict):
    from .tracking import PhaseRun

    rev = read_json(art("fetch", "revision.json")) if Path(art("fetch", "revision.json")).is_file() else {}
    run = PhaseRun(p["profile"], step, tags={"draftport.source_revision": rev.get("commit", "unknown"),
                                             "draftport.source_repo": rev.get("repo_id", "unknown"),
                                             "draftport.runner": "dvc" if os.environ.get("DVC_STAGE") else "snakemake"})
    run.log_params(P.flatten(p))
    print(f"{step}: MLflow run {run.run_id} in experiment draftport-{p['profile']} at {run.uri}")
    return run


def _prepare_folder(folder: Path, p: dict) -> Path:
    """A fresh hidden sibling of the step's folder, holding the values used, for the step to
    write into: a rerun never mixes with an older run's files, and until _publish swaps it in,
    the older run's outputs (a good checkpoint, its metrics.json) stay untouched."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.parent.glob(f".{folder.name}.*.building"), *folder.parent.glob(f".{folder.name}.*.old")]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed run of this step
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".building", dir=folder.parent))
    tmp.chmod(0o755)
    (tmp / "step_params.json").write_text(json.dumps(p, indent=2, sort_keys=True) + "\n")
    return tmp


def _publish(tmp: Path, folder: Path) -> None:
    """The finished run's folder replaces artifacts/<step>/ (two renames, the old one removed last)."""
    old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists() or folder.is_symlink():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def write_json(path, obj) -> None:
    from .checkpoint import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def read_json(path) -> Any:
    from .config import load_json

    return load_json(path, "missing (has the step that writes it run?)")


# ---- shared by the step scripts ------------------------------------------------------------
def is_hub_id(value: str) -> bool:
    """org/name that is not a local folder (artifacts/... paths are the pipeline's own)."""
    return (not Path(value).exists() and value.count("/") == 1 and not value.startswith((".", "/"))
            and not value.startswith(ARTIFACTS + "/"))


def target_dir(value: str, which: str = "new") -> Path:
    """A target folder: the fetch step's copy when given as a hub id (targets.new / targets.old)."""
    return Path(art("fetch", f"target_{which}")) if is_hub_id(value) else Path(value)


def source_dir() -> Path:
    return Path(art("fetch", "source"))


def source_revision() -> str:
    p = Path(art("fetch", "revision.json"))
    return json.loads(p.read_text())["commit"] if p.is_file() else "unknown"


def target_config(target) -> dict:
    from .config import target_text_config

    return target_text_config(target)


def check_source_fits(features: dict) -> None:
    """The features must be captured at the aux layers the source drafter reads: fail before compute."""
    from .config import read_config

    cfg, _ = read_config(source_dir())
    if cfg.aux_layer_ids is not None and list(cfg.aux_layer_ids) != list(features["aux_layer_ids"]):
        raise DraftportError("features.aux_layer_ids", f"{features['aux_layer_ids']} but the source drafter "
                             f"reads {list(cfg.aux_layer_ids)}: the features would not fit it")
    if cfg.aux_convention and cfg.aux_convention != features["aux_convention"]:
        raise DraftportError("features.aux_convention", f"{features['aux_convention']} but the source drafter "
                             f"was trained under {cfg.aux_convention}")


def trusted(target, trust_remote_code) -> bool:
    """Whether a target folder may run its own code: its hub repo (the fetch recorded it), or the
    folder itself, is named in targets.trust_remote_code."""
    lock = Path(target) / "fetch.lock.json"
    repo = json.loads(lock.read_text()).get("source") if lock.is_file() else str(target)
    return repo in set(trust_remote_code or ())


def build_features(out_dir, target, prompts, f: dict, *, n: int, offset: int = 0, trust=()) -> dict:
    """trust: targets.trust_remote_code (repo ids whose own code may run)."""
    from . import plan

    idx = plan.build_features(target, prompts, out_dir, n_samples=n, offset=offset,
                              trust_remote_code=trusted(target, trust),
                              aux_layer_ids=f["aux_layer_ids"], convention=f["aux_convention"],
                              regenerate_responses=True, max_new_tokens=f["max_new_tokens"],
                              batch_size=f["batch_size"], dtype=f["dtype"], device=f["device"],
                              engine=f["engine"], tensor_parallel_size=f["tensor_parallel_size"],
                              regenerate_via=f["regenerate"], base_url=f["base_url"],
                              served_model=f["served_model"])
    return {"samples": idx["samples"], "tokens": idx["tokens"],
            "mb": round(idx["tokens"] * idx["bytes_per_token"] / 1e6, 2)}


def cost_metrics(accept_length: float, costmodel: dict, k: int) -> dict:
    from .costmodel import CostModel

    cm = CostModel(costmodel["baseline_tok_s"], costmodel["verify_ms"], costmodel["draft_ms"], k=k)
    tok_s = cm.tok_s(accept_length)
    return {"projected_tok_s": tok_s, "break_even_accept_length": cm.break_even_accept_length,
            "speedup_vs_baseline": tok_s / costmodel["baseline_tok_s"]}


EVAL_KEYS = ("accept_length", "accept_length_all_positions", "num_cycles", "eval_samples")


def phase_metrics(res: dict, p: dict) -> dict:
    """The metric names every phase shares (MLflow compare view, DVC metrics, the report)."""
    k = p["eval"]["k"]
    out = {key: res[key] for key in EVAL_KEYS}
    for i in range(k):
        out[f"accept_rate_pos_{i}"] = res[f"accept_rate_pos_{i}"]
        out[f"cond_acc_{i}"] = res[f"cond_acc_{i}"]
    out.update(cost_metrics(res["accept_length"], p["costmodel"], k))
    return out


def evaluate_on(drafter, target, features, p: dict) -> dict:
    from . import plan

    e = p["eval"]
    return plan.evaluate(drafter, target, features, k=e["k"], batch_size=e["batch_size"],
                         max_samples=e["max_samples"])


def train_and_evaluate(s: "Step", group: str, *, features: str, init: str, vocab_policy: str = "remap") -> dict:
    """One training phase (phase1, phase1_scratch, phase2): train, save, evaluate, cost."""
    import csv

    from . import plan
    from .train import TrainConfig

    from .train import init_distributed

    tp = s.p[group]["train"]
    target = target_dir(s.p["targets"]["new"])
    rank, _ = init_distributed()  # under torchrun: every rank trains on its slice of each batch
    if rank > 0:  # the same run, its files written by rank 0 (checkpoints: shared ckpt_dir)
        with tempfile.TemporaryDirectory(prefix=f".{s.name}-rank{rank}-") as scratch:
            plan.train_phase(scratch, features_dir=features, target_dir=target,
                             vocab_path=art("vocab_new", "vocab.safetensors"), init=init,
                             source_dir=source_dir(), vocab_policy=vocab_policy, train_cfg=TrainConfig(**tp),
                             logger=None, progress=False, ckpt_dir=checkpoints(s.name))
        return {}
    rep = plan.train_phase(s.dir, features_dir=features, target_dir=target,
                           vocab_path=art("vocab_new", "vocab.safetensors"), init=init,
                           source_dir=source_dir(), vocab_policy=vocab_policy,
                           train_cfg=TrainConfig(**tp), logger=s.run.background() if s.run else None,
                           progress=True, ckpt_dir=checkpoints(s.name))
    hist = json.loads(s.path("train_history.json").read_text())
    cols = ["step", "loss", "acc_0", "lr"]
    with open(s.path("history.csv"), "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for h in hist:
            w.writerow([h.get(c, "") for c in cols])
    res = evaluate_on(s.path("drafter"), target, art("features_eval", "eval_new"), s.p)
    write_json(s.path("eval.json"), res)
    out = phase_metrics(res, s.p)
    fin = rep.get("final", {})
    from .train import dist_info

    out.update(train_processes=dist_info()[1])  # > 1 under torchrun (resources.<rule>.torchrun)
    out.update(train_steps=rep["train_steps"], train_seconds=round(rep["train_seconds"], 1),
               final_loss=fin.get("loss"), final_acc_0=fin.get("acc_0"),
               resumed_from_step=rep["resumed_from_step"])
    if "vocab" in rep:
        out["lm_head_rows_kept"] = rep["vocab"].get("kept_rows")
        out["lm_head_rows_new"] = rep["vocab"].get("new_rows")
    return {k: v for k, v in out.items() if v is not None}


def online_phase(s: "Step", phase: str) -> dict:
    """The online step of a phase: its drafter served by vLLM next to the offline evaluator on the
    same sequences (draftport.online.run_step). The figures go to metrics.json, next to the
    phase's own offline accept_length, and into the phase's MLflow run. Fails (after writing
    online.json and logging both figures) when the two tau differ by more than online.tolerance."""
    from . import export, online
    from .tracking import PhaseRun

    o, k = s.p["online"], s.p["eval"]["k"]
    ran = read_json(done(phase))
    run_info = read_json(art(phase, RUN_FILE))
    run = PhaseRun.attach(run_info["run_id"], where=art(phase, RUN_FILE))  # before compute
    drafter = source_dir() if phase == "phase0" else Path(art(phase, "drafter"))
    drafter, how = export.for_vllm(drafter, s.path("export"), s.p["features"]["aux_convention"])
    print(f"{s.name}: {drafter}: {how}")
    m = online.run_step(target_dir(s.p["targets"]["new"]), drafter, s.p["targets"]["prompts_eval_new"], s.dir,
                        n_prompts=o["n_prompts"], k=k, max_new_tokens=o["max_new_tokens"], tol=o["tolerance"],
                        vllm_python_path=o["vllm_python"], max_num_seqs=o["max_num_seqs"], dtype=o["dtype"],
                        tensor_parallel_size=o["tensor_parallel_size"], check=False,
                        # beside the step's log: it outlives a failed step, whose folder is dropped
                        log_path=Path("logs", f"{s.name}.vllm.log"))
    out = {"accept_length": ran["accept_length"], **{key: v for key, v in m.items() if not isinstance(v, str)}}
    agree = abs(m["online_offline_difference"]) <= o["tolerance"]
    run.log_metrics({key: v for key, v in out.items() if key != "accept_length"}, step=int(ran.get("train_steps", 0)))
    run.set_tags({"draftport.online": "agrees" if agree else "DISAGREES", "draftport.vllm": m.get("vllm_version")})
    print(f"{s.name}: vLLM tau {m['online_accept_length']:.4f} ({m['online_seconds']:.0f} s) vs offline on the "
          f"same sequences {m['offline_same_prompts_accept_length']:.4f} "
          f"({m['offline_same_prompts_seconds']:.0f} s); the phase's offline tau {ran['accept_length']:.4f}; "
          f"logged to MLflow run {run.run_id}")
    if not agree:
        online.agreement_check(m, {"accept_length": m["offline_same_prompts_accept_length"], "k": k,
                                   **{f"accept_rate_pos_{i}": m[f"offline_same_prompts_accept_rate_pos_{i}"]
                                      for i in range(k)}}, o["tolerance"])
    return out


# ---- dvc.yaml from the Snakefile -------------------------------------------------------------
DVC_HEADER = """\
# GENERATED from the Snakefile by `python -m draftport.pipeline dvc-yaml`: do not edit.
# Each stage runs the command of the Snakemake rule of the same name; params are the dotted keys
# the rule passes through `params:`; deps/outs are the rule's, an artifacts/<step>/ file standing
# for its folder. tests/test_pipeline_dvc.py fails when this file and the Snakefile drift apart.
"""


@contextlib.contextmanager
def snakemake_workflow(snakefile: str = "Snakefile", configfiles: tuple = ()):
    """The parsed Snakemake workflow (rules with their input/output/params/shell), no DAG."""
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import (ConfigSettings, OutputSettings, Quietness,
                                          ResourceSettings)

    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf_api = api.workflow(resource_settings=ResourceSettings(cores=1),
                              config_settings=ConfigSettings(configfiles=[Path(c) for c in configfiles]),
                              snakefile=Path(snakefile).absolute())
        yield wf_api._workflow


def _dep_of(path: str) -> str:
    parts = Path(path).parts
    if len(parts) >= 2 and parts[0] == ARTIFACTS:
        return str(Path(*parts[:2]))
    return str(path)


def stage_of(rule) -> dict:
    from snakemake.utils import format as smk_format

    cmd = smk_format(rule.shellcmd, input=rule.input, output=rule.output, params=rule.params,
                     log=rule.log, threads=1, rule=rule.name, wildcards={})
    cmd = " ".join(cmd.split())
    deps = []
    for f in rule.input:
        d = _dep_of(str(f))
        if d not in deps:
            deps.append(d)
    outs = []
    for f in rule.output:
        o = _dep_of(str(f))
        if o not in outs:
            outs.append(o)
    if outs != [art(rule.name)]:
        raise DraftportError(f"rule {rule.name}", f"outputs {list(map(str, rule.output))} are not all under {art(rule.name)}/")
    stage: dict[str, Any] = {"cmd": cmd, "deps": deps, "params": list(P.STEP_KEYS[rule.name])}
    stage["outs"] = [{outs[0]: {"cache": False}}] if rule.name in UNCACHED else outs
    return stage


def dvc_yaml_text(snakefile: str = "Snakefile") -> str:
    """dvc.yaml for params.yaml's profile, derived from the Snakefile's rules."""
    stages = {}
    with snakemake_workflow(snakefile) as wf:
        for rule in wf.rules:
            if rule.shellcmd is None:
                continue  # aggregating targets (all): `dvc repro` without a target is their DVC twin
            if rule.name in SNAKEMAKE_ONLY:
                continue
            if rule.name not in P.STEP_KEYS:
                raise DraftportError(f"rule {rule.name}", "has no entry in params.STEP_KEYS")
            stages[rule.name] = stage_of(rule)
    metrics = [done(s) for s in stages]
    plots = [art("report", p) for p in REPORT_PLOTS] + [
        {"loss": {"template": "linear", "x": "step", "y": {
            art(s, "history.csv"): "loss" for s in ("phase1", "phase1_scratch", "phase2") if s in stages}}},
    ]
    doc = {"stages": stages, "metrics": metrics, "plots": plots}
    return DVC_HEADER + yaml.safe_dump(doc, sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import difflib

    ap = argparse.ArgumentParser(prog="python -m draftport.pipeline")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("dvc-yaml", help="write dvc.yaml from the Snakefile (--check: fail on drift)")
    g.add_argument("--check", action="store_true")
    g.add_argument("--out", default="dvc.yaml")
    c = sub.add_parser("dvc-commit", help="record finished steps in dvc.lock")
    c.add_argument("stages", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "dvc-yaml":
        text = dvc_yaml_text()
        old = Path(a.out).read_text() if Path(a.out).is_file() else ""
        if a.check:
            if old != text:
                sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                           a.out, "generated from Snakefile"))
                print(f"{a.out} drifted from the Snakefile: run `python -m draftport.pipeline dvc-yaml`",
                      file=sys.stderr)
                return 1
            print(f"{a.out} matches the Snakefile")
            return 0
        Path(a.out).write_text(text)
        print(f"wrote {a.out} ({text.count(chr(10))} lines)")
        return 0
    if a.cmd == "dvc-commit":
        dvc_commit(a.stages)
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
