"""The adaptive data budget (data.budget adaptive: step budget in place of features_phase2) on the
micro world, one copy, real Snakemake runs:
  - with micro's small training budget (1 epoch, at most 16 steps) the curve flattens: the rounds
    stop before the cap, "flattened";
  - with 4 epochs and up to 128 steps a point, the curve keeps rising: the rounds go on to the cap;
  - that run killed with SIGKILL inside a round resumes with the same command (the finished rounds
    kept) and ends with the uninterrupted run's budget.json, byte for byte;
  - Phase 2's data is the rounds' captures (a chain folder: the prompts after Phase 1's, up to where
    the rounds stopped); MLflow's run `budget` has each round."""

import json
import os
import signal
import sqlite3
import time

import pytest
import yaml
from repo import BIN, micro_copy
from resume_copy import Copy

from draftport.data.shards import FeatureChain, open_set
from draftport.plan import cluster
from draftport.plan import params as schema
from draftport.training.phases import feature_dirs

pytestmark = pytest.mark.slow
N1, CAP = 32, 256


def adaptive(cfg: dict) -> None:
    cfg["data"].update(budget="adaptive", seeds=[0])
    cfg["phase1"]["n_samples"], cfg["phase2"]["n_samples"] = N1, CAP
    cfg["curves"]["n_samples"] = [32, 128]
    cfg["drift"]["enabled"] = False


def rising(cfg: dict) -> None:
    """More training per point: the same epochs at every n (4), the steps' cap out of the way."""
    cfg["curves"]["epochs"] = 4
    cfg["curves"]["train"].update(steps=128, eval_every=0)


@pytest.fixture(scope="module")
def copy(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "repo"
    micro_copy(path, adaptive)
    return Copy(path)


def budget_json(c: Copy) -> dict:
    return json.loads((c.path / "artifacts/budget/budget.json").read_text())


def test_a_flattening_curve_stops_before_the_cap(copy):
    copy.run(BIN / "snakemake", "--cores", "2", "budget")
    b = budget_json(copy)
    print(b["why"])
    assert b["stop"] == "flattened" and b["n_samples"] < CAP
    last = b["rounds"][-1]
    assert last["projected_gain_ci_high"] < b["min_gain"] <= b["rounds"][-2].get("projected_gain_ci_high", 1e9)
    # Phase 2's data: the prompts after Phase 1's, up to where the rounds stopped
    parts = feature_dirs(copy.path / "artifacts/budget/train")
    chain = FeatureChain([open_set(p) for p in parts])
    assert chain.prompts[1:] == (N1, b["n_samples"])
    # MLflow: the step's run has each round's accept length, the round as its step
    db = sqlite3.connect(copy.path / "mlflow.db")
    steps = [r[0] for r in db.execute("select step from metrics where key = 'accept_length' order by step")]
    assert steps == list(range(len(b["rounds"])))


def edit(c: Copy, fn) -> None:
    params = c.path / "params.yaml"
    cfg = yaml.safe_load(params.read_text())
    fn(cfg)
    params.write_text(yaml.safe_dump(cfg, sort_keys=False))


def test_under_torchrun_the_rounds_train_over_two_processes_to_the_same_stop(copy):
    """resources.budget.torchrun: each round's trainings under torchrun (2 gloo processes on the
    CPU: every batch split, the gradients reduced), the step itself one process."""
    flat = budget_json(copy)
    edit(copy, lambda cfg: cfg["resources"].update(budget={"gpu": 2, "torchrun": True}))
    cfg = schema.load(base=copy.path / "params.yaml")
    assert cluster.launcher(cfg, "budget") == "python"  # the step itself: one process
    copy.run(BIN / "snakemake", "--cores", "2", "budget")
    b = budget_json(copy)
    assert {p for r in b["rounds"] for p in r["train_processes"]} == {2}
    assert {p for r in flat["rounds"] for p in r["train_processes"]} == {1}
    assert (b["stop"], b["n_samples"]) == (flat["stop"], flat["n_samples"])
    for one, two in zip(flat["rounds"], b["rounds"]):
        assert abs(one["accept_length"] - two["accept_length"]) < 0.01, (one, two)
    edit(copy, lambda cfg: cfg["resources"].pop("budget"))


def test_a_rising_curve_goes_to_the_cap_and_a_killed_round_resumes(copy):
    edit(copy, rising)
    cmd = (BIN / "snakemake", "--cores", "2", "budget")
    copy.run(*cmd)
    ref = (copy.path / "artifacts/budget/budget.json").read_bytes()
    b = budget_json(copy)
    print(b["why"])
    assert (b["stop"], b["n_samples"]) == ("cap: samples", CAP)
    assert [r["n_samples"] for r in b["rounds"]] == [32, 64, 128, 256]
    assert all(r["projected_gain_ci_high"] >= b["min_gain"] for r in b["rounds"][1:])

    # the same plan again from nothing, killed inside round 2 (after rounds 0 and 1 finished)
    os.system(f"rm -rf {copy.path}/artifacts/budget {copy.path}/checkpoints/budget")
    p = copy.start(*cmd)
    mark = copy.path / "checkpoints/budget/r2/spec.json"
    deadline = time.time() + 300
    while not mark.is_file():
        assert p.poll() is None, "the budget step ended before round 2 began"
        assert time.time() < deadline
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert not (copy.path / "artifacts/budget/budget.json").exists()  # nothing half-written
    copy.run(*cmd)
    log = (copy.path / "logs/budget.log").read_text()
    assert "round 1 (n = 64) finished before: kept" in log
    assert (copy.path / "artifacts/budget/budget.json").read_bytes() == ref
