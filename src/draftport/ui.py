"""`draftport ui`: the MLflow UI on the profile's tracking store, and the addresses that land on
the phase runs (their compare view, tau by training step, the runs table).

MLflow 3's UI opens an experiment on its GenAI overview (traces, none here); the phase runs are
under "Model training". So this finds the profile's experiment and each phase's run (the one the
workspace's evaluation recorded in .draftport/runs/, else the phase's latest top-level run),
starts `mlflow server` on 127.0.0.1 over the store (a sqlite file, or any database URI; an
http(s) store is a server already and is only pointed at), waits until it answers, prints the
addresses and stays in the foreground until Ctrl-C. The addresses are the UI's own hash routes
(MLflow 3.x: `#/compare-runs`, `#/metric`, `#/experiments/<id>/runs?workflowType=machine_learning`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from draftport.errors import DraftportError
from draftport.pipeline.runner import RUNS_DIR
from draftport.pipeline.tracking import check_reachable, client, experiment_name, retry, tracking_uri
from draftport.plan import params, registry

METRIC = "accept_length"  # the phases' headline; by step in each training run (tau during training)
CURVES = "curves"  # the learning curves' parent run (one nested run per point)
HINT = "run `make phase1` first"
TOGGLE = (
    'if the UI opens on a GenAI overview ("Traces 0"), pick "Model training" in the GenAI | '
    "Model training switch at the top left: the runs are there"
)


def phases() -> list[str]:
    """The phase runs, in the plan's order (the registry's evaluation steps), curves left out."""
    out = []
    for row in registry.STEPS:
        if row.run and row.run != CURVES and row.name == f"eval_{row.run}" and row.run not in out:
            out.append(row.run)
    return out


def trained_phases() -> set[str]:
    """Phases with a training step: their runs hold accept_length by step."""
    return {row.run for row in registry.STEPS if row.trains and row.run}


def profile_of(configfiles: list[Path], base: Path) -> str:
    cfg = params.read_yaml(base)
    for f in configfiles:
        cfg = params.merge(cfg, params.read_yaml(f))
    profile = cfg.get("profile")
    if not isinstance(profile, str) or not profile:
        raise DraftportError(base, "no `profile` key: cannot name the MLflow experiment")
    return profile


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def _check_store(uri: str) -> None:
    """A sqlite store must exist already: opening a missing one would create an empty file."""
    db = _sqlite_file(uri)
    if db is not None and not db.is_file():
        raise DraftportError(
            uri,
            f"no tracking store ({db} does not exist); {HINT}, or set "
            f"MLFLOW_TRACKING_URI to the store the pipeline logged to",
        )
    if db is not None:  # read-only look: MLflow would turn any sqlite file into a store

        def tables_of():
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            finally:
                con.close()

        try:
            tables = retry(tables_of)  # a pipeline step may hold the write lock a moment
        except sqlite3.DatabaseError as e:
            raise DraftportError(uri, f"not a tracking store ({db}: {e})") from None
        if not {"experiments", "runs"} <= tables:
            raise DraftportError(uri, f"not an MLflow tracking store ({db} has no experiments and runs tables); {HINT}")
    if uri.startswith(("http://", "https://")):
        check_reachable(uri)


def _recorded(runs_dir: Path, phase: str) -> str | None:
    """The run id the workspace's evaluation of the phase logged to (.draftport/runs/)."""
    rec = runs_dir / f"eval_{phase}.json"
    try:
        return json.loads(rec.read_text()).get("run_id") if rec.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None


