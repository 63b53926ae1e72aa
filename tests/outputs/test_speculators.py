"""A peer takes the published drafter further with speculators 0.9.0, in its own venv
(`make speculators-venv`): `speculators convert` keeps every tensor bit for bit under its new
name, speculators' Eagle3DraftModel loads it (with the embedding the folder carries, the new
target's) and computes draftport's teacher-forced forward; draftport's loader reads the
converted folder back (RoPE from transformers 5's rope_parameters); and draftport's own
speculators-format folder loads in speculators too, naming the new target as its verifier.

Skipped without the venv, unless DRAFTPORT_REQUIRE_SPECULATORS=1 (CI), which makes that a failure.
"""

import json
import os

import pytest
import torch
from publish_pipeline import AUX, K, build_pipeline
from repo import ROOT

from draftport.errors import DraftportError
from draftport.evaluation import roundtrip as RT
from draftport.model.config import DrafterConfig, parse_config
from draftport.model.formats import find_target_embedding, load_drafter_state, read_tensor_np, save_drafter
from draftport.outputs.publish import from_pipeline

REQUIRE = bool(os.environ.get("DRAFTPORT_REQUIRE_SPECULATORS"))
SPEC_PY = (
    RT.default_speculators_python()
    if os.environ.get("DRAFTPORT_SPECULATORS_PYTHON")
    else ROOT / RT.VENV_DIR / "bin" / "python"
)
# float32 on both sides, the same operations in another order (speculators' Llama layer, its flex
# attention): measured max |diff| ~1e-7 on logits of magnitude ~1; a real bug (a norm, RoPE, the
# mask, the fed-back state) moves them by O(0.1).
TOL = 1e-4


def test_the_convert_command_passes_the_aux_ids_and_norm_before_residual():
    cfg = DrafterConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=100,
        draft_vocab_size=40,
        aux_layer_ids=[2, 30, 58],
    )
    args = RT.convert_args("org/d", "org/t", "out", cfg)
    assert args[:7] == ["convert", "org/d", "--algorithm", "eagle3", "--verifier", "org/t", "--output-path"]
    assert json.loads(args[-1]) == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "norm_before_residual": False}
    cfg.aux_layer_ids = None
    with pytest.raises(DraftportError, match="no eagle_aux_hidden_state_layer_ids"):
        RT.convert_args("org/d", "org/t", "out", cfg)


def test_rope_from_transformers_5s_rope_parameters():
    """speculators 0.9.0 writes transformer_layer_config under transformers 5: RoPE as
    rope_parameters, no rope_theta. Read as the default 10000, the drafter would rotate wrongly."""
    layer = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 100,
        "rope_parameters": {"rope_theta": 50000.0, "rope_type": "default"},
    }
    raw = {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": 40,
        "eagle_aux_hidden_state_layer_ids": AUX,
    }
    cfg = parse_config(raw)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is None and cfg.norm_before_residual is False
    layer["rope_parameters"] = {"rope_theta": 50000.0, "rope_type": "linear", "factor": 2.0}
    assert parse_config(raw).rope_scaling == {"rope_type": "linear", "factor": 2.0}
    layer["rope_theta"] = 20000.0  # transformers 4's key, when present, wins
    assert parse_config(raw).rope_theta == 20000.0


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    if not SPEC_PY.exists():
        if REQUIRE:
            pytest.fail(f"DRAFTPORT_REQUIRE_SPECULATORS is set but {SPEC_PY} is missing: run `make speculators-venv`")
        pytest.skip(
            f"no speculators venv at {SPEC_PY} (run `make speculators-venv`; DRAFTPORT_REQUIRE_SPECULATORS=1 "
            "makes this a failure)"
        )

    root = tmp_path_factory.mktemp("speculators")
    # rope_theta 50000: a RoPE read wrongly on either side (the default is 10000) shows in the logits
    pipe = build_pipeline(root, rope_theta=50000.0, verifier_is_folder=True)
    out = root / "published" / "drafter"
    from_pipeline(pipe["params"], pipe["inputs"], out)
    return {**pipe, "published": out, "python": SPEC_PY}


