"""Rule R11 (draftport.evaluation.serving): the step table, the best configuration per batch size,
the engine settings, and the decision's serving block, on counts whose accept lengths are known."""

import json
import zlib

import pytest

from draftport.errors import DraftportError
from draftport.evaluation import decision, serving
from tests.evaluation.test_decision import counts, curves_from, run_decide

SEEDS_CM = {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}


def table(rows: str, tmp_path, name="steps.csv"):
    path = tmp_path / name
    path.write_text(rows)
    return serving.read_step_table(path)


def test_read_step_table_and_its_two_forms(tmp_path):
    t = table("batch_size,k,step_ms\n1,0,10\n1,2,14\n1,4,18\n8,0,12\n8,4,30\n", tmp_path)
    assert t.ms == {1: {0: 10.0, 2: 14.0, 4: 18.0}, 8: {0: 12.0, 4: 30.0}}
    assert t.step_ms(1, 3) == (16.0, False)  # between k 2 and 4
    assert t.step_ms(8, 6) == (pytest.approx(39.0), True)  # past the table: the last slope, flagged
    itl = table("batch_size,k,itl_ms,accept_length\n1,0,10,1\n1,3,6,2.5\n", tmp_path, "itl.csv")
    assert itl.ms[1] == {0: 10.0, 3: 15.0}  # a step = ITL x tokens a step
    with pytest.raises(DraftportError, match="batch size 4 is served"):
        t.check([1, 4], "serving.batch_sizes")


@pytest.mark.parametrize(
    "text, problem",
    [
        ("batch_size,k\n1,0\n", "need batch_size, k and step_ms"),
        ("batch_size,k,step_ms\n1,0,10\n1,0,11\n", "line 3: batch size 1 at k 0 given twice"),
        ("batch_size,k,step_ms\n1,x,10\n", "line 2: batch_size and k must be integers"),
        ("batch_size,k,step_ms\n0,1,10\n", "need batch_size >= 1"),
        ("", "no rows"),
    ],
)
def test_bad_step_tables_are_refused_in_one_line(tmp_path, text, problem):
    with pytest.raises(DraftportError, match=problem) as e:
        table(text, tmp_path)
    assert "steps.csv" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DraftportError, match="no such file"):
        serving.read_step_table(tmp_path / "absent.csv")


def test_seeds_table_keeps_the_cost_models_break_even_at_its_own_k():
    t = serving.seeds_table(SEEDS_CM, k0=3, k_max=8, ms_per_draft_token=1.0)
    alone, at3 = t.step_ms(1, 0)[0], t.step_ms(1, 3)[0]
    assert at3 == 30.0 and at3 / alone == pytest.approx(30 * 82 / 1000)  # break-even tau 2.46, the seeds'
    assert t.step_ms(1, 8)[0] == 35.0 and t.step_ms(1, 1)[0] == 28.0


def tau(x, lo=None, hi=None):
    return {"accept_length": x, "ci": [lo if lo is not None else x - 0.05, hi if hi is not None else x + 0.05]}


def test_best_configuration_per_batch_size_by_hand(tmp_path):
    # batch 1: 10 ms alone, +2 ms a draft token; batch 32: 20 ms alone, +12 ms a draft token
    t = table("batch_size,k,step_ms\n1,0,10\n1,1,12\n32,0,20\n32,1,32\n", tmp_path)
    taus = {1: tau(1.7), 2: tau(2.2), 3: tau(2.5), 4: tau(2.6)}
    trees = [{"steps": 3, "topk": 2, "num_draft_tokens": 4, **tau(2.7)}]  # 3 draft tokens, charged as k=3
    per = serving.best_per_batch(taus, trees, t, [1, 32], ttt_steps=3)
    b1, b32 = per
    # batch 1: tok/s = 1000 tau / (10 + 2k): k=1 121.4, k=2 157.1, k=3 156.3, k=4 144.4; the tree 168.8
    assert b1["best"]["kind"] == "tree" and b1["best"]["tok_s"] == pytest.approx(1000 * 2.7 / 16)
    assert b1["best_chain_k"] == 2 and b1["tree_beats_chain"] is True and b1["speculate"]
    assert b1["target_alone_tok_s"] == pytest.approx(100.0) and b1["significant"]
    # batch 32: 1000 tau / (20 + 12k): k=1 53.1 (CI [51.6, 54.7]) beats the target alone's 50; deeper loses
    assert b32["best"]["k"] == 1 and b32["best"]["tok_s"] == pytest.approx(1000 * 1.7 / 32)
    assert b32["speculate"] and b32["significant"] and b32["tree_beats_chain"] is False
    deep = serving.best_per_batch({4: tau(3.9)}, [], t, [1], ttt_steps=3)[0]
    assert deep["past_ttt"] and deep["best"]["step_extrapolated"]


