"""Rules R7 (regenerate or not) and R8 (recipe), the hours and the payback, on synthetic counts
whose gaps are known (tests/evaluation/test_decision.py's helpers)."""

import zlib

import pytest

from draftport.errors import DraftportError
from draftport.evaluation import decision, hours
from tests.evaluation.test_decision import CM, NB, K, counts, same_mean

SEEDS = (0, 1)


def pts(arm: str, taus: dict, like: str | None = None, seconds: float = 36.0):
    """A (arm) curve: {n: tau} with fresh counts; like: that arm's counts with a zero-sum
    perturbation (the same pooled tau, a paired difference of exactly 0)."""
    init = arm.split("-")[0]
    out = []
    for n, tau in taus.items():
        for s in SEEDS:
            acc, cyc = counts(tau, seed=zlib.crc32(f"{like or arm}/{n}/{s}".encode()))
            if like:
                acc = same_mean(acc)
            out.append(
                {
                    "init": init,
                    "arm": arm,
                    "n_samples": n,
                    "seed": s,
                    "train_seconds": seconds,
                    "answers": "dataset" if "-dataset" in arm else "regenerated",
                    "per_sample": {"accepted": acc, "cycles": cyc},
                }
            )
    return out


BASE = pts("source", {100: 2.6, 400: 2.9}) + pts("scratch", {100: 1.5, 400: 2.0})
RATES = {
    "rates": {
        "regenerate_s_per_sample": 36.0,
        "capture_s_per_sample": 3.6,
        "capture_dataset_s_per_sample": 1.8,
        "source": "test",
    },
    "phases": {},
    "plan": {"regenerate": 1.0, "capture": 0.5, "train": 2.0, "curves": 1.5, "total": 3.5},
}


def run(points, **kw):
    return decision.decide({"points": points}, {}, costmodel=CM, k=K, n_boot=NB, **kw)


def test_regenerate_when_the_targets_answers_train_better():
    d = run(BASE + pts("source-dataset", {400: 2.5}) + pts("scratch-dataset", {400: 1.9}), hours=RATES)
    rec = d["recommendation"]
    assert rec["regenerate"] is True
    g = d["answers_gain"]["source"][-1]
    assert g["significant"] and g["diff"] == pytest.approx(0.4, abs=0.05)
    # R2's n for source is 100: its regeneration is 100 x 36 s = 1 device-hour
    assert rec["n_samples"] == 100
    assert any(t.startswith("Regenerate the answers") and "costs 1 device-hours" in t for t in rec["text"])
    # the headline's n: the source curve still rises at n=400 (R6), so the drafter trains there
    assert rec["n_train"] == 400 and rec["chosen"]["n_samples"] == 400
    assert rec["chosen"]["arm"] == "source" and rec["chosen"]["measured"]
    assert rec["chosen"]["hours"] == pytest.approx({"regenerate": 4.0, "capture": 0.4, "train": 0.01, "total": 4.41})


def test_no_regeneration_when_it_brings_nothing():
    d = run(BASE + pts("source-dataset", {400: 2.9}, like="source") + pts("scratch-dataset", {400: 2.0}), hours=RATES)
    rec = d["recommendation"]
    assert rec["regenerate"] is False and not d["answers_gain"]["source"][-1]["significant"]
    assert d["answers_gain"]["source"][-1]["diff"] == pytest.approx(0.0, abs=1e-12)
    assert any(
        t.startswith("Do not regenerate: the new target's own answers bring no significant gain")
        and "saves 1 device-hours" in t
        for t in rec["text"]
    )
    # the chosen arm: source on the dataset's answers at the headline's n=400, where it was trained
    ch = rec["chosen"]
    assert ch["arm"] == "source-dataset" and ch["measured"] and ch["figures_from"] == "source-dataset"
    assert ch["hours"]["regenerate"] == 0.0 and ch["hours"]["capture"] == pytest.approx(400 * 1.8 / 3600)


