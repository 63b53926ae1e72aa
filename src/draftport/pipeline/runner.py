"""A step's lifecycle: its command line, its params, its log, its MLflow run, a fresh folder that
replaces artifacts/<step>/ only once metrics.json is written, and its code checked against the
registry.

Every step is `python scripts/<step>.py [--params FILE] --input name=path ... --logfile LOG`, run
by Snakemake and, verbatim, by DVC. The script names its step; the registry row (its inputs,
keys, modules, flags) says the rest. The step's function gets a `StepContext`: its params (only the
row's keys), its named inputs, its folder, its MLflow run.

Outputs are byte-identical for identical runs on one machine: times and MLflow run ids stay out
of artifacts/ (logs/<step>.json holds the step's time, .draftport/runs/<step>.json its run).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from draftport.errors import DraftportError
from draftport.files import atomic_write_text, load_json
from draftport.pipeline.bridge import drop_snakemake_records, record_for_snakemake
from draftport.plan import params as schema
from draftport.plan import registry
from draftport.progress import LogWriter

CHECKPOINTS = "checkpoints"
# The MLflow run a step made (tracked steps): a later step (the phase's evaluation, its online
# check) reopens it. Outside artifacts/: a run id differs between identical runs.
RUNS_DIR = ".draftport/runs"


art, done = registry.art, registry.done


def checkpoints(step: str) -> Path:
    """Training checkpoints live outside the step folders: `dvc repro` deletes a stage's outs
    before it runs and a step empties its folder, and a resumed run needs them. Neither tool
    tracks this folder; a step removes its own once it has finished (metrics.json written)."""
    return Path(CHECKPOINTS, step)


class Tee:
    """stdout/stderr to the terminal and, through progress.LogWriter (carriage-return updates
    collapsed to a line every few seconds), to logs/<step>.log."""

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


class StepContext:
    """What a step's function gets: its params (only its keys), its named inputs, its folder,
    its MLflow run (tracked steps)."""

    def __init__(self, row: registry.Step, params: dict, inputs: dict[str, Path], folder: Path):
        self.row, self.name, self.p, self.inputs, self.dir = row, row.name, params, inputs, folder
        self.run = None  # tracking.PhaseRun for the phases
        # measured seconds the step reports (the decision's hours): logs/<step>.json, never
        # artifacts/ (two runs of the same plan differ in them, their outputs must not)
        self.timing: dict = {}

    def path(self, *parts) -> Path:
        return self.dir.joinpath(*parts)

    def record_run(self, what: str, run: dict | None, step: int = 0) -> None:
        """Where a computation ran and at what rate (draftport.model.device: device, gpu,
        processes, tokens_per_s, mfu; a training's steady rate, warm-up seconds, start seconds and
        compiles): logs/<step>.json under `what` (a rate differs between identical runs, so never
        artifacts/) and, tracked, the run's tags `what.device`, `what.gpu`, `what.processes` and
        metrics `what_tokens_per_s`, `what_mfu`, `what_steady_tokens_per_s`, `what_warmup_s`, ..."""
        if not run:
            return
        self.timing[what] = run
        if self.run is not None:
            self.run.set_tags({f"{what}.{k}": run.get(k) or "none" for k in ("device", "gpu", "processes")})
            keys = ("tokens_per_s", "mfu", "steady_tokens_per_s", "steady_mfu", "warmup_s", "start_s", "compiles")
            self.run.log_metrics({f"{what}_{k}": run[k] for k in keys if run.get(k) is not None}, step=step)

    def input(self, name: str) -> Path:
        """A named input (the rule passes it). Whoever reads it checks it and names the file."""
        if name not in self.inputs:
            raise DraftportError(f"scripts/{self.name}.py", f"no --input {name}=PATH (its rule passes it)")
        return self.inputs[name]


def write_json(path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=_jsonable) + "\n")


def read_json(path) -> Any:
    return load_json(path, "missing (has the step that writes it run?)")


def _jsonable(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def load_step_params(step: str, params_file: str | None) -> dict:
    """The step's values: params.yaml's, or the --params file's (a profile's, written and fully
    validated by the Snakefile: here only each value is checked, the profile's other values are
    not in the file). Under params.yaml alone (DVC, a step run by hand) a step that these params
    leave out of the plan is refused: dvc.yaml was made under other values."""
    base = schema.read_yaml(schema.PARAMS_FILE)
    if params_file:
        base = schema.merge(base, schema.read_yaml(params_file))
    cfg = schema.validate(base, cross=not params_file)
    row = registry.BY_NAME[step]
    if not params_file and not registry.enabled(row, cfg):
        conds = (row.enabled,) if isinstance(row.enabled, str) else row.enabled
        off = next(c for c in conds if not registry.holds(cfg, c))
        key = off.partition("=")[0]
        instead = [s.name for s in registry.STEPS if s.replaces == step and registry.enabled(s, cfg)]
        raise schema.ParamsError(
            key,
            f"{registry.get(cfg, key)}: step {step} is not part of this plan (it needs {off}"
            + (f"; step {instead[0]} stands in for it" if instead else "")
            + "): regenerate dvc.yaml (python -m draftport.pipeline.bridge dvc-yaml)",
        )
    return registry.step_params(cfg, step)


def default_inputs(row: registry.Step) -> dict[str, Path]:
    """The named inputs of the step's command under params.yaml (a step run by hand)."""
    return {k: Path(v) for k, v in registry.inputs(row, schema.load()).items()}