def test_speculation_off_where_the_target_alone_is_faster(tmp_path):
    t = table("batch_size,k,step_ms\n1,0,10\n1,2,14\n64,0,20\n64,2,60\n", tmp_path)
    per = serving.best_per_batch({2: tau(2.4)}, [], t, [1, 64], ttt_steps=None)
    assert per[0]["speculate"] and not per[1]["speculate"]  # 2.4 / 60 ms = 40 tok/s < 50 alone
    cfg = serving.vllm_config("org/drafter", per)
    assert cfg == {
        "method": "eagle3",
        "model": "org/drafter",
        "num_speculative_tokens": 2,
        "num_speculative_tokens_per_batch_size": {"1-63": 2, "64-64": 0},
    }
    assert serving.sglang_flags("org/drafter", per[1]) is None
    flags = serving.sglang_flags("org/drafter", per[0])
    assert "--speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in flags
    # one K everywhere: no table (it would cost vLLM CUDA graphs); off everywhere: no config
    same = serving.best_per_batch({2: tau(2.4)}, [], t, [1], ttt_steps=None)
    assert "num_speculative_tokens_per_batch_size" not in serving.vllm_config("m", same)
    off = serving.best_per_batch({2: tau(1.1, 1.05, 1.15)}, [], t, [64], ttt_steps=None)
    assert serving.vllm_config("m", off) is None


def phase_at_depth(taus: dict, seed: int, p=120):
    """A phase evaluation with per-depth counts: at each k its own counts near tau(k)."""
    by_k = []
    for k, x in taus.items():
        acc, cyc = counts(x, seed=zlib.crc32(f"{seed}/{k}".encode()), p=p)
        by_k.append({"k": k, "accepted": acc, "cycles": cyc})
    top = by_k[-1]
    return {"per_sample": {"accepted": top["accepted"], "cycles": top["cycles"], "by_k": by_k}}


def test_the_decision_serves_the_recommended_drafter_and_the_source():
    phases = {
        "phase0": phase_at_depth({1: 1.5, 2: 1.8, 3: 1.9}, 0),
        "phase1_scratch": phase_at_depth({1: 1.3, 2: 1.4, 3: 1.5}, 1),
        "phase1": phase_at_depth({1: 1.8, 2: 2.4, 3: 2.8}, 2),
    }
    t = serving.seeds_table(SEEDS_CM, k0=3, k_max=3, ms_per_draft_token=1.0)
    srv = {"table": t, "batch_sizes": [1], "k": 3, "ttt_steps": {"recommended": 3}, "models": {"source": "org/src"}}
    curves = curves_from({"source": {100: 2.6, 400: 2.9}, "scratch": {100: 1.5, 400: 2.0}})
    d = run_decide(curves, phases, serving=srv)
    block = d["serving"]
    rec, src = block["drafters"]["recommended"], block["drafters"]["source"]
    assert rec["phase"] == "phase1" and src["phase"] == "phase0" and rec["depths"] == [1, 2, 3]
    # phase1 at batch 1: tok/s = 1000 tau / (27 + k) -> k=3 (2.8 / 30 ms) beats k=2 (2.4 / 29 ms)
    assert rec["per_batch"][0]["best"]["k"] == 3
    assert rec["vllm_speculative_config"]["num_speculative_tokens"] == 3
    # the source's best (1.9 at k=3 = 63 tok/s; 1.8 at k=2 = 62) is below the target alone's 82: do not deploy
    r = d["recommendation"]
    assert r["deploy_source_now"] is False
    text = r["text"]
    assert any(x.startswith("Do not deploy the source drafter as fetched: at its best configuration") for x in text)
    assert any(x.startswith("Serving the recommended drafter (phase1): batch 1: chain k=3") for x in text)
    head = r["headline"]
    assert head.startswith("Do: fine-tune the source drafter on n=400") and "serve it as chain k=3" in head
    assert r["rules"][-1]["id"] == "R11" and "b1 chain k=3" in r["rules"][-1]["fired"]
    json.dumps(d)  # the block is JSON as decision.json stores it


