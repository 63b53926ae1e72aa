"""draftport.evaluation.decision: bootstrap CIs over prompts, the paired gains, rules R1-R9, and `draftport decide`."""

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from draftport.cli import main
from draftport.errors import DraftportError
from draftport.evaluation import decision

ROOT = Path(__file__).resolve().parents[2]
# cycle = (18 + 1 * 2) ms = 20 ms -> break-even tau = 100 tok/s * 0.020 s = 2.0; tok/s = 50 * tau
CM = {"baseline_tok_s": 100.0, "verify_ms": 18.0, "draft_ms": 2.0}
K = 1
NB = 300  # bootstrap draws in tests
P = 200
CYC = 20


def counts(tau, seed, *, p=P, noise=0.3):
    """Per-prompt counts whose pooled tau is near `tau` (CYC cycles a prompt, noisy acceptance)."""
    rng = np.random.default_rng(seed)
    acc = np.clip(np.rint((tau - 1.0) * CYC + rng.normal(0.0, noise * CYC, p)), 0, None).astype(int)
    return acc.tolist(), [CYC] * p


def same_mean(acc, shift=3):
    """Different per-prompt counts with exactly the same sum: a paired difference of exactly 0."""
    d = np.array([shift if i % 2 == 0 else -shift for i in range(len(acc))])
    if len(acc) % 2:
        d[-1] = 0
    out = np.array(acc) + d
    assert (out >= 0).all()
    return out.tolist()


def point(init, n, seed, acc, cyc):
    return {
        "init": init,
        "n_samples": n,
        "seed": seed,
        "accept_length": 0.0,
        "train_steps": 10,
        "per_sample": {"accepted": acc, "cycles": cyc},
    }


def curves_from(taus: dict, seeds=(0, 1), perturb: dict | None = None):
    """taus: {init: {n: tau}}; perturb: {(init, n): (other_init)} -> that point gets the other init's
    counts with a zero-sum perturbation (the same pooled tau, different prompts)."""
    pts = []
    base = {}
    for init, by_n in taus.items():
        for n, tau in by_n.items():
            for s in seeds:
                acc, cyc = counts(tau, seed=zlib.crc32(f"{init}/{n}/{s}".encode()))
                base[(init, n, s)] = (acc, cyc)
    for (init, n, s), (acc, cyc) in base.items():
        if perturb and (init, n) in perturb:
            acc0, cyc = base[(perturb[(init, n)], n, s)]
            acc = same_mean(acc0)
        pts.append(point(init, n, s, acc, cyc))
    return {"points": pts, "other": "ignored"}


def phase(tau, seed, p=120):
    acc, cyc = counts(tau, seed, p=p)
    return {"accept_length": tau, "per_sample": {"accepted": acc, "cycles": cyc}}


def run_decide(curves, phases=None, **kw):
    return decision.decide(curves, phases or {}, costmodel=CM, k=K, n_boot=NB, **kw)


# ---------------------------------------------------------------- statistics


def test_tau_ci_hand_computed():
    acc = [[3, 5, 0], [2, 0, 4]]
    cyc = [[2, 2, 1], [1, 1, 3]]
    r = decision.tau_ci(acc, cyc, n_boot=NB, seed=0)
    assert r["accept_length"] == pytest.approx(1 + 14 / 10)
    assert r["seeds"] == pytest.approx([1 + 8 / 5, 1 + 6 / 5])
    assert r["seed_std"] == pytest.approx(0.2)  # population std of (2.6, 2.2)
    assert r["n_prompts"] == 3
    assert r["ci"][0] <= r["accept_length"] <= r["ci"][1]
    one = decision.tau_ci([3, 5, 0], [2, 2, 1], n_boot=NB)  # 1-D: one seed
    assert (
        one["accept_length"] == pytest.approx(2.6) and one["seed_std"] == 0.0 and one["seeds"] == [pytest.approx(2.6)]
    )