@pytest.mark.slow
def test_speculators_converts_loads_and_computes_what_draftport_computes(spec):
    rep = RT.roundtrip(
        spec["published"],
        spec["target"],
        spec["features"],
        spec["root"] / "roundtrip",
        n_samples=8,
        steps=K,
        python=spec["python"],
    )
    meta = rep["speculators"]
    assert meta["speculators_version"] == "0.9.0" and meta["attn_implementation"] == "simple_flex_attention"
    assert meta["aux_layer_ids"] == AUX and meta["norm_before_residual"] is False
    # every tensor (the 15 of the drafter and the new target's embedding) renamed, bit for bit
    t = rep["tensors"]
    assert len(t["identical"]) == 16 and "embed_tokens.weight" in t["identical"], t
    assert t["differ"] == [] and t["only_flat"] == [] and t["only_speculators"] == []
    assert rep["embed_tokens_equal_target"] and not meta["embed_tokens_has_nan"]
    fwd = rep["forward"]
    print(
        f"speculators vs draftport, {rep['sequences']} sequences, {K} TTT steps: max |diff| "
        f"{fwd['max_abs_diff']:.2e}, argmax {fwd['argmax_agree']}/{fwd['rows']}"
    )
    assert fwd["rows"] > 0 and fwd["argmax_agree"] == fwd["rows"]
    assert fwd["max_abs_diff"] <= TOL, fwd
    assert all(s["max_abs_logit"] > 0.1 for s in fwd["steps"])  # logits that could differ
    back = rep["draftport_on_converted"]  # draftport's loader on speculators' folder: the same drafter
    assert back["max_abs_diff"] == 0.0 and back["argmax_agree"] == back["rows"], back


@pytest.mark.slow
def test_draftports_speculators_format_loads_in_speculators(spec):
    """The speculators-format writer names the drafter's own target (the new one) as its
    verifier, which speculators reads (its layer count, its final norm)."""
    cfg, state = load_drafter_state(spec["inputs"]["drafter_phase1"])  # as Phase 1's training saved it
    assert cfg.extra["verifier"] == str(spec["target"])
    state["embed_tokens.weight"] = torch.from_numpy(read_tensor_np(find_target_embedding(spec["target"])).copy())
    folder = save_drafter(spec["root"] / "dp_speculators", cfg, state, fmt="speculators")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(spec["target"])
    assert raw["norm_before_residual"] is False
    seqs = RT.sequences_from_features(spec["features"], 6)
    lengths = [len(t) for _, t in seqs]
    ours = RT.draftport_forward(spec["inputs"]["drafter_phase1"], spec["target"], seqs, K)
    theirs, meta, embed = RT.speculators_forward(
        folder, seqs, K, python=spec["python"], work_dir=spec["root"], dump_embedding=True
    )
    assert meta["verifier"] == str(spec["target"]) and meta["aux_layer_ids"] == AUX
    assert torch.equal(embed, state["embed_tokens.weight"])
    cmp = RT.compare_logits(ours, theirs, lengths)
    assert cmp["argmax_agree"] == cmp["rows"] and cmp["max_abs_diff"] <= TOL, cmp


@pytest.mark.slow
def test_a_missing_venv_or_a_failed_convert_is_one_line(spec, tmp_path):
    with pytest.raises(DraftportError, match="no speculators interpreter: run `make speculators-venv`"):
        RT.speculators_python(tmp_path / "nope" / "python")
    bad = tmp_path / "not_a_target"
    bad.mkdir()  # speculators 0.9.0 would convert against it, and write a folder it cannot load
    with pytest.raises(DraftportError, match="not_a_target: the verifier is not a model folder"):
        RT.convert(spec["published"], bad, tmp_path / "conv", python=spec["python"])
    assert not (tmp_path / "conv").exists()
    # speculators itself refusing: the flat folder is not its format
    with pytest.raises(DraftportError, match=r"speculators forward failed \(exit \d+\): .*\[log: "):
        RT.speculators_forward(
            spec["published"],
            RT.sequences_from_features(spec["features"], 1),
            K,
            python=spec["python"],
            work_dir=tmp_path,
        )
