"""MLflow tracking: one experiment per profile, one run per phase, the same metric names.

The tracking store is MLFLOW_TRACKING_URI when set, else `sqlite:///mlflow.db` (MLflow 3 refuses the
./mlruns file store; a queued DVC experiment's copy logs to its repository's file). A server that
does not answer fails the step before any compute, with the URI in the message. Several pipeline
jobs may write one sqlite file at once: the experiment is created up front (the Snakefile's onstart,
`python -m draftport.pipeline.tracking init`) and every store call retries on "database is
locked".

A tracking hiccup never stops training: metrics logged while training go through a background
sender that retries transient failures (connection refused/reset, timeouts, HTTP 5xx) with
backoff for up to DRAFTPORT_MLFLOW_RETRY_S seconds (default 300) each, then drops them with a
warning; closing the run (finish) waits for the sender and retries the same way. The retries
are tenacity's (`retry`: database locked; `patient`: transient, up to a deadline). MLflow's own
HTTP retries are shortened (unless set in the environment) so that these are in charge.

Runs are named after the phase (phase0, phase1, phase1_scratch, phase2) and tagged with the git
commit and the source drafter's revision, so `mlflow ui`'s compare view lines phases up.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

from tenacity import RetryCallState, Retrying, retry_if_exception, stop_after_attempt, wait_exponential
from tenacity.stop import stop_base

from draftport.errors import DraftportError
from draftport.progress import Logger

DEFAULT_URI = "sqlite:///mlflow.db"


def dvc_exp_root(cwd: Path | None = None) -> Path | None:
    """The repository a queued/temp DVC experiment was copied from, when this process runs in
    that copy (`<repo>/.dvc/tmp/exps/<tmp>/`), else None."""
    parts = (cwd or Path.cwd()).resolve().parts
    for i in range(len(parts) - 3, 0, -1):
        if parts[i : i + 3] == (".dvc", "tmp", "exps"):
            return Path(*parts[:i])
    return None


def tracking_uri() -> str:
    """MLFLOW_TRACKING_URI, else the repo's sqlite store; a queued DVC experiment (run in a copy
    that DVC deletes afterwards) logs to the store of the repository it was queued from."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    root = dvc_exp_root()
    return f"sqlite:///{root / 'mlflow.db'}" if root is not None else DEFAULT_URI


def experiment_name(profile: str) -> str:
    return f"draftport-{profile}"


def check_reachable(uri: str | None = None, timeout: float = 5.0) -> str:
    """Fail fast (before compute) when the tracking store cannot be used; returns the URI."""
    uri = uri or tracking_uri()
    if uri.startswith(("http://", "https://")):
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                if r.status != 200:
                    raise DraftportError(uri, f"MLflow tracking server answered {r.status} on /health")
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise DraftportError(
                uri,
                f"MLflow tracking server unreachable ({reason}); start it or "
                f"unset MLFLOW_TRACKING_URI to log to {DEFAULT_URI}",
            ) from None
    elif uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///") :])
        parent = db.parent if str(db.parent) else Path(".")
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise DraftportError(uri, f"cannot write the tracking database's folder {parent}")
    return uri


def _locked(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, Exception) and ("database is locked" in msg or "busy" in msg)


def retry(fn: Callable, *args, attempts: int = 20, **kw):
    """Call an MLflow store function, retrying while sqlite says the database is locked (backoff
    0.1 s doubling to 2 s, `attempts` calls at most); any other failure, or the last, is raised."""
    # MlflowException, sqlalchemy OperationalError
    return Retrying(
        retry=retry_if_exception(_locked),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        reraise=True,
    )(fn, *args, **kw)


_TRANSIENT = re.compile(
    r"connection ?(refused|reset|aborted|error)|max retries exceeded|timed ?out|timeout|temporar|"
    r"remote ?end ?closed|newconnectionerror|error code 5\d\d|too many 5\d\d|\b50[0234]\b|"
    r"unavailable|bad gateway|database is locked|busy"
)


def transient(e: BaseException) -> bool:
    """A failure worth retrying: the store is (briefly) away, overloaded or locked."""
    return isinstance(e, (ConnectionError, TimeoutError)) or bool(_TRANSIENT.search(str(e).lower()))


def retry_seconds() -> float:
    return float(os.environ.get("DRAFTPORT_MLFLOW_RETRY_S") or 300)


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


class _stop_at(stop_base):
    """Stop when the next try would start after `deadline` (time.monotonic())."""

    def __init__(self, deadline: float):
        self.deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return time.monotonic() + retry_state.upcoming_sleep > self.deadline


def patient(fn: Callable, *args, deadline: float, what: str, **kw) -> bool:
    """Call fn until it succeeds, retrying transient failures with backoff (0.5 s doubling to
    10 s) until `deadline` (time.monotonic()). False, with a warning, when it kept failing or
    failed otherwise: the caller goes on (tracking must not cost the compute)."""
    retrying = Retrying(
        retry=retry_if_exception(lambda e: isinstance(e, Exception) and transient(e)),
        stop=_stop_at(deadline),
        wait=wait_exponential(multiplier=0.5, max=10.0),
        reraise=True,
    )
    try:
        retrying(fn, *args, **kw)
    except Exception as e:  # MlflowException, requests/urllib3 errors
        tries = retrying.statistics.get("attempt_number", 1)
        line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        if transient(e):
            warn(f"MLflow: {what} dropped after {tries} tries ({line})")
        else:
            warn(f"MLflow: {what} not logged ({line})")
        return False
    tries = retrying.statistics.get("attempt_number", 1)
    if tries > 1:
        print(f"MLflow: {what} logged after {tries} tries", file=sys.stderr, flush=True)
    return True