def test_render_shows_the_headline_the_depths_and_the_settings():
    phases = {"phase0": phase_at_depth({1: 1.5, 2: 1.8}, 0), "phase1": phase_at_depth({1: 1.9, 2: 2.8}, 2)}
    t = serving.seeds_table(SEEDS_CM, k0=2, k_max=2, ms_per_draft_token=1.0)
    srv = {"table": t, "batch_sizes": [1], "k": 2, "models": {"recommended": "org/new"}}
    curves = curves_from({"source": {100: 2.6, 400: 2.9}, "scratch": {100: 1.5, 400: 2.0}})
    lines = decision.render_text(run_decide(curves, phases, serving=srv)).splitlines()
    assert lines[0].startswith("Do: fine-tune the source drafter on n=400")
    # phase1: 2.8 / 30 ms = 93 tok/s at k=2 against 82 alone; the source's best (1.8 / 30 ms) is not
    assert any(x.startswith("  recommended (phase1) batch 1") and "best: chain k=2" in x for x in lines)
    assert any(x.startswith("  source      (phase0) batch 1") and "best: off" in x for x in lines)
    vllm = next(x for x in lines if x.startswith("  vLLM: --speculative-config"))
    assert json.loads(vllm.split("'")[1]) == {"method": "eagle3", "model": "org/new", "num_speculative_tokens": 2}


def test_the_report_and_the_model_card_carry_the_serving_rule():
    from draftport.outputs.publish import serve_lines
    from draftport.outputs.report import decision_section

    phases = {"phase0": phase_at_depth({1: 1.5, 2: 1.8}, 0), "phase1": phase_at_depth({1: 1.9, 2: 2.8}, 2)}
    t = serving.seeds_table(SEEDS_CM, k0=2, k_max=2, ms_per_draft_token=1.0)
    srv = {"table": t, "batch_sizes": [1], "k": 2, "models": {"recommended": "artifacts/publish/drafter"}}
    curves = curves_from({"source": {100: 2.6, 400: 2.9}, "scratch": {100: 1.5, 400: 2.0}})
    d = run_decide(curves, phases, serving=srv)
    html = "\n".join(decision_section(d, None))
    assert "<h3>Serving (R11)</h3>" in html and "recommended (phase1)" in html and "source (phase0)" in html
    assert "off (the target alone is faster)" in html  # the source: 1.8 / 30 ms = 60 tok/s < 82
    rec = d["serving"]["drafters"]["recommended"]
    card = "\n".join(serve_lines({"serving": rec}, "org/base", "org/k25", 2))
    assert '"model": "org/k25"' in card and '"num_speculative_tokens": 2' in card  # the hub id, not the folder
    assert "--speculative-draft-model-path org/k25 --speculative-num-steps 2" in card
    assert "| 1 | 82.0 | chain k=2 |" in card