def test_tau_ci_width_determinism():
    acc, cyc = counts(2.2, seed=1, p=400)
    big = decision.tau_ci(acc, cyc, n_boot=NB, seed=3)
    small = decision.tau_ci(acc[:25], cyc[:25], n_boot=NB, seed=3)
    assert big["ci"][0] < big["accept_length"] < big["ci"][1]
    assert small["ci"][1] - small["ci"][0] > 2 * (big["ci"][1] - big["ci"][0])
    assert decision.tau_ci(acc, cyc, n_boot=NB, seed=3) == big
    assert decision.tau_ci(acc, cyc, n_boot=NB, seed=4)["ci"] != big["ci"]


def test_bootstrap_keeps_a_prompts_seeds_together():
    # Two seeds anti-correlated per prompt: resampling prompts jointly keeps every draw at tau = 2.
    acc = [[0, 20, 0, 20], [20, 0, 20, 0]]
    cyc = [[10] * 4, [10] * 4]
    r = decision.tau_ci(acc, cyc, n_boot=NB)
    assert r["ci"] == pytest.approx([2.0, 2.0])
    assert r["seeds"] == pytest.approx([2.0, 2.0])


@pytest.mark.parametrize(
    "acc,cyc,problem",
    [
        ([1, 2], [1, 2, 3], "differ in shape"),
        ([], [], "no counts"),
        ([1, -1], [1, 1], ">= 0"),
        ([0, 0], [0, 0], "sum of cycles is 0"),
        ([[[1]]], [[[1]]], "[seeds, prompts]"),
    ],
)
def test_tau_ci_bad_inputs(acc, cyc, problem):
    with pytest.raises(DraftportError) as e:
        decision.tau_ci(acc, cyc, n_boot=10)
    assert problem in str(e.value)


def test_paired_diff_ci():
    a = counts(2.4, seed=1)
    b = counts(2.0, seed=2)
    r = decision.paired_diff_ci([a[0]], [a[1]], *b, n_boot=NB, level=0.95, seed=0)
    assert r["diff"] == pytest.approx((1 + sum(a[0]) / sum(a[1])) - (1 + sum(b[0]) / sum(b[1])))
    assert r["significant"] and r["better"] == "a" and r["ci"][0] > 0
    assert decision.paired_diff_ci(*b, *a, n_boot=NB, seed=0)["better"] == "b"
    same = decision.paired_diff_ci(a[0], a[1], same_mean(a[0]), a[1], n_boot=NB, seed=0)
    assert same["diff"] == pytest.approx(0.0) and not same["significant"] and same["better"] is None
    with pytest.raises(DraftportError, match="same prompts"):
        decision.paired_diff_ci(a[0], a[1], a[0][:-1], a[1][:-1], n_boot=NB, seed=0)


# ---------------------------------------------------------------- the decision


