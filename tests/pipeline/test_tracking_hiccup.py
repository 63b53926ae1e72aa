"""A tracking server that goes away mid-training: the training goes on, what was logged during a
short outage arrives once the server is back, what outlasts the retry budget is dropped with a
warning, and the run is closed at the end. A real `mlflow server`, killed and restarted on the
same port and backend store."""

import os

import pytest
from mlflow.exceptions import MlflowException
from mlflow_server import MlflowServer
from toys import make_features, toy_drafter

from draftport.pipeline.tracking import Logger, PhaseRun, transient
from draftport.training.loop import TrainConfig, train


@pytest.fixture
def server(tmp_path, monkeypatch):
    for k, v in (
        ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1"),
        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1"),
        ("MLFLOW_HTTP_REQUEST_TIMEOUT", "30"),
        ("DRAFTPORT_MLFLOW_RETRY_S", "120"),
    ):
        monkeypatch.setenv(k, v)
    s = MlflowServer(tmp_path)
    s.start()
    yield s
    if s.proc.poll() is None:
        s.kill()


class Outages(Logger):
    """Passes every call to the run; around chosen steps, takes the server down and up again."""

    def __init__(self, run: PhaseRun, server: MlflowServer):
        self.run, self.server, self.seen = run, server, []

    def log_metrics(self, metrics, step):
        if step == 3:  # a short outage: steps 3-5 are logged while the server is down
            self.server.kill()
        elif step == 6:
            self.server.start()
        elif step == 8:  # a long one: more than the retry budget, steps 8-9 are dropped
            self.run.flush()
            os.environ["DRAFTPORT_MLFLOW_RETRY_S"] = "1"
            self.server.kill()
        elif step == 10:
            self.run.flush()
            os.environ["DRAFTPORT_MLFLOW_RETRY_S"] = "120"
            self.server.start()
        self.seen.append(step)
        self.run.log_metrics(metrics, step)


@pytest.mark.slow
def test_training_survives_the_tracking_server_going_away(server, tmp_path, capsys):
    fs, head = make_features(tmp_path)
    run = PhaseRun("hiccup", "phase1", uri=server.uri).background()
    log = Outages(run, server)
    cfg = TrainConfig(steps=12, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=6, log_every=1)
    res = train(toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, logger=log, progress=False)
    assert res["steps"] == 12 and log.seen == list(range(1, 13))
    run.log_metrics({"accept_length": 2.5}, step=12)  # the step's final figures
    run.finish(ok=True)
    err = capsys.readouterr().err

    info = server.rest(f"runs/get?run_id={run.run_id}")["run"]
    assert info["info"]["status"] == "FINISHED"
    hist = server.rest(f"metrics/get-history?run_id={run.run_id}&metric_key=loss")["metrics"]
    assert sorted(int(m["step"]) for m in hist) == [1, 2, 3, 4, 5, 6, 7, 10, 11, 12]
    assert {m["key"]: m["value"] for m in info["data"]["metrics"]}["accept_length"] == 2.5
    assert "logged after" in err  # the short outage: retried until it worked
    dropped = [line for line in err.splitlines() if "dropped after" in line]
    assert dropped and all(f"{server.uri}" in line for line in dropped)
    assert {s for s in (8, 9) if any(f"at step {s} " in line for line in dropped)} == {8, 9}


def test_what_counts_as_a_hiccup():
    assert transient(
        MlflowException(
            "API request to http://h/api failed with exception HTTPConnectionPool("
            "host='h', port=5000): Max retries exceeded ([Errno 111] Connection refused)"
        )
    )
    assert transient(
        MlflowException(
            "API request to endpoint /api/2.0/mlflow/runs/log-batch failed with "
            "error code 503 != 200. Response body: ''"
        )
    )
    assert transient(ConnectionResetError(104, "Connection reset by peer"))
    assert not transient(MlflowException("INVALID_PARAMETER_VALUE: Metric 'loss' has a bad value"))
    assert not transient(MlflowException("RESOURCE_DOES_NOT_EXIST: Run 'x' not found"))
