"""Side-by-side report of two drafters: config, weights, vocab maps and a verdict.

Typical use: src = the drafter trained for the old target, dst = a drafter (or a fresh layout)
for the new target version. Everything comes from the safetensors headers plus the two small
vocab maps (d2t, t2d), so two multi-GB checkpoints compare in well under a second. Nothing here
(or in what it imports) pulls in torch.

A broken checkpoint is an error, not a row in the report: a d2t of the wrong length or pointing
past the vocab, a t2d that disagrees with d2t, or tensor shapes that contradict config.json
would make every later number meaningless. `strict=False` turns the vocab-map problems into
report fields instead, for callers that want to look at a broken drafter.

Given the target (`target=`, the CLI's `--target`), the report gains `embedding`: whether a
drafter that carries its own embed_tokens carries exactly the target's (sha256 of the tensor
bytes on both sides, read by byte range; `embedding_check`). The engines disagree on such a
drafter: vLLM 0.32 serves the drafter's own embedding whenever the checkpoint has one (its
EAGLE-3 Llama load_weights marks has_own_embed_tokens, and the proposer shares the target's only
when the two are torch.equal), SGLang always installs the target's on an EAGLE-3 drafter
(eagle_worker: set_embed, or set_embed_and_head when the drafter loads lm_head from the target).
Headers stay the only thing read without `target`; with it the embedding bytes are hashed
only for a drafter that carries one (about 2 x 2.3 GB at Kimi-K2 scale).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from draftport.errors import DraftportError
from draftport.model.formats import (
    LAYER_KEYS,
    OPTIONAL_KEYS,
    REQUIRED_KEYS,
    DrafterInfo,
    TensorInfo,
    check_shapes,
    find_target_embedding,
    inspect_drafter,
    read_tensor_np,
    tensor_sha256,
    tensors_equal_values,
)
from draftport.model.vocab import check_maps, compare_maps, d2t_format, hot_ids, t2d_consistent

CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "vocab_size",
    "draft_vocab_size",
    "aux_layer_ids",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "architectures",
    "norm_before_residual",
    "target_hidden_size",
    "aux_convention",
)
# A difference here changes the shape of fc / midlayer / norm: src's trained body cannot be
# loaded into dst's layout. (Vocab sizes only touch lm_head/d2t/t2d/embed: a vocab question.)
BODY_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "target_hidden_size",
)
# Same shapes, different computation: the weights load but the drafter behaves differently.
BEHAVIOUR_FIELDS = (
    "aux_layer_ids",
    "aux_convention",
    "rope_theta",
    "rope_scaling",
    "norm_before_residual",
    "max_position_embeddings",
)
VOCAB_TENSORS = ("lm_head.weight", "d2t", "t2d", "embed_tokens.weight")
CANONICAL_ORDER = (
    ["fc.weight"]
    + [f"midlayer.{k}" for k in LAYER_KEYS]
    + ["norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d"]
)
SIDES = ("src", "dst")


def compare_drafters(
    src_folder: str | Path, dst_folder: str | Path, *, strict: bool = True, target: str | Path | None = None
) -> dict:
    """JSON-ready report with keys config, weights, vocab, verdict (and folders); with `target`
    (a target folder) also `embedding`: embedding_check of each side against it, and a verdict
    warning for each side whose own embed_tokens is not the target's."""
    infos = {"src": inspect_drafter(src_folder), "dst": inspect_drafter(dst_folder)}
    for info in infos.values():
        check_shapes(info)  # q_proj vs heads x head_dim, d2t vs draft_vocab_size, ...
    config = config_rows(infos)
    weights = weight_rows(infos)
    vocab = vocab_report(infos, strict=strict)
    rep = {
        "folders": {
            side: {"path": str(info.folder), "format": info.format, "files": [p.name for p in info.files]}
            for side, info in infos.items()
        },
        "config": config,
        "weights": weights,
        "vocab": vocab,
        "verdict": verdict(infos, config, weights, vocab),
    }
    if target is not None:
        tgt = _TargetEmbedding(target)
        rep["embedding"] = {"target": str(target), **{s: embedding_check(infos[s], target, _target=tgt) for s in SIDES}}
        rep["verdict"]["warnings"] += [
            embedding_warning(s, rep["embedding"][s]) for s in SIDES if rep["embedding"][s]["engines_agree"] is False
        ]
    return rep


# ---- embedding: the drafter's own embed_tokens against the target's -------------------------


