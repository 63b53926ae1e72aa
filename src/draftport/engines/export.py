"""Is an exported drafter what vLLM and SGLang will load, next to this target?

The engines read a flat EAGLE-3 folder without complaint in many broken cases: a checkpoint
whose layer is named `layers.0.*` where the loader wants `midlayer.*`, a missing d2t (the
engines then propose draft slot ids as if they were target ids), default aux layers when
`eagle_config` lacks them, a max_position_embeddings below the target's context (RoPE tables
too short, positions past it fail or wrap), an embed_tokens that was never loaded from the
target. Each of these costs acceptance silently, so each is checked here, from the headers and
three small tensors, before a byte of the drafter is served.

`export_problems` lists what is wrong (empty = servable); `validate_export` raises them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from draftport.errors import DraftportError
from draftport.model.config import FLAT_ARCH, parse_config, target_text_config
from draftport.model.formats import (
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    expected_shapes,
    find_target_embedding,
    read_header,
    read_tensor_np,
    tensor_sha256,
)
from draftport.model.target import read_target_tensor


def _raw_tables(folder: Path) -> dict:
    """{stored name: TensorInfo} over every safetensors file, names as written (not normalized:
    the engines see the stored names)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DraftportError(folder, "no *.safetensors weights in the export")
    out = {}
    for f in files:
        table, _ = read_header(f)
        for name, info in table.items():
            if name in out:
                raise DraftportError(f, f"tensor {name!r} appears twice in the export")
            out[name] = info
    return out


def _read(info):
    return read_tensor_np(info)


EMBED_CHOICES = ("drop", "target")


def export_problems(
    drafter_dir,
    target_dir,
    *,
    context: int | None = None,
    convention: str | None = "vllm",
    embed_tokens: str | None = None,
) -> list[str]:
    """Everything that would make vLLM/SGLang serve this export wrongly next to target_dir.

    context: the longest sequence that will be served (default: the target's
    max_position_embeddings). convention: the aux-layer convention the serving engine uses
    ("vllm": id k = state entering layer k); a drafter that recorded another one is flagged.
    embed_tokens: what the export was made to carry (params online.embed_tokens, see
    evaluation.online.for_vllm): "drop" = no embed_tokens at all; "target" = the target's,
    bit for bit (same dtype, shape and bytes); None = either (an embed_tokens present must equal
    the target's at the drafter's precision).
    """
    if embed_tokens is not None and embed_tokens not in EMBED_CHOICES:
        raise DraftportError("online.embed_tokens", f"must be one of {', '.join(EMBED_CHOICES)}, got {embed_tokens!r}")
    folder = Path(drafter_dir)
    raw, cfg, stop = _read_export_config(folder)
    if stop is not None:
        return [stop]
    tcfg = target_text_config(target_dir)
    problems = _config_format_problems(raw)
    tables = _raw_tables(folder)
    problems += _tensor_layout_problems(tables, cfg)
    problems += _draft_vocab_problems(tables, cfg, tcfg)
    problems += _aux_layer_problems(raw, cfg, tcfg, convention)
    # -- positions: RoPE tables as long as the longest sequence served --------------------------
    ctx = context or tcfg.get("max_position_embeddings")
    if ctx is not None and cfg.max_position_embeddings < ctx:
        problems.append(f"max_position_embeddings {cfg.max_position_embeddings} < the target's context {ctx}")
    problems += _embed_tokens_problems(tables, target_dir, embed_tokens)
    return problems


def _read_export_config(folder: Path):
    """(raw config.json, its parsed config, None), or (None, None, the problem that stops every other check)."""
    cpath = folder / "config.json"
    if not cpath.is_file():
        return None, None, f"{cpath}: missing (vLLM reads the drafter's architecture from it)"
    try:
        raw = json.loads(cpath.read_text())
    except json.JSONDecodeError as e:
        return None, None, f"{cpath}: not valid JSON ({e})"
    try:
        cfg = parse_config(raw, cpath)
    except DraftportError as e:
        return None, None, e.problem
    return raw, cfg, None


def _config_format_problems(raw: dict) -> list[str]:
    """config.json in the flat format, naming the architecture the engines' EAGLE-3 loaders expect."""
    problems = []
    if raw.get("speculators_model_type") or "transformer_layer_config" in raw:
        problems.append("config is in the speculators format; the online step serves the flat format")
    if FLAT_ARCH not in (raw.get("architectures") or []):
        problems.append(
            f"config architectures {raw.get('architectures')} lack {FLAT_ARCH!r} "
            "(the engine would not pick the EAGLE-3 head)"
        )
    return problems


