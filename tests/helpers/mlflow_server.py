"""A real `mlflow server` on 127.0.0.1 for the tests that need one (its own session, sqlite store
in a temp folder); start() waits for /health; it can be killed and started again on the same port
and store."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


# Ports below Linux's ephemeral range (32768-60999): the kernel never hands these out for bind(0) or
# connect(), so a port picked here stays free until the server that is told it binds it.
PORTS = range(20000, 32768)


def free_port() -> int:
    """A free port on 127.0.0.1 for a server a test starts. Under pytest-xdist each worker takes
    only ports that are its number modulo the number of workers: two workers never pick the same
    port in the seconds before their servers bind it (an MLflow or vLLM start), nor while a killed
    server is started again on its port."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    k = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % n  # gw0, gw1, ...: unset without xdist
    for _ in range(1000):
        port = random.randrange(PORTS.start // n, PORTS.stop // n) * n + k
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken
            return port
    raise RuntimeError(f"no free port in {PORTS}")


def rest(uri: str, path: str, body: dict | None = None):
    """MLflow's REST API: GET, or POST with a JSON body."""
    req = urllib.request.Request(
        f"{uri}/api/2.0/mlflow/{path}",
        method="POST" if body is not None else "GET",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


class MlflowServer:
    def __init__(self, tmp: Path, env: dict | None = None):
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.tmp, self.env, self.proc, self.starts = Path(tmp), env, None, 0

    def start(self, timeout: float = 300) -> "MlflowServer":
        self.starts += 1
        env = {**(self.env or os.environ), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = self.tmp / f"mlflow-server{self.starts}.log"
        self.proc = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.tmp}/mlflow-server.db",
                "--default-artifact-root",
                str(self.tmp / "mlart"),
            ],
            cwd=self.tmp,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as h:
                    if h.status == 200:
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise AssertionError("mlflow server did not start:\n" + log.read_text()[-3000:])
            time.sleep(0.3)

    def kill(self) -> None:
        """A crash, not a shutdown: the server's session (it and its workers) gets SIGKILL."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)

    def rest(self, path: str, body: dict | None = None):
        return rest(self.uri, path, body)