class _TargetEmbedding:
    """The target's embed_tokens (found once, hashed at most once)."""

    def __init__(self, target_dir):
        self.dir = Path(target_dir)
        self.info: TensorInfo = find_target_embedding(target_dir)
        self._sha: str | None = None

    @property
    def sha256(self) -> str:
        if self._sha is None:
            self._sha = tensor_sha256(self.info)
        return self._sha


def embedding_check(drafter: str | Path | DrafterInfo, target_dir: str | Path, *, _target=None) -> dict:
    """Does the drafter carry its own embed_tokens, and is it the target's, bit for bit?

    Returns: carries_embed_tokens; the drafter's and the target's tensor (name in the target,
    shape, dtype, sha256 of the stored bytes: the target's is hashed only when the drafter carries
    one); equal (same dtype, shape and bytes; None when the drafter carries none); equal_values
    (only when the dtypes differ: the same values in another dtype); what each engine would embed
    with (vllm / sglang: "target" or "drafter") and whether that is the same (engines_agree); a
    one-line note. Torch-free: headers, then the two tensors' bytes by byte range.
    """
    info = drafter if isinstance(drafter, DrafterInfo) else inspect_drafter(drafter)
    tgt = _target if _target is not None else _TargetEmbedding(target_dir)
    t = tgt.info
    mine = info.tensors.get("embed_tokens.weight")
    out: dict[str, Any] = {
        "drafter": str(info.folder),
        "target": str(target_dir),
        "carries_embed_tokens": mine is not None,
        "drafter_shape": None,
        "drafter_dtype": None,
        "drafter_sha256": None,
        "target_tensor": t.name,
        "target_file": t.file.name,
        "target_shape": list(t.shape),
        "target_dtype": t.dtype,
        "target_sha256": None,
        "equal": None,
        "equal_values": None,
        "vllm": "target",
        "sglang": "target",
        "engines_agree": True,
    }
    if mine is None:
        out["note"] = "no embed_tokens in the drafter: vLLM and SGLang both embed with the target's"
        return out
    out.update(
        drafter_shape=list(mine.shape),
        drafter_dtype=mine.dtype,
        drafter_sha256=tensor_sha256(mine),
        target_sha256=tgt.sha256,
    )
    same_shape = tuple(mine.shape) == tuple(t.shape)
    out["equal"] = same_shape and mine.dtype == t.dtype and out["drafter_sha256"] == out["target_sha256"]
    same = out["equal"]
    if same_shape and mine.dtype != t.dtype:
        out["equal_values"] = tensors_equal_values(mine, t)
        same = out["equal_values"]
    if same:
        # vLLM keeps the drafter's copy unless torch.equal to the target's: either way the same values
        out["note"] = (
            "the drafter's embed_tokens is the target's"
            + ("" if out["equal"] else f" in another dtype ({mine.dtype} vs {t.dtype})")
            + ": both engines embed alike"
        )
        return out
    out.update(vllm="drafter", engines_agree=False)
    why = f"shape {list(mine.shape)} vs the target's {list(t.shape)}" if not same_shape else "same shape, other values"
    out["note"] = (
        f"the drafter's embed_tokens differs from the target's ({why}): vLLM would serve the "
        "drafter's own embedding, SGLang the target's"
    )
    return out


def embedding_warning(side: str, check: dict) -> str:
    return (
        f"{side}'s embed_tokens differs from the target's {check['target_tensor']} "
        f"(sha256 {check['drafter_sha256'][:12]}... vs {check['target_sha256'][:12]}...): "
        "vLLM would serve the drafter's own embedding, SGLang the target's"
    )


# ---- config ----------------------------------------------------------------------------------


def _config_value(info: DrafterInfo, field: str) -> Any:
    cfg = info.config
    if field == "target_hidden_size":
        return cfg.target_hidden_size or cfg.hidden_size  # absent means "same as hidden_size"
    return getattr(cfg, field)


def config_rows(infos: dict[str, DrafterInfo]) -> list[dict]:
    rows = []
    for field in CONFIG_FIELDS:
        src, dst = (_config_value(infos[s], field) for s in SIDES)
        row = {"field": field, "src": src, "dst": dst, "match": src == dst}
        if field == "architectures" and src != dst and infos["src"].format != infos["dst"].format:
            row["note"] = f"follows the checkpoint format ({infos['src'].format} vs {infos['dst'].format})"
        rows.append(row)
    return rows


# ---- weights ---------------------------------------------------------------------------------