def _tensor_layout_problems(tables: dict, cfg) -> list[str]:
    """The stored tensor names are the flat EAGLE-3 layout's, none missing, each of the shape config.json implies."""
    problems = []
    names = set(tables)
    not_flat = sorted(n for n in names if n not in REQUIRED_KEYS and n not in OPTIONAL_KEYS)
    if not_flat:
        hint = (
            " (speculators names: convert layers.0.* to midlayer.*)"
            if any(n.startswith("layers.0.") for n in not_flat)
            else ""
        )
        problems.append(
            f"tensor names outside the flat EAGLE-3 layout: {', '.join(not_flat[:6])}"
            f"{' ...' if len(not_flat) > 6 else ''}{hint}"
        )
    missing = sorted(set(REQUIRED_KEYS) - names - {"t2d"})
    if "d2t" in missing:
        problems.append("d2t is missing: the engine would read draft slot i as target id i")
        missing.remove("d2t")
    if missing:
        problems.append(f"tensors missing from the export: {', '.join(missing)}")
    exp = expected_shapes(cfg)
    for name, info in tables.items():
        want = exp.get(name)
        if want is not None and tuple(info.shape) != want:
            problems.append(f"tensor {name} has shape {list(info.shape)}, config.json implies {list(want)}")
    return problems


def _draft_vocab_problems(tables: dict, cfg, tcfg: dict) -> list[str]:
    """lm_head, the vocab size and the d2t / t2d maps agree with config.json and the target's vocab."""
    problems = []
    dv = cfg.draft_vocab_size
    if "lm_head.weight" in tables and tables["lm_head.weight"].shape[0] != dv:
        problems.append(
            f"draft_vocab_size {dv} in config.json but lm_head has {tables['lm_head.weight'].shape[0]} rows"
        )
    vocab_t = tcfg.get("vocab_size")
    if vocab_t is not None and cfg.vocab_size != vocab_t:
        problems.append(f"drafter vocab_size {cfg.vocab_size} != target's {vocab_t}")
    if "d2t" in tables:
        problems.extend(_d2t_problems(tables, cfg, dv, vocab_t))
    return problems


def _d2t_problems(tables: dict, cfg, dv: int, vocab_t: int | None) -> list[str]:
    """d2t maps each draft slot to a distinct target id in the vocab, and t2d marks exactly those ids."""
    d2t = _read(tables["d2t"]).astype(np.int64)
    if d2t.ndim != 1 or d2t.shape[0] != dv:
        return [f"d2t has shape {list(d2t.shape)}, draft_vocab_size is {dv}"]
    if not d2t.size:
        return []
    ids = np.arange(d2t.size) + d2t
    bad = np.nonzero((ids < 0) | (ids >= (vocab_t or cfg.vocab_size)))[0]
    if bad.size:
        return [
            f"d2t slot {int(bad[0])} maps to target id {int(ids[bad[0]])}, "
            f"outside the vocab of {vocab_t or cfg.vocab_size} ({bad.size} slots out of range)"
        ]
    if np.unique(ids).size != ids.size:
        return ["d2t maps two draft slots to the same target id"]
    if "t2d" in tables:
        t2d = _read(tables["t2d"]).astype(bool)
        if t2d.shape == (cfg.vocab_size,) and not (t2d.sum() == ids.size and t2d[ids].all()):
            return ["t2d disagrees with d2t (SGLang reads t2d, vLLM d2t: they would draft different vocabularies)"]
    return []


def _aux_layer_problems(raw: dict, cfg, tcfg: dict, convention: str | None) -> list[str]:
    """Aux layers explicit, in range, and in the convention the engine uses; fc's input size the target's."""
    problems = []
    eagle = raw.get("eagle_config") or {}
    aux = eagle.get("eagle_aux_hidden_state_layer_ids")
    n_layers = tcfg.get("num_hidden_layers")
    if not aux:
        problems.append(
            "eagle_config.eagle_aux_hidden_state_layer_ids is missing: "
            "the engine would fall back to its default layers (2, L/2, L-3)"
        )
    elif n_layers is not None and not all(0 <= i <= n_layers for i in aux):
        # vLLM: id k = the state entering layer k, id L = the state leaving the last layer
        problems.append(f"aux layer ids {aux} out of range 0..{n_layers} for a target with {n_layers} layers")
    elif list(aux) != sorted(set(aux)):
        # vLLM collects the aux states of sorted(set(ids)) in layer order: a repeated id gives
        # fc fewer inputs than it was trained on, an unsorted list feeds them in another order.
        problems.append(f"aux layer ids {aux} must be distinct and increasing (vLLM concatenates sorted(set(ids)))")
    if aux and eagle.get("use_aux_hidden_state") is False:
        problems.append("eagle_config.use_aux_hidden_state is false: the engine would feed only the last hidden state")
    if convention and cfg.aux_convention and cfg.aux_convention != convention:
        problems.append(
            f"drafter was trained under the {cfg.aux_convention} aux-layer convention, the engine uses {convention}"
        )
    th = cfg.target_hidden_size or cfg.hidden_size
    if tcfg.get("hidden_size") is not None and th != tcfg["hidden_size"]:
        problems.append(f"fc expects target hidden size {th}, the target has {tcfg['hidden_size']}")
    return problems


