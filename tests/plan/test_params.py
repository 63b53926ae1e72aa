"""params.yaml: schema, one-line errors naming the key, profiles layered on it."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftport.errors import DraftportError
from draftport.plan import params, registry
from draftport.plan.registry import STEP_NAMES, TRAINING_STEPS
from draftport.training.loop import TrainConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def base():
    return params.read_yaml(ROOT / "params.yaml")


def bad(cfg, dotted, value):
    cfg = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    cur = cfg
    for p in parents:
        cur = cur[p]
    cur[last] = value
    return cfg


def error_of(cfg) -> str:
    with pytest.raises(params.ParamsError) as e:
        params.validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize("profile", [[], ["configs/micro.yaml"], ["configs/kimi-k2.5.yaml"]])
def test_shipped_profiles_validate(profile):
    cfg = params.load(*[ROOT / p for p in profile], base=ROOT / "params.yaml")
    assert cfg["profile"] in ("embedded", "micro", "kimi-k2.5")


def test_kimi_profile_has_the_real_ids():
    cfg = params.load(ROOT / "configs/kimi-k2.5.yaml", base=ROOT / "params.yaml")
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


@pytest.mark.parametrize(
    "dotted,value,expect",
    [
        ("phase1.train.steps", "many", "phase1.train.steps: expected an integer"),
        ("phase1.train.lr", True, "phase1.train.lr: expected a number"),
        ("phase1.vocab_policy", "rebuild", "phase1.vocab_policy: must be one of remap, keep"),
        ("eval.k", 0, "eval.k: must be >= 1"),
        ("features.aux_layer_ids", [1, "2"], "features.aux_layer_ids: expected a non-empty list of integers"),
        ("source.repo_id", "no-slash", "source.repo_id: expected a hub id like org/name or a folder"),
        ("costmodel.verify_ms", 0, "costmodel.verify_ms: must be >="),
        ("world.model.hidden_size", 1.5, "world.model.hidden_size: expected an integer"),
        ("world.target_old", 3, "world.target_old: expected a group of keys"),
        ("profile", None, "profile: must be set"),
    ],
)
def test_bad_values_are_one_line_naming_the_key(base, dotted, value, expect):
    assert error_of(bad(base, dotted, value)).startswith(expect)


def test_missing_key(base):
    cfg = copy.deepcopy(base)
    del cfg["eval"]["k"]
    assert error_of(cfg) == "eval.k: missing"


def test_train_groups_take_defaults_for_left_out_keys(base):
    cfg = copy.deepcopy(base)
    cfg["phase1"]["train"] = {"steps": 3}
    assert params.validate(cfg)["phase1"]["train"] == {"steps": 3}


@pytest.mark.parametrize(
    "dotted,value,expect",
    [
        ("phase2.n_samples", 10, "phase2.n_samples: must exceed phase1.n_samples"),
        ("features.aux_layer_ids", [1, 2, 9], "features.aux_layer_ids: [9] out of range"),
        ("features.eval_samples", 10_000, "features.eval_samples:"),
        ("vocab_new.draft_vocab_size", 100_000, "vocab_new.draft_vocab_size:"),
        (
            "curves.arms_n_samples",
            [150, 300],
            "curves.arms_n_samples: [150, 300]: ascending, each among curves.n_samples",
        ),
        ("curves.arms_n_samples", [400, 150], "curves.arms_n_samples: [400, 150]: ascending"),
        ("curves.recipes", {"Big-LR": {"lr": 0.01}}, "curves.recipes.Big-LR: a recipe's name: lowercase"),
        ("curves.recipes", {"long": {"steps": 9}}, "curves.recipes.long.steps: set by the budget rule"),
        ("curves.recipes", {"odd": {"lrr": 0.01}}, "curves.recipes.odd: unknown training key(s): lrr"),
        ("curves.recipes", {"odd": {"l2sp_lambda": -1.0}}, "curves.recipes.odd.l2sp_lambda:"),
        ("curves.recipes", {"empty": {}}, "curves.recipes.empty: a mapping of the train keys"),
        ("curves.inits", ["scratch"], "curves.recipes: fine-tune the source: needs source among curves.inits"),
        ("curves.train.l2sp_lambda", 1e-4, "curves.train.l2sp_lambda: the scratch points start from random weights"),
        ("world.source_drafter.train.l2sp_lambda", 1e-4, "world.source_drafter.train.l2sp_lambda: the source drafter"),
    ],
)
def test_values_that_do_not_fit_together(base, dotted, value, expect):
    assert error_of(bad(base, dotted, value)).startswith(expect)


def test_aux_id_L_is_vllm_only(base):
    """vLLM also collects the state leaving the last layer (id L); SGLang's ids stop at L-1."""
    L = base["world"]["model"]["num_hidden_layers"]
    ok = bad(base, "features.aux_layer_ids", [0, 1, L])
    assert params.validate(ok)["features"]["aux_layer_ids"] == [0, 1, L]
    ok["features"]["aux_convention"] = "sglang"
    assert error_of(ok).startswith(f"features.aux_layer_ids: [{L}] out of range")