def _missing_note(name: str, side: str) -> str:
    if name == "embed_tokens.weight":
        return "expected: embed_tokens is frozen and taken from the target"
    if name in ("d2t", "t2d"):
        return f"{side} ships no {name}: see the vocab section"
    if name in REQUIRED_KEYS:
        return f"required EAGLE-3 tensor missing from {side}: an engine would run it uninitialized"
    return f"not an EAGLE-3 drafter tensor (only in {'dst' if side == 'src' else 'src'})"


def weight_rows(infos: dict[str, DrafterInfo]) -> list[dict]:
    src, dst = infos["src"].tensors, infos["dst"].tensors
    names = set(src) | set(dst)
    order = [n for n in CANONICAL_ORDER if n in names] + sorted(names - set(CANONICAL_ORDER))
    rows = []
    for name in order:
        s, d = src.get(name), dst.get(name)
        row = {
            "name": name,
            "src_shape": list(s.shape) if s else None,
            "dst_shape": list(d.shape) if d else None,
            "src_dtype": s.dtype if s else None,
            "dst_dtype": d.dtype if d else None,
        }
        notes = []
        if s is None or d is None:
            row["status"] = "missing_in_src" if s is None else "missing_in_dst"
            notes.append(_missing_note(name, "src" if s is None else "dst"))
        else:
            same_shape, same_dtype = tuple(s.shape) == tuple(d.shape), s.dtype == d.dtype
            row["status"] = "match" if same_shape and same_dtype else "mismatch"
            if not same_shape:
                notes.append(
                    "shape differs"
                    + (
                        ": draft vocab sizes differ, remap rows by target id"
                        if name in ("lm_head.weight", "d2t")
                        else ""
                    )
                )
            if not same_dtype:
                notes.append(f"dtype differs ({s.dtype} vs {d.dtype}): cast when loading")
            if name in ("d2t", "t2d") and same_shape:
                notes.append("values compared in the vocab section")
        if name == "embed_tokens.weight":
            # A random embed_tokens exported by mistake is a known failure; headers cannot show it.
            holders = [side for side, t in (("src", s), ("dst", d)) if t is not None]
            notes.append(f"{' and '.join(holders)}'s copy must equal the target's embeddings")
        if name not in REQUIRED_KEYS and name not in OPTIONAL_KEYS and s is not None and d is not None:
            notes.append("not an EAGLE-3 drafter tensor")
        row["note"] = "; ".join(notes)
        rows.append(row)
    return rows


# ---- vocab -----------------------------------------------------------------------------------


def _vocab_side(info: DrafterInfo, strict: bool) -> dict:
    """What one drafter's maps say, validated. 'ids' = the target ids its draft slots stand for."""
    cfg = info.config
    out: dict[str, Any] = {
        "d2t_present": "d2t" in info.tensors,
        "t2d_present": "t2d" in info.tensors,
        "format": None,
        "t2d_consistent": None,
        "ids_out_of_range": None,
        "sorted": None,
        "ids": None,
    }
    t2d = None
    if "t2d" in info.tensors:
        ti = info.tensors["t2d"]
        if ti.dtype not in ("BOOL", "U8"):
            raise DraftportError(ti.file, f"t2d has dtype {ti.dtype}, expected BOOL")
        t2d = read_tensor_np(ti).astype(bool)
    if "d2t" not in info.tensors:
        if cfg.draft_vocab_size == cfg.vocab_size:
            # A full-vocab drafter needs no map: slot i is target id i.
            out["ids"] = np.arange(cfg.vocab_size, dtype=np.int64)
            out["format"] = "identity"
        return out
    di = info.tensors["d2t"]
    if di.dtype not in ("I64", "I32"):
        raise DraftportError(di.file, f"d2t has dtype {di.dtype}, expected I64 (target-id deltas)")
    d2t = read_tensor_np(di).astype(np.int64)
    ids = hot_ids(d2t)
    fmt = d2t_format(d2t, cfg.vocab_size, t2d)
    out["format"] = fmt
    out["ids_out_of_range"] = int(np.count_nonzero((ids < 0) | (ids >= cfg.vocab_size)))
    out["t2d_consistent"] = None if t2d is None else t2d_consistent(d2t, t2d)
    if strict:
        if fmt == "absolute":
            raise DraftportError(
                di.file,
                "d2t stores absolute target ids, not deltas: engines read "
                "slot i as target id i + d2t[i] (store d2t[i] = id_i - i)",
            )
        check_maps(d2t, t2d, cfg.vocab_size, cfg.draft_vocab_size, where=di.file)
    if fmt == "absolute":
        ids = d2t.copy()  # what the author meant; the report flags the storage
    out["sorted"] = bool(np.all(np.diff(ids) > 0))
    out["ids"] = ids
    return out