def find_runs(uri: str, profile: str, runs_dir: Path | str | None = None, check: bool = True) -> dict:
    """The profile's experiment and its phase runs: {experiment, experiment_id, runs: {phase:
    {run_id, accept_length, by}}, missing, curves: {run_id, children} or None}. A phase's run is
    the one the workspace's record names when this store holds it (by "record": the same run
    whichever URI reached it), else the phase's latest top-level run (by "latest")."""
    runs_dir = Path(runs_dir if runs_dir is not None else RUNS_DIR)
    if check:
        _check_store(uri)
    name = experiment_name(profile)
    try:
        c = client(uri)
        exp = retry(c.get_experiment_by_name, name)
    except Exception as e:  # MlflowException, sqlalchemy errors, a database driver missing
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DraftportError(uri, f"cannot read the tracking store ({type(e).__name__}: {line})") from None
    if exp is None or exp.lifecycle_stage != "active":
        others = sorted(x.name for x in retry(c.search_experiments) if x.name.startswith("draftport-"))
        has = f" (it has {', '.join(others)}: pass that profile's --configfile)" if others else ""
        raise DraftportError(uri, f"no experiment {name}{has}; {HINT}")
    # lazy: mlflow is optional (the pipeline extra)
    from mlflow.entities import ViewType

    found = retry(
        c.search_runs,
        [exp.experiment_id],
        run_view_type=ViewType.ACTIVE_ONLY,
        max_results=5000,
        order_by=["attributes.start_time DESC"],
    )
    by_id = {r.info.run_id: r for r in found}
    top = [r for r in found if "mlflow.parentRunId" not in r.data.tags]

    def latest(phase):
        return next((r for r in top if r.data.tags.get("draftport.phase", r.info.run_name) == phase), None)

    runs, missing = {}, []
    for phase in phases():
        run, by = by_id.get(_recorded(runs_dir, phase) or ""), "record"
        if run is None or "mlflow.parentRunId" in run.data.tags:
            run, by = latest(phase), "latest"
        if run is None:
            missing.append(phase)
            continue
        runs[phase] = {"run_id": run.info.run_id, METRIC: run.data.metrics.get(METRIC), "by": by}
    if not runs:
        raise DraftportError(uri, f"experiment {name} holds no phase run ({', '.join(phases())}); {HINT}")
    parent = latest(CURVES)
    curves = None
    if parent is not None:
        kids = [r.info.run_name for r in found if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        curves = {"run_id": parent.info.run_id, "children": sorted(kids)}
    return {"experiment": name, "experiment_id": exp.experiment_id, "runs": runs, "missing": missing, "curves": curves}


def _j(obj) -> str:
    """A query value as the UI writes it: JSON without spaces, percent-encoded."""
    return urllib.parse.quote(json.dumps(obj, separators=(",", ":")), safe="")


def urls(base: str, found: dict) -> dict:
    """The UI's addresses: the phases' compare view, their tau by training step, the runs table."""
    base = base.rstrip("/") + "/"
    exp = [found["experiment_id"]]
    ids = [r["run_id"] for r in found["runs"].values()]
    trained = [r["run_id"] for p, r in found["runs"].items() if p in trained_phases()]
    out = {
        "compare": f"{base}#/compare-runs?runs={_j(ids)}&experiments={_j(exp)}",
        "runs": f"{base}#/experiments/{found['experiment_id']}/runs?workflowType=machine_learning",
    }
    if trained:
        out["tau_by_step"] = (
            f"{base}#/metric?runs={_j(trained)}&metric={_j(METRIC)}&experiments={_j(exp)}"
            f"&plot_metric_keys={_j([METRIC])}&plot_layout={_j({})}&x_axis=step&y_axis_scale=linear"
            f"&line_smoothness=1&show_point=true&deselected_curves={_j([])}&last_linear_y_axis_range={_j([])}"
        )
    return out


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a closed port's TIME_WAIT is free
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve(uri: str, host: str, port: int, log: Path, timeout: float = 180.0) -> subprocess.Popen:
    """`mlflow server` on the store, in its own session (Ctrl-C reaches us, we stop it), once
    /health answers; its output goes to `log`."""
    if not port_free(host, port):
        raise DraftportError(f"{host}:{port}", "port in use (another MLflow UI?); pick another with --port")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")  # the UI needs no job runner
    out = open(log, "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            host,
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            uri,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    out.close()
    try:
        _wait_up(proc, host, port, log, timeout)
    except BaseException:  # not up, or interrupted while waiting: never left behind
        stop(proc)
        raise
    return proc


def _wait_up(proc: subprocess.Popen, host: str, port: int, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            why = lines[-1][:200] if lines else "no output"
            what = f"exited with {proc.returncode}" if proc.returncode is not None else f"not up in {timeout:.0f} s"
            raise DraftportError(log, f"mlflow server {what} ({why})")
        time.sleep(0.3)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's session (it and its workers), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def describe(uri: str, base: str, found: dict, u: dict, serving: bool) -> str:
    runs = found["runs"]
    lines = [
        f"MLflow UI {'at' if serving else 'for'} {base} on {uri}, experiment {found['experiment']} "
        f"(id {found['experiment_id']})",
        f"  compare the phases: {u['compare']}",
        f"      ({', '.join(f'{p} {METRIC} {_fmt(r[METRIC])}' for p, r in runs.items())})",
    ]
    if "tau_by_step" in u:
        lines += [
            f"  tau by step:        {u['tau_by_step']}",
            f"      ({', '.join(p for p in runs if p in trained_phases())}: held-out {METRIC} by training step)",
        ]
    lines.append(f"  runs table:         {u['runs']}")
    if found["curves"]:
        lines.append(
            f"      ({CURVES}: expand its row for its {len(found['curves']['children'])} nested runs, "
            f"one per point; Columns > Metrics > {METRIC} adds the column)"
        )
    if found["missing"]:
        lines.append(f"  not run yet: {', '.join(found['missing'])}")
    lines.append(f"  {TOGGLE}")
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(configfiles: list[Path], base: Path, host: str, port: int, print_only: bool, as_json: bool, log: Path) -> int:
    """The `draftport ui` command (cli.py parses, this runs)."""
    uri = tracking_uri()
    _check_store(uri)  # before the profile: run in the wrong folder, this says more
    found = find_runs(uri, profile_of(configfiles, base), check=False)
    remote = uri.startswith(("http://", "https://"))
    base_url = uri if remote else f"http://{host}:{port}"
    u = urls(base_url, found)
    serving = not (print_only or remote)
    report = {"store": uri, "ui": base_url.rstrip("/") + "/", "serving": serving, **found, "urls": u}

    def emit():
        if as_json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
        else:
            sys.stdout.write(describe(uri, base_url, found, u, serving))
            if print_only and not remote:
                sys.stdout.write(f"  serve it: mlflow server --host {host} --port {port} --backend-store-uri {uri}\n")
        sys.stdout.flush()

    if not serving:
        emit()
        return 0

    def _term(*_):
        raise KeyboardInterrupt

    # the server runs in its own session (a terminal's Ctrl-C reaches only us): stopped on every way
    # out; SIGINT handled even where a shell started us with it ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _term)
    proc = None
    try:
        proc = serve(uri, host, port, log)
        emit()
        print(f"serving until Ctrl-C (server log: {log})", file=sys.stderr, flush=True)
        code = proc.wait()
    except KeyboardInterrupt:
        if proc is not None:
            stop(proc)
        print("stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        if proc is not None:
            stop(proc)
    raise DraftportError(log, f"mlflow server exited with {code}")