def test_clear_gain_source():
    d = run_decide(curves_from({"source": {100: 1.8, 200: 2.3, 400: 2.6}, "scratch": {100: 1.3, 200: 1.6, 400: 1.9}}))
    assert d["schema"] == "draftport.decision/1" and d["k"] == K and d["n_boot"] == NB
    assert d["costmodel"]["break_even_accept_length"] == pytest.approx(2.0)
    src = d["curves"]["source"]
    assert [r["n_samples"] for r in src] == [100, 200, 400]
    assert [r["beats_break_even"] for r in src] == ["no", "yes", "yes"]
    assert all(r["n_seeds"] == 2 and len(r["seeds"]) == 2 for r in src)
    assert src[1]["projected_tok_s"] == pytest.approx(50 * src[1]["accept_length"])
    assert src[1]["speedup_vs_baseline"] == pytest.approx(src[1]["accept_length"] / 2.0)
    assert src[1]["ci"][0] > 2.0
    assert [g["n_samples"] for g in d["gain"]] == [100, 200, 400]
    assert all(g["significant"] and g["better"] == "source" and g["diff"] > 0.4 for g in d["gain"])
    assert d["smallest_n_beating_break_even"] == {"source": 200, "scratch": None}
    rec = d["recommendation"]
    assert rec["init"] == "source" and rec["n_samples"] == 200 and rec["confidence"] == "high"
    assert [r["id"] for r in rec["rules"]] == ["R1", "R2", "R3", "R4", "R5", "R6", "R7", "R8", "R9"]
    assert any("n=200" in s and f"{src[1]['accept_length']:.3f}" in s for s in rec["text"])
    assert rec["phase2"] == "not measured" and rec["deploy_source_now"] is False
    assert d["phases"] == {} and d["phase2_gain"] is None and d["phase1_gain_vs_scratch"] is None and d["drift"] is None
    json.dumps(d)  # plain JSON types only
    assert list(d) == [
        "schema",
        "level",
        "n_boot",
        "k",
        "min_gain",
        "costmodel",
        "curves",
        "gain",
        "smallest_n_beating_break_even",
        "phases",
        "phase1_gain_vs_scratch",
        "phase2_gain",
        "plateau",
        "answers_gain",
        "recipe_gain",
        "drift",
        "hours",
        "recommendation",
    ]
    assert list(src[0]) == [
        "n_samples",
        "accept_length",
        "ci",
        "seeds",
        "seed_std",
        "n_seeds",
        "projected_tok_s",
        "speedup_vs_baseline",
        "beats_break_even",
    ]
    assert (
        run_decide(curves_from({"source": {100: 1.8, 200: 2.3, 400: 2.6}, "scratch": {100: 1.3, 200: 1.6, 400: 1.9}}))
        == d
    )  # deterministic


def test_overlapping_cis_not_significant():
    d = run_decide(
        curves_from(
            {"source": {100: 2.3, 200: 2.5}, "scratch": {100: 2.3, 200: 2.5}},
            perturb={("scratch", 100): "source", ("scratch", 200): "source"},
        )
    )
    assert all(not g["significant"] and g["better"] is None for g in d["gain"])
    assert all(abs(g["diff"]) < 1e-9 for g in d["gain"])
    rec = d["recommendation"]
    assert rec["init"] == "either"
    assert rec["n_samples"] == 100  # the smaller of the two inits' smallest n
    assert rec["confidence"] == "medium"


def test_advantage_vanishing_at_largest_n():
    d = run_decide(
        curves_from(
            {"source": {100: 1.8, 200: 2.3, 400: 2.6}, "scratch": {100: 1.3, 200: 1.9, 400: 2.6}},
            perturb={("scratch", 400): "source"},
        )
    )
    g = {x["n_samples"]: x for x in d["gain"]}
    assert g[100]["significant"] and g[200]["significant"] and not g[400]["significant"]
    rec = d["recommendation"]
    assert rec["init"] == "source" and rec["confidence"] != "high"
    assert rec["confidence"] == "medium" and rec["n_samples"] == 200
    s = rec["text"][0]
    assert "not significant at the largest n=400" in s and "n=100" in s and "n=200" in s


def test_scratch_wins_at_largest_n():
    d = run_decide(curves_from({"source": {100: 1.8, 400: 2.2}, "scratch": {100: 1.4, 400: 2.7}}))
    g = {x["n_samples"]: x for x in d["gain"]}
    assert g[100]["better"] == "source" and g[400]["better"] == "scratch"
    rec = d["recommendation"]
    assert rec["init"] == "scratch" and rec["n_samples"] == 400 and rec["confidence"] == "high"


def test_nothing_reaches_break_even():
    d = run_decide(curves_from({"source": {100: 1.5, 300: 1.8}, "scratch": {100: 1.2, 300: 1.4}}))
    assert d["smallest_n_beating_break_even"] == {"source": None, "scratch": None}
    assert all(r["beats_break_even"] == "no" for i in ("source", "scratch") for r in d["curves"][i])
    rec = d["recommendation"]
    assert rec["init"] == "source" and rec["n_samples"] is None and rec["confidence"] == "medium"
    s = rec["text"][3]  # R1, R8, R7, then R2
    assert "None of the measured n (up to n=300)" in s and "more data than n=300" in s and "2.000" in s