def _side_note(side: str, v: dict, cfg) -> str | None:
    if not v["d2t_present"]:
        if v["format"] == "identity":
            return f"{side} has no d2t; its draft vocab is the full vocab, so slot i is target id i."
        return (
            f"{side} has no d2t: its {cfg.draft_vocab_size} lm_head rows cannot be tied to target "
            f"ids, and an engine would read slot i as target id i (the wrong tokens)."
        )
    if v["format"] == "absolute":
        return f"{side}'s d2t stores absolute ids instead of deltas: engines would map slots wrongly."
    if v["format"] == "invalid" or v["ids_out_of_range"]:
        return f"{side}'s d2t is invalid ({v['ids_out_of_range']} slots point outside the vocab or repeat)."
    if v["t2d_consistent"] is False:
        return f"{side}'s t2d disagrees with its d2t."
    return None


def vocab_report(infos: dict[str, DrafterInfo], *, strict: bool = True) -> dict:
    sides = {s: _vocab_side(infos[s], strict) for s in SIDES}
    cfgs = {s: infos[s].config for s in SIDES}
    rep: dict[str, Any] = {
        "draft_vocab_size": {s: cfgs[s].draft_vocab_size for s in SIDES},
        "vocab_size": {s: cfgs[s].vocab_size for s in SIDES},
        "d2t_present": {s: sides[s]["d2t_present"] for s in SIDES},
        "format": {s: sides[s]["format"] for s in SIDES},
        "t2d_consistent": {s: sides[s]["t2d_consistent"] for s in SIDES},
        "ids_out_of_range": {s: sides[s]["ids_out_of_range"] for s in SIDES},
        "identical": None,
        "positions_differ": None,
        "positions_compared": None,
        "first_differing_slot": None,
        "overlap": None,
        "jaccard": None,
        "src_only": None,
        "dst_only": None,
        "positions_artifact_of_sorting": None,
    }
    notes = [n for s in SIDES if (n := _side_note(s, sides[s], cfgs[s]))]
    a, b = sides["src"]["ids"], sides["dst"]["ids"]
    if a is not None and b is not None:
        # compare_maps speaks deltas; hand it the ids as deltas.
        cm = compare_maps(a - np.arange(a.size), b - np.arange(b.size))
        for key in (
            "positions_differ",
            "positions_compared",
            "first_differing_slot",
            "overlap",
            "jaccard",
            "src_only",
            "dst_only",
            "positions_artifact_of_sorting",
        ):
            rep[key] = cm[key]
        rep["identical"] = a.size == b.size and bool(np.array_equal(a, b))
        notes.insert(0, _overlap_sentence(rep, cm))
    if cfgs["src"].vocab_size != cfgs["dst"].vocab_size:
        notes.append(
            f"The target vocab sizes differ ({cfgs['src'].vocab_size} vs "
            f"{cfgs['dst'].vocab_size}): the tokenizer changed, so a shared id may not be the same token."
        )
    rep["explanation"] = " ".join(notes)
    return rep


def _overlap_sentence(rep: dict, cm: dict) -> str:
    n = cm["positions_compared"]
    if rep["identical"]:
        return f"Both maps hold the same {n} target ids in the same slots."
    sizes = rep["draft_vocab_size"]
    head = (
        f"{cm['positions_differ']} of {max(sizes.values())} draft slots hold a different target id, "
        f"yet the maps share {cm['overlap']} ids ({cm['overlap_frac_of_src']:.1%} of src's, "
        f"Jaccard {cm['jaccard']:.3f}): {cm['src_only']} ids are only in src, {cm['dst_only']} only in dst."
    )
    if sizes["src"] != sizes["dst"]:
        head += f" The draft vocab sizes differ ({sizes['src']} vs {sizes['dst']})."
    if cm["positions_artifact_of_sorting"]:
        head += (
            " The slot count is an artifact of sorting: both maps list their ids in ascending "
            "order, so each id that enters or leaves the set shifts every later slot by one. "
            "Judge the maps by their overlap, and move lm_head rows by target id, not by slot."
        )
    else:
        head += " The draft vocabularies really differ, not just their slot order."
    return head


# ---- verdict ---------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    return json.dumps(v) if isinstance(v, (dict, list)) or v is None else str(v)