def _parse(step: str, argv):
    ap = argparse.ArgumentParser(prog=f"scripts/{step}.py", description=registry.BY_NAME[step].doc)
    ap.add_argument("--params", help="the step's values (a profile's; default: params.yaml)")
    ap.add_argument(
        "--input",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a named input (the rule passes every one the registry lists)",
    )
    # --logfile: torchrun reads a bare --log as an abbreviation of its own --log-dir
    ap.add_argument("--logfile", "--log", dest="log", help="also write stdout/stderr to this file")
    a = ap.parse_args(argv)
    ins = {}
    for item in a.input:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            ap.error(f"--input {item}: expected NAME=PATH")
        ins[name] = Path(path)
    return a, ins


def function_of(row: registry.Step) -> Callable[[StepContext], dict]:
    mod, fn = row.fn.split(":")
    return getattr(importlib.import_module(f"draftport.pipeline.steps.{mod}"), fn)


def main(step: str, argv: list[str] | None = None) -> int:
    """Run the step: parse its command line, run its function in a fresh folder, write
    metrics.json last, then let that folder replace artifacts/<step>/.

    The function returns the step's metrics (numbers, nested dicts of numbers); tracked steps
    get their MLflow run in step.run before any compute. A DraftportError is one line on stderr,
    exit code 2; a run that fails leaves artifacts/<step>/ as it was (no partial file, the older
    run kept)."""
    row = registry.BY_NAME[step]
    a, ins = _parse(step, argv)
    fn = function_of(row)
    if torchrun_rank() > 0:
        return _run_worker(row, fn, a.params, ins)
    log_fh = None
    if a.log:
        Path(a.log).parent.mkdir(parents=True, exist_ok=True)
        open(a.log, "w").close()
        log_fh = open(a.log, "a")  # appended: a step's worker processes add their lines (train_curves)
        log = LogWriter(log_fh)
        sys.stdout, sys.stderr = Tee(sys.__stdout__, log), Tee(sys.__stderr__, log)
    t0 = time.time()
    _set_threads()
    _compile_cache()
    building = None
    try:
        p = load_step_params(step, a.params)
        if not ins:  # run by hand: the inputs its rule would pass under params.yaml
            ins = default_inputs(row)
        if os.environ.get("DVC_STAGE"):
            n = drop_snakemake_records(step)
            if n:
                print(f"{step}: run by DVC; dropped {n} Snakemake record(s) of {art(step)}/")
        final = Path(art(step))
        s = StepContext(row, p, ins, final)
        if row.run and os.environ.get("DRAFTPORT_TRACKING") != "off":  # off: draftport.pipeline.local --no-tracking
            s.run = _open_run(s)  # before any compute: an unreachable server fails here
        folder = s.dir = building = _prepare_folder(final, p)
        try:
            metrics = fn(s)
            _check_modules(row)  # under DRAFTPORT_STRICT_MODULES an unlisted module fails the step
        except BaseException:
            if s.run is not None:
                s.run.finish(ok=False)
            raise
        seconds = round(time.time() - t0, 1)
        if s.run is not None:
            s.run.log_metrics({**schema.flatten(metrics), "seconds": seconds}, step=int(metrics.get("train_steps", 0)))
            s.run.finish(ok=True)
        write_json(folder / "metrics.json", metrics)
        _publish(folder, final)
        folder = s.dir = final
        write_json(
            Path("logs", f"{step}.json"),
            {
                "seconds": seconds,
                "finished": time.time(),
                "modules": sorted(loaded_modules()),
                **({"timing": s.timing} if s.timing else {}),
            },
        )
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
            sys.stdout.flush()
            sys.stderr.flush()
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            log.close()  # LogWriter: writes a pending last state, then closes log_fh


