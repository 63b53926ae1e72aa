"""`draftport ui` on a real sqlite tracking store made the way the steps make it (PhaseRun): which
runs it finds (the workspace's records, else each phase's latest top-level run; the curves'
nested runs under their parent), the UI addresses it prints, its one-line errors (no store, no
experiment, no phase run, a taken port), and a real `mlflow server` it starts and stops on
Ctrl-C. The pages behind the addresses, in a browser: tests/pipeline/test_pipeline.py on the micro store."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from mlflow_server import free_port

from draftport.pipeline.tracking import PhaseRun, ensure_experiment

BIN = Path(sys.executable).parent
PROFILE = "tiny"


def ui(cwd, *args, env=None):
    e = {**os.environ, **(env or {})}
    e.pop("MLFLOW_TRACKING_URI", None)
    e.update(env or {})
    return subprocess.run(
        [str(BIN / "draftport"), "ui", *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=e
    )


def one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("draftport: error: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A workspace (params.yaml: profile tiny) whose sqlite store holds what the pipeline logs:
    phase0, phase1_scratch, two phase1 runs (a rerun), the curves parent with two nested runs,
    and a run of another profile's experiment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "params.yaml").write_text(f"profile: {PROFILE}\n")
    # absolute here (MLflow keeps one engine per URI in this process); `draftport ui` runs in
    # tmp_path and opens it as the pipeline does, sqlite:///mlflow.db
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    runs = {}

    def phase(name, tau, steps=()):
        r = PhaseRun(PROFILE, name, uri=uri)
        for s, v in steps:
            r.log_metrics({"accept_length": v}, step=s)
        r.log_metrics({"accept_length": tau, "projected_tok_s": 100 * tau}, step=steps[-1][0] if steps else 0)
        r.finish()
        return r.run_id

    runs["phase0"] = phase("phase0", 1.25)
    runs["phase1_scratch"] = phase("phase1_scratch", 1.5, [(4, 1.1), (8, 1.4)])
    runs["phase1_old"] = phase("phase1", 1.75, [(4, 1.2), (8, 1.6)])
    time.sleep(0.01)
    runs["phase1"] = phase("phase1", 2.0, [(4, 1.3), (8, 1.9)])
    parent = PhaseRun(PROFILE, "curves", uri=uri)
    runs["curves"] = parent.run_id
    for init in ("source", "scratch"):
        kid = PhaseRun(
            PROFILE,
            f"curves {init} n=32 seed=0",
            uri=uri,
            tags={"mlflow.parentRunId": parent.run_id, "init": init, "n_samples": 32, "seed": 0},
        )
        kid.log_metrics({"accept_length": 1.5}, step=4)
        kid.finish()
    parent.finish()
    # a nested run never stands for a phase, even one named like it and started last
    PhaseRun(PROFILE, "phase0", uri=uri, tags={"mlflow.parentRunId": runs["phase1"]}).finish()
    PhaseRun("other", "phase0", uri=uri).finish()
    return tmp_path, runs


def query(url: str) -> dict:
    """The hash route's query, decoded (the UI reads JSON values)."""
    route = urllib.parse.urlsplit(url).fragment
    path, _, q = route.partition("?")
    return {"route": path, **{k: v[0] for k, v in urllib.parse.parse_qs(q).items()}}


def test_print_urls_finds_the_phase_runs_and_the_curves(store):
    cwd, runs = store
    r = ui(cwd, "--print-urls", "--json", "--port", "5123")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["experiment"] == f"draftport-{PROFILE}" and rep["serving"] is False
    # no record in .draftport/runs: each phase's latest top-level run, in the plan's order
    assert list(rep["runs"]) == ["phase0", "phase1_scratch", "phase1"]
    assert {p: v["run_id"] for p, v in rep["runs"].items()} == {
        p: runs[p] for p in ("phase0", "phase1_scratch", "phase1")
    }
    assert rep["runs"]["phase1"]["accept_length"] == 2.0
    assert rep["missing"] == ["phase2"]
    assert rep["curves"] == {
        "run_id": runs["curves"],
        "children": ["curves scratch n=32 seed=0", "curves source n=32 seed=0"],
    }
    exp = rep["experiment_id"]
    u = rep["urls"]
    assert u["compare"].startswith("http://127.0.0.1:5123/#/compare-runs?")
    c = query(u["compare"])
    assert c["route"] == "/compare-runs"
    assert json.loads(c["runs"]) == [runs["phase0"], runs["phase1_scratch"], runs["phase1"]]
    assert json.loads(c["experiments"]) == [exp]
    m = query(u["tau_by_step"])
    assert m["route"] == "/metric" and json.loads(m["metric"]) == "accept_length"
    assert json.loads(m["runs"]) == [runs["phase1_scratch"], runs["phase1"]]  # the trained phases
    assert m["x_axis"] == "step" and json.loads(m["plot_metric_keys"]) == ["accept_length"]
    assert u["runs"] == f"http://127.0.0.1:5123/#/experiments/{exp}/runs?workflowType=machine_learning"
    text = ui(cwd, "--print-urls", "--port", "5123")
    assert text.returncode == 0
    for line in (
        u["compare"],
        u["tau_by_step"],
        u["runs"],
        "phase1 accept_length 2.000",
        "not run yet: phase2",
        '"Model training"',
        "mlflow server --host 127.0.0.1 --port 5123 --backend-store-uri sqlite:///mlflow.db",
    ):
        assert line in text.stdout, line