def test_one_init_only_at_some_n():
    d = run_decide(curves_from({"source": {100: 1.8, 200: 2.4}, "scratch": {100: 1.3}}))
    assert [g["n_samples"] for g in d["gain"]] == [100]
    assert d["recommendation"]["init"] == "source"
    assert d["recommendation"]["n_samples"] == 200


CURVES = curves_from({"source": {100: 2.4}, "scratch": {100: 1.6}}, seeds=(0,))


def test_phase2_helps_and_deploy():
    ph = {"phase0": phase(2.5, 1), "phase1_scratch": phase(1.8, 2), "phase1": phase(2.3, 3), "phase2": phase(2.7, 4)}
    d = run_decide(CURVES, ph, drift={"tau_gap": 0.25, "cos_final": 0.9})
    assert list(d["phases"]) == ["phase0", "phase1_scratch", "phase1", "phase2"]
    assert d["phases"]["phase0"]["beats_break_even"] == "yes"
    assert d["phase2_gain"]["significant"] and d["phase2_gain"]["diff"] > 0
    assert set(d["phase2_gain"]) == {"diff", "ci", "significant"}
    assert d["phase1_gain_vs_scratch"]["better"] == "phase1"
    rec = d["recommendation"]
    assert rec["phase2"] == "helps" and rec["deploy_source_now"] is True
    assert d["drift"] == {"tau_gap": 0.25, "cos_final": 0.9}
    assert any("+0.250" in s for s in rec["text"])
    assert any("Deploy the source drafter now" in s for s in rec["text"])


def test_phase2_hurts_no_gain_not_measured():
    base = {"phase0": phase(1.5, 1), "phase1": phase(2.5, 3)}
    hurts = run_decide(CURVES, {**base, "phase2": phase(2.1, 4)})["recommendation"]
    assert hurts["phase2"] == "hurts" and hurts["deploy_source_now"] is False
    p1 = base["phase1"]["per_sample"]
    flat = {**base, "phase2": {"per_sample": {"accepted": same_mean(p1["accepted"]), "cycles": p1["cycles"]}}}
    d = run_decide(CURVES, flat)
    assert d["recommendation"]["phase2"] == "no significant gain" and not d["phase2_gain"]["significant"]
    missing = run_decide(CURVES, {"phase1": phase(2.5, 3), "phase2": {"accept_length": 2.9}})
    assert missing["phase2_gain"] is None and missing["recommendation"]["phase2"] == "not measured"
    assert "phase2" not in missing["phases"]
    assert missing["recommendation"]["deploy_source_now"] is False  # phase0 missing


def test_bad_inputs():
    c = curves_from({"source": {100: 2.0}, "scratch": {100: 2.0}}, seeds=(0,))
    c["points"][1]["per_sample"] = {"accepted": [1] * (P - 1), "cycles": [CYC] * (P - 1)}
    with pytest.raises(DraftportError) as e:
        run_decide(c)
    assert e.value.where == "curves" and "same prompts" in str(e.value)
    with pytest.raises(DraftportError, match="init"):
        run_decide({"points": [point("sauce", 1, 0, [1], [1])]})
    with pytest.raises(DraftportError) as e:
        run_decide(CURVES, {"phase0": phase(2.0, 1, p=10), "phase1": phase(2.0, 2, p=11)})
    assert e.value.where == "phases"
    with pytest.raises(DraftportError) as e:
        decision.decide(CURVES, {}, costmodel={"baseline_tok_s": 100.0}, k=1, n_boot=NB)
    assert e.value.where == "costmodel"


STRONG = {"source": {100: 1.8, 200: 2.6}, "scratch": {100: 1.3, 200: 1.6}}  # R1 and R2 hold: confidence high