def test_dataset_answers_better_and_not_measured():
    d = run(BASE + pts("source-dataset", {400: 3.3}))
    assert d["recommendation"]["regenerate"] is False
    assert any("the dataset's own answers train a better source drafter" in t for t in d["recommendation"]["text"])
    d = run(BASE)
    assert d["recommendation"]["regenerate"] is None and d["answers_gain"] == {}


def test_recipe_chosen_only_when_significant():
    more = pts("source", {800: 3.4}) + pts("scratch", {800: 2.2})  # still rising: the headline's n is 800
    good = run(BASE + more + pts("source-l2sp", {400: 3.2}) + pts("source-lr_low", {400: 2.9}, like="source"))
    rec = good["recommendation"]
    assert rec["recipe"] == "l2sp" and good["recipe_gain"]["l2sp"][-1]["significant"]
    assert rec["n_train"] == 800
    # arms at n=400 only: the plain source's figures at 800
    ch = rec["chosen"]
    assert ch["arm"] == "source-l2sp" and not ch["measured"] and ch["figures_from"] == "source"
    flat = run(BASE + pts("source-l2sp", {400: 2.9}, like="source") + pts("source-frozen", {400: 2.5}))
    rec = flat["recommendation"]
    assert rec["recipe"] == "plain"
    assert any(
        t.startswith("Recipe: plain fine-tuning; no recipe beats it significantly at n=400")
        and "frozen -0.3" in t
        and "l2sp +0.000" in t
        for t in rec["text"]
    )


def test_payback_by_hand():
    d = run(BASE, hours=RATES, serving_tokens_per_day=1e6)
    cm = d["costmodel"]
    ch = d["recommendation"]["chosen"]
    pay = d["recommendation"]["payback"]
    saved = 1e6 * (1 / cm["baseline_tok_s"] - 1 / ch["projected_tok_s"]) / 3600
    assert pay["saved_hours_per_day"] == pytest.approx(saved)
    assert pay["days"] == pytest.approx(ch["hours"]["total"] / saved)
    assert pay["plan"]["days"] == pytest.approx(3.5 / saved)
    slow = hours.payback(2.0, tok_s_chosen=50.0, tok_s_break_even=82.0, tokens_per_day=1e6)
    assert slow["days"] is None and slow["saved_hours_per_day"] < 0


def test_rates_from_the_steps_metrics():
    m = lambda n, r, c: {"samples": n, "regenerate": r, "capture": c}  # noqa: E731
    r = hours.rates(
        {
            "features_new": m(100, 30.0, 5.0),
            "features_phase2": m(300, 90.0, 15.0),
            "features_dataset": m(200, 0.0, 4.0),
        },
        {"default": {"gpu": 0}, "features_phase2": {"gpu": 2}},
    )
    assert r == {
        "regenerate_s_per_sample": (30 + 180) / 400,
        "capture_s_per_sample": (5 + 30) / 400,
        "capture_dataset_s_per_sample": 4 / 200,
    }
    with pytest.raises(DraftportError, match="logs/features_new.json: no samples / regenerate / capture seconds"):
        hours.rates({"features_new": {"samples": 3}})


def test_the_pipeline_tests_checker_catches_a_wrong_field():
    """tests/helpers/decision_check.py (used on pipeline runs) agrees with decide() here and flags a
    field flipped against the numbers."""
    from decision_check import says_what_the_numbers_show as check

    d = run(BASE + pts("source-dataset", {400: 2.5}) + pts("source-l2sp", {400: 3.2}), hours=RATES)
    assert check(d) == []
    for key, wrong in (("regenerate", False), ("recipe", "plain"), ("init", "scratch"), ("deploy_source_now", True)):
        bad = {**d, "recommendation": {**d["recommendation"], key: wrong}}
        if key == "deploy_source_now":  # R4 needs phase0: below break-even, so True is wrong
            bad["phases"] = {"phase0": {"accept_length": 1.5, "ci": [1.4, 1.6]}}
        assert any(m.startswith(key) for m in check(bad)), key
