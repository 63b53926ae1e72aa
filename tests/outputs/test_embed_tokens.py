"""embed_tokens across engines: vLLM serves a drafter's own embed_tokens, SGLang the target's.

A drafter that carries the OLD target's embedding is served differently by the two on the new
target: `draftport compare --target` flags it (sha256 of the tensor bytes, torch-free), and the
vLLM export (`for_vllm`, params online.embed_tokens) either drops it or carries the new target's
bit for bit, never the drafter's as is.
"""

import copy
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_targets import STUB_VOCAB, H, stub_drafter, stub_target

from draftport.engines.export import export_problems, validate_export
from draftport.errors import DraftportError
from draftport.evaluation.online import for_vllm
from draftport.model.formats import (
    copy_tensors_safetensors,
    find_target_embedding,
    read_header,
    save_safetensors,
    tensor_sha256,
    tensors_equal_values,
)
from draftport.outputs.compare import compare_drafters, embedding_check
from draftport.plan import params

ROOT = Path(__file__).resolve().parents[2]

WARNING = "vLLM would serve the drafter's own embedding, SGLang the target's"


def target_embed(target, name="model.embed_tokens.weight"):
    return load_file(str(target / "model.safetensors"))[name]


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def make_drafter(folder, embed_from=None, **cfg_kw):
    """A flat drafter; with embed_from (a target folder) it carries that target's embed_tokens."""
    return stub_drafter(folder, embed_from, **cfg_kw)


def tensors(folder) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({n: sf.get_tensor(n) for n in sf.keys()})
    return out


@pytest.fixture
def w(tmp_path):
    old = stub_target(tmp_path / "target_old", seed=1)  # "K2"
    new = stub_target(tmp_path / "target_new", seed=2)  # "K2.5": another embedding
    assert not torch.equal(target_embed(old), target_embed(new))
    return {
        "old": old,
        "new": new,
        "tmp": tmp_path,
        "src_old_embed": make_drafter(tmp_path / "src_old_embed", embed_from=old),
        "src_new_embed": make_drafter(tmp_path / "src_new_embed", embed_from=new),
        "plain": make_drafter(tmp_path / "plain"),
    }


# ---- compare ----------------------------------------------------------------------------------
def test_compare_flags_a_drafter_carrying_the_old_targets_embedding(w):
    rep = compare_drafters(w["src_old_embed"], w["plain"], target=w["new"])
    e = rep["embedding"]["src"]
    assert e["carries_embed_tokens"] is True and e["equal"] is False and e["engines_agree"] is False
    assert e["drafter_sha256"] == sha(target_embed(w["old"]))  # the old target's bytes, hashed by range
    assert e["target_sha256"] == sha(target_embed(w["new"]))
    assert e["drafter_sha256"] != e["target_sha256"]
    assert e["target_tensor"] == "model.embed_tokens.weight" and e["target_shape"] == [STUB_VOCAB, H]
    assert (e["vllm"], e["sglang"]) == ("drafter", "target")
    assert WARNING in e["note"]
    warn = [x for x in rep["verdict"]["warnings"] if WARNING in x]
    assert len(warn) == 1 and warn[0].startswith("src's embed_tokens differs")
    d = rep["embedding"]["dst"]  # no embed_tokens: both engines take the target's
    assert d["carries_embed_tokens"] is False and d["equal"] is None and d["engines_agree"] is True
    assert rep["embedding"]["target"] == str(w["new"])


def test_compare_says_equal_for_the_targets_own_embedding(w):
    rep = compare_drafters(w["src_new_embed"], w["plain"], target=w["new"])
    e = rep["embedding"]["src"]
    assert e["equal"] is True and e["engines_agree"] is True and e["drafter_sha256"] == e["target_sha256"]
    assert not any(WARNING in x for x in rep["verdict"]["warnings"])
    # the same drafter against the OLD target is the foreign one
    assert embedding_check(w["src_new_embed"], w["old"])["equal"] is False


def test_compare_without_target_has_no_embedding_section(w):
    assert "embedding" not in compare_drafters(w["src_old_embed"], w["plain"])