def test_the_decision_step_derives_a_real_targets_step_times(tmp_path):
    """serving.step_table null on a real target: the decision step derives its table from the
    target's config (here the built-in Kimi-K2.5 shape) and the drafter folder's bytes."""
    from draftport.pipeline.runner import StepContext
    from draftport.pipeline.steps.decision_step import _serving
    from draftport.plan import params, registry

    p = params.load()
    p["world"]["build"] = False
    p["targets"]["new"] = "moonshotai/Kimi-K2.5"
    p["serving"].update(batch_sizes=[1, 32], tensor_parallel=8)
    src = tmp_path / "source"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"\0" * 3_000_000)  # only its size is read
    (src / "fetch.lock.json").write_text("{}")
    row = next(r for r in registry.STEPS if r.name == "decision")
    s = StepContext(row, p, {"source": src / "fetch.lock.json"}, tmp_path)
    ev = {"per_sample": {"by_k": [{"k": k} for k in (1, 2, 5)]}}
    srv = _serving(s, {"phase1": ev})
    t = srv["table"]
    assert t.source == "derived" and sorted(t.ms) == [1, 32] and sorted(t.ms[1]) == list(range(6))
    assert "8 x H200" in t.notes[0] and "built in" in t.notes[0]
    assert t.ms[32][0] > t.ms[1][0] and t.ms[1][5] > t.ms[1][0]
    assert srv["models"]["recommended"] == "artifacts/publish/drafter"


def test_the_phase_metrics_best_k_is_r11s_at_batch_1():
    """metrics.json's best_k reads the cost model as R11 does (1 ms a draft token): on the embedded
    world's Phase 1 depths (docs/results.md) k=6 (4.733 / 33 ms) beats k=8 (4.946 / 35 ms)."""
    from draftport.pipeline.steps.eval_steps import best_k_metrics

    taus = [1.918, 2.721, 3.492, 4.077, 4.493, 4.733, 4.857, 4.946]
    by_k = [{"k": k, "accept_length": x} for k, x in enumerate(taus, 1)]
    m = best_k_metrics(by_k, SEEDS_CM, 3, 1.0)
    assert m["best_k"] == 6 and m["best_k_projected_tok_s"] == pytest.approx(4733 / 33)
    assert best_k_metrics(by_k, SEEDS_CM, 3, 0.0)["best_k"] == 8  # a free draft token: the deepest


def curves_at_depth(taus: dict, seeds=(0, 1)):
    """taus: {init: {n: {k: tau}}} -> curves.json points measured to depth (per_sample.by_k), their
    counts at eval.k (3) the k=3 entry's."""
    from tests.evaluation.test_decision import point

    pts = []
    for init, by_n in taus.items():
        for n, by_k in by_n.items():
            for s in seeds:
                ks = [
                    {
                        "k": k,
                        **dict(zip(("accepted", "cycles"), counts(x, seed=zlib.crc32(f"{init}/{n}/{s}/{k}".encode())))),
                    }
                    for k, x in by_k.items()
                ]
                at3 = next(c for c in ks if c["k"] == 3)
                pt = point(init, n, s, at3["accepted"], at3["cycles"])
                pt["per_sample"]["by_k"] = ks
                pts.append(pt)
    return {"points": pts}


