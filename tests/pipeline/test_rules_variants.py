"""The rules on a world unlike the embedded one: a micro world whose source drafter saw little of
the old target (a weak source, as a port from a drafter trained on a small set) and whose new
target moved further (more training on the new corpus): the source as fetched is below break-even
and scratch catches up with fine-tuning early. The whole plan runs to the decision; every field of
the recommendation must say what its numbers show (tests/helpers/decision_check.py), including "do
not deploy the source as fetched". (The micro profile of test_pipeline is the other regime.)"""

import json
import os

import pytest
from decision_check import says_what_the_numbers_show
from repo import BIN, micro_copy

pytestmark = pytest.mark.slow


def weak_source_far_target(cfg: dict) -> None:
    w = cfg["world"]
    w["source_drafter"]["n_samples"] = 24  # a quarter of micro's: a weak source
    w["source_drafter"]["train"]["steps"] = 6
    w["source_drafter"]["train"]["checkpoint_every"] = 6
    w["source_drafter"]["train"]["eval_every"] = 0
    w["target_new"]["steps"] = 40  # five times micro's: the target moved further
    cfg["drift"]["enabled"] = False  # not this test's subject
    c = cfg["curves"]
    c["recipes"] = {"lr_low": {"lr": 0.0005}}  # one recipe, R7's arm, at n=32: the rules' branches
    c["n_samples"], c["arms_n_samples"], c["seeds"] = [32, 128], [32], [0]  # one seed: the CIs are over prompts


def test_a_weak_source_on_a_far_target(tmp_path):
    path = tmp_path / "repo"
    cfg = micro_copy(path, weak_source_far_target)
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(path / "src"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("OMP_NUM_THREADS", None)
    import subprocess

    r = subprocess.run(
        [str(BIN / "snakemake"), "--cores", "2", "decision"],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    dec = json.loads((path / "artifacts/decision/decision.json").read_text())
    assert cfg["curves"]["recipes"] == {"lr_low": {"lr": 0.0005}}
    be = dec["costmodel"]["break_even_accept_length"]
    print(
        json.dumps(
            {
                "phase0": dec["phases"]["phase0"]["ci"],
                "break_even": be,
                "gain": dec["gain"],
                "recommendation": {
                    k: dec["recommendation"][k]
                    for k in ("init", "recipe", "regenerate", "n_samples", "deploy_source_now")
                },
            }
        )
    )
    # the regime this world was built for: the source as fetched below break-even ...
    assert dec["phases"]["phase0"]["ci"][1] < be and dec["recommendation"]["deploy_source_now"] is False
    # ... and scratch level with or ahead of fine-tuning at the largest n
    assert not (dec["gain"][-1]["significant"] and dec["gain"][-1]["better"] == "source")
    assert says_what_the_numbers_show(dec) == []
