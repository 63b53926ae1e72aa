"""A copy of the repository in which a training step is killed with SIGKILL after its first
checkpoint and run again: the copy (its commands, checkpoints, metrics, weights), the kill, and
the check that the resumed run ends as the uninterrupted one."""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch
from repo import BIN
from safetensors.torch import load_file

from draftport.pipeline import runner

STEP = "train_phase1_scratch"  # the control's training step
STEPS, EVERY = 120, 20  # ~5 s of training on 2 shared cores: a kill lands between checkpoints


class Copy:
    def __init__(self, path: Path):
        self.path = path
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(path / "src"),
            "DVC_NO_ANALYTICS": "1",
            "HF_HUB_OFFLINE": "1",
            "MLFLOW_TRACKING_URI": "sqlite:///mlflow.db",
        }
        self.env.pop("OMP_NUM_THREADS", None)

    def run(self, *cmd, check=True, timeout=600):
        r = subprocess.run(
            [str(c) for c in cmd], cwd=self.path, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and r.returncode:
            raise AssertionError(f"{cmd} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
        return r

    def start(self, *cmd) -> subprocess.Popen:
        """In its own session: a kill of the group takes the tool and the step it runs."""
        return subprocess.Popen(
            [str(c) for c in cmd],
            cwd=self.path,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def clone(self, dst: Path) -> "Copy":
        shutil.copytree(self.path, dst, symlinks=True)
        return Copy(dst)

    def ckpts(self) -> list[Path]:
        return sorted(p for p in (self.path / runner.CHECKPOINTS / STEP).glob("step_*") if (p / "state.json").is_file())

    def metrics(self) -> dict:
        return json.loads((self.path / runner.done(STEP)).read_text())

    def weights(self) -> dict:
        return load_file(str(self.path / "artifacts" / STEP / "drafter" / "model.safetensors"))


def kill_after_first_checkpoint(c: Copy, cmd) -> int:
    p = c.start(*cmd)
    deadline = time.time() + 300
    while not c.ckpts():
        assert p.poll() is None, f"{cmd} ended before its first checkpoint"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (c.path / runner.done(STEP)).exists(), "the run finished before the kill: make it longer"
    last = int(c.ckpts()[-1].name.split("_")[1])
    assert 0 < last < STEPS
    return last


def assert_same_result(c: Copy, ref: Copy, killed_at: int):
    log = (c.path / "logs" / f"{STEP}.log").read_text()
    m = c.metrics()
    assert m["resumed_from_step"] >= killed_at and m["resumed_from_step"] % EVERY == 0
    assert f"resuming from {runner.CHECKPOINTS}/{STEP}/step_{m['resumed_from_step']:07d}" in log
    assert m["train_steps"] == STEPS
    a, b = c.weights(), ref.weights()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert m["final_loss"] == ref.metrics()["final_loss"]  # (its accept length: the same weights, bit for bit)
    assert not (c.path / runner.CHECKPOINTS / STEP).exists()
