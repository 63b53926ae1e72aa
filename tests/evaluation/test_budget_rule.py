"""The adaptive data budget's rule (draftport.evaluation.budget) on curves of known shape: the
projection is exact on a power-law curve, a flattening curve stops before the cap, a curve that
keeps rising goes on to the cap, an hours cap stops it where the hours run out."""

import math

import numpy as np
import pytest

from draftport.errors import DraftportError
from draftport.evaluation import budget

P, CYCLES = 200, 40  # prompts, verify cycles per prompt


def counts(tau: float, rng, difficulty) -> dict:
    """Per-prompt counts whose pooled accept length is about tau: each prompt's own difficulty
    (shared by every round: the rounds are paired) and a little noise of its own."""
    acc = np.clip((tau - 1.0 + difficulty + rng.normal(0, 0.05, P)) * CYCLES, 0, None).round()
    return {"accepted": [acc.tolist()], "cycles": [[CYCLES] * P]}


def run_rounds(curve, *, n1=32, cap=512, factor=2.0, min_gain=0.05, hours_per_sample=0.0, max_hours=None):
    """The budget step's loop on a curve tau(n): (the n it stops at, why, the rounds' n)."""
    rng = np.random.default_rng(0)
    difficulty = rng.normal(0, 0.3, P)
    rounds, n, hours = [], n1, 0.0
    while True:
        rounds.append({"n_samples": n, **counts(curve(n), rng, difficulty)})
        hours += (n - (rounds[-2]["n_samples"] if len(rounds) > 1 else n)) * hours_per_sample
        if len(rounds) == 1:
            n = budget.next_n(n, factor, cap)
            continue
        nn = budget.next_n(n, factor, cap) if n < cap else budget.next_n(n, factor, 2 * n + 1)
        proj = budget.project_next_gain(rounds, nn, n_boot=500)
        why = budget.stop_reason(
            proj,
            n=n,
            cap=cap,
            min_gain=min_gain,
            hours_spent=hours,
            next_hours=(nn - n) * hours_per_sample,
            max_hours=max_hours,
        )
        if why:
            return n, why, [r["n_samples"] for r in rounds]
        n = nn


def test_schedule_doubles_up_to_the_cap():
    assert budget.schedule(32, 2.0, 300) == [32, 64, 128, 256, 300]
    assert budget.next_n(10, 1.01, 100) == 11  # always more than n
    assert budget.next_n(256, 2.0, 300) == 300


def test_the_projection_is_exact_on_a_power_law():
    """tau = a - b n^-c: slopes per e-fold shrink by 2^-c per doubling, so the projection from two
    slopes is the next round's true gain."""

    def tau(n):
        return 3.0 - 2.0 * (n / 32) ** -0.7

    ns = [32, 64, 128]
    taus = [tau(n) for n in ns]
    assert budget._projection(taus, ns, 256) == pytest.approx(tau(256) - tau(128), rel=1e-9)
    # after one round there is no evidence of flattening: the last gain again (per e-fold)
    assert budget._projection(taus[:2], ns[:2], 128) == pytest.approx(tau(64) - tau(32), rel=1e-9)


def test_a_flattening_curve_stops_before_the_cap():
    n, why, ns = run_rounds(lambda n: 3.0 - 1.5 * (n / 32) ** -1.5)
    assert why == budget.FLATTENED and n < 512, (n, why, ns)
    # it went on while the gain could still be worth it: the round before the stop gained > min_gain
    assert 3.0 - 1.5 * (n / 32) ** -1.5 - (3.0 - 1.5 * (ns[-2] / 32) ** -1.5) > 0.05


def test_a_curve_that_keeps_rising_goes_on_to_the_cap():
    n, why, ns = run_rounds(lambda n: 1.5 + 0.3 * math.log(n / 32))  # +0.21 per doubling
    assert (n, why) == (512, budget.CAP_SAMPLES)
    assert ns == [32, 64, 128, 256, 512]


def test_an_hours_cap_stops_where_the_hours_run_out():
    # 0.01 h a sample: rounds to 64, 128 spend 0.32 + 0.64 = 0.96 h; the next (128 -> 256) would add 1.28
    n, why, ns = run_rounds(lambda n: 1.5 + 0.3 * math.log(n / 32), hours_per_sample=0.01, max_hours=2.0)
    assert (n, why) == (128, budget.CAP_HOURS), (n, why, ns)


def test_the_ci_is_over_prompts_and_paired():
    rng = np.random.default_rng(1)
    difficulty = rng.normal(0, 0.3, P)
    rounds = [{"n_samples": n, **counts(t, rng, difficulty)} for n, t in ((32, 2.0), (64, 2.2), (128, 2.3))]
    p = budget.project_next_gain(rounds, 256, n_boot=1000)
    assert p["ci"][0] <= p["projected_gain"] <= p["ci"][1]
    # paired: the prompts' shared difficulty (std 0.3) cancels, the CI is far narrower than it
    assert p["ci"][1] - p["ci"][0] < 0.1


def test_bad_rounds_are_refused():
    rng = np.random.default_rng(0)
    one = {"n_samples": 32, **counts(2.0, rng, np.zeros(P))}
    with pytest.raises(DraftportError, match="at least two rounds"):
        budget.project_next_gain([one], 64)
    short = {"n_samples": 64, "accepted": [[1.0] * 10], "cycles": [[2.0] * 10]}
    with pytest.raises(DraftportError, match="same prompts"):
        budget.project_next_gain([one, short], 128)
    with pytest.raises(DraftportError, match="increasing"):
        budget.project_next_gain([one, {**one}], 128)