def test_the_workspace_records_pick_the_run(store):
    """The evaluation's record (.draftport/runs/eval_<phase>.json) names the run behind the
    workspace's artifacts: it wins over a later run when this store holds it (whatever URI the
    step reached the store by); a record of a run the store lacks is passed over."""
    cwd, runs = store
    rec = cwd / ".draftport/runs/eval_phase1.json"
    rec.parent.mkdir(parents=True)
    rec.write_text(json.dumps({"run_id": runs["phase1_old"], "uri": "sqlite:///mlflow.db", "experiment_id": "1"}))
    rep = json.loads(ui(cwd, "--print-urls", "--json").stdout)
    assert rep["runs"]["phase1"] == {"run_id": runs["phase1_old"], "accept_length": 1.75, "by": "record"}
    assert rep["runs"]["phase0"]["by"] == "latest"
    rec.write_text(json.dumps({"run_id": runs["phase1_old"], "uri": "http://127.0.0.1:5000", "experiment_id": "1"}))
    assert json.loads(ui(cwd, "--print-urls", "--json").stdout)["runs"]["phase1"]["run_id"] == runs["phase1_old"]
    rec.write_text(json.dumps({"run_id": "0" * 32, "uri": "sqlite:///mlflow.db", "experiment_id": "1"}))
    assert json.loads(ui(cwd, "--print-urls", "--json").stdout)["runs"]["phase1"] == {
        "run_id": runs["phase1"],
        "accept_length": 2.0,
        "by": "latest",
    }


def test_errors_are_one_line(tmp_path, store):
    cwd, _ = store
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(ui(empty), "sqlite:///mlflow.db: no tracking store", "run `make phase1` first")
    assert not (empty / "mlflow.db").exists()  # looking never creates a store
    (cwd / "micro.yaml").write_text("profile: micro\n")
    one_line_error(
        ui(cwd, "--configfile", "micro.yaml", "--print-urls"),
        "no experiment draftport-micro",
        "draftport-other",
        "draftport-tiny",
        "run `make phase1` first",
    )
    bare = tmp_path / "bare"
    bare.mkdir()

    ensure_experiment("bare", f"sqlite:///{bare}/mlflow.db")
    (bare / "params.yaml").write_text("profile: bare\n")
    one_line_error(ui(bare, "--print-urls"), "experiment draftport-bare holds no phase run", "run `make phase1` first")
    (bare / "params.yaml").write_text("world: {}\n")
    one_line_error(ui(bare, "--print-urls"), "params.yaml: no `profile` key")
    one_line_error(ui(cwd, "--configfile", "nope.yaml", "--print-urls"), "nope.yaml: no such parameter file")
    one_line_error(
        ui(cwd, "--print-urls", env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}),
        "http://127.0.0.1:9: MLflow tracking server unreachable",
    )
    other = tmp_path / "other.db"
    other.write_bytes(b"")
    one_line_error(
        ui(cwd, "--print-urls", env={"MLFLOW_TRACKING_URI": f"sqlite:///{other}"}),
        "not an MLflow tracking store",
        "no experiments and runs tables",
    )
    assert other.stat().st_size == 0  # a sqlite file that is not a store is left as it was


def test_a_taken_port_is_named(store):
    cwd, _ = store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        one_line_error(ui(cwd, "--port", str(port)), f"127.0.0.1:{port}: port in use", "--port")


def test_serves_until_ctrl_c(store):
    """A real `mlflow server` on the store: up (its REST API lists the phase run) while
    `draftport ui` runs, gone after Ctrl-C, which exits 0."""
    cwd, runs = store
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    p = subprocess.Popen(
        [str(BIN / "draftport"), "ui", "--port", str(port)],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        first = p.stdout.readline()  # printed once the server answers
        assert first.startswith(f"MLflow UI at http://127.0.0.1:{port} on sqlite:///mlflow.db"), (first, p.poll())
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/get?run_id={runs['phase1']}", timeout=10
        ) as r:
            assert json.loads(r.read())["run"]["info"]["run_name"] == "phase1"
        assert "runs table:" in "".join(p.stdout.readline() for _ in range(8))
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
        assert "stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3)
    assert (cwd / "logs/mlflow_ui.log").read_text()