def test_merge_is_recursive_like_snakemake():
    out = params.merge({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": 5}, "d": [2, 3]})
    assert out == {"a": {"b": 5, "c": 2}, "d": [2, 3]}


def test_step_keys_exist_in_the_schema(base):
    cfg = params.validate(base)
    for step in registry.STEPS:
        sub = registry.step_params(cfg, step.name)
        assert params.flatten(sub) or sub == {"reference": None}, step.name
        for k in step.params:
            params.get(cfg, k)
        for inp in step.inputs.values():
            for k in inp.when:
                registry.holds(cfg, k)  # its key exists (a KeyError names one that does not)
        registry.enabled(step, cfg)


def test_yaml_syntax_error_names_the_line(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("profile: x\nworld: [\n")
    with pytest.raises(params.ParamsError) as e:
        params.read_yaml(f)
    assert str(e.value).startswith(f"{f}:")


def test_cli_exit_code_and_one_line(tmp_path, base):
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(bad(base, "eval.batch_size", -1)))
    r = subprocess.run(
        [sys.executable, "-m", "draftport.plan.params", "--params", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert r.stderr.strip() == "error: eval.batch_size: must be >= 1, got -1"


# ---- the pydantic model tree -------------------------------------------------------------------
def model_leaves(model, prefix=""):
    """Dotted keys of every leaf field of a model tree (a field whose type is no model)."""
    for name, f in model.model_fields.items():
        sub = params._model_of(f.annotation)
        if sub is None:
            yield prefix + name
        else:
            yield from model_leaves(sub, f"{prefix}{name}.")


# Leaves params.yaml may leave out, and why: each is an optional override, not a value a step uses
# when it is absent.
OPTIONAL_LEAVES = (
    # a step's resources entry overrides resources.default's keys; a step or key left out takes
    # resources.default (which must be complete: a cross check)
    lambda k: k.startswith("resources.") and not k.startswith("resources.default."),
    # the source drafter's shape: a key left out is derived from the target by
    # draftport.model.bind.new_drafter_config (key/value heads = heads, head_dim = hidden / heads, ...)
    lambda k: (
        k
        in (
            "world.source_drafter.arch.num_key_value_heads",
            "world.source_drafter.arch.head_dim",
            "world.source_drafter.arch.rope_theta",
        )
    ),
    # the targets' architecture (left out: llama, the embedded world) and DeepSeek-V3's keys (left
    # out: derived by draftport.world.targets.target_config); configs/micro-deepseek.yaml sets them
    lambda k: k == "world.model.arch" or k in {f"world.model.{n}" for n in params.WorldModel.DEEPSEEK_KEYS},
    # `reference: null` in the embedded profile (no published drafter for the world's new target);
    # configs/kimi-k2.5.yaml writes every key of it (checked below)
    lambda k: k.startswith("reference."),
)


def test_params_yaml_shows_every_value_a_step_uses(base):
    written = set(params.flatten(base))
    for k in model_leaves(params.Params):
        if not any(opt(k) for opt in OPTIONAL_LEAVES):
            # a mapping-valued leaf (curves.recipes) is written when keys under it are
            assert k in written or any(w.startswith(k + ".") for w in written), f"{k} is not written out in params.yaml"
    kimi = params.read_yaml(ROOT / "configs/kimi-k2.5.yaml")
    assert set(params.flatten({"reference": kimi["reference"]})) == {
        f"reference.{k}" for k in params.ReferenceParams.model_fields
    }
    # and nothing in params.yaml is outside the tree
    assert {w for w in written if not w.startswith("curves.recipes.")} <= set(model_leaves(params.Params)) | {
        "reference"
    }


def test_every_field_has_a_description():
    def walk(model, prefix=""):
        for name, f in model.model_fields.items():
            assert f.description, f"{prefix}{name} has no description"
            sub = params._model_of(f.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(params.Params)
    params.Params.model_json_schema()  # the schema renders (docs, editors)


# TrainConfig's defaults (those of the dataclass it replaced, plus held-out tau and the port recipes
# off): params.yaml's train groups spell every value out, equal to the defaults but for the keys below
OLD_TRAIN_DEFAULTS = {
    "steps": 200,
    "batch_size": 8,
    "lr": 1e-3,
    "min_lr_ratio": 0.1,
    "warmup_steps": 20,
    "weight_decay": 0.0,
    "grad_clip": 1.0,
    "ttt_steps": 3,
    "gamma": 0.8,
    "seed": 0,
    "checkpoint_every": 50,
    "keep_checkpoints": 2,
    "log_every": 10,
    "dtype": "auto",
    "device": "auto",
    "train_lm_head": True,
    "impl": "auto",
    "parallel": "ddp",
    "eval_every": 0,
    "patience": 0,
    "packing": False,
    "tokens_per_step": 0,
    "l2sp_lambda": 0.0,
    "freeze": [],
    "fast": {"attention": "flash", "packed_attention": "auto", "compile_tuning": True, "tune_min_steps": 1000},
}
OLD_EXPLICIT = {  # the keys each train group sets apart from the defaults
    "world.source_drafter.train": {
        "steps": 1200,
        "batch_size": 16,
        "lr": 0.003,
        "warmup_steps": 20,
        "ttt_steps": 3,
        "log_every": 50,
        "checkpoint_every": 1200,
        "eval_every": 100,
    },
    "phase1.train": {
        "steps": 38,
        "batch_size": 16,
        "lr": 0.002,
        "warmup_steps": 10,
        "ttt_steps": 3,
        "log_every": 5,
        "checkpoint_every": 38,
        "eval_every": 5,
    },
    "phase2.train": {
        "steps": 120,
        "batch_size": 16,
        "lr": 0.001,
        "warmup_steps": 10,
        "ttt_steps": 3,
        "log_every": 5,
        "checkpoint_every": 60,
        "eval_every": 20,
    },
    "curves.train": {
        "steps": 600,
        "batch_size": 16,
        "lr": 0.002,
        "warmup_steps": 10,
        "ttt_steps": 3,
        "log_every": 10,
        "checkpoint_every": 200,
        "eval_every": 25,
    },
}


def test_train_groups_in_params_yaml_keep_the_effective_values(base):
    assert TrainConfig().model_dump() == OLD_TRAIN_DEFAULTS
    assert list(TrainConfig.model_fields) == list(OLD_TRAIN_DEFAULTS)
    for dotted, explicit in OLD_EXPLICIT.items():
        assert params.get(base, dotted) == {**OLD_TRAIN_DEFAULTS, **explicit}, dotted
        assert TrainConfig(**params.get(base, dotted)) == TrainConfig(**explicit)


def test_world_model_defaults_are_the_embedded_world(base):
    w = params.WorldParams().model_dump()
    assert w == base["world"] == params.load(base=ROOT / "params.yaml")["world"]
    assert params.WorldParams.model_validate(w).model_dump() == w
    micro = params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")["world"]
    assert micro["model"]["num_hidden_layers"] == 2 and micro["source_drafter"]["arch"] == {
        "num_attention_heads": 2,
        "intermediate_size": 128,
    }
    # the world group on its own, keys named in the file's terms
    assert params.validate(base["world"], params.WorldParams, "world.") == base["world"]
    with pytest.raises(params.ParamsError, match=r"^world\.n_old: expected an integer"):
        params.validate(bad(base, "world.n_old", "many")["world"], params.WorldParams, "world.")


def test_resource_rules_come_from_the_step_registry():
    assert params.RESOURCE_RULES == ("default", *STEP_NAMES) and params.TRAINING_RULES == (*TRAINING_STEPS, "budget")
    assert list(params.ResourcesParams.model_fields) == list(params.RESOURCE_RULES)


def test_kimi_resources_use_the_step_names(base):
    cfg = params.load(ROOT / "configs/kimi-k2.5.yaml", base=ROOT / "params.yaml")
    res = cfg["resources"]
    for step in params.TRAINING_RULES:
        assert res[step]["torchrun"] is True and res[step]["gpu"] == 8, step
    for step in ("eval_phase1_scratch", "eval_phase1", "eval_phase2"):
        assert res[step] == res["eval_phase0"], step
    assert not set(res) - set(params.RESOURCE_RULES)


def test_import_is_light():
    # CPU seconds, not wall seconds: the suite runs on every core (pytest-xdist), and a busy machine
    # stretches the wall time of an import (1.6 s seen) without it doing any more work
    code = (
        "import sys, time; t = time.process_time(); import draftport.plan.params; "
        "dt = time.process_time() - t; "
        "print('torch' in sys.modules, 'draftport.world' in sys.modules, dt)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    torch, world, dt = r.stdout.split()
    assert (torch, world) == ("False", "False")
    assert float(dt) < 1.0


def test_show_prints_the_merged_params(capsys):
    assert (
        params.main(["--params", str(ROOT / "params.yaml"), "--configfile", str(ROOT / "configs/micro.yaml"), "--show"])
        == 0
    )
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")
    assert shown["profile"] == "micro" and shown["phase1"]["train"]["steps"] == 12


# ---- strict types, one line per problem --------------------------------------------------------
@pytest.mark.parametrize(
    "dotted,value,expect",
    [
        ("eval.batch_size", "32", 'eval.batch_size: expected an integer, got "32"'),
        ("eval.batch_size", 1.5, "eval.batch_size: expected an integer, got 1.5"),
        ("eval.batch_size", True, "eval.batch_size: expected an integer, got True"),
        ("costmodel.verify_ms", True, "costmodel.verify_ms: expected a number, got True"),
        ("costmodel.verify_ms", "30", 'costmodel.verify_ms: expected a number, got "30"'),
        ("costmodel.verify_ms", 0, "costmodel.verify_ms: must be >= 1e-09, got 0"),
        ("online.enabled", 1, "online.enabled: expected true or false, got 1"),
        ("online.enabled", "true", 'online.enabled: expected true or false, got "true"'),
        ("phase1.train.lr", 5, "phase1.train.lr: must be <= 1, got 5"),
        ("phase1.train.lr", 5.0, "phase1.train.lr: must be <= 1, got 5"),
        ("phase1.train.ttt_steps", 17, "phase1.train.ttt_steps: must be <= 16, got 17"),
        ("phase1.train.parallel", "zero3", 'phase1.train.parallel: must be one of ddp, fsdp; got "zero3"'),
        ("phase1.train.impl", 3, "phase1.train.impl: expected a non-empty string, got 3"),
        ("phase1.train", 3, "phase1.train: expected a group of keys, got 3"),
        ("phase1.vocab_policy", "rebuild", 'phase1.vocab_policy: must be one of remap, keep; got "rebuild"'),
        ("eval.k", 0, "eval.k: must be >= 1, got 0"),
        ("eval.k", 17, "eval.k: must be <= 16, got 17"),
        ("eval.max_samples", 0, "eval.max_samples: must be >= 1, got 0"),
        ("eval", None, "eval: expected a group of keys, got null"),
        (
            "features.aux_layer_ids",
            [1, "2"],
            'features.aux_layer_ids: expected a non-empty list of integers, got [1, "2"]',
        ),
        ("features.aux_layer_ids", [], "features.aux_layer_ids: expected a non-empty list of integers, got []"),
        ("features.aux_layer_ids", [-1, 2], "features.aux_layer_ids: every entry must be >= 0, got [-1, 2]"),
        ("features.aux_layer_ids", [0, 1, 2, 3], "features.aux_layer_ids: expected at most 3 entries, got 4"),
        ("features.aux_layer_ids", None, "features.aux_layer_ids: must be set (null is not allowed here)"),
        ("features.base_url", "", 'features.base_url: expected a non-empty string, got ""'),
        ("features.device", "  ", 'features.device: expected a non-empty string, got "  "'),
        (
            "source.repo_id",
            "no-slash",
            'source.repo_id: expected a hub id like org/name or a folder (./path, /path), got "no-slash"',
        ),
        (
            "source.repo_id",
            "a/b/c",
            'source.repo_id: expected a hub id like org/name or a folder (./path, /path), got "a/b/c"',
        ),
        ("source.repo_id", 3, "source.repo_id: expected a non-empty string, got 3"),
        ("targets.trust_remote_code", ["x"], 'targets.trust_remote_code: expected hub ids like org/name, got "x"'),
        ("world.target_old", 3, "world.target_old: expected a group of keys, got 3"),
        (
            "world.source_drafter.arch.head_dim",
            None,
            "world.source_drafter.arch.head_dim: must be set (null is not allowed here)",
        ),
        (
            "world.source_drafter.arch.heads",
            2,
            "world.source_drafter.arch.heads: unknown key (did you mean world.source_drafter.arch.head_dim?)",
        ),
        ("resources.phase1", {"threads": 2}, "resources.phase1: unknown key (did you mean resources.eval_phase1?)"),
        ("resources.default", None, "resources.default: expected a group of keys, got null"),
        ("reference", 3, "reference: expected a group of keys, got 3"),
        ("profile", None, "profile: must be set (null is not allowed here)"),
    ],
)
def test_problems_word_for_word(base, dotted, value, expect):
    assert error_of(bad(base, dotted, value)) == expect


def test_reference_keys_are_required_when_it_is_set(base):
    cfg = bad(base, "reference", {"repo_id": "org/name", "revision": "main"})
    assert error_of(cfg) == "reference.note: missing"
    cfg["reference"]["note"] = None
    assert params.validate(cfg)["reference"] == {"repo_id": "org/name", "revision": "main", "note": None}


def test_first_problem_in_file_order(base):
    """As a reader walks the file: keys in the order written, a group's missing keys after its own."""
    cfg = bad(bad(base, "phase1.train.lr", 5), "eval.k", 0)  # eval is above phase1 in params.yaml
    assert error_of(cfg) == "eval.k: must be >= 1, got 0"
    cfg = copy.deepcopy(base)
    del cfg["eval"]["k"]
    cfg["eval"]["batch_size"] = "x"
    assert error_of(cfg) == 'eval.batch_size: expected an integer, got "x"'
    cfg = copy.deepcopy(base)
    del cfg["eval"]["k"]
    cfg["costmodel"]["draft_ms"] = -1
    assert error_of(cfg) == "eval.k: missing"
    # the order the user wrote, not the schema's
    cfg = {k: base[k] for k in reversed(base)}
    cfg = bad(bad(cfg, "profile", 3), "online.n_prompts", 0)
    assert error_of(cfg) == "online.n_prompts: must be >= 1, got 0"
    cfg = copy.deepcopy(base)
    del cfg["world"]["seed"], cfg["world"]["build"]
    assert error_of(cfg) == "world.seed: missing"  # the world's own keys before what the pipeline adds


def test_validated_copy_keeps_types_order_and_only_the_keys_given(base):
    cfg = bad(base, "costmodel.draft_ms", 0)
    out = params.validate(cfg)
    assert type(out["costmodel"]["draft_ms"]) is float and type(out["eval"]["k"]) is int
    assert list(out) == list(base) and list(out["features"]) == list(base["features"])
    assert params.flatten(out).keys() == params.flatten(base).keys()
    cfg["resources"] = {"default": base["resources"]["default"], "compare": {"mem_mb": 10}}
    assert params.validate(cfg)["resources"] == cfg["resources"]


def test_cross_false_skips_only_the_cross_checks(base):
    cfg = bad(base, "phase2.n_samples", 10)
    assert params.validate(cfg, cross=False)["phase2"]["n_samples"] == 10
    assert error_of(cfg).startswith("phase2.n_samples: must exceed")
    with pytest.raises(params.ParamsError, match=r"^eval\.k: must be >= 1"):
        params.validate(bad(cfg, "eval.k", 0), cross=False)
    cfg = copy.deepcopy(base)
    cfg["resources"] = {"train_phase1": {"threads": 2}}
    assert error_of(cfg).startswith("resources.default: missing (every rule's")


def test_cross_checks_name_the_training_steps(base):
    cfg = params.merge(base, {"resources": {"compare": {"torchrun": True, "gpu": 1}}})
    assert error_of(cfg) == (
        "resources.compare.torchrun: only training rules run under torchrun "
        "(train_phase1_scratch, train_phase1, train_phase2, train_curves, budget)"
    )
    cfg = params.merge(base, {"resources": {"train_phase1": {"torchrun": True}}})
    assert error_of(cfg) == "resources.train_phase1.torchrun: needs gpu >= 1 (one process per GPU)"
    ok = params.merge(base, {"resources": {"train_phase1": {"torchrun": True, "gpu": 2}}})
    assert params.validate(ok)["resources"]["train_phase1"] == {"threads": 2, "torchrun": True, "gpu": 2}


def test_not_a_mapping():
    with pytest.raises(params.ParamsError) as e:
        params.validate([1, 2])
    assert str(e.value) == "params: expected a mapping, got [1, 2]"


def test_train_config_is_the_train_group():
    assert TrainConfig is params.TrainConfig
    cfg = TrainConfig(steps=3, lr=1)
    assert cfg.lr == 1.0 and type(cfg.lr) is float and cfg.gamma == 0.8
    assert cfg.model_dump() == {**OLD_TRAIN_DEFAULTS, "steps": 3, "lr": 1.0}
    assert TrainConfig.from_dict({"steps": 3}) == TrainConfig(steps=3)
    for kw, msg in [
        ({"steps": "3"}, 'train.steps: expected an integer, got "3"'),
        ({"lr": True}, "train.lr: expected a number, got True"),
        ({"parallel": "zero3"}, 'train.parallel: must be one of ddp, fsdp; got "zero3"'),
        ({"stesp": 3}, "train.stesp: unknown key (did you mean train.steps?)"),
        (
            {"fast": {"attention": "cudnn", "packed_attention": "segments"}},
            "train.fast.packed_attention: segments under attention cudnn: cuDNN refuses a one-token segment "
            "(s_q = s_kv = 1, measured on an H100); use varlen or auto",
        ),
    ]:
        with pytest.raises(params.ParamsError) as e:
            TrainConfig(**kw)
        assert str(e.value) == msg
    with pytest.raises(DraftportError) as e:
        TrainConfig.from_dict({"stesp": 3, "lrr": 1}, where="phase1.train")
    assert str(e.value) == "phase1.train: unknown training key(s): lrr, stesp"
    with pytest.raises(params.ParamsError) as e:
        TrainConfig.from_dict({"steps": 0}, where="phase1.train")
    assert str(e.value) == "phase1.train.steps: must be >= 1, got 0"
    cfg.steps = 5  # mutable, and validated on assignment
    assert cfg.steps == 5
    with pytest.raises(ValueError):
        cfg.steps = "5"


# ---- tests/pipeline/test_bad_inputs.py's params cases (that suite runs the pipeline; the same messages here)
def set_key(cfg, dotted, value):
    return bad(cfg, dotted, value)


def drop_key(cfg, dotted):
    cfg = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    cur = cfg
    for p in parents:
        cur = cur[p]
    del cur[last]
    return cfg


@pytest.fixture(scope="module")
def micro(base):
    """params.yaml as test_bad_inputs' repository copy has it: the micro profile merged in."""
    return params.merge(base, params.read_yaml(ROOT / "configs/micro.yaml"))


@pytest.mark.parametrize(
    "case,edit,where,problem",
    [
        ("params-typo", lambda c: set_key(c, "eval.kk", 3), "eval.kk", "unknown key (did you mean eval.k?)"),
        (
            "params-wrong-type",
            lambda c: set_key(c, "eval.batch_size", "32"),
            "eval.batch_size",
            'expected an integer, got "32"',
        ),
        ("params-out-of-range", lambda c: set_key(c, "phase1.train.lr", 5.0), "phase1.train.lr", "must be <= 1, got 5"),
        ("params-eval-k-zero", lambda c: set_key(c, "eval.k", 0), "eval.k", "must be >= 1, got 0"),
        ("params-missing-key", lambda c: drop_key(c, "eval.batch_size"), "eval.batch_size", "missing"),
        (
            "params-null",
            lambda c: set_key(c, "source.revision", None),
            "source.revision",
            "must be set (null is not allowed here)",
        ),
        (
            "params-aux-out-of-range",
            lambda c: set_key(c, "features.aux_layer_ids", [0, 1, 7]),
            "features.aux_layer_ids",
            "[7] out of range for the world's 2-layer targets",
        ),
        (
            "params-aux-sglang-out-of-range",
            lambda c: set_key(c, "features.aux_convention", "sglang"),
            "features.aux_layer_ids",
            "[2] out of range for the world's 2-layer targets (sglang convention)",
        ),
        (
            "params-phase2-not-larger",
            lambda c: set_key(c, "phase2.n_samples", 10),
            "phase2.n_samples",
            "must exceed phase1.n_samples",
        ),
        (
            "profile-typo",
            lambda c: params.merge(c, yaml.safe_load("eval: {kk: 3}\n")),
            "eval.kk",
            "unknown key (did you mean eval.k?)",
        ),
        (
            "params-cli-profile-wrong-type",
            lambda c: params.merge(c, yaml.safe_load("phase1: {n_samples: many}\n")),
            "phase1.n_samples",
            'expected an integer, got "many"',
        ),
    ],
)
def test_bad_input_params_cases(micro, case, edit, where, problem):
    cfg = edit(micro)
    # through a file, as the scripts read it (yaml.safe_dump as test_bad_inputs.edit_params writes)
    msg = error_of(yaml.safe_load(yaml.safe_dump(cfg, sort_keys=False)))
    assert msg.startswith(f"{where}: ") and problem in msg.split(where, 1)[1], (case, msg)


def test_bad_input_params_files(tmp_path, micro):
    """params-yaml-syntax and params-cli-unknown-profile: through the CLI, one line on stderr."""
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(micro, sort_keys=False) + "eval: {k: 3, batch_size: 32\n")
    r = subprocess.run(
        [sys.executable, "-m", "draftport.plan.params", "--params", str(f)], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: {f}:") and "not valid YAML (" in r.stderr
    f.write_text(yaml.safe_dump(micro, sort_keys=False))
    r = subprocess.run(
        [sys.executable, "-m", "draftport.plan.params", "--params", str(f), "--configfile", "configs/nope.yaml"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr == "error: configs/nope.yaml: no such parameter file\n"


def test_no_arms_is_an_empty_list(base):
    """curves.arms_n_samples: [] turns the arms off (answers and recipes then unused): the plain
    points alone, named as before the arms existed."""
    from draftport.plan.curves import points

    cfg = copy.deepcopy(base)
    cfg["curves"]["arms_n_samples"] = []
    c = params.validate(cfg)["curves"]
    names = [p["name"] for p in points(c)]
    assert len(names) == len(c["n_samples"]) * len(c["inits"]) * len(c["seeds"]) and names[0] == "source_n50_s0"
    assert len(points(base["curves"])) == len(names) + 5 * 2 * 3


# ---- the named held-out sets, the context buckets and min_share (#51) --------------------------
SETS = [
    {"name": "chat", "prompts": "prompts/chat.jsonl", "share": 0.7},
    {"name": "code", "prompts": "prompts/code.jsonl", "share": 0.3, "n": 50},
]


@pytest.mark.parametrize(
    "dotted,value,expect",
    [
        (
            "targets.eval_sets",
            [SETS[0], {**SETS[1], "name": "chat"}],
            "targets.eval_sets[1] (chat): the name is also targets.eval_sets[0]'s",
        ),
        (
            "targets.eval_sets",
            [{**SETS[0], "share": 0.6}, SETS[1]],
            "targets.eval_sets: the shares add up to 0.9 (chat 0.6 + code 0.3), not 1",
        ),
        ("targets.eval_sets", [{**SETS[0], "name": "Chat"}, SETS[1]], "targets.eval_sets[0] (Chat): name: lowercase"),
        ("targets.eval_sets", [SETS[0], {**SETS[1], "name": "c" * 41}], f"targets.eval_sets[1] ({'c' * 41}): name: "),
        (
            "targets.eval_sets",
            [SETS[0], {**SETS[1], "share": 0}],
            "targets.eval_sets[1] (code): share: expected a number",
        ),
        (
            "targets.eval_sets",
            [SETS[0], {**SETS[1], "n": 0}],
            "targets.eval_sets[1] (code): n: expected an integer >= 1",
        ),
        ("targets.eval_sets", [{"name": "chat", "share": 1.0}], "targets.eval_sets[0] (chat): prompts: missing"),
        ("targets.eval_sets", [{**SETS[0], "weight": 1}], 'targets.eval_sets[0] (chat): unknown key "weight"'),
        ("targets.eval_sets", [], "targets.eval_sets: expected null or a non-empty list"),
        ("eval.context_buckets", [64, 128], "eval.context_buckets: expected lower edges starting at 0, strictly"),
        ("eval.context_buckets", [0, 64, 64], "eval.context_buckets: expected lower edges starting at 0, strictly"),
        ("eval.context_buckets", list(range(0, 900, 100)), "eval.context_buckets: expected at most 8 entries, got 9"),
        ("eval.context_buckets", [], "eval.context_buckets: expected a non-empty list of integers"),
        ("decision.min_share", 1.5, "decision.min_share: must be <= 1, got 1.5"),
    ],
)
def test_eval_sets_buckets_and_min_share_problems_name_the_key(base, dotted, value, expect):
    assert error_of(bad(base, dotted, value)).startswith(expect)


def test_eval_set_shares_add_up_within_rounding(base):
    # thirds written to 7 places add up to 0.9999999: within the tolerance (1e-6); 0.999 is not
    sets = [{"name": n, "prompts": f"prompts/{n}.jsonl", "share": 0.3333333} for n in ("a", "b", "c")]
    assert params.validate(bad(base, "targets.eval_sets", sets))["targets"]["eval_sets"] == sets
    assert params.check_eval_sets(sets) == sets
    with pytest.raises(params.ParamsError, match=r"^targets\.eval_sets: the shares add up to 0\.999 "):
        params.check_eval_sets([*sets[:2], {**sets[2], "share": 0.3323334}])
    with pytest.raises(params.ParamsError, match=r"^targets\.eval_sets\[1\] \(b\): share: "):
        params.check_eval_sets([sets[0], {**sets[1], "share": "0.2"}, sets[2]])


def test_resolved_eval_sets_default_is_todays_held_out_set(base):
    cfg = params.validate(bad(base, "targets.eval_sets", None))  # the embedded profile names two sets
    t, n = cfg["targets"], cfg["features"]["eval_samples"]
    assert cfg["eval"]["context_buckets"] == [0, 64, 128, 256] and cfg["decision"]["min_share"] == 0.05
    assert params.resolved_eval_sets(cfg) == [
        {"name": "heldout", "prompts": t["prompts_eval_new"], "share": 1.0, "n": n}
    ]
    assert params.resolved_eval_sets(cfg, "old") == [
        {"name": "heldout", "prompts": t["prompts_eval_old"], "share": 1.0, "n": n}
    ]
    assert params.resolved_eval_sets(bad(cfg, "targets.prompts_eval_old", None), "old")[0]["prompts"] is None
    # the features_eval step's own keys are enough
    assert params.resolved_eval_sets(registry.step_params(cfg, "features_eval")) == params.resolved_eval_sets(cfg)


def test_resolved_eval_sets_fill_n_and_serve_both_targets(base):
    cfg = params.validate(bad(base, "targets.eval_sets", SETS))
    n = cfg["features"]["eval_samples"]
    want = [{**SETS[0], "n": n}, SETS[1]]
    assert params.resolved_eval_sets(cfg) == want and params.resolved_eval_sets(cfg, "old") == want
    with pytest.raises(ValueError):
        params.resolved_eval_sets(cfg, "older")


def test_the_steps_read_the_new_keys():
    for step in ("features_eval", "online_phase0", "online_phase1"):
        assert "targets.eval_sets" in registry.BY_NAME[step].params, step
        assert "targets.prompts_train" in registry.BY_NAME[step].params, step  # the sets are checked disjoint
    # the decision reads the sets from Phase 0's eval.json (what was measured), not from params
    assert "targets.eval_sets" not in registry.BY_NAME["decision"].params
    assert "data.evalsets" in registry.BY_NAME["features_eval"].modules
    for step in ("eval_phase0", "eval_phase1_scratch", "eval_phase1", "eval_phase2"):
        assert "eval" in registry.BY_NAME[step].params, step  # the whole group: eval.context_buckets with it
    for step in ("eval_curves", "budget", "publish"):  # chains of eval.k: k_max and trees edits retrain nothing
        ps = registry.BY_NAME[step].params
        assert "eval.context_buckets" in ps and "eval" not in ps and "eval.trees" not in ps, step
        # the curves' evaluation drafts to eval.k_max (R2 at the best k); a training step never reads it
        assert ("eval.k_max" in ps) == (step == "eval_curves"), step
    assert not any(k.startswith("eval") for k in registry.BY_NAME["train_curves"].params)
    assert "decision" in registry.BY_NAME["decision"].params
    cfg = params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")
    assert cfg["eval"]["context_buckets"] == [0, 32, 64]


def test_serving_batch_sizes_beyond_1_need_a_step_table_on_the_embedded_world(base):
    cfg = bad(base, "serving.batch_sizes", [1, 8])
    assert error_of(cfg).startswith("serving.batch_sizes: [1, 8]: the embedded world's cost model knows batch 1 only")
    assert params.validate(bad(cfg, "serving.step_table", "steps.csv"))["serving"]["batch_sizes"] == [1, 8]
    assert error_of(bad(base, "serving.batch_sizes", [8, 1])).startswith("serving.batch_sizes: ")  # increasing