def _aux_warning(cfg_rows: dict, infos: dict[str, DrafterInfo]) -> list[str]:
    out = []
    for s in SIDES:
        if infos[s].config.aux_layer_ids is None:
            out.append(
                f"{s} config names no eagle_aux_hidden_state_layer_ids: engines fall back to a "
                "default set of layers silently"
            )
    ids, conv = cfg_rows["aux_layer_ids"], cfg_rows["aux_convention"]
    if None in (conv["src"], conv["dst"]):
        missing = [s for s in SIDES if conv[s] is None]
        out.append(
            f"aux-layer convention not recorded for {' and '.join(missing)} (vLLM: id k = "
            "hidden_states[k]; SGLang adds 1): check it against the engine that trained it"
        )
    if ids["src"] and ids["dst"]:
        # Compare the layers meant, not the numbers written: SGLang's id k is vLLM's k + 1.
        shift = {s: 1 if conv[s] == "sglang" else 0 for s in SIDES}
        meant = {s: [i + shift[s] for i in ids[s]] for s in SIDES}
        if meant["src"] != meant["dst"]:
            out.append(
                f"aux layers differ (src {ids['src']} [{conv['src'] or '?'}], dst {ids['dst']} "
                f"[{conv['dst'] or '?'}]): fc was trained on other layers and must re-adapt"
            )
        elif ids["src"] != ids["dst"]:
            out.append(
                f"aux ids are written differently ({ids['src']} vs {ids['dst']}) but name the same "
                "layers under their recorded conventions"
            )
    return out


def verdict(infos: dict[str, DrafterInfo], config: list[dict], weights: list[dict], vocab: dict) -> dict:
    rows = {r["field"]: r for r in config}
    reasons, warnings = [], []
    for f in BODY_FIELDS:
        if not rows[f]["match"]:
            reasons.append(f"{f} differs ({_fmt(rows[f]['src'])} vs {_fmt(rows[f]['dst'])})")
    for w in weights:
        if w["name"] in VOCAB_TENSORS:
            continue
        if w["status"] in ("missing_in_src", "missing_in_dst"):
            reasons.append(f"{w['name']} is {w['status'].replace('_', ' ')}")
        elif w["src_shape"] != w["dst_shape"]:
            reasons.append(f"{w['name']} shape differs ({w['src_shape']} vs {w['dst_shape']})")
    compatible = not reasons
    if compatible:
        body = [w for w in weights if w["name"] not in VOCAB_TENSORS]
        reasons.append(
            f"all {len(body)} body tensors (fc, midlayer.*, norm) have the same shapes and the "
            "shape-defining config fields agree: src's weights load into dst's layout"
        )
    for w in weights:
        if w["status"] == "mismatch" and w["src_dtype"] != w["dst_dtype"] and w["name"] not in VOCAB_TENSORS:
            warnings.append(f"{w['name']} dtype differs ({w['src_dtype']} vs {w['dst_dtype']})")
    for f in BEHAVIOUR_FIELDS:
        if f in ("aux_layer_ids", "aux_convention"):
            continue
        if not rows[f]["match"]:
            warnings.append(
                f"{f} differs ({_fmt(rows[f]['src'])} vs {_fmt(rows[f]['dst'])}): same shapes, different computation"
            )
    warnings += _aux_warning({f: rows[f] for f in ("aux_layer_ids", "aux_convention")}, infos)
    return {
        "compatible_architecture": compatible,
        "reasons": reasons,
        "warnings": warnings,
        "vocab_action": vocab_action(vocab),
    }


def vocab_action(v: dict) -> str:
    present, fmt = v["d2t_present"], v["format"]
    if not present["src"] and fmt["src"] != "identity":
        return (
            "src has no d2t: recover the map it was trained with (from its training run) before "
            "fine-tuning; rebuilding one from new data would silently re-label every lm_head row"
        )
    if v["identical"] is None:
        return (
            "dst has no d2t: keep the source map (policy keep) and write src's d2t/t2d into the "
            "fine-tuned drafter; never rebuild the map silently"
        )
    if v["identical"]:
        return "nothing: the maps are identical, lm_head rows line up slot for slot"
    action = (
        f"the maps differ ({v['src_only']} ids only in src, {v['dst_only']} only in dst): either keep "
        f"the source map (policy keep: d2t, t2d and lm_head carried over unchanged) or remap "
        f"lm_head rows by target id onto dst's map (policy remap: {v['overlap']} trained rows move "
        f"to their new slots, {v['dst_only']} new rows start from the target's lm_head); never "
        f"rebuild the map silently"
    )
    if v["vocab_size"]["src"] != v["vocab_size"]["dst"]:
        action += "; the target vocab changed too, so check that shared ids still name the same tokens"
    return action