def test_the_same_values_in_another_dtype(w):
    """A bf16 target and the drafter's f32 copy of it: not bit-equal, but the same values."""
    t16 = stub_target(w["tmp"] / "t16", seed=2, dtype=torch.bfloat16)
    e = embedding_check(w["src_old_embed"], t16)
    assert e["equal"] is False and e["equal_values"] is False and e["engines_agree"] is False
    d = w["tmp"] / "d_f32_of_bf16"
    make_drafter(d)
    sd = load_file(str(d / "model.safetensors"))
    sd["embed_tokens.weight"] = target_embed(t16).float()
    (d / "model.safetensors").unlink()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    e = embedding_check(d, t16)
    assert e["equal"] is False and e["equal_values"] is True and e["engines_agree"] is True


def test_the_target_embedding_is_found_under_a_wrappers_name(w):
    kimi = stub_target(w["tmp"] / "kimi_like", seed=2, embed_name="language_model.model.embed_tokens.weight")
    info = find_target_embedding(kimi)
    assert info.name == "language_model.model.embed_tokens.weight"
    assert tensor_sha256(info) == sha(target_embed(w["new"]))
    assert embedding_check(w["src_new_embed"], kimi)["equal"] is True
    with pytest.raises(DraftportError, match="no such target folder"):
        find_target_embedding(w["tmp"] / "nope")


def run_cli(*args):
    env = {**os.environ, "COLUMNS": "200"}  # a wide terminal: the hashes stay on one line
    return subprocess.run(
        [sys.executable, "-m", "draftport.cli", *map(str, args)], capture_output=True, text=True, env=env
    )


def test_cli_target_option_json_and_text(w):
    res = run_cli("compare", w["src_old_embed"], w["plain"], "--target", w["new"], "--json")
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["embedding"]["src"]["equal"] is False
    assert any(WARNING in x for x in rep["verdict"]["warnings"])
    res = run_cli("compare", w["src_old_embed"], w["plain"], "--target", w["new"])
    assert res.returncode == 0, res.stderr
    out = " ".join(res.stdout.split())
    assert "embedding" in out and WARNING in out
    assert sha(target_embed(w["new"]))[:16] in out and sha(target_embed(w["old"]))[:16] in out
    res = run_cli("compare", w["src_old_embed"], w["plain"], "--target", w["tmp"] / "nope")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "no such target folder" in res.stderr


