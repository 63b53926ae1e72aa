"""params.yaml: the one parameter file, its profiles and its schema.

Every value a step uses lives in params.yaml, grouped by step. A profile (configs/<name>.yaml)
is a partial params.yaml layered on top (`snakemake --configfile configs/micro.yaml`); the merge
is a recursive dict update, exactly what Snakemake does with its configfiles.

`validate` runs before any work (the Snakefile calls it at parse time, every script again):
an unknown key, a wrong type or a bad value is one line naming the dotted key. The schema is
plain data below; the `world` group takes its keys and types from draftport.world's "default"
preset, so the world keeps one definition of what it accepts.

No torch, no snakemake here: the Snakefile imports this on every start.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import DraftportError

PARAMS_FILE = "params.yaml"


class ParamsError(DraftportError):
    """A bad parameter: str() is one line, `key: problem`."""


# ---- schema ------------------------------------------------------------------------------------
@dataclass
class Spec:
    kind: str                      # int float bool str intlist path hubid hubidlist
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    doc: str = ""

    def check(self, key: str, v: Any) -> Any:
        if v is None:
            if self.nullable:
                return None
            raise ParamsError(key, "must be set (null is not allowed here)")
        k = self.kind
        if k == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise ParamsError(key, f"expected an integer, got {_show(v)}")
        elif k == "float":
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ParamsError(key, f"expected a number, got {_show(v)}")
            v = float(v)
        elif k == "bool":
            if not isinstance(v, bool):
                raise ParamsError(key, f"expected true or false, got {_show(v)}")
        elif k in ("str", "path", "hubid"):
            if not isinstance(v, str) or not v.strip():
                raise ParamsError(key, f"expected a non-empty string, got {_show(v)}")
            if k == "hubid" and (v.count("/") != 1 or v.startswith("/") or v.endswith("/")):
                raise ParamsError(key, f"expected a hub id like org/name, got {_show(v)}")
        elif k == "hubidlist":  # may be empty
            if not isinstance(v, list):
                raise ParamsError(key, f"expected a list of hub ids like org/name, got {_show(v)}")
            for x in v:
                if not isinstance(x, str) or x.count("/") != 1 or x.startswith("/") or x.endswith("/"):
                    raise ParamsError(key, f"expected hub ids like org/name, got {_show(x)}")
            return list(v)
        elif k == "intlist":
            if not isinstance(v, list) or not v or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
                raise ParamsError(key, f"expected a non-empty list of integers, got {_show(v)}")
            if self.min is not None and min(v) < self.min:
                raise ParamsError(key, f"every entry must be >= {_num(self.min)}, got {v}")
            if self.max is not None and len(v) > self.max:
                raise ParamsError(key, f"expected at most {_num(self.max)} entries, got {len(v)}")
            return list(v)
        else:  # pragma: no cover - a schema bug
            raise AssertionError(k)
        if self.choices is not None and v not in self.choices:
            raise ParamsError(key, f"must be one of {', '.join(map(str, self.choices))}; got {_show(v)}")
        if k in ("int", "float"):
            if self.min is not None and v < self.min:
                raise ParamsError(key, f"must be >= {_num(self.min)}, got {_num(v)}")
            if self.max is not None and v > self.max:
                raise ParamsError(key, f"must be <= {_num(self.max)}, got {_num(v)}")
        return v


@dataclass
class Group:
    keys: dict[str, "Spec | Group"] = field(default_factory=dict)
    doc: str = ""
    nullable: bool = False
    optional: bool = False  # keys may be left out (their defaults live in the code, e.g. TrainConfig)


def _show(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (str, list, dict)) or v is None else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def I(min=None, max=None, **kw) -> Spec:
    return Spec("int", min=min, max=max, **kw)


def F(min=None, max=None, **kw) -> Spec:
    return Spec("float", min=min, max=max, **kw)


def S(choices=None, **kw) -> Spec:
    return Spec("str", choices=tuple(choices) if choices else None, **kw)


def train_group(steps_min: int = 1) -> Group:
    """draftport.train.TrainConfig's fields (the loop's knobs), with ranges."""
    return Group({
        "steps": I(steps_min), "batch_size": I(1), "lr": F(1e-7, 1.0), "min_lr_ratio": F(0, 1),
        "warmup_steps": I(0), "weight_decay": F(0, 1), "grad_clip": F(0), "ttt_steps": I(1, 16),
        "gamma": F(0, 1), "seed": I(0), "checkpoint_every": I(1), "keep_checkpoints": I(1),
        "log_every": I(1), "dtype": S(("auto", "float32", "bfloat16")), "train_lm_head": Spec("bool"),
        "parallel": S(("ddp", "fsdp"), doc="under torchrun (resources.<rule>.torchrun)"),
    }, optional=True)


RESOURCE_RULES = ("default", "world", "fetch", "features_new", "features_eval", "vocab_new",
                  "features_phase2", "compare", "phase0", "phase1_scratch", "phase1", "phase2", "report",
                  "online_phase0", "online_phase1")
TRAINING_RULES = ("phase1_scratch", "phase1", "phase2")


def resource_group(optional: bool) -> Group:
    """What a rule asks of the machine or the cluster; torchrun: one process per GPU (training)."""
    return Group({"gpu": I(0), "mem_mb": I(1), "runtime": I(1, doc="minutes"), "threads": I(1),
                  "torchrun": Spec("bool")}, optional=optional)


def _world_group() -> Group:
    """Keys and types of draftport.world.WORLD_PRESETS['default'], plus what the pipeline adds."""
    from .world import WORLD_PRESETS

    def from_value(v):
        if isinstance(v, dict):
            return Group({k: from_value(x) for k, x in v.items()})
        if isinstance(v, bool):
            return Spec("bool")
        if isinstance(v, int):
            return I(0)
        if isinstance(v, float):
            return F(0)
        if isinstance(v, list):
            return Spec("intlist")
        return S()

    g = from_value(WORLD_PRESETS["default"])
    g.keys.update({
        "build": Spec("bool", doc="false: no embedded world (a real target, e.g. the kimi profile)"),
        "source_drafter": Group({
            "n_samples": I(1), "max_new_tokens": I(1), "draft_vocab_ratio": F(0.001, 1.0),
            "batch_size": I(1), "arch": Group({"num_attention_heads": I(1), "intermediate_size": I(1), "num_key_value_heads": I(1),
                           "head_dim": I(1), "rope_theta": F(1)}, optional=True),
            "train": train_group(),
        }),
    })
    return g


def schema() -> Group:
    return Group({
        "profile": S(doc="names the MLflow experiment (draftport-<profile>)"),
        "world": _world_group(),
        "source": Group({
            "repo_id": Spec("hubid"), "revision": S(), "cache_dir": Spec("path", nullable=True),
            "offline": Spec("bool"), "lock_file": Spec("path", nullable=True),
            # pickle weights (.bin/.pt) can run code: refused unless true, then converted to
            # safetensors at fetch with torch.load(weights_only=True)
            "allow_pickle": Spec("bool"),
        }),
        "targets": Group({
            "new": S(), "old": S(nullable=True),
            "prompts_train": Spec("path"), "prompts_eval_new": Spec("path"),
            "prompts_eval_old": Spec("path", nullable=True),
            # hub repos whose own code (config.json auto_map: model, tokenizer) may run; [] = none
            "trust_remote_code": Spec("hubidlist"),
        }),
        "features": Group({
            "aux_layer_ids": Spec("intlist", min=0, max=3), "aux_convention": S(("vllm", "sglang")),
            "max_new_tokens": I(1), "batch_size": I(1), "dtype": S(("bfloat16", "float16", "float32")),
            "device": S(), "eval_samples": I(1),
            # hidden states: transformers in this process (device_map over the visible GPUs), or
            # vLLM's extract_hidden_states with tensor parallelism (draftport.vllm_features)
            "engine": S(("transformers", "vllm")), "tensor_parallel_size": I(1),
            # the target's own answers: generated here, or by the target served behind an
            # OpenAI-compatible API (vLLM, SGLang) at base_url under the name served_model
            "regenerate": S(("local", "openai")), "base_url": S(nullable=True),
            "served_model": S(nullable=True),
        }),
        "vocab_new": Group({"draft_vocab_size": I(8)}),
        "eval": Group({"k": I(1, 16), "batch_size": I(1), "max_samples": I(1, nullable=True)}),
        "costmodel": Group({"baseline_tok_s": F(1e-9), "verify_ms": F(1e-9), "draft_ms": F(0)}),
        "phase1": Group({
            "n_samples": I(1), "vocab_policy": S(("remap", "keep")), "train": train_group(),
        }),
        "phase2": Group({"n_samples": I(1), "train": train_group()}),
        # a published drafter trained for the new target itself (an upper bound): fetched like the
        # source (source.cache_dir, source.offline), evaluated in Phase 0 next to it
        "reference": Group({"repo_id": Spec("hubid"), "revision": S(), "note": S(nullable=True)},
                           nullable=True),
        # Snakemake resources per rule (draftport.cluster): `default` for every rule, a rule's
        # entry overrides keys of it
        "resources": Group({r: resource_group(optional=r != "default") for r in RESOURCE_RULES},
                           optional=True),
        "online": Group({
            "enabled": Spec("bool", doc="true: `all` and the report include the online steps"),
            "n_prompts": I(1), "max_new_tokens": I(1), "max_num_seqs": I(1), "tolerance": F(0, 1),
            "dtype": S(("float32", "bfloat16", "float16")), "vllm_python": Spec("path", nullable=True),
            "tensor_parallel_size": I(1),
        }),
    })


# ---- load / merge / validate -------------------------------------------------------------------
def merge(base: dict, overlay: dict) -> dict:
    """Recursive update, as Snakemake merges configfiles: dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for k, v in (overlay or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(path, "no such parameter file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ParamsError(where, f"not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(path, "expected a mapping of groups at the top level")
    return data


def load(*overlays: str | Path, base: str | Path = PARAMS_FILE) -> dict:
    """params.yaml with the profiles layered on, validated."""
    cfg = read_yaml(base)
    for o in overlays:
        cfg = merge(cfg, read_yaml(o))
    return validate(cfg)


def validate(cfg: dict, group: Group | None = None, prefix: str = "", cross: bool = True) -> dict:
    """A validated copy of cfg (ints stay ints, floats become floats). Raises ParamsError.

    cross: also check values against each other (sizes that must fit together).
    """
    group = group or schema()
    if not isinstance(cfg, dict):
        raise ParamsError(prefix.rstrip(".") or "params", f"expected a mapping, got {_show(cfg)}")
    out = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        spec = group.keys.get(k)
        if spec is None:
            close = difflib.get_close_matches(str(k), list(group.keys), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ParamsError(key, f"unknown key{hint}")
        if isinstance(spec, Group):
            if v is None and spec.nullable:
                out[k] = None
                continue
            if not isinstance(v, dict):
                raise ParamsError(key, f"expected a group of keys, got {_show(v)}")
            out[k] = validate(v, spec, key + ".", cross=False)
        else:
            out[k] = spec.check(key, v)
    missing = [] if group.optional else [k for k in group.keys if k not in cfg]
    if missing:
        raise ParamsError(f"{prefix}{missing[0]}", "missing")
    if not prefix and cross:
        _cross_checks(out)
    return out


def _cross_checks(cfg: dict) -> None:
    w, f = cfg["world"], cfg["features"]
    if cfg["phase2"]["n_samples"] <= cfg["phase1"]["n_samples"]:
        raise ParamsError("phase2.n_samples", f"must exceed phase1.n_samples ({cfg['phase1']['n_samples']}): "
                          "Phase 2 scales the data (the total count, Phase 1's samples included)")
    if w["build"]:
        layers = w["model"]["num_hidden_layers"]
        # as draftport.target.check_aux_ids: vllm 0..L (L = leaving the last layer), sglang 0..L-1
        limit = layers if f["aux_convention"] == "vllm" else layers - 1
        bad = [i for i in f["aux_layer_ids"] if i > limit]
        if bad:
            raise ParamsError("features.aux_layer_ids", f"{bad} out of range for the world's "
                              f"{layers}-layer targets ({f['aux_convention']} convention)")
        need = cfg["phase2"]["n_samples"]
        if need > w["n_new"]:
            raise ParamsError("phase2.n_samples", f"{need} samples but the world's new corpus holds "
                              f"world.n_new = {w['n_new']}")
        if f["eval_samples"] > w["n_heldout"]:
            raise ParamsError("features.eval_samples", f"{f['eval_samples']} but the world holds "
                              f"world.n_heldout = {w['n_heldout']} held-out prompts")
        if cfg["vocab_new"]["draft_vocab_size"] > w["vocab_size"]:
            raise ParamsError("vocab_new.draft_vocab_size", f"{cfg['vocab_new']['draft_vocab_size']} exceeds "
                              f"the vocab (world.vocab_size = {w['vocab_size']})")
    res = cfg["resources"]
    if "default" not in res:
        raise ParamsError("resources.default", "missing (every rule's gpu, mem_mb, runtime, threads, torchrun)")
    for rule, r in res.items():
        if r.get("torchrun") and rule not in TRAINING_RULES:
            raise ParamsError(f"resources.{rule}.torchrun", f"only training rules run under torchrun "
                              f"({', '.join(TRAINING_RULES)})")
        if r.get("torchrun") and {**res["default"], **r}["gpu"] < 1:
            raise ParamsError(f"resources.{rule}.torchrun", "needs gpu >= 1 (one process per GPU)")
    if f["regenerate"] == "openai" and not (f["base_url"] and f["served_model"]):
        raise ParamsError("features.base_url" if not f["base_url"] else "features.served_model",
                          "must be set when features.regenerate is openai")
    if cfg["eval"]["k"] > 16:
        raise ParamsError("eval.k", "at most 16 draft tokens")


# ---- the keys each step reads ------------------------------------------------------------------
# One table for both tools: the Snakefile passes these values through `params:` (Snakemake's
# params trigger), dvc.yaml lists the same dotted keys (DVC's params tracking), and a script
# sees only these (a KeyError otherwise): no step can read a value neither tool tracks.
STEP_KEYS: dict[str, list[str]] = {
    "world": ["world", "source.repo_id", "features.aux_layer_ids", "features.aux_convention"],
    "fetch": ["source", "reference", "targets.new", "targets.old", "targets.trust_remote_code", "world.build"],
    "features_new": ["targets", "features", "phase1.n_samples"],
    "features_eval": ["targets", "features"],
    "vocab_new": ["targets.new", "vocab_new"],
    "compare": ["targets.new"],
    "phase0": ["profile", "targets", "eval", "costmodel", "reference"],
    "phase1_scratch": ["profile", "targets.new", "phase1", "eval", "costmodel"],
    "phase1": ["profile", "targets.new", "phase1", "eval", "costmodel"],
    "features_phase2": ["targets", "features", "phase1.n_samples", "phase2.n_samples"],
    "phase2": ["profile", "targets.new", "phase2", "eval", "costmodel"],
    "report": ["profile", "costmodel", "eval.k", "online.enabled"],
}
# The online steps (vLLM serving a phase's drafter): all of `online` but the switch, which only
# decides whether `all` and the report include them.
ONLINE_KEYS = ["profile", "targets.new", "targets.prompts_eval_new", "features.aux_convention", "eval.k", "online.n_prompts",
               "online.max_new_tokens", "online.max_num_seqs", "online.tolerance", "online.dtype",
               "online.vllm_python", "online.tensor_parallel_size"]
ONLINE_PHASES = ("phase0", "phase1")
STEP_KEYS.update({f"online_{ph}": ONLINE_KEYS for ph in ONLINE_PHASES})


def get(cfg: dict, dotted: str) -> Any:
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def subset(cfg: dict, keys: list[str]) -> dict:
    """The nested sub-dict of cfg holding exactly `keys` (dotted)."""
    out: dict = {}
    for dotted in keys:
        parts = dotted.split(".")
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = copy.deepcopy(get(cfg, dotted))
    return out


def step_params(cfg: dict, step: str) -> dict:
    return subset(cfg, STEP_KEYS[step])


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values (MLflow params, DVC keys)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m draftport.params [--configfile X ...] [--show]`: validate; print the merged params."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m draftport.params", description=main.__doc__)
    ap.add_argument("--configfile", action="append", default=[], help="profile(s) layered on params.yaml")
    ap.add_argument("--params", default=PARAMS_FILE)
    ap.add_argument("--show", action="store_true", help="print the merged, validated parameters as YAML")
    a = ap.parse_args(argv)
    try:
        cfg = load(*a.configfile, base=a.params)
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.show:
        sys.stdout.write(yaml.safe_dump(cfg, sort_keys=False))
    else:
        print(f"ok: {a.params}{''.join(' + ' + c for c in a.configfile)} (profile {cfg['profile']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
