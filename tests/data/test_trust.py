"""Nothing from the hub runs code unless the params say so: pickle weights are refused (or, when
source.allow_pickle is true, converted with torch.load(weights_only=True), which still refuses a
pickle that carries code), and a repo's own code runs only when targets.trust_remote_code names it."""

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from toys import toy_drafter
from transformers import LlamaConfig, LlamaForCausalLM

from draftport.data import fetch
from draftport.data.capture import load_target, trusted
from draftport.errors import DraftportError
from draftport.model.formats import load_drafter_state, save_drafter
from draftport.plan import params, registry

ROOT = Path(__file__).resolve().parents[2]


def pickled_repo(tmp_path, payload=None) -> tuple[str, Path, dict]:
    """A hub repo (in a local hub cache) holding config.json + pytorch_model.bin only."""
    d = toy_drafter(seed=3)
    save_drafter(tmp_path / "good", d.cfg, d.export_state())

    state = load_file(str(tmp_path / "good" / "model.safetensors"))
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    with open(folder / "pytorch_model.bin", "wb") as fh:
        if payload is None:
            torch.save(state, fh)
        else:
            pickle.dump(payload, fh)
    fetch.publish_to_cache(folder, tmp_path / "hub", "org/pickled")
    return "org/pickled", tmp_path / "hub", state


def test_pickle_weights_are_refused_by_default_with_how_to_allow(tmp_path):
    repo, hub, _ = pickled_repo(tmp_path)
    with pytest.raises(DraftportError) as e:
        fetch.fetch(repo, tmp_path / "out", cache_dir=hub, offline=True)
    msg = str(e.value)
    assert "pytorch_model.bin" in msg and "refused" in msg and "source.allow_pickle: true" in msg
    assert "\n" not in msg and not (tmp_path / "out").exists()


def test_allowed_pickle_weights_are_converted_to_safetensors(tmp_path):
    repo, hub, state = pickled_repo(tmp_path)
    lock = fetch.fetch(repo, tmp_path / "out", cache_dir=hub, offline=True, allow_pickle=True)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "fetch.lock.json", "pytorch_model.safetensors"]
    assert lock["converted"] == {"pytorch_model.bin": "pytorch_model.safetensors"}
    assert "pytorch_model.bin" in lock["files"]  # the sha256 of what the hub served
    _, loaded = load_drafter_state(out)
    assert set(loaded) == set(state)
    for k in state:
        assert torch.equal(loaded[k], state[k]), k


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['DRAFTPORT_TEST_MARKER']}",))


def test_allowed_pickle_that_carries_code_is_still_refused(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv("DRAFTPORT_TEST_MARKER", str(marker))
    repo, hub, _ = pickled_repo(tmp_path, payload={"fc.weight": _Evil()})
    with pytest.raises(DraftportError) as e:
        fetch.fetch(repo, tmp_path / "out", cache_dir=hub, offline=True, allow_pickle=True)
    assert "refused by torch.load(weights_only=True)" in str(e.value)
    assert not marker.exists() and not (tmp_path / "out").exists()


def custom_code_target(tmp_path) -> Path:
    """A tiny Llama whose config.json asks for the repo's own classes; importing them leaves a mark."""
    folder = tmp_path / "target"
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    marker = tmp_path / "code_ran"
    (folder / "modeling_toy.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('yes')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class ToyConfig(LlamaConfig):\n    model_type = 'draftport_toy'\n"
        "class ToyForCausalLM(LlamaForCausalLM):\n    config_class = ToyConfig\n"
    )
    c = json.loads((folder / "config.json").read_text())
    c.update(
        model_type="draftport_toy",
        architectures=["ToyForCausalLM"],
        auto_map={"AutoConfig": "modeling_toy.ToyConfig", "AutoModelForCausalLM": "modeling_toy.ToyForCausalLM"},
    )
    (folder / "config.json").write_text(json.dumps(c))
    return folder


def test_remote_code_runs_only_when_trusted(tmp_path):
    folder = custom_code_target(tmp_path)
    marker = tmp_path / "code_ran"
    with pytest.raises(DraftportError) as e:
        load_target(folder, trust_remote_code=trusted(folder, []))
    assert str(e.value) == (
        f"{folder}: the model needs its own code (auto_map) and trust_remote_code is off: "
        f"add its repo id to targets.trust_remote_code to run it"
    )
    assert not marker.exists()
    # the fetch step records the repo id the folder came from: trust names that repo
    (folder / "fetch.lock.json").write_text(json.dumps({"source": "org/toy"}))
    assert not trusted(folder, ["org/other"])
    model = load_target(folder, trust_remote_code=trusted(folder, ["org/toy"]))
    assert marker.exists() and type(model).__name__ == "ToyForCausalLM"


def test_fetch_takes_a_repos_code_only_when_trusted(tmp_path):
    folder = custom_code_target(tmp_path)
    fetch.publish_to_cache(folder, tmp_path / "hub", "org/toy")
    fetch.fetch("org/toy", tmp_path / "plain", cache_dir=tmp_path / "hub", offline=True, patterns=fetch.TARGET_PATTERNS)
    assert not list((tmp_path / "plain").glob("*.py"))
    fetch.fetch(
        "org/toy",
        tmp_path / "code",
        cache_dir=tmp_path / "hub",
        offline=True,
        patterns=fetch.TARGET_PATTERNS,
        trust_remote_code=True,
    )
    assert [p.name for p in (tmp_path / "code").glob("*.py")] == ["modeling_toy.py"]


def test_trust_params_are_off_by_default_and_validated():
    base = params.load(base=ROOT / "params.yaml")
    assert base["source"]["allow_pickle"] is False and base["targets"]["trust_remote_code"] == []
    ok = params.validate(params.merge(base, {"targets": {"trust_remote_code": ["moonshotai/Kimi-K2.5"]}}))
    assert ok["targets"]["trust_remote_code"] == ["moonshotai/Kimi-K2.5"]
    with pytest.raises(params.ParamsError) as e:
        params.validate(params.merge(base, {"targets": {"trust_remote_code": True}}))
    assert str(e.value).startswith("targets.trust_remote_code: expected a list of hub ids")
    with pytest.raises(params.ParamsError) as e:
        params.validate(params.merge(base, {"source": {"allow_pickle": "yes"}}))
    assert str(e.value) == 'source.allow_pickle: expected true or false, got "yes"'
    assert "targets.trust_remote_code" in registry.BY_NAME["fetch"].params
    assert all(
        "targets.trust_remote_code" in registry.BY_NAME[s].params
        for s in ("features_new", "features_eval", "features_phase2")
    )