def _embed_tokens_problems(tables: dict, target_dir, embed_tokens: str | None) -> list[str]:
    """embed_tokens absent (shared from the target) or exactly the target's, as online.embed_tokens asks."""
    # vLLM serves a drafter's own embed_tokens (SGLang the target's): a foreign one would make the
    # two engines draft differently, so it is never servable.
    embed = tables.get("embed_tokens.weight")
    if embed_tokens == "drop" and embed is not None:
        return [
            "the export carries embed_tokens but online.embed_tokens is drop (vLLM would serve "
            "the drafter's copy, SGLang the target's)"
        ]
    if embed_tokens == "target":
        if embed is None:
            return ["online.embed_tokens is target but the export carries no embed_tokens"]
        return _embed_bits_problems(embed, target_dir)
    if embed is not None:
        return _embed_problems(embed, target_dir)
    return []


def _embed_bits_problems(info, target_dir) -> list[str]:
    """The export's embed_tokens must be the target's bit for bit (online.embed_tokens: target)."""
    try:
        theirs = find_target_embedding(target_dir)
    except DraftportError as e:
        return [f"cannot compare embed_tokens with the target's: {e.problem}"]
    if (tuple(info.shape), info.dtype) != (tuple(theirs.shape), theirs.dtype):
        return [
            f"embed_tokens {info.dtype}{list(info.shape)} is not the target's {theirs.name} "
            f"{theirs.dtype}{list(theirs.shape)} (online.embed_tokens: target wants it bit for bit)"
        ]
    if tensor_sha256(info) != tensor_sha256(theirs):
        return [
            f"embed_tokens differs from the target's {theirs.name} (sha256 of the bytes): a random or "
            "foreign embedding was exported"
        ]
    return []


def _embed_problems(info, target_dir) -> list[str]:
    try:
        mine = None
        with safe_open(str(info.file), framework="pt") as sf:
            for name in sf.keys():
                if name == info.name or name.endswith("embed_tokens.weight"):
                    mine = sf.get_tensor(name)
                    break
        theirs = read_target_tensor(target_dir, "embed_tokens.weight")
    except DraftportError as e:
        return [f"cannot compare embed_tokens with the target's: {e.problem}"]
    if tuple(mine.shape) != tuple(theirs.shape):
        return [f"embed_tokens {list(mine.shape)} has another shape than the target's {list(theirs.shape)}"]
    # Exported in the drafter's dtype: compare at that precision.
    if not torch.equal(mine, theirs.to(mine.dtype)):
        diff = (mine.float() - theirs.float()).abs().max().item()
        return [
            f"embed_tokens differs from the target's (max |diff| {diff:.3g}): "
            "a random or foreign embedding was exported"
        ]
    return []


def validate_export(
    drafter_dir,
    target_dir,
    *,
    context: int | None = None,
    convention: str | None = "vllm",
    embed_tokens: str | None = None,
) -> dict:
    """Raise DraftportError listing every problem; return a short summary when servable."""
    problems = export_problems(
        drafter_dir, target_dir, context=context, convention=convention, embed_tokens=embed_tokens
    )
    if problems:
        raise DraftportError(drafter_dir, "export is not servable: " + "; ".join(problems))
    raw = json.loads((Path(drafter_dir) / "config.json").read_text())
    tables = _raw_tables(Path(drafter_dir))
    return {
        "aux_layer_ids": raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "max_position_embeddings": raw.get("max_position_embeddings"),
        "embed_tokens": "exported (equal to the target's)"
        if "embed_tokens.weight" in tables
        else "shared from the target",
    }