def test_r9_a_degenerate_phase_lowers_the_confidence_and_is_named():
    fine = run_decide(curves_from(STRONG), {"phase0": phase(1.5, 1), "phase1": phase(2.5, 2)})
    assert fine["recommendation"]["confidence"] == "high" and fine["recommendation"]["evidence_problems"] == []
    flat = {"accept_length": 1.5, "per_sample": {"accepted": [10] * 120, "cycles": [20] * 120}}  # every prompt 1.5
    d = run_decide(curves_from(STRONG), {"phase0": flat, "phase1": phase(2.5, 2)})
    rec = d["recommendation"]
    assert d["phases"]["phase0"]["ci"] == [1.5, 1.5]
    assert rec["confidence"] == "medium"
    [problem] = rec["evidence_problems"]
    assert problem["kind"] == "degenerate" and problem["where"] == "phase phase0" and problem["ci"] == [1.5, 1.5]
    assert problem["text"] in rec["text"] and "1.500 (CI [1.500, 1.500])" in problem["text"]
    assert rec["rules"][8] == {"id": "R9", "fired": "degenerate: phase phase0"}
    assert "R9 found 1 problem(s)" in rec["rules"][4]["fired"]


def test_r9_names_a_curve_that_contradicts_the_phase_at_the_same_n():
    curves = curves_from(STRONG)
    seed0 = next(p for p in curves["points"] if p["init"] == "source" and p["n_samples"] == 200 and p["seed"] == 0)
    agrees = {"accept_length": 0.0, "per_sample": seed0["per_sample"]}  # the curve's own seed-0 drafter
    ok = run_decide(curves, {"phase2": agrees}, phase_n={"phase2": 200})
    assert ok["recommendation"]["evidence_problems"] == [] and ok["recommendation"]["confidence"] == "high"
    far = {"phase2": phase(3.4, 5, p=200)}  # far above the source curve's 2.6 at the same n
    assert run_decide(curves, far)["recommendation"]["evidence_problems"] == []  # no n given: not checked
    d = run_decide(curves, far, phase_n={"phase2": 200, "phase1": 50})  # no curve point at n=50: not checked
    rec = d["recommendation"]
    [problem] = rec["evidence_problems"]
    assert problem["kind"] == "contradicting" and problem["where"] == "phase2 vs curves.source at n=200"
    assert problem["curve_ci"][1] < problem["phase_ci"][0]
    assert "curves.train.steps" in problem["text"] and problem["text"] in rec["text"]
    assert rec["confidence"] == "medium"


def test_r6_says_why_a_gain_above_min_gain_does_not_count():
    curves = curves_from({"source": {100: 2.4, 200: 2.43}, "scratch": {100: 1.3, 200: 1.6}})
    d = run_decide(curves, min_gain=0.05)
    rec = d["recommendation"]
    row = d["plateau"][0]
    # n=200 is above n=100 (CI above 0) but its CI's lower end is not above min_gain
    assert 0 < row["ci"][0] <= 0.05 < row["ci"][1] and not row["significantly_below"]
    assert rec["n_enough"] == 100
    [sentence] = [t for t in rec["text"] if t.startswith("Enough data")]
    assert f"lower end {row['ci'][0]:.3f} is not above 0.05, so the gain does not count" in sentence


def test_rules_are_documented_word_for_word():
    doc = (ROOT / "docs" / "decision.md").read_text()
    for rid, txt in decision.RULES.items():
        assert f"**{rid}** {txt}" in doc, rid


def test_render_text():
    ph = {"phase0": phase(2.5, 1), "phase1": phase(2.3, 3), "phase2": phase(2.7, 4)}
    d = run_decide(curves_from({"source": {100: 1.8, 200: 2.3}, "scratch": {100: 1.3, 200: 1.6}}), ph)
    out = decision.render_text(d)
    lines = out.splitlines()
    assert lines[0].startswith("Do: fine-tune the source drafter on n=200 new-target samples")  # the headline
    assert lines[1].startswith(
        "Recommendation: init source, recipe plain, regenerate not measured, n_samples 200 (enough: 200), phase2 helps"
    )
    assert f"{d['curves']['scratch'][1]['accept_length']:.3f}" in out
    assert "Phase 2 - Phase 1:" in out and "phase0" in out and "Gain source - scratch:" in out


