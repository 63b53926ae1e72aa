"""`compare_drafters` on header-only fixtures: the seed-000 table, vocab overlap, verdicts, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from draftport.errors import DraftportError
from draftport.model.fixtures import (
    frequency_maps,
    kimi_k2_config,
    small_config,
    swap_hot_ids,
    write_header_only_drafter,
)
from draftport.model.vocab import hot_ids
from draftport.outputs.compare import CONFIG_FIELDS, compare_drafters

# Seed 000: AQ-MedAI's K2 drafter (no embed_tokens) against the team's K2.5 drafter (with it).
SEED_000 = {
    "fc.weight": ([7168, 21504], "BF16"),
    "midlayer.input_layernorm.weight": ([7168], "BF16"),
    "midlayer.hidden_norm.weight": ([7168], "BF16"),
    "midlayer.post_attention_layernorm.weight": ([7168], "BF16"),
    "midlayer.self_attn.q_proj.weight": ([8192, 14336], "BF16"),  # 64 heads x head_dim 128, 2H in
    "midlayer.self_attn.k_proj.weight": ([8192, 14336], "BF16"),
    "midlayer.self_attn.v_proj.weight": ([8192, 14336], "BF16"),
    "midlayer.self_attn.o_proj.weight": ([7168, 8192], "BF16"),
    "midlayer.mlp.gate_proj.weight": ([18432, 7168], "BF16"),
    "midlayer.mlp.up_proj.weight": ([18432, 7168], "BF16"),
    "midlayer.mlp.down_proj.weight": ([7168, 18432], "BF16"),
    "norm.weight": ([7168], "BF16"),
    "lm_head.weight": ([32000, 7168], "BF16"),
    "d2t": ([32000], "I64"),
    "t2d": ([163840], "BOOL"),
}


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    """Sparse full-size K2 / K2.5 drafters: src flat without embed, dst with embed_tokens."""
    root = tmp_path_factory.mktemp("k2")
    cfg = kimi_k2_config()
    d2t, t2d = frequency_maps(cfg, seed=0)
    d2t_b, t2d_b = swap_hot_ids(d2t, cfg.vocab_size, 250, seed=1)
    return {
        "cfg": cfg,
        "d2t": d2t,
        "d2t_b": d2t_b,
        "src": write_header_only_drafter(root / "k2", cfg, d2t, t2d, with_embed=False),
        "dst": write_header_only_drafter(root / "k25", cfg, d2t_b, t2d_b, with_embed=True),
        "dst_same_map": write_header_only_drafter(root / "k25_same", cfg, d2t, t2d, with_embed=True),
        "dst_spec": write_header_only_drafter(root / "k2_spec", cfg, d2t, t2d, with_embed=False, fmt="speculators"),
    }


def test_seed_000_weight_table(k2):
    rep = compare_drafters(k2["src"], k2["dst"])
    assert set(rep) >= {"config", "weights", "vocab", "verdict"}
    rows = {r["name"]: r for r in rep["weights"]}
    assert set(rows) == set(SEED_000) | {"embed_tokens.weight"}
    for name, (shape, dtype) in SEED_000.items():
        r = rows[name]
        assert (r["src_shape"], r["dst_shape"]) == (shape, shape), name
        assert (r["src_dtype"], r["dst_dtype"]) == (dtype, dtype), name
        assert r["status"] == "match", name
    emb = rows["embed_tokens.weight"]
    assert emb["status"] == "missing_in_src"
    assert emb["src_shape"] is None and emb["dst_shape"] == [163840, 7168] and emb["dst_dtype"] == "BF16"
    assert "expected" in emb["note"] and "frozen" in emb["note"] and "target" in emb["note"]
    v = rep["verdict"]
    assert v["compatible_architecture"] is True
    # every architecture field side by side, all agreeing
    cfg_rows = {r["field"]: r for r in rep["config"]}
    assert set(cfg_rows) == set(CONFIG_FIELDS)
    assert all(r["match"] for r in rep["config"])
    assert cfg_rows["head_dim"]["src"] == 128 and cfg_rows["aux_layer_ids"]["dst"] == [2, 30, 58]


def test_sorted_maps_a_few_hundred_tokens_apart(k2):
    """The seed-002 trap: ~31k slots 'differ' while 99% of the tokens are shared."""
    v = compare_drafters(k2["src"], k2["dst"])["vocab"]
    assert v["identical"] is False
    assert v["positions_differ"] > 10_000
    assert v["overlap"] == 32000 - 250 and v["src_only"] == v["dst_only"] == 250
    assert v["jaccard"] > 0.95
    assert v["positions_artifact_of_sorting"] is True
    assert "artifact of sorting" in v["explanation"]
    assert v["format"] == {"src": "delta", "dst": "delta"}
    assert v["t2d_consistent"] == {"src": True, "dst": True}
    assert v["ids_out_of_range"] == {"src": 0, "dst": 0}
    assert v["draft_vocab_size"] == {"src": 32000, "dst": 32000}
    action = compare_drafters(k2["src"], k2["dst"])["verdict"]["vocab_action"]
    assert "remap lm_head rows by target id" in action and "keep" in action and "never rebuild" in action


def test_identical_maps_need_no_vocab_action(k2):
    rep = compare_drafters(k2["src"], k2["dst_same_map"])
    assert rep["vocab"]["identical"] is True and rep["vocab"]["positions_differ"] == 0
    assert rep["verdict"]["vocab_action"].startswith("nothing")


def test_flat_and_speculators_forms_of_one_drafter_agree(k2):
    rep = compare_drafters(k2["src"], k2["dst_spec"])
    mism = [r["field"] for r in rep["config"] if not r["match"]]
    assert mism == ["architectures"]  # ["LlamaForCausalLMEagle3"] vs ["Eagle3Speculator"]
    assert "format" in rep["config"][CONFIG_FIELDS.index("architectures")]["note"]
    assert all(r["status"] == "match" for r in rep["weights"])
    assert rep["folders"]["dst"]["format"] == "speculators"
    assert rep["vocab"]["identical"] is True


def _pair(tmp_path, src_cfg=None, dst_cfg=None, **dst_kw):
    src_cfg = src_cfg or small_config()
    dst_cfg = dst_cfg or src_cfg
    d2t, t2d = frequency_maps(src_cfg)
    dd2t, dt2d = dst_kw.pop("maps", frequency_maps(dst_cfg))
    a = write_header_only_drafter(tmp_path / "src", src_cfg, d2t, t2d)
    b = write_header_only_drafter(tmp_path / "dst", dst_cfg, dd2t, dt2d, **dst_kw)
    return a, b


def test_architecture_mismatch_is_explained(tmp_path):
    a, b = _pair(tmp_path, dst_cfg=small_config(intermediate_size=256, rope_theta=1e6))
    v = compare_drafters(a, b)["verdict"]
    assert v["compatible_architecture"] is False
    assert any("intermediate_size differs (128 vs 256)" in r for r in v["reasons"])
    assert any("mlp.up_proj.weight shape differs" in r for r in v["reasons"])
    assert any("rope_theta differs" in w for w in v["warnings"])


def test_draft_vocab_size_change_is_a_vocab_question_not_an_architecture_one(tmp_path):
    a, b = _pair(tmp_path, dst_cfg=small_config(draft_vocab_size=150))
    rep = compare_drafters(a, b)
    assert rep["verdict"]["compatible_architecture"] is True
    rows = {r["name"]: r for r in rep["weights"]}
    assert rows["lm_head.weight"]["status"] == "mismatch" and "remap" in rows["lm_head.weight"]["note"]
    assert rep["vocab"]["draft_vocab_size"] == {"src": 200, "dst": 150}
    assert rep["vocab"]["dst_only"] == 0 and rep["vocab"]["src_only"] == 50


def test_aux_layers_compared_as_layers_under_their_conventions(tmp_path):
    src = small_config(aux_layer_ids=[1, 3, 5], aux_convention="sglang")
    same = small_config(aux_layer_ids=[2, 4, 6], aux_convention="vllm")
    a, b = _pair(tmp_path, src_cfg=src, dst_cfg=same)
    w = compare_drafters(a, b)["verdict"]["warnings"]
    assert any("name the same layers" in x for x in w) and not any("aux layers differ" in x for x in w)
    other = small_config(aux_layer_ids=[1, 3, 5], aux_convention="vllm")
    a, b = _pair(tmp_path / "2", src_cfg=src, dst_cfg=other)
    assert any("aux layers differ" in x for x in compare_drafters(a, b)["verdict"]["warnings"])


def test_missing_aux_ids_and_conventions_are_flagged(tmp_path):
    a, b = _pair(tmp_path, config_patch={"eagle_config": {"use_aux_hidden_state": True}})
    w = compare_drafters(a, b)["verdict"]["warnings"]
    assert any("dst config names no eagle_aux_hidden_state_layer_ids" in x for x in w)
    assert any("convention not recorded" in x for x in w)


def test_one_side_without_d2t_is_said_plainly(tmp_path):
    a, b = _pair(tmp_path, drop=["d2t", "t2d"])
    rep = compare_drafters(a, b)
    v = rep["vocab"]
    assert v["d2t_present"] == {"src": True, "dst": False}
    assert v["overlap"] is None and v["positions_differ"] is None
    assert "dst has no d2t" in v["explanation"]
    assert "keep the source map" in rep["verdict"]["vocab_action"]
    rows = {r["name"]: r for r in rep["weights"]}
    assert rows["d2t"]["status"] == "missing_in_dst"
    b2, a2 = _pair(tmp_path / "rev", drop=["d2t", "t2d"])
    rep = compare_drafters(a2, b2)
    assert "src has no d2t" in rep["vocab"]["explanation"]
    assert "recover the map" in rep["verdict"]["vocab_action"]


def test_full_vocab_drafter_without_d2t_implies_identity(tmp_path):
    cfg = small_config(draft_vocab_size=1000)
    ident = (np.zeros(1000, dtype=np.int64), np.ones(1000, dtype=bool))
    a = write_header_only_drafter(tmp_path / "a", cfg, None, None)
    b = write_header_only_drafter(tmp_path / "b", cfg, *ident)
    v = compare_drafters(a, b)["vocab"]
    assert v["format"]["src"] == "identity" and v["identical"] is True


# ---- errors: compare is where a user finds out -------------------------------------------------


def test_d2t_of_wrong_length_is_an_error(tmp_path):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    a, b = _pair(tmp_path, maps=(d2t[:-1], t2d))
    with pytest.raises(DraftportError, match=r"tensor d2t has shape \[199\].*draft_vocab_size 200") as e:
        compare_drafters(a, b)
    assert e.value.where == str(b / "model.safetensors")


def test_d2t_past_the_vocab_is_an_error(tmp_path):
    d2t, t2d = frequency_maps(small_config())
    bad = d2t.copy()
    bad[-1] += 10_000
    a, b = _pair(tmp_path, maps=(bad, None))
    with pytest.raises(DraftportError, match="outside the vocab of 1000"):
        compare_drafters(a, b)
    v = compare_drafters(a, b, strict=False)["vocab"]
    assert v["ids_out_of_range"]["dst"] == 1 and v["format"]["dst"] == "invalid"


def test_t2d_disagreeing_with_d2t_is_an_error(tmp_path):
    d2t, t2d = frequency_maps(small_config())
    t2d_off = ~t2d
    a, b = _pair(tmp_path, maps=(d2t, t2d_off))
    with pytest.raises(DraftportError, match="t2d disagrees with d2t"):
        compare_drafters(a, b)
    assert compare_drafters(a, b, strict=False)["vocab"]["t2d_consistent"]["dst"] is False


def test_absolute_d2t_is_an_error_and_reported_when_lenient(tmp_path):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    a, b = _pair(tmp_path, maps=(hot_ids(d2t), t2d))
    with pytest.raises(DraftportError, match="absolute target ids, not deltas"):
        compare_drafters(a, b)
    v = compare_drafters(a, b, strict=False)["vocab"]
    assert v["format"]["dst"] == "absolute"
    assert v["identical"] is True  # compared by the ids the author meant
    assert "absolute ids" in v["explanation"]


def test_q_proj_against_heads_times_head_dim_is_an_error(tmp_path):
    cfg = kimi_k2_config()
    d2t, t2d = frequency_maps(cfg)
    a = write_header_only_drafter(tmp_path / "a", cfg, d2t, t2d)
    # a config that forgets head_dim: 7168 / 64 = 112, but q_proj holds 64 x 128 rows
    b = write_header_only_drafter(tmp_path / "b", cfg, d2t, t2d, config_patch={"head_dim": None})
    with pytest.raises(DraftportError, match=r"q_proj.*\[8192, 14336\].*\[7168, 14336\].*head_dim 112"):
        compare_drafters(a, b)


def test_compare_never_imports_torch(k2):
    code = (
        "import sys, json; from draftport.outputs.compare import compare_drafters; "
        f"compare_drafters({str(k2['src'])!r}, {str(k2['dst'])!r}); "
        "import draftport.cli, draftport.outputs.render, draftport.model.fixtures; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'safetensors'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # the headers are read by safetensors' Rust core (under 1 ms to import), never safetensors.torch
    assert set(json.loads(out.stdout)) <= {"safetensors", "safetensors._safetensors_rust"}