def client(uri: str | None = None):
    # lazy: mlflow is optional (the pipeline extra); training imports this module without it
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri or tracking_uri())


def ensure_experiment(profile: str, uri: str | None = None, c=None) -> str:
    """The experiment id of the profile, created if missing (race-safe)."""
    c = c or client(uri)
    name = experiment_name(profile)
    for _ in range(5):
        exp = retry(c.get_experiment_by_name, name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                retry(c.restore_experiment, exp.experiment_id)
            return exp.experiment_id
        try:
            return retry(c.create_experiment, name, tags={"draftport.profile": profile})
        except Exception as e:  # created by a parallel job in between
            if "already exists" not in str(e).lower() and "unique" not in str(e).lower():
                raise
    raise DraftportError(uri or tracking_uri(), f"cannot create or find experiment {name}")


def git_commit(cwd: str | Path = ".") -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not sha:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class PhaseRun(Logger):
    """One MLflow run; also the training loop's Logger (loss/accuracy by step)."""

    def __init__(self, profile: str, phase: str, *, tags: dict[str, str] | None = None, uri: str | None = None):
        # lazy: mlflow is optional (the pipeline extra)
        from mlflow.entities import RunTag

        self._q = None  # the background sender's queue (background())
        self.uri = check_reachable(uri)
        _short_http_retries()
        self.c = client(self.uri)
        self.exp_id = ensure_experiment(profile, self.uri, self.c)
        all_tags = {
            "mlflow.runName": phase,
            "draftport.phase": phase,
            "draftport.profile": profile,
            "mlflow.source.git.commit": git_commit(),
            **(tags or {}),
        }
        run = retry(self.c.create_run, self.exp_id, run_name=phase, tags={k: str(v) for k, v in all_tags.items()})
        self.run_id = run.info.run_id
        self._RunTag = RunTag

    @classmethod
    def attach(cls, run_id: str, where=None, uri: str | None = None) -> "PhaseRun":
        """An existing run (a phase's, reopened by a later step to add its figures). Fails before
        any compute when the store is unreachable or does not hold the run."""
        # lazy: mlflow is optional (the pipeline extra)
        from mlflow.entities import RunTag

        self = cls.__new__(cls)
        self._q = None
        self.uri = check_reachable(uri)
        self.c = client(self.uri)
        try:
            run = retry(self.c.get_run, run_id)
        except Exception as e:  # MlflowException: RESOURCE_DOES_NOT_EXIST
            raise DraftportError(
                where or self.uri,
                f"MLflow run {run_id} is not in {self.uri} "
                f"({str(e).splitlines()[0][:120]}); rerun the phase to log it there",
            ) from None
        self.run_id, self.exp_id, self._RunTag = run_id, run.info.experiment_id, RunTag
        return self

    # Logger
    def log_params(self, params: dict) -> None:
        # lazy: mlflow is optional (the pipeline extra)
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            retry(self.c.log_batch, self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Retried on transient failures, dropped with a warning if they last: never raises.
        In the background (background()) when a training loop calls it."""
        # lazy: mlflow is optional (the pipeline extra)
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [
            Metric(k, float(v), ts, int(step))
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        for i in range(0, len(items), 500):
            self._send(
                self.c.log_batch,
                self.run_id,
                metrics=items[i : i + 500],
                what=f"{len(items[i : i + 500])} metric(s) at step {step} for run {self.run_id} at {self.uri}",
            )

    def background(self) -> "PhaseRun":
        """From now on log_metrics queues and returns at once; a daemon thread sends (the
        training loop never waits for the store). finish() and interpreter exit flush it."""
        if getattr(self, "_q", None) is None:
            self._q = queue.Queue()
            threading.Thread(target=self._work, name="mlflow-sender", daemon=True).start()

            atexit.register(self.flush)
        return self

    def flush(self) -> None:
        if getattr(self, "_q", None) is not None:
            self._q.join()  # bounded: every queued call has its own deadline

    def _send(self, fn, *args, what: str, **kw) -> None:
        deadline = time.monotonic() + retry_seconds()
        if getattr(self, "_q", None) is not None:
            self._q.put((fn, args, kw, deadline, what))
        else:
            patient(fn, *args, deadline=deadline, what=what, **kw)

    def _work(self) -> None:
        while True:
            fn, args, kw, deadline, what = self._q.get()
            try:
                patient(fn, *args, deadline=deadline, what=what, **kw)
            except BaseException as e:  # pragma: no cover - never let the sender die silently
                warn(f"MLflow: {what} not logged ({e})")
            finally:
                self._q.task_done()

    def set_tags(self, tags: dict[str, Any]) -> None:
        retry(self.c.log_batch, self.run_id, tags=[self._RunTag(k, str(v)) for k, v in tags.items()])

    def finish(self, ok: bool = True) -> None:
        """Wait for queued metrics, then close the run (retried like them; never raises)."""
        self.flush()
        patient(
            self.c.set_terminated,
            self.run_id,
            "FINISHED" if ok else "FAILED",
            deadline=time.monotonic() + retry_seconds(),
            what=f"closing run {self.run_id} at {self.uri}",
        )


def _short_http_retries() -> None:
    """MLflow retries a failed HTTP call for minutes on its own (7 tries, backoff factor 2,
    120 s timeout), blocking the caller; ours (patient) does the waiting instead. Values set in
    the environment are kept."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")


def main(argv: list[str] | None = None) -> int:
    """`python -m draftport.pipeline.tracking init PROFILE`: check the store, create the experiment."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "init":
        print("usage: python -m draftport.pipeline.tracking init PROFILE", file=sys.stderr)
        return 2
    try:
        uri = check_reachable()
        exp = ensure_experiment(args[1], uri)
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"mlflow: experiment {experiment_name(args[1])} ({exp}) at {uri}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
