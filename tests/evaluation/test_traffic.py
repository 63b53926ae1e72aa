"""The traffic mix: the stratified bootstrap (draftport.evaluation.bootstrap's strata), the sets and
context buckets (draftport.evaluation.traffic) and rule R10, on synthetic counts whose gaps are known."""

import json

import numpy as np
import pytest

from draftport.errors import DraftportError
from draftport.evaluation import bootstrap, decision, traffic
from tests.evaluation.test_decision import CM, NB, K, counts, curves_from

# ---------------------------------------------------------------- the stratified bootstrap


def unstratified(acc, cyc, n_boot, seed):
    """The bootstrap as it was before strata (a copy): pooled tau, one draw of P prompts per replicate."""
    a, c = np.atleast_2d(np.asarray(acc, float)), np.atleast_2d(np.asarray(cyc, float))
    A, C, P = a.sum(axis=0), c.sum(axis=0), a.shape[1]
    rng, out = np.random.default_rng(seed), []
    for done in range(0, n_boot, bootstrap.BOOT_CHUNK):
        idx = rng.integers(0, P, size=(min(bootstrap.BOOT_CHUNK, n_boot - done), P))
        num, den = A[idx].sum(axis=1), C[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            out.append(np.where(den > 0, 1.0 + num / np.where(den > 0, den, 1.0), np.nan))
    return 1.0 + a.sum() / c.sum(), np.concatenate(out)


def two_seeds(tau, seed, p=90):
    rows = [counts(tau, seed * 7 + s, p=p) for s in (0, 1)]
    return [r[0] for r in rows], [r[1] for r in rows]


def test_no_strata_and_one_full_stratum_give_todays_figures_bit_for_bit():
    acc, cyc = two_seeds(2.3, 1)
    tau, boot = unstratified(acc, cyc, 600, seed=5)  # 600 draws: more than one chunk
    plain = bootstrap.tau_ci(acc, cyc, n_boot=600, seed=5)
    assert plain["accept_length"] == tau and plain["ci"] == bootstrap.percentile_ci(boot, 0.95)
    one = bootstrap.tau_ci(acc, cyc, n_boot=600, seed=5, strata=[(np.arange(90), 1.0)])
    assert one == plain
    b_acc, b_cyc = two_seeds(2.1, 2)
    d = bootstrap.paired_diff_ci(acc, cyc, b_acc, b_cyc, n_boot=600, seed=5)
    tb, boot_b = unstratified(b_acc, b_cyc, 600, seed=5)
    assert d["diff"] == tau - tb and d["ci"] == bootstrap.percentile_ci(boot - boot_b, 0.95)
    assert bootstrap.paired_diff_ci(acc, cyc, b_acc, b_cyc, n_boot=600, seed=5, strata=[(list(range(90)), 1)]) == d


def test_the_weighted_figure_is_the_shares_sum_of_the_strata():
    acc, cyc = two_seeds(2.0, 3)
    a, c = np.asarray(acc, float), np.asarray(cyc, float)
    odd, even = np.arange(1, 90, 2), np.arange(0, 90, 2)  # strata need not be contiguous
    a[:, odd] += 10  # the odd prompts accept more: the strata differ
    r = bootstrap.tau_ci(a, c, n_boot=NB, strata=[(even, 0.25), (odd, 0.75)])
    by_hand = 0.25 * (1 + a[:, even].sum() / c[:, even].sum()) + 0.75 * (1 + a[:, odd].sum() / c[:, odd].sum())
    assert r["accept_length"] == pytest.approx(by_hand)
    rows = [
        0.25 * (1 + a[i, even].sum() / c[i, even].sum()) + 0.75 * (1 + a[i, odd].sum() / c[i, odd].sum())
        for i in (0, 1)
    ]
    assert r["seeds"] == pytest.approx(rows)
    assert r["ci"][0] < r["accept_length"] < r["ci"][1]
    pooled = bootstrap.tau_ci(a, c, n_boot=NB)["accept_length"]
    assert pooled < r["accept_length"] - 0.1  # the pooled figure weighs the strata 50/50


def test_the_stratified_ci_covers_the_traffics_accept_length():
    """40 draws of a two-set world (40 + 10 prompts, shares 0.3 / 0.7): the 90% CI holds the true
    weighted accept length (0.3 x 2.0 + 0.7 x 2.8) about 90% of the time."""
    truth, hits, pooled_hits = 0.3 * 2.0 + 0.7 * 2.8, 0, 0
    strata = [(np.arange(40), 0.3), (np.arange(40, 50), 0.7)]
    for i in range(40):
        rng = np.random.default_rng(100 + i)
        cyc = rng.integers(5, 30, 50)
        acc = rng.binomial(cyc * 3, np.r_[np.full(40, 1.0 / 3), np.full(10, 1.8 / 3)])
        lo, hi = bootstrap.tau_ci(acc, cyc, n_boot=400, level=0.9, seed=i, strata=strata)["ci"]
        hits += lo <= truth <= hi
        lo, hi = bootstrap.tau_ci(acc, cyc, n_boot=400, level=0.9, seed=i)["ci"]
        pooled_hits += lo <= truth <= hi
    assert 31 <= hits <= 40
    assert pooled_hits <= 4  # pooled, the 40 chat prompts outweigh their 30%


def test_a_paired_difference_with_strata_draws_once_for_both():
    acc, cyc = two_seeds(2.2, 4)
    strata = [(np.arange(30), 0.5), (np.arange(30, 90), 0.5)]
    same = bootstrap.paired_diff_ci(acc, cyc, acc, cyc, n_boot=NB, strata=strata)
    assert same["diff"] == 0.0 and same["ci"] == [0.0, 0.0] and not same["significant"]
    better = bootstrap.paired_diff_ci(np.asarray(acc) + 4, cyc, acc, cyc, n_boot=NB, strata=strata)
    assert better["better"] == "a" and better["diff"] == pytest.approx(0.2)


def test_a_replicate_without_a_cycle_in_a_stratum_is_dropped():
    cyc = [0] * 9 + [20] + [20] * 10  # stratum 0: one prompt of ten has cycles
    acc = [0] * 9 + [20] + [10] * 10
    r = bootstrap.tau_ci(acc, cyc, n_boot=NB, strata=[(np.arange(10), 0.5), (np.arange(10, 20), 0.5)])
    assert r["accept_length"] == pytest.approx(0.5 * 2.0 + 0.5 * 1.5) and r["ci"] == pytest.approx([1.75, 1.75])


@pytest.mark.parametrize(
    "strata,problem",
    [
        ([(np.arange(5), 0.5), (np.arange(4, 10), 0.5)], "overlap"),
        ([(np.arange(5), 0.5), (np.arange(5, 9), 0.5)], "cover 9 of the 10"),
        ([(np.arange(5), 0.5), (np.arange(5, 11), 0.5)], "in [0, 10)"),
        ([(np.arange(5), 0.6), (np.arange(5, 10), 0.6)], "sum to 1.2"),
        ([(np.arange(5), 1.0), (np.arange(5, 10), 0.0)], "share must be a number > 0"),
        ([(np.arange(10),)], "must be a pair"),
        ([], "non-empty"),
    ],
)
def test_bad_strata(strata, problem):
    with pytest.raises(DraftportError) as e:
        bootstrap.tau_ci([1] * 10, [2] * 10, n_boot=10, strata=strata, where="phases: phase0")
    assert problem in str(e.value) and e.value.where == "phases: phase0" and "\n" not in str(e.value)


# ---------------------------------------------------------------- sets and buckets


def test_bucket_names_and_edges():
    assert traffic.bucket_names([0, 64, 128]) == ["0-64", "64-128", "128+"]
    assert traffic.bucket_names([0, 512, 2048, 8192]) == ["0-512", "512-2K", "2K-8K", "8K+"]
    assert traffic.bucket_names([0, 1536]) == ["0-1536", "1536+"]
    for bad in ([64, 128], [0, 64, 64], [], [0, 1.5]):
        with pytest.raises(DraftportError, match="starting at 0, strictly increasing"):
            traffic.bucket_names(bad)


def test_sets_default_and_checks():
    assert traffic.eval_sets({"per_sample": {}}, 7, "phase0") == [
        {"name": "heldout", "share": 1.0, "start": 0, "count": 7}
    ]
    ok = [
        {"name": "chat", "share": 0.6, "start": 0, "count": 4},
        {"name": "code", "share": 0.4, "start": 4, "count": 3},
    ]
    assert traffic.eval_sets({"sets": ok}, 7, "phase0") == ok
    assert [ix.tolist() for ix, _ in traffic.strata_of(ok)] == [[0, 1, 2, 3], [4, 5, 6]]
    gap = [ok[0], {**ok[1], "start": 5}]
    with pytest.raises(DraftportError, match="expected start 4"):
        traffic.eval_sets({"sets": gap}, 7, "phase0")
    with pytest.raises(DraftportError, match="shares sum to 0.9"):
        traffic.eval_sets({"sets": [ok[0], {**ok[1], "share": 0.3}]}, 7, "phase0")
    with pytest.raises(DraftportError, match="cover 7 prompts but the evaluation has 8"):
        traffic.eval_sets({"sets": ok}, 8, "phase0")


def test_a_bucket_without_cycles_is_not_measured():
    ev = {"per_sample": {"accepted": [7, 5], "cycles": [6, 4], "bucket_accepted": [[4, 3, 0], [5, 0, 0]]}}
    ev["per_sample"]["bucket_cycles"] = [[3, 3, 0], [4, 0, 0]]
    got = traffic.bucket_counts(ev, 3, "phase0")
    rows = traffic.bucket_taus(got, [0, 64, 128], None, {"n_boot": NB}, "phase0")
    assert [r["bucket"] for r in rows] == ["0-64", "64-128", "128+"]
    assert rows[0]["accept_length"] == pytest.approx(1 + 9 / 7) and rows[0]["num_cycles"] == 7
    assert rows[2] == {
        "bucket": "128+",
        "lower": 128,
        "upper": None,
        "accept_length": None,
        "ci": None,
        "num_cycles": 0,
        "measured": True,
        "beyond_source_limit": False,
    }
    ev["per_sample"]["bucket_cycles"] = [[3, 2, 0], [4, 0, 0]]
    with pytest.raises(DraftportError, match="do not add up"):
        traffic.bucket_counts(ev, 3, "phase0")


# ---------------------------------------------------------------- rule R10

STRONG = {"source": {100: 1.8, 200: 2.6}, "scratch": {100: 1.3, 200: 1.6}}  # init source, n=200
EDGES = [0, 512, 2048]
LIMIT = {
    "source_max_position_embeddings": 512,
    "source_rope_scaling": None,
    "source_limit": 512,
    "serving_length": 4096,
    "limited": True,
}


def phase_on_sets(taus, seed, late=1.0):
    """A phase's eval.json on the sets' prompts (taus: [(tau, prompts)] in order); each prompt's 20
    cycles split 12 / 8 / 0 over the buckets 0-512, 512-2K, 2K+ (late: the share of its accepted
    drafts at 512-2K relative to 8/20: below 1, the drafter is worse there)."""
    acc, cyc = [], []
    for i, (tau, p) in enumerate(taus):
        a, c = counts(tau, seed * 10 + i, p=p)
        acc, cyc = acc + a, cyc + c
    mid = [int(round(a * 8 / 20 * late)) for a in acc]
    ps = {"accepted": acc, "cycles": cyc, "bucket_accepted": [[a - m, m, 0] for a, m in zip(acc, mid)]}
    return {"per_sample": ps | {"bucket_cycles": [[12, 8, 0] for _ in cyc]}}


def sets_of(share_code):
    return [
        {"name": "chat", "share": 1 - share_code, "start": 0, "count": 150},
        {"name": "code", "share": share_code, "start": 150, "count": 50},
    ]


# Phase 1 beats the source as-is on chat, loses on code; the control is worse everywhere
PHASES = {
    "phase0": phase_on_sets([(2.0, 150), (2.6, 50)], 1),
    "phase1_scratch": phase_on_sets([(1.5, 150), (1.5, 50)], 2),
    "phase1": phase_on_sets([(2.6, 150), (2.0, 50)], 3),
}


def run(phases=PHASES, **kw):
    return decision.decide(curves_from(STRONG), phases, costmodel=CM, k=K, n_boot=NB, **kw)


def test_one_set_gives_the_figures_of_no_sets_and_a_traffic_block():
    plain = run()
    one = run(sets=[{"name": "heldout", "share": 1.0, "start": 0, "count": 200}])
    assert "traffic" not in plain and all(r["id"] != "R10" for r in plain["recommendation"]["rules"])
    assert {key: v for key, v in one.items() if key not in ("traffic", "recommendation")} == {
        key: v for key, v in plain.items() if key != "recommendation"
    }
    rec = one["recommendation"]
    assert rec["rules"][:9] == plain["recommendation"]["rules"] and rec["rules"][9]["id"] == "R10"
    assert rec["traffic_problems"] == [] and rec["text"] == plain["recommendation"]["text"]
    t = one["traffic"]
    assert t["sets"] == [{"name": "heldout", "share": 1.0, "n_prompts": 200}] and not t["weighted"]
    assert t["phases"]["phase0"]["sets"]["heldout"]["accept_length"] == plain["phases"]["phase0"]["accept_length"]
    assert t["buckets"] is None and t["context_limit"] is None


def test_a_set_where_the_recommended_drafter_is_worse_is_named_unless_its_share_is_small():
    d = run(sets=sets_of(0.2))
    t, rec = d["traffic"], d["recommendation"]
    assert t["weighted"] and t["recommended_phase"] == "phase1"
    p0 = t["phases"]["phase0"]["sets"]
    assert d["phases"]["phase0"]["accept_length"] == pytest.approx(
        0.8 * p0["chat"]["accept_length"] + 0.2 * p0["code"]["accept_length"]
    )
    code = t["vs"]["phase0"]["sets"]["code"]
    assert code["ci"][1] < 0 and code["better"] == "phase0" and t["vs"]["phase1_scratch"]["sets"]["code"]["ci"][0] > 0
    [problem] = rec["traffic_problems"]
    assert (
        problem["kind"] == "set"
        and problem["where"] == "code"
        and [a["phase"] for a in problem["against"]] == ["phase0"]
    )
    assert problem["text"] in rec["text"] and "code (20% of the traffic)" in problem["text"]
    assert "add code's kind of prompts to the training data (targets.prompts_train)" in problem["text"].lower()
    assert f"{code['diff']:+.3f}" in problem["text"]
    assert any(s.startswith("Every accept length in this decision is traffic-weighted") for s in rec["text"])
    assert rec["text"][-1].startswith("Confidence") and "set code worse than phase0" in rec["rules"][9]["fired"]
    small = run(sets=sets_of(0.03))  # the same counts, code 3% of the traffic: below min_share
    assert small["traffic"]["vs"]["phase0"]["sets"]["code"]["ci"][1] < 0
    assert small["recommendation"]["traffic_problems"] == []
    assert not any("On the set code" in s for s in small["recommendation"]["text"])
    assert run(sets=sets_of(0.03), min_share=0.02)["recommendation"]["traffic_problems"][0]["where"] == "code"


def test_the_weighted_figure_drives_the_rules():
    """The same counts at 80 / 20 and at 10 / 90 chat / code: Phase 1 (better on chat) beats the
    break-even 2.0 and the source as-is only where chat weighs."""
    chat, code = run(sets=sets_of(0.2)), run(sets=sets_of(0.9))
    p1 = {sh: d["traffic"]["phases"]["phase1"]["sets"] for sh, d in ((0.2, chat), (0.9, code))}
    for sh, d in ((0.2, chat), (0.9, code)):
        weighted = (1 - sh) * p1[sh]["chat"]["accept_length"] + sh * p1[sh]["code"]["accept_length"]
        assert d["phases"]["phase1"]["accept_length"] == pytest.approx(weighted)
    assert (
        chat["phases"]["phase1"]["beats_break_even"] == "yes" and code["phases"]["phase1"]["beats_break_even"] != "yes"
    )
    assert chat["traffic"]["vs"]["phase0"]["weighted"]["better"] == "phase1"
    assert code["traffic"]["vs"]["phase0"]["weighted"]["better"] == "phase0"
    assert code["phase1_gain_vs_scratch"]["diff"] < chat["phase1_gain_vs_scratch"]["diff"] - 0.3


def test_buckets_past_the_source_limit_are_flagged_and_named():
    phases = {**PHASES, "phase1": phase_on_sets([(2.6, 150), (2.0, 50)], 3, late=0.3)}
    d = run(phases, sets=sets_of(0.2), bucket_edges=EDGES, context_limit=LIMIT)
    t, rec = d["traffic"], d["recommendation"]
    b0 = t["buckets"]["phase0"]
    assert [r["bucket"] for r in b0] == ["0-512", "512-2K", "2K+"]
    assert [r["beyond_source_limit"] for r in b0] == [False, True, True]
    assert b0[1]["num_cycles"] == 200 * 8 and b0[2]["accept_length"] is None and b0[2]["num_cycles"] == 0
    assert t["buckets_vs"]["phase0"][2]["diff"] is None
    [limit] = [s for s in rec["text"] if s.startswith("The source config allows positions up to 512")]
    assert "new target serves 4096" in limit and "max_position_embeddings 512, rope_scaling none" in limit
    assert (
        f"512-2K: {b0[1]['accept_length']:.3f}" in limit
        and "2K+: not measured (no held-out prompt reaches it)" in limit
    )
    bucket = [p for p in rec["traffic_problems"] if p["kind"] == "bucket"]
    assert [p["where"] for p in bucket] == ["512-2K"] and "add prompts that reach that context length" in bucket[0][
        "text"
    ].lower()
    assert rec["confidence"] == run(phases)["recommendation"]["confidence"]  # R10 leaves R5 alone
    out = decision.render_text(d)
    assert "Traffic: chat 80% (150 prompts), code 20% (50 prompts)" in out and "past the source's limit" in out
    json.dumps(d, allow_nan=False)  # plain JSON: no numpy types, no nan
    from decision_check import says_what_the_numbers_show as check

    assert check(d) == []  # the rules' fields agree with the (weighted) figures in the file


def test_without_bucket_counts_or_a_bucket_past_the_limit():
    old = {ph: {"per_sample": {k: ev["per_sample"][k] for k in ("accepted", "cycles")}} for ph, ev in PHASES.items()}
    d = run(old, bucket_edges=EDGES, context_limit=LIMIT)
    assert all(not r["measured"] and r["accept_length"] is None for r in d["traffic"]["buckets"]["phase0"])
    assert any("not measured (Phase 0 has no per-bucket counts)" in s for s in d["recommendation"]["text"])
    d = run(bucket_edges=[0, 64, 128], context_limit={**LIMIT, "source_limit": 1024})
    assert any("no context bucket starts at or past 1024" in s for s in d["recommendation"]["text"])
    with pytest.raises(DraftportError, match=r"shape \[200, 2\]"):
        run(bucket_edges=[0, 64])
    few = {"phase0": phase_on_sets([(2.0, 120)], 1)}  # 120 prompts: one set spans the curves' 200 as well
    one = run(few, sets=[{"name": "heldout", "share": 1.0, "start": 0, "count": 120}])
    assert one["traffic"]["curve_gain"]["heldout"]["to_n"] == 200
    with pytest.raises(DraftportError, match="they cover 120 prompts but the curves' points have 200"):
        run(
            few,
            sets=[
                {"name": "a", "share": 0.5, "start": 0, "count": 60},
                {"name": "b", "share": 0.5, "start": 60, "count": 60},
            ],
        )
    with pytest.raises(DraftportError, match="they cover 120 prompts but the phases' evaluations have 200"):
        run(
            sets=[
                {"name": "a", "share": 0.5, "start": 0, "count": 60},
                {"name": "b", "share": 0.5, "start": 60, "count": 60},
            ]
        )


def test_the_control_as_recommended_drafter_is_compared_with_phase0_and_phase1():
    assert decision.recommended_phase("scratch", "helps", {"phase1_scratch": 1}) == "phase1_scratch"
    assert decision.recommended_phase("source", "helps", {"phase1": 1, "phase2": 1}) == "phase2"
    assert decision.recommended_phase("either", "no significant gain", {"phase1": 1, "phase2": 1}) == "phase1"
    assert decision.recommended_phase("source", "not measured", {"phase2": 1}) == "phase2"
    assert decision.recommended_phase("source", "helps", {}) is None
    scratch = {"source": {100: 1.3, 200: 1.6}, "scratch": {100: 1.8, 200: 2.6}}
    d = decision.decide(curves_from(scratch), PHASES, costmodel=CM, k=K, n_boot=NB, sets=sets_of(0.2))
    t = d["traffic"]
    assert d["recommendation"]["init"] == "scratch" and t["recommended_phase"] == "phase1_scratch"
    assert list(t["vs"]) == ["phase0", "phase1"]
    assert {p["where"] for p in d["recommendation"]["traffic_problems"]} == {"chat", "code"}
    assert set(t["curve_gain"]) == {"chat", "code"} and t["curve_gain"]["code"]["arm"] == "scratch"
    assert t["curves"]["code"]["scratch"][1]["n_samples"] == 200


def test_the_text_says_on_which_set_more_data_pays_most():
    d = run(sets=sets_of(0.2))
    gain = d["traffic"]["curve_gain"]
    [line] = [s for s in d["recommendation"]["text"] if s.startswith("From n=100 to n=200 the source curve gains")]
    for name in ("chat", "code"):
        assert (
            f"{gain[name]['diff']:+.3f} (CI [{gain[name]['ci'][0]:.3f}, {gain[name]['ci'][1]:.3f}]) on {name}" in line
        )
    shares = {x["name"]: x["share"] for x in d["traffic"]["sets"]}
    # weighed by the shares (chat 0.8, code 0.2), not by the raw gains
    best = max((shares[n] * g["diff"], n) for n, g in gain.items() if g["significant"] and g["diff"] > 0)[1]
    assert f"weighed by the shares, {best} gains most." in line
    assert line.endswith(
        "The curve's points share one training set: what more data of another set's kind would bring was not measured."
    )
    named = run(sets=sets_of(0.2), train_prompts="corpus/new.jsonl")["recommendation"]["text"]
    unmeasured = "what more data of another set's kind would bring was not measured."
    assert any(s.endswith(f"Every point of that curve trained on corpus/new.jsonl: {unmeasured}") for s in named)
    assert not any(s.startswith("From n=") for s in run()["recommendation"]["text"])  # one set: no such line