def test_compare_with_target_stays_torch_free(w):
    code = (
        "import sys, json; from draftport.outputs.compare import compare_drafters; "
        f"compare_drafters({str(w['src_old_embed'])!r}, {str(w['plain'])!r}, target={str(w['new'])!r}); "
        "import draftport.cli, draftport.outputs.render; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# ---- the vLLM export ------------------------------------------------------------------------
def test_export_drop_carries_no_embed_tokens(w):
    src = w["src_old_embed"]
    before = {f.name: f.read_bytes() for f in src.iterdir()}
    out, how = for_vllm(src, w["tmp"] / "served", "vllm", "drop")
    assert out == w["tmp"] / "served" and "dropped" in how
    got, orig = tensors(out), tensors(src)
    assert "embed_tokens.weight" not in got
    assert set(got) == set(orig) - {"embed_tokens.weight"}
    assert all(torch.equal(got[n], orig[n]) and got[n].dtype == orig[n].dtype for n in got)  # bit for bit
    assert {f.name: f.read_bytes() for f in src.iterdir()} == before  # the source is untouched
    assert export_problems(out, w["new"], embed_tokens="drop") == []
    assert validate_export(out, w["new"], embed_tokens="drop")["embed_tokens"] == "shared from the target"


def test_export_target_carries_the_new_targets_bytes(w):
    out, how = for_vllm(w["src_old_embed"], w["tmp"] / "served", "vllm", "target", target_dir=w["new"])
    assert "replaced by the target's" in how and "bit for bit" in how
    emb = tensors(out)["embed_tokens.weight"]
    assert sha(emb) == sha(target_embed(w["new"])) and emb.dtype == target_embed(w["new"]).dtype
    assert export_problems(out, w["new"], embed_tokens="target") == []
    assert compare_drafters(out, w["plain"], target=w["new"])["embedding"]["src"]["equal"] is True
    # a drafter without embed_tokens gets the target's added
    out2, how2 = for_vllm(w["plain"], w["tmp"] / "served2", "vllm", "target", target_dir=w["new"])
    assert out2 != w["plain"] and "set to the target's" in how2
    assert sha(tensors(out2)["embed_tokens.weight"]) == sha(target_embed(w["new"]))
    assert export_problems(out2, w["new"], embed_tokens="target") == []


def test_a_foreign_embedding_is_never_exported_as_is(w):
    src = w["src_old_embed"]
    assert any("embed_tokens differs from the target's" in p for p in export_problems(src, w["new"]))
    for mode in ("drop", "target"):
        out, _ = for_vllm(src, w["tmp"] / f"served_{mode}", "vllm", mode, target_dir=w["new"])
        assert out != src
        emb = tensors(out).get("embed_tokens.weight")
        assert emb is None or sha(emb) != sha(target_embed(w["old"]))
        assert export_problems(out, w["new"], embed_tokens=mode) == []


def test_nothing_to_do_serves_the_folder_as_is(w):
    out, how = for_vllm(w["plain"], w["tmp"] / "unused", "vllm", "drop")
    assert out == w["plain"] and "served as is" in how and not (w["tmp"] / "unused").exists()
    out, how = for_vllm(w["src_new_embed"], w["tmp"] / "unused", "vllm", "target", target_dir=w["new"])
    assert out == w["src_new_embed"] and "kept" in how and not (w["tmp"] / "unused").exists()


def test_renumbering_and_dropping_together(w):
    src = make_drafter(w["tmp"] / "sg", embed_from=w["old"], aux_layer_ids=[0, 1, 2], aux_convention="sglang")
    out, how = for_vllm(src, w["tmp"] / "served", None, "drop")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert "[1, 2, 3]" in how and "dropped" in how
    assert "embed_tokens.weight" not in tensors(out)
    assert export_problems(out, w["new"], embed_tokens="drop") == []


def test_export_checks_follow_the_choice(w):
    assert any(
        "online.embed_tokens is drop" in p for p in export_problems(w["src_new_embed"], w["new"], embed_tokens="drop")
    )
    assert any("carries no embed_tokens" in p for p in export_problems(w["plain"], w["new"], embed_tokens="target"))
    assert export_problems(w["src_new_embed"], w["new"], embed_tokens="target") == []
    assert any(
        "differs from the target's" in p for p in export_problems(w["src_old_embed"], w["new"], embed_tokens="target")
    )
    # the target's values in another dtype are not the target's bit for bit
    d = w["tmp"] / "bf16_copy"
    make_drafter(d)
    sd = load_file(str(d / "model.safetensors"))
    sd["embed_tokens.weight"] = target_embed(w["new"]).to(torch.bfloat16)
    (d / "model.safetensors").unlink()
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert any("bit for bit" in p for p in export_problems(d, w["new"], embed_tokens="target"))
    with pytest.raises(DraftportError, match="online.embed_tokens"):
        export_problems(w["plain"], w["new"], embed_tokens="keep")
    with pytest.raises(DraftportError, match="online.embed_tokens"):
        for_vllm(w["plain"], w["tmp"] / "x", "vllm", "keep")
    with pytest.raises(DraftportError, match="needs the target folder"):
        for_vllm(w["plain"], w["tmp"] / "x", "vllm", "target")


# ---- the byte-range helpers -------------------------------------------------------------------
def test_copied_tensors_give_save_safetensors_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {
        "b": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a": torch.randn(4, generator=g),
        "i": torch.arange(7),
        "m": torch.ones(2, dtype=torch.bool),
    }
    save_safetensors(sd, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    table, meta = read_header(tmp_path / "ref.safetensors")
    copy_tensors_safetensors(table, tmp_path / "copy.safetensors", metadata=meta)
    assert (tmp_path / "copy.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    renamed = copy_tensors_safetensors({"x": table["b"]}, tmp_path / "one.safetensors")
    assert torch.equal(load_file(str(renamed))["x"], sd["b"])
    assert tensors_equal_values(table["a"], table["a"]) and not tensors_equal_values(table["a"], table["b"])


# ---- params -------------------------------------------------------------------------------
def test_params_online_embed_tokens():
    cfg = params.read_yaml(ROOT / "params.yaml")
    assert cfg["online"]["embed_tokens"] == "drop"  # params.yaml shows it
    assert params.OnlineParams.model_fields["embed_tokens"].default == "drop"
    bad = copy.deepcopy(cfg)
    bad["online"]["embed_tokens"] = "keep"
    with pytest.raises(params.ParamsError, match='online.embed_tokens: must be one of drop, target; got "keep"'):
        params.validate(bad)