def torchrun_rank() -> int:
    """This process's rank when a training rule runs under torchrun (resources.<rule>.torchrun)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def _run_worker(row: registry.Step, fn, params_file: str | None, ins: dict) -> int:
    """A torchrun rank other than 0: it joins the training (fn), and leaves the step's folder,
    its log, MLflow and metrics.json to rank 0."""
    _set_threads()
    _compile_cache()
    try:
        fn(StepContext(row, load_step_params(row.name, params_file), ins or default_inputs(row), Path(art(row.name))))
        return 0
    except DraftportError as e:
        print(f"error: [rank {torchrun_rank()}] {e}", file=sys.stderr)
        return 2


def _compile_cache() -> None:
    """torch.compile's caches (inductor's graphs and tuned kernels, Triton's binaries) in one
    folder of the run, .draftport/compile-cache (or DRAFTPORT_COMPILE_CACHE), shared by every step
    process of the plan and kept for a rerun on the same machine: a training after the first
    loads its kernels instead of compiling them. Set before torch compiles anything."""
    root = Path(os.environ.get("DRAFTPORT_COMPILE_CACHE") or Path(".draftport", "compile-cache")).resolve()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def _set_threads() -> None:
    """Intra-op threads: the rule's `threads` (Snakemake exports OMP_NUM_THREADS), else 1.

    Under DVC nothing sets it: one thread, because waiting OpenMP threads spin and slow one
    another on shared cores (the Snakefile's jobs get OMP_WAIT_POLICY=PASSIVE: theirs sleep).
    """
    n = int(os.environ.get("OMP_NUM_THREADS") or 1)
    os.environ["OMP_NUM_THREADS"] = str(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


# ---- MLflow: a phase's run --------------------------------------------------------------------
def run_file(step: str) -> Path:
    return Path(RUNS_DIR, f"{step}.json")


def _open_run(s: StepContext):
    """The phase's MLflow run: a training step (and Phase 0) starts one; a step with `run_from`
    (an evaluation: its training step) reopens that step's run (recorded in .draftport/runs/), so
    the phase's loss by step and its accept length share one run, or starts one when that record
    is gone (e.g. after a fresh clone's `dvc pull`) or belongs to another tracking store."""
    # lazy (registry): only tracked steps run pipeline.tracking; the other rows do not list it
    from draftport.pipeline.tracking import PhaseRun

    trained = s.row.run_from
    rec = run_file(trained) if trained else None
    if rec is not None and rec.is_file():
        info = json.loads(rec.read_text())
        # lazy (registry): only tracked steps run pipeline.tracking; the other rows do not list it
        from draftport.pipeline.tracking import tracking_uri

        if info.get("uri") == tracking_uri():
            run = PhaseRun.attach(info["run_id"], where=rec)
            _log_params_once(run, schema.flatten(s.p))
            _record_run(s.name, run)
            print(f"{s.name}: MLflow run {run.run_id} ({s.row.run}, made by {trained}) at {run.uri}")
            return run
    rev_file = Path(art("fetch", "revision.json"))
    rev = read_json(rev_file) if rev_file.is_file() else {}
    profile = s.p.get("profile") or schema.read_yaml(schema.PARAMS_FILE).get("profile", "default")
    run = PhaseRun(
        profile,
        s.row.run,
        tags={
            "draftport.source_revision": rev.get("commit", "unknown"),
            "draftport.source_repo": rev.get("repo_id", "unknown"),
            "draftport.step": s.name,
            "draftport.runner": "dvc" if os.environ.get("DVC_STAGE") else "snakemake",
            **({"draftport.dvc_exp": os.environ["DVC_EXP_NAME"]} if os.environ.get("DVC_EXP_NAME") else {}),
        },
    )
    run.log_params(schema.flatten(s.p))
    _record_run(s.name, run)
    print(f"{s.name}: MLflow run {run.run_id} in experiment draftport-{profile} at {run.uri}")
    return run


def _log_params_once(run, params: dict) -> None:
    """MLflow params are write-once: a re-evaluation with other eval values logs the new values
    as tags `param.<key>` (the UI shows both; metrics.json holds the truth)."""
    # lazy (registry): only tracked steps run pipeline.tracking; the other rows do not list it
    from draftport.pipeline.tracking import retry

    have = retry(run.c.get_run, run.run_id).data.params
    new = {k: v for k, v in params.items() if k not in have}
    changed = {f"param.{k}": v for k, v in params.items() if k in have and have[k] != str(v)[:6000]}
    if new:
        run.log_params(new)
    if changed:
        run.set_tags(changed)


def timing_of(step: str) -> dict | None:
    """What a finished step measured (StepContext.timing, in logs/<step>.json); None when its
    record is missing or older than timings."""
    f = Path("logs", f"{step}.json")
    try:
        return json.loads(f.read_text()).get("timing")
    except (OSError, ValueError):
        return None


def _record_run(step: str, run) -> None:
    write_json(run_file(step), {"run_id": run.run_id, "uri": run.uri, "experiment_id": run.exp_id})


# ---- folders ----------------------------------------------------------------------------------
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


# ---- code dependencies ------------------------------------------------------------------------
_FROM_WORKERS: set[str] = set()  # modules the step's worker processes ran (pipeline.steps.points)


def loaded_modules() -> set[str]:
    """draftport's modules this process has imported, and those its step's workers reported, as
    registry names ("train", "steps.data")."""
    here = {m[len("draftport.") :] for m in sys.modules if m.startswith("draftport.") and sys.modules[m] is not None}
    return here | _FROM_WORKERS


def note_worker_modules(names) -> None:
    """Modules a worker process of this step ran: its record and the strict check count them."""
    _FROM_WORKERS.update(names)


def undeclared_modules(row: registry.Step) -> list[str]:
    """Modules the step ran that its registry row does not list: a change there would not rerun
    it. Packages count through their modules (draftport.world for world.targets)."""
    declared = set(registry.PLUMBING_MODULES) | set(row.modules)
    packages = {".".join(d.split(".")[:i]) for d in declared for i in range(1, d.count(".") + 1)}
    return sorted(m for m in loaded_modules() if m not in declared and m not in packages)


def _check_modules(row: registry.Step) -> None:
    missing = undeclared_modules(row)
    if not missing:
        return
    msg = (
        f"ran draftport module(s) {', '.join(missing)} that its registry row does not list "
        f"(src/draftport/plan/registry.py): a change there would not rerun it"
    )
    if os.environ.get("DRAFTPORT_STRICT_MODULES"):
        raise DraftportError(f"step {row.name}", msg)
    print(f"warning: step {row.name} {msg}", file=sys.stderr)
