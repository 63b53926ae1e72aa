"""Accept length per named eval set and per context bucket: the counts an evaluation records
(evaluate_drafter on a real feature folder with sets.json beside it) add up to its totals."""

import json

import pytest
from toys import make_features, toy_drafter

from draftport.errors import DraftportError
from draftport.evaluation.accept import bucket_counts, bucket_of, cycle_rows, evaluate_drafter, read_sets, walk
from draftport.model.formats import save_drafter, save_safetensors


def test_cycle_rows_are_walks_rows():
    acc, chk = [2, 0, 1, 3, 0, 0, 1, 0], [3] * 8
    rows = cycle_rows(acc, chk, 0, 8)
    assert rows == [(0, 2), (3, 3), (7, 0)]
    assert [a for _, a in rows] == walk(acc, chk, 0, 8)


def test_buckets_take_the_last_edge_at_or_below():
    edges = [0, 4, 16]
    assert [bucket_of(p, edges) for p in (0, 3, 4, 15, 16, 900)] == [0, 0, 1, 1, 2, 2]
    assert bucket_counts([(0, 2), (3, 3), (7, 0), (20, 1)], edges) == ([5, 0, 1], [2, 1, 1])


@pytest.fixture
def saved(tmp_path):
    return save_toy_pair(tmp_path)


def save_toy_pair(tmp_path):
    """A saved toy drafter, its target (embedding and head) and 24 samples of features in tmp_path."""
    fs, head = make_features(tmp_path, n=24)
    d = toy_drafter(seed=5)
    save_drafter(tmp_path / "drafter", d.cfg, d.export_state())
    target = tmp_path / "target"
    target.mkdir()
    weights = {"model.embed_tokens.weight": d.embed_tokens.weight.detach().clone(), "lm_head.weight": head}
    save_safetensors(weights, target / "model.safetensors")
    (target / "config.json").write_text(json.dumps({"hidden_size": d.cfg.hidden_size, "vocab_size": d.cfg.vocab_size}))
    return tmp_path


def test_sets_and_buckets_add_up_to_the_pooled_figure(saved):
    sets = [
        {"name": "chat", "share": 0.7, "start": 0, "count": 16},
        {"name": "long", "share": 0.3, "start": 16, "count": 8},
    ]
    (saved / "feats" / "sets.json").write_text(json.dumps({"sets": sets}))
    res = evaluate_drafter(saved / "drafter", saved / "target", saved / "feats", k=2, batch_size=8, buckets=[0, 6, 12])
    per = res["per_sample"]
    assert [sum(row) for row in per["bucket_cycles"]] == per["cycles"]
    assert [sum(row) for row in per["bucket_accepted"]] == per["accepted"]
    assert sum(b["num_cycles"] for b in res["by_bucket"]) == res["num_cycles"]
    chat, long = res["by_set"]["chat"], res["by_set"]["long"]
    assert chat["num_cycles"] + long["num_cycles"] == res["num_cycles"]
    assert 1.0 + sum(per["accepted"][:16]) / sum(per["cycles"][:16]) == pytest.approx(chat["accept_length"])
    # the headline is the traffic-weighted figure; the pooled one is kept beside it
    assert res["accept_length"] == pytest.approx(0.7 * chat["accept_length"] + 0.3 * long["accept_length"])
    assert res["accept_length_pooled"] == pytest.approx(1.0 + res["num_accepted_tokens"] / res["num_cycles"])
    # eval.max_samples takes the first prompts of each set, not of the folder
    few = evaluate_drafter(saved / "drafter", saved / "target", saved / "feats", k=2, max_samples=3)
    assert few["sets"] == [dict(sets[0], count=3), dict(sets[1], start=3, count=3)]
    assert few["per_sample"]["cycles"] == per["cycles"][:3] + per["cycles"][16:19]


def test_one_set_keeps_the_pooled_figure(saved):
    res = evaluate_drafter(saved / "drafter", saved / "target", saved / "feats", k=2)
    assert res["sets"] == [{"name": "heldout", "share": 1.0, "start": 0, "count": 24}]
    assert "accept_length_pooled" not in res and "by_bucket" not in res
    assert res["by_set"]["heldout"]["accept_length"] == res["accept_length"]


def test_sets_that_do_not_tile_the_folder_are_named(saved):
    path = saved / "feats" / "sets.json"
    path.write_text(json.dumps({"sets": [{"name": "a", "share": 1.0, "start": 0, "count": 20}]}))
    with pytest.raises(DraftportError, match=r"sets\.json: its sets \[\(0, 20\)\] do not tile the folder's 24"):
        read_sets(saved / "feats", 24)
    path.write_text("{}")
    with pytest.raises(DraftportError, match=r"sets\.json: not a sets file"):
        read_sets(saved / "feats", 24)
