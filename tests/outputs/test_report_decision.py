"""The report's decision section and its new plots (curves.png, tau_by_step.png, source_curve.png),
from hand-made inputs: each is rendered when its input is given, left out (no error) when not."""

from __future__ import annotations

import csv
import json
import re

import pytest

from draftport.outputs.report import break_even, build_report

PNG = b"\x89PNG\r\n\x1a\n"
K = 3
COST = {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 2.0}
BE = 82.0 * (30.0 + K * 2.0) / 1000  # 2.952
P = {"profile": "t", "eval": {"k": K}, "costmodel": COST, "online": {"enabled": False}}
NS = [100, 1000, 10000]
TEXT = "Fine-tune the source on 1000 samples: τ <beats> break-even & scratch doesn't."


def _item(n, tau, beats):
    return {
        "n_samples": n,
        "accept_length": tau,
        "ci": [tau - 0.1, tau + 0.1],
        "seeds": [tau - 0.05, tau + 0.05],
        "seed_std": 0.07,
        "n_seeds": 2,
        "projected_tok_s": tau / 0.036,
        "speedup_vs_baseline": tau / BE,
        "beats_break_even": beats,
    }


def decision_json():
    src = [_item(n, t, b) for n, t, b in zip(NS, (2.6, 3.1, 3.4), ("no", "yes", "yes"))]
    scr = [_item(n, t, b) for n, t, b in zip(NS, (1.4, 2.2, 2.95), ("no", "no", "unclear"))]
    return {
        "schema": "draftport.decision/1",
        "level": 0.95,
        "n_boot": 2000,
        "k": K,
        "costmodel": {**COST, "break_even_accept_length": BE},
        "curves": {"source": src, "scratch": scr},
        "gain": [
            {
                "n_samples": n,
                "diff": a["accept_length"] - b["accept_length"],
                "ci": [a["accept_length"] - b["accept_length"] - 0.2, a["accept_length"] - b["accept_length"] + 0.2],
                "significant": True,
                "better": "source",
            }
            for n, a, b in zip(NS, src, scr)
        ],
        "smallest_n_beating_break_even": {"source": 1000, "scratch": None},
        "phases": {
            "phase0": {
                "accept_length": 2.1,
                "ci": [2.0, 2.2],
                "projected_tok_s": 58.0,
                "speedup_vs_baseline": 0.71,
                "beats_break_even": "no",
            },
            "phase1": {
                "accept_length": 3.2,
                "ci": [3.1, 3.3],
                "projected_tok_s": 88.0,
                "speedup_vs_baseline": 1.08,
                "beats_break_even": "yes",
            },
        },
        "phase1_gain_vs_scratch": {"diff": 0.9, "ci": [0.7, 1.1], "significant": True, "better": "source"},
        "phase2_gain": None,
        "drift": None,
        "recommendation": {
            "init": "source",
            "n_samples": 1000,
            "phase2": "not needed",
            "deploy_source_now": False,
            "confidence": "high",
            "rules": [
                {"id": "R1", "fired": "source beats scratch at every n"},
                {"id": "R3", "fired": "phase0 < break-even"},
            ],
            "text": [TEXT, "Second sentence."],
        },
    }


def curves_json():
    pts = [
        {
            "init": init,
            "n_samples": n,
            "seed": s,
            "accept_length": base + 0.3 * i + 0.05 * s,
            "train_steps": 10,
            "stopped_early": False,
            "curve": [{"step": 5, "accept_length": base}],
            "per_sample": {"accepted": [1, 2], "cycles": [2, 2]},
        }
        for init, base in (("source", 2.5), ("scratch", 1.3))
        for i, n in enumerate(NS)
        for s in (0, 1)
    ]
    return {"n_samples": NS, "seeds": [0, 1], "inits": ["source", "scratch"], "budget": {}, "points": pts}


def write(tmp_path, name, obj):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def phase0_metrics(tmp_path):
    m = {
        "accept_length": 2.1,
        "projected_tok_s": 58.0,
        "speedup_vs_baseline": 0.71,
        "break_even_accept_length": BE,
        "accept_length_all_positions": 2.1,
        "eval_samples": 10,
        **{f"accept_rate_pos_{i}": 0.5 ** (i + 1) for i in range(K)},
        **{f"cond_acc_{i}": 0.5 for i in range(K)},
    }
    return write(tmp_path, "phase0.json", m)


HIST_TAU = (
    "step,loss,acc_0,lr,accept_length\n10,5.0,0.2,0.001,\n20,4.0,0.3,0.001,2.4\n"
    "30,3.5,0.35,0.001,\n40,3.0,0.4,0.001,2.9\n"
)  # tau only where it was evaluated
HIST_SCRATCH = "step,loss,acc_0,lr,accept_length\n10,7.0,0.1,0.001,1.2\n20,6.0,0.15,0.001,\n40,5.0,0.2,0.001,1.8\n"
HIST_OLD = "step,loss,acc_0,lr\n10,5.0,0.2,0.001\n20,4.0,0.3,0.001\n"
HIST_EMPTY = "step,loss,acc_0,lr,accept_length\n10,5.0,0.2,0.001,\n20,4.0,0.3,0.001,\n"
SOURCE = {
    "n_samples": 4321,
    "monitor": [{"step": s, "accept_length": 1.5 + 1.5 * (1 - 0.5 ** (s / 100))} for s in range(0, 600, 100)],
}


