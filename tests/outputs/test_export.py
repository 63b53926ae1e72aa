"""The export validator: each way a flat EAGLE-3 export is read wrongly by vLLM/SGLang is caught."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_targets import STUB_CTX, STUB_LAYERS, STUB_VOCAB, H, stub_drafter, stub_target

from draftport.engines.export import export_problems, validate_export
from draftport.errors import DraftportError
from draftport.evaluation.online import for_vllm


def make_export(folder, target, *, include_embed=False, **cfg_kw):
    return stub_drafter(folder, target, include_embed=include_embed, **cfg_kw)


@pytest.fixture
def world(tmp_path):
    target = stub_target(tmp_path / "target")
    return target, make_export(tmp_path / "drafter", target)


def rewrite_tensors(folder, fn):
    path = folder / "model.safetensors"
    sd = load_file(str(path))
    sd = fn(sd)
    path.unlink()
    save_file(sd, str(path), metadata={"format": "pt"})


def rewrite_config(folder, fn):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def only_problem(drafter, target, needle):
    probs = export_problems(drafter, target)
    assert any(needle in p for p in probs), probs
    with pytest.raises(DraftportError, match="not servable"):
        validate_export(drafter, target)
    return probs


def test_a_good_export_passes(world):
    target, drafter = world
    assert export_problems(drafter, target) == []
    summary = validate_export(drafter, target)
    assert summary["aux_layer_ids"] == [1, 2, 3]
    assert summary["embed_tokens"] == "shared from the target"


def test_embed_tokens_equal_to_the_target_passes(tmp_path):
    target = stub_target(tmp_path / "target")
    drafter = make_export(tmp_path / "drafter", target, include_embed=True)
    assert export_problems(drafter, target) == []


def test_names_must_be_midlayer(world):
    target, drafter = world
    rewrite_tensors(drafter, lambda sd: {k.replace("midlayer.", "layers.0."): v for k, v in sd.items()})
    probs = only_problem(drafter, target, "outside the flat EAGLE-3 layout")
    assert any("layers.0." in p and "midlayer" in p for p in probs)


def test_d2t_missing(world):
    target, drafter = world
    rewrite_tensors(drafter, lambda sd: {k: v for k, v in sd.items() if k != "d2t"})
    only_problem(drafter, target, "d2t is missing")


def test_d2t_out_of_range(world):
    target, drafter = world

    def shift_last(sd):
        sd["d2t"] = sd["d2t"].clone()
        sd["d2t"][-1] += STUB_VOCAB
        return sd

    rewrite_tensors(drafter, shift_last)
    only_problem(drafter, target, "outside the vocab")


def test_aux_ids_missing_from_eagle_config(world):
    target, drafter = world
    rewrite_config(drafter, lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"))
    only_problem(drafter, target, "eagle_aux_hidden_state_layer_ids is missing")


@pytest.mark.parametrize(
    "ids, needle",
    [([1, 3, 3], "distinct and increasing"), ([3, 1, 2], "distinct and increasing"), ([1, 2, 9], "out of range")],
)
def test_aux_ids_vllm_cannot_serve(world, ids, needle):
    target, drafter = world
    rewrite_config(drafter, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids))
    only_problem(drafter, target, needle)


def test_aux_id_L_is_the_last_layers_output_and_allowed(world):
    target, drafter = world
    rewrite_config(drafter, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 2, STUB_LAYERS]))
    assert export_problems(drafter, target) == []


def test_max_position_embeddings_below_target_context(world):
    target, drafter = world
    rewrite_config(drafter, lambda c: c.update(max_position_embeddings=STUB_CTX // 2))
    only_problem(drafter, target, f"max_position_embeddings {STUB_CTX // 2} < the target's context {STUB_CTX}")


def test_random_embed_tokens(world):
    target, drafter = world
    rewrite_tensors(drafter, lambda sd: {**sd, "embed_tokens.weight": torch.randn(STUB_VOCAB, H)})
    only_problem(drafter, target, "embed_tokens differs from the target's")


def test_draft_vocab_size_mismatch(world):
    target, drafter = world
    rewrite_config(drafter, lambda c: c.update(draft_vocab_size=50))
    probs = only_problem(drafter, target, "draft_vocab_size 50 in config.json but lm_head has 40 rows")
    assert any("d2t has shape" in p or "tensor d2t" in p for p in probs)


def test_other_convention_is_flagged(world):
    target, drafter = world
    rewrite_config(drafter, lambda c: c.update(draftport_aux_convention="sglang"))
    only_problem(drafter, target, "sglang aux-layer convention")


def test_speculators_config_is_not_the_flat_format(world):
    target, drafter = world
    rewrite_config(drafter, lambda c: c.update(architectures=["Eagle3Speculator"]))
    only_problem(drafter, target, "lack 'LlamaForCausalLMEagle3'")


def test_sglang_numbered_drafter_is_served_to_vllm_with_ids_plus_one(tmp_path):
    """SGLang's aux id k (leaving layer k) is vLLM's k + 1 (entering layer k + 1)."""
    target = stub_target(tmp_path / "target")
    src = make_export(tmp_path / "sglang", target, aux_layer_ids=[0, 1, 2], aux_convention="sglang")
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    out, how = for_vllm(src, tmp_path / "served", None)
    assert out == tmp_path / "served" and "[0, 1, 2]" in how and "[1, 2, 3]" in how
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["draftport_aux_convention"] == "vllm"
    assert (out / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before  # the source is untouched
    assert export_problems(out, target) == []  # servable as vLLM reads it
    # a vLLM-numbered drafter is served as it is; an unrecorded one follows the profile's convention
    vl = make_export(tmp_path / "vllm", target)
    assert for_vllm(vl, tmp_path / "unused", "sglang")[0] == vl and not (tmp_path / "unused").exists()
    raw = json.loads((vl / "config.json").read_text())
    del raw["draftport_aux_convention"]
    (vl / "config.json").write_text(json.dumps(raw))
    assert for_vllm(vl, tmp_path / "hub", "sglang")[0] == tmp_path / "hub"
    assert for_vllm(vl, tmp_path / "unused", None)[0] == vl