def test_break_even_is_taken_at_each_ns_best_configuration():
    """R2 with curves measured to depth: n=100 is below break-even at eval.k (3) but beats the target
    alone at k=6, where draft tokens cost 1 ms each (seeds' table: 30 ms a cycle at k=3, 33 at k=6)."""
    cm = {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}
    t = serving.seeds_table(cm, k0=3, k_max=6, ms_per_draft_token=1.0)
    srv = {"table": t, "batch_sizes": [1], "k": 3, "ttt_steps": {"recommended": 3}, "models": {}}
    deep = {1: 1.5, 3: 2.3, 6: 3.4}  # k=3: 2.3 < 30 ms x 82 tok/s = 2.46; k=6: 3.4 / 33 ms = 103 tok/s > 82
    curves = curves_at_depth({"source": {100: deep, 400: {1: 1.7, 3: 2.9, 6: 3.8}}, "scratch": {100: deep, 400: deep}})

    def run(c, **kw):
        return decision.decide(c, {}, costmodel=cm, k=3, n_boot=300, **kw)

    at_k = run(curves)  # no serving inputs: R2 at eval.k, as before
    assert at_k["recommendation"]["n_samples"] == 400
    assert "best_config" not in at_k["curves"]["source"][0]
    d = run(curves, serving=srv)
    row = d["curves"]["source"][0]
    assert row["beats_break_even"] == "no"  # at eval.k, kept beside
    bc = row["best_config"]
    assert (bc["k"], bc["batch_size"], bc["beats_target_alone"]) == (6, 1, "yes")
    assert bc["tok_s"] == pytest.approx(bc["accept_length"] * 1000 / 33.0)
    assert bc["target_alone_tok_s"] == pytest.approx(82.0)
    rec = d["recommendation"]
    assert rec["n_samples"] == 100 and d["smallest_n_beating_break_even"]["source"] == 100
    r2 = next(x for x in rec["text"] if x.startswith("Break-even from n=100 samples"))
    lo, hi = bc["tok_s_ci"]
    assert f"chain k=6 at batch 1: {bc['tok_s']:.1f} tok/s a request (CI [{lo:.1f}, {hi:.1f}])" in r2
    # curves without depths (a budget's rounds, an older curves.json): R2 at eval.k even with serving
    flat = {
        "points": [
            {**p, "per_sample": {k: v for k, v in p["per_sample"].items() if k != "by_k"}} for p in curves["points"]
        ]
    }
    assert run(flat, serving=srv)["recommendation"]["n_samples"] == 400


def test_a_deeper_trained_arm_measures_whether_depth_pays_past_the_trained_depth():
    """The recommended drafter's best k (6) is past its 3 trained steps: with a recipe arm trained to
    6 steps, R11 states its paired gain over plain fine-tuning at k=6; without one, how to add it."""
    t = serving.seeds_table(SEEDS_CM, k0=3, k_max=6, ms_per_draft_token=1.0)
    srv = {"table": t, "batch_sizes": [1], "k": 3, "ttt_steps": {"recommended": 3}, "models": {}}
    phases = {"phase0": phase_at_depth({3: 1.9, 6: 2.2}, 0), "phase1": phase_at_depth({3: 2.8, 6: 3.9}, 2)}
    plain = {100: {3: 2.4, 6: 3.0}, 400: {3: 2.9, 6: 3.6}}
    taus = {"source": plain, "scratch": {n: {3: 1.5, 6: 1.6} for n in plain}}
    curves = curves_at_depth(taus)
    deep = curves_at_depth({"source": {400: {3: 2.9, 6: 4.1}}})["points"]
    curves["points"] += [{**p, "arm": "source-ttt6", "recipe": "ttt6"} for p in deep]

    def run(c):
        return decision.decide(c, phases, costmodel=SEEDS_CM, k=3, n_boot=300, serving=srv)

    without = run(curves)  # no recipe says what source-ttt6 is: not measured, and how to measure it
    assert without["serving"]["depth_arm"] == {"k": 6, "measured": False}
    assert any(
        "add a recipe such as ttt6: {ttt_steps: 6} to curves.recipes" in x for x in without["recommendation"]["text"]
    )
    d = run({**curves, "recipes": {"ttt6": {"ttt_steps": 6}}})
    arm = d["serving"]["depth_arm"]
    assert (arm["measured"], arm["recipe"], arm["ttt_steps"], arm["k"], arm["n_samples"]) == (True, "ttt6", 6, 6, 400)
    assert arm["significant"] and arm["better"] == "ttt6" and arm["diff"] == pytest.approx(0.5, abs=0.1)
    assert any(
        x.startswith("Training deeper at k=6: the source fine-tuned to unroll 6 steps (recipe ttt6) pays")
        for x in d["recommendation"]["text"]
    )