def is_png(path):
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG


def h2s(html):
    return re.findall(r"<h2>(.*?)</h2>", html)


def test_everything_given(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    inputs = {
        "phase0": phase0_metrics(tmp_path),
        "decision": write(tmp_path, "decision.json", decision_json()),
        "curves": write(tmp_path, "curves.json", curves_json()),
        "history_phase1": write(tmp_path, "h1.csv", HIST_TAU),
        "history_phase1_scratch": write(tmp_path, "hs.csv", HIST_SCRATCH),
        "history_phase2": write(tmp_path, "h2.csv", HIST_OLD),
        "source_drafter": write(tmp_path, "source_drafter.json", SOURCE),
    }
    res = build_report(out, P, inputs)
    assert res["decision"]["init"] == "source" and res["decision"]["n_samples"] == 1000
    for f in ("curves.png", "tau_by_step.png", "source_curve.png", "tau.png", "loss.png"):
        assert is_png(out / f), f
    html = (out / "summary.html").read_text()
    heads = h2s(html)
    assert heads[0] == "Decision", heads
    assert html.index("<h2>Decision</h2>") < html.index("<h2>Accept length per phase</h2>")
    # the generated sentences, escaped
    assert "τ &lt;beats&gt; break-even &amp; scratch doesn&#x27;t." in html and "<beats>" not in html
    assert "Second sentence." in html
    assert "R1" in html and "source beats scratch at every n" in html and "phase0 &lt; break-even" in html
    assert "smallest n beating break-even: 1000" in html and "no n beats break-even" in html
    assert "Gain of fine-tuning the source" in html and "Δτ +0.900" in html
    # curves.png sits in the decision section; tau_by_step under Training curves; source curve its own
    dec = html[html.index("<h2>Decision</h2>") : html.index(f"<h2>{heads[1]}</h2>")]
    assert dec.count("data:image/png;base64,") == 1
    train = html[html.index("<h2>Training curves</h2>") :]
    assert train.count("data:image/png;base64,") >= 2
    assert "The source drafter's training" in html and "<b>4321</b> samples" in html

    with open(out / "decision.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["init"], int(r["n_samples"])) for r in rows] == [("source", n) for n in NS] + [
        ("scratch", n) for n in NS
    ]
    src1000 = rows[1]
    assert float(src1000["accept_length"]) == pytest.approx(3.1)
    assert float(src1000["ci_lo"]) == pytest.approx(3.0) and float(src1000["ci_hi"]) == pytest.approx(3.2)
    assert src1000["beats_break_even"] == "yes"
    assert float(src1000["gain_vs_scratch"]) == pytest.approx(0.9)
    assert float(rows[4]["gain_vs_scratch"]) == pytest.approx(0.9)  # the same n's gain on scratch's row


def test_nothing_new_given_leaves_it_all_out(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    (out / "curves.png").write_bytes(b"stale")  # a previous run's: not this run's output
    res = build_report(out, P, {"phase0": phase0_metrics(tmp_path)})
    assert "decision" not in res
    for f in ("curves.png", "tau_by_step.png", "source_curve.png", "decision.csv"):
        assert not (out / f).exists(), f
    html = (out / "summary.html").read_text()
    assert "Decision" not in h2s(html) and h2s(html)[0] == "Accept length per phase"


def test_histories_without_tau_give_no_tau_plot(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    inputs = {
        "history_phase1": write(tmp_path, "h1.csv", HIST_OLD),
        "history_phase1_scratch": write(tmp_path, "hs.csv", HIST_EMPTY),
        "source_drafter": write(tmp_path, "sd.json", {"n_samples": 10}),
    }  # no monitor
    build_report(out, P, inputs)
    assert is_png(out / "loss.png")
    assert not (out / "tau_by_step.png").exists() and not (out / "source_curve.png").exists()
    assert "source drafter's training" not in (out / "summary.html").read_text()


def test_curves_alone_plot_the_seeds_mean(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    build_report(out, P, {"curves": write(tmp_path, "curves.json", curves_json())})
    assert is_png(out / "curves.png")
    assert not (out / "decision.csv").exists()
    html = (out / "summary.html").read_text()
    assert h2s(html)[0] == "Accept length by training samples"


def test_sparse_decision_renders(tmp_path):
    """Empty curves and gain, no phases, nulls: a short Decision section, no plot, no error."""
    out = tmp_path / "report"
    out.mkdir()
    d = {
        **decision_json(),
        "curves": {"source": [], "scratch": []},
        "gain": [],
        "phases": {},
        "phase1_gain_vs_scratch": None,
        "smallest_n_beating_break_even": {"source": None, "scratch": None},
    }
    d["recommendation"] = {**d["recommendation"], "init": "either", "n_samples": None, "confidence": "low"}
    res = build_report(out, P, {"decision": write(tmp_path, "decision.json", d)})
    assert res["decision"]["confidence"] == "low"
    html = (out / "summary.html").read_text()
    assert h2s(html)[0] == "Decision" and "either init" in html
    assert not (out / "curves.png").exists()
    assert (out / "decision.csv").read_text().splitlines()[1:] == []


def test_break_even_from_the_decision_else_the_params():
    assert break_even(P) == pytest.approx(BE)
    assert break_even(P, {"costmodel": {"break_even_accept_length": 2.5}}) == pytest.approx(2.5)
    assert break_even(P, {"costmodel": {}}) == pytest.approx(BE)
