"""params.yaml: schema, one-line errors naming the key, profiles layered on it."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftport import params as P

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base():
    return P.read_yaml(ROOT / "params.yaml")


def bad(cfg, dotted, value):
    cfg = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    cur = cfg
    for p in parents:
        cur = cur[p]
    cur[last] = value
    return cfg


def error_of(cfg) -> str:
    with pytest.raises(P.ParamsError) as e:
        P.validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("profile", [[], ["configs/micro.yaml"], ["configs/kimi-k2.5.yaml"]])
def test_shipped_profiles_validate(profile):
    cfg = P.load(*[ROOT / p for p in profile], base=ROOT / "params.yaml")
    assert cfg["profile"] in ("embedded", "micro", "kimi-k2.5")


def test_kimi_profile_has_the_real_ids():
    cfg = P.load(ROOT / "configs/kimi-k2.5.yaml", base=ROOT / "params.yaml")
    assert cfg["source"]["repo_id"] == "AQ-MedAI/Kimi-K2-Instruct-eagle3"
    assert cfg["targets"]["new"] == "moonshotai/Kimi-K2.5"
    assert cfg["features"]["aux_layer_ids"] == [2, 30, 58]
    assert (cfg["phase1"]["n_samples"], cfg["phase2"]["n_samples"]) == (37000, 200000)
    assert (cfg["costmodel"]["baseline_tok_s"], cfg["costmodel"]["verify_ms"]) == (82.0, 30.0)
    assert cfg["world"]["build"] is False


def test_unknown_key_names_it_and_suggests(base):
    cfg = copy.deepcopy(base)
    cfg["phase1"]["n_sample"] = 5
    assert error_of(cfg) == "phase1.n_sample: unknown key (did you mean phase1.n_samples?)"


def test_unknown_top_level_group(base):
    cfg = copy.deepcopy(base)
    cfg["phase3"] = {}
    assert error_of(cfg).startswith("phase3: unknown key")


@pytest.mark.parametrize("dotted,value,expect", [
    ("phase1.train.steps", "many", "phase1.train.steps: expected an integer"),
    ("phase1.train.lr", True, "phase1.train.lr: expected a number"),
    ("phase1.vocab_policy", "rebuild", "phase1.vocab_policy: must be one of remap, keep"),
    ("eval.k", 0, "eval.k: must be >= 1"),
    ("features.aux_layer_ids", [1, "2"], "features.aux_layer_ids: expected a non-empty list of integers"),
    ("source.repo_id", "no-slash", "source.repo_id: expected a hub id like org/name"),
    ("costmodel.verify_ms", 0, "costmodel.verify_ms: must be >="),
    ("world.model.hidden_size", 1.5, "world.model.hidden_size: expected an integer"),
    ("world.target_old", 3, "world.target_old: expected a group of keys"),
    ("profile", None, "profile: must be set"),
])
def test_bad_values_are_one_line_naming_the_key(base, dotted, value, expect):
    assert error_of(bad(base, dotted, value)).startswith(expect)


def test_missing_key(base):
    cfg = copy.deepcopy(base)
    del cfg["eval"]["k"]
    assert error_of(cfg) == "eval.k: missing"


def test_train_groups_take_defaults_for_left_out_keys(base):
    cfg = copy.deepcopy(base)
    cfg["phase1"]["train"] = {"steps": 3}
    assert P.validate(cfg)["phase1"]["train"] == {"steps": 3}


@pytest.mark.parametrize("dotted,value,expect", [
    ("phase2.n_samples", 10, "phase2.n_samples: must exceed phase1.n_samples"),
    ("features.aux_layer_ids", [1, 2, 9], "features.aux_layer_ids: [9] out of range"),
    ("features.eval_samples", 10_000, "features.eval_samples:"),
    ("vocab_new.draft_vocab_size", 100_000, "vocab_new.draft_vocab_size:"),
])
def test_values_that_do_not_fit_together(base, dotted, value, expect):
    assert error_of(bad(base, dotted, value)).startswith(expect)


def test_aux_id_L_is_vllm_only(base):
    """vLLM also collects the state leaving the last layer (id L); SGLang's ids stop at L-1."""
    L = base["world"]["model"]["num_hidden_layers"]
    ok = bad(base, "features.aux_layer_ids", [0, 1, L])
    assert P.validate(ok)["features"]["aux_layer_ids"] == [0, 1, L]
    ok["features"]["aux_convention"] = "sglang"
    assert error_of(ok).startswith(f"features.aux_layer_ids: [{L}] out of range")


def test_merge_is_recursive_like_snakemake():
    out = P.merge({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 5}, "d": [2, 3]})
    assert out == {"a": {"b": 5, "c": 2}, "d": [2, 3]}


def test_step_keys_exist_in_the_schema(base):
    cfg = P.validate(base)
    for step, keys in P.STEP_KEYS.items():
        sub = P.step_params(cfg, step)
        assert P.flatten(sub), step
        for k in keys:
            P.get(cfg, k)


def test_yaml_syntax_error_names_the_line(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("profile: x\nworld: [\n")
    with pytest.raises(P.ParamsError) as e:
        P.read_yaml(f)
    assert str(e.value).startswith(f"{f}:")


def test_cli_exit_code_and_one_line(tmp_path, base):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(bad(base, "eval.batch_size", -1)))
    r = subprocess.run([sys.executable, "-m", "draftport.params", "--params", str(f)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip() == "error: eval.batch_size: must be >= 1, got -1"
