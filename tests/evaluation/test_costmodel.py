"""Cost model: the seeds' numbers (82 tok/s baseline, 30 ms verify) and the CLI around it."""

import json
import subprocess
import sys

import pytest

from draftport.errors import DraftportError
from draftport.evaluation.costmodel import CostModel, accept_length_from_p, best_k, cond_acc

SEEDS = {  # tok/s -> (accept length, conditional acceptance), as the seeds quote them
    82: (2.46, 0.59),
    100: (3.0, 0.67),
    150: (4.5, 0.78),
    200: (6.0, 0.83),
}


def test_table_reproduces_the_seeds():
    t = CostModel(82, 30).table()
    assert t["break_even_accept_length"] == pytest.approx(2.46)
    assert t["break_even_cond_acc"] == pytest.approx(0.59, abs=0.005)
    rows = {r["tok_s"]: r for r in t["targets"]}
    assert {100.0, 150.0, 200.0} <= set(rows)
    for tok_s, (tau, p) in SEEDS.items():
        assert rows[tok_s]["accept_length"] == pytest.approx(tau)
        assert rows[tok_s]["cond_acc"] == pytest.approx(p, abs=0.005)


def test_finite_chain_inverts_and_caps_at_k_plus_one():
    for k in (1, 3, 7):
        for p in (0.3, 0.6, 0.9):
            assert cond_acc(accept_length_from_p(p, k), k) == pytest.approx(p, abs=1e-9)
    assert cond_acc(5.0, 3) is None  # 3 drafts + bonus cannot average 5
    cm = CostModel(82, 30, draft_ms=2, k=3)
    assert cm.cycle_s() == pytest.approx(0.036)
    assert cm.break_even_accept_length == pytest.approx(82 * 0.036)
    assert cm.table(targets=(200,))["targets"][-1]["cond_acc"] is None


def test_bad_parameters_are_errors():
    with pytest.raises(DraftportError, match="needs k"):
        CostModel(82, 30, draft_ms=2)  # the draft cost would silently vanish
    with pytest.raises(DraftportError, match="verify_ms"):
        CostModel(82, 0)
    with pytest.raises(DraftportError, match=r"\[0, 1\]"):
        best_k([0.8, 1.4], CostModel(82, 30))


def test_cheap_verify_needs_no_acceptance():
    # verify faster than a plain decode step: tau = 1 already beats the baseline
    assert CostModel(20, 30).table()["break_even_cond_acc"] == 0.0


def test_best_k_trades_acceptance_against_draft_cost():
    cm = CostModel(82, 30, draft_ms=3, k=5)
    res = best_k([0.8, 0.6, 0.45, 0.2, 0.05], cm)
    by_k = {r["k"]: r for r in res["by_k"]}
    assert by_k[3]["accept_length"] == pytest.approx(2.85)
    assert by_k[3]["tok_s"] == pytest.approx(2.85 / 0.039)
    assert res["best_k"] == 3


def test_cli_json():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftport.cli",
            "costmodel",
            "--baseline-tok-s",
            "82",
            "--verify-ms",
            "30",
            "--target-tok-s",
            "120",
            "--accept-rates",
            "0.8,0.6,0.4",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rep = json.loads(out.stdout)
    assert rep["break_even_accept_length"] == pytest.approx(2.46)
    assert [r["tok_s"] for r in rep["targets"]] == [82.0, 120.0]
    assert rep["best_k"]["best_k"] == 3
    default = subprocess.run(
        [sys.executable, "-m", "draftport.cli", "costmodel", "--baseline-tok-s", "82", "--verify-ms", "30", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert {r["tok_s"] for r in json.loads(default.stdout)["targets"]} >= {100.0, 150.0, 200.0}