# ---------------------------------------------------------------- CLI


def cli(args, capsys):
    try:
        rc = main(args)
    except SystemExit as e:  # typer exits on success
        rc = e.code or 0
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_decide(tmp_path, capsys):
    d = run_decide(curves_from({"source": {100: 1.8, 200: 2.3}, "scratch": {100: 1.3, 200: 1.6}}))
    path = tmp_path / "decision.json"
    path.write_text(json.dumps(d))
    rc, out, err = cli(["decide", str(path)], capsys)
    assert rc == 0 and err == ""
    assert out.splitlines()[1].startswith(
        "Recommendation: init source, recipe plain, regenerate not measured, n_samples 200"
    )
    rc, out, _ = cli(["decide", str(path), "--json"], capsys)
    assert rc == 0 and json.loads(out) == d


def test_cli_decide_errors(tmp_path, capsys):
    missing = tmp_path / "nope" / "decision.json"
    rc, out, err = cli(["decide", str(missing)], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"draftport: error: {missing}: ")
    assert "snakemake --cores 8 decision" in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "something/else"}))
    rc, _, err = cli(["decide", str(other)], capsys)
    assert rc == 2 and str(other) in err and err.count("\n") == 1


def test_enough_data_where_the_curve_flattens():
    """R6: the smallest n not significantly below the largest n's tau (paired over the prompts)."""
    cur = curves_from({"source": {50: 1.6, 100: 2.4, 200: 2.9, 400: 2.9}, "scratch": {50: 1.2, 400: 2.5}})
    # the n=200 points: n=400's counts with a zero-sum shuffle -> exactly the same tau, not below
    for p in cur["points"]:
        if p["init"] == "source" and p["n_samples"] == 200:
            twin = next(
                q for q in cur["points"] if q["init"] == "source" and q["n_samples"] == 400 and q["seed"] == p["seed"]
            )
            p["per_sample"] = {
                "accepted": same_mean(twin["per_sample"]["accepted"]),
                "cycles": twin["per_sample"]["cycles"],
            }
    rec = run_decide(cur)["recommendation"]
    assert rec["init"] == "source" and rec["n_enough"] == 200
    plateau = {x["n_samples"]: x for x in run_decide(cur)["plateau"]}
    assert plateau[50]["significantly_below"] and plateau[100]["significantly_below"]
    assert not plateau[200]["significantly_below"] and plateau[200]["diff_to_largest"] == pytest.approx(0.0)
    assert any(s.startswith("Enough data: beyond n=200") for s in rec["text"])


def test_enough_data_when_the_curve_still_rises():
    cur = curves_from({"source": {50: 1.5, 100: 2.0, 200: 2.6}, "scratch": {50: 1.2, 100: 1.4, 200: 1.8}})
    rec = run_decide(cur)["recommendation"]
    assert rec["n_enough"] == 200
    assert any("still rising at the largest n=200" in s for s in rec["text"])
    assert rec["rules"][5]["id"] == "R6"


def test_enough_data_with_a_min_gain():
    """R6 with min_gain: a small but significant rise no longer counts as "more data needed"."""
    cur = curves_from({"source": {100: 2.0, 200: 2.55, 400: 2.6}, "scratch": {100: 1.2, 400: 1.9}})
    strict = run_decide(cur)["recommendation"]
    loose = run_decide(cur, min_gain=0.2)["recommendation"]
    assert loose["n_enough"] == 200 and strict["n_enough"] in (200, 400)
    assert any("above 0.2 with significance" in s for s in loose["text"])
    assert run_decide(cur, min_gain=1.0)["recommendation"]["n_enough"] == 100
