"""The drafter's architecture, normalized across the flat and speculators formats.

Flat format (AQ-MedAI, SpecForge, SGLang, vLLM): Llama fields at the top level of config.json,
`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, and
`eagle_config: {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}`.

speculators format: `speculators_model_type: "eagle3"`, Llama fields nested under
`transformer_layer_config`, aux ids at the top level, `speculators_config` with the verifier.

No torch here: `draftport compare` must start fast.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from draftport.errors import DraftportError
from draftport.files import load_json  # noqa: F401 - its old home, re-exported

FLAT_ARCH = "LlamaForCausalLMEagle3"
# Where the aux layer ids point: "vllm" = id k is the state *before* layer k
# (transformers' hidden_states[k]); "sglang" = id k is the state after layer k (hidden_states[k+1]).
CONVENTIONS = ("vllm", "sglang")


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] | None
    target_hidden_size: int | None = None
    num_hidden_layers: int = 1
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    norm_before_residual: bool = False
    aux_convention: str | None = None
    architectures: list[str] = field(default_factory=lambda: [FLAT_ARCH])
    format: str = "flat"
    extra: dict = field(default_factory=dict)  # fields we carry through untouched (bos/eos ids, ...)

    @property
    def fc_in(self) -> int:
        return 3 * (self.target_hidden_size or self.hidden_size)

    def to_flat_dict(self) -> dict[str, Any]:
        """config.json in the flat layout vLLM/SGLang read."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            architectures=[FLAT_ARCH],
            model_type="llama",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            num_hidden_layers=self.num_hidden_layers,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
            hidden_act=self.hidden_act,
            norm_before_residual=self.norm_before_residual,
            tie_word_embeddings=False,
            eagle_config={
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids or []),
                "use_aux_hidden_state": True,
            },
        )
        if self.target_hidden_size and self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.aux_convention:
            out["draftport_aux_convention"] = self.aux_convention
        return out

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def _req(cfg: dict, key: str, path: str | Path, where: str = "") -> Any:
    if key not in cfg or cfg[key] is None:
        raise DraftportError(path, f"config is missing {where}{key}")
    val = cfg[key]
    if not isinstance(val, int) or isinstance(val, bool) or val <= 0:
        raise DraftportError(path, f"config {where}{key} must be a positive integer, got {val!r}")
    return val


def _opt_int(cfg: dict, key: str, default, path, where: str = ""):
    """An optional positive int: absent/null -> default; anything else must be valid.

    Without this a string or 0 in config.json surfaces later as a traceback deep in shape math.
    """
    if cfg.get(key) is None:
        return default
    return _req(cfg, key, path, where)


def _opt_float(cfg: dict, key: str, default: float, path, where: str = "") -> float:
    val = cfg.get(key)
    if val is None:
        return default
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        raise DraftportError(path, f"config {where}{key} must be a number, got {val!r}")
    return float(val)


def _from_llama_fields(llama: dict, top: dict, path, where: str, fmt: str) -> DrafterConfig:
    hidden = _req(llama, "hidden_size", path, where)
    heads = _req(llama, "num_attention_heads", path, where)
    kv = _opt_int(llama, "num_key_value_heads", heads, path, where)
    if heads % kv:
        raise DraftportError(
            path, f"config {where}num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
        )
    # head_dim from the config wins (Kimi: 128, not 7168 / 64 = 112).
    head_dim = _opt_int(llama, "head_dim", hidden // heads, path, where)
    vocab = _req(llama, "vocab_size", path, where)
    if top.get("draft_vocab_size") is not None:
        draft_vocab = _req(top, "draft_vocab_size", path)
    else:
        draft_vocab = _opt_int(llama, "draft_vocab_size", vocab, path, where)
    target_hidden = (
        _opt_int(top, "target_hidden_size", None, path)
        if top.get("target_hidden_size") is not None
        else _opt_int(llama, "target_hidden_size", None, path, where)
    )
    # A target_hidden_size equal to hidden_size says nothing new: normalize it away so that the
    # flat (omits it) and speculators (always writes it) forms of one drafter compare equal.
    if target_hidden == hidden:
        target_hidden = None
    known = {
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "draft_vocab_size",
        "num_hidden_layers",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
        "rms_norm_eps",
        "hidden_act",
        "architectures",
        "eagle_config",
        "target_hidden_size",
        "norm_before_residual",
        "model_type",
        "tie_word_embeddings",
        "draftport_aux_convention",
        "rope_parameters",
    }
    extra = {k: v for k, v in top.items() if k not in known and fmt == "flat"}
    # transformers 5 writes RoPE as rope_parameters {rope_theta, rope_type, ...} (speculators 0.9.0's
    # converted configs do), transformers 4 as rope_theta + rope_scaling: read both.
    rope = llama.get("rope_parameters") if isinstance(llama.get("rope_parameters"), dict) else {}
    return DrafterConfig(
        hidden_size=hidden,
        intermediate_size=_req(llama, "intermediate_size", path, where),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=None,
        target_hidden_size=target_hidden,
        num_hidden_layers=_opt_int(llama, "num_hidden_layers", 1, path, where),
        max_position_embeddings=_opt_int(llama, "max_position_embeddings", 2048, path, where),
        rope_theta=_opt_float(
            llama, "rope_theta", _opt_float(rope, "rope_theta", 10000.0, path, f"{where}rope_parameters."), path, where
        ),
        rope_scaling=llama.get("rope_scaling") or _scaling_of(rope),
        rms_norm_eps=_opt_float(llama, "rms_norm_eps", 1e-6, path, where),
        hidden_act=llama.get("hidden_act", "silu"),
        extra=extra,
        format=fmt,
    )


def _scaling_of(rope: dict) -> dict | None:
    """rope_scaling from transformers 5's rope_parameters: none for the default type."""
    kind = rope.get("rope_type", rope.get("type"))
    if not rope or kind in (None, "default"):
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def parse_config(raw: dict, path: str | Path = "config.json") -> DrafterConfig:
    """Normalize a drafter config.json (either format) into a DrafterConfig."""
    if not isinstance(raw, dict):
        raise DraftportError(path, "config is not a JSON object")
    if raw.get("speculators_model_type") or "transformer_layer_config" in raw:
        llama = raw.get("transformer_layer_config")
        if not isinstance(llama, dict):
            raise DraftportError(path, "speculators config has no transformer_layer_config object")
        cfg = _from_llama_fields(llama, raw, path, "transformer_layer_config.", "speculators")
        cfg.aux_layer_ids = raw.get("eagle_aux_hidden_state_layer_ids")
        # Absent means False in both formats: speculators 0.9.0's Eagle3SpeculatorConfig defaults
        # norm_before_residual to False (Field(default=False)), as its eagle3 converter does.
        cfg.norm_before_residual = bool(raw.get("norm_before_residual", False))
        cfg.architectures = list(raw.get("architectures") or ["Eagle3Speculator"])
        spec = raw.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        if verifier.get("name_or_path"):
            cfg.extra["verifier"] = verifier.get("name_or_path")
    else:
        cfg = _from_llama_fields(raw, raw, path, "", "flat")
        eagle = raw.get("eagle_config") or {}
        cfg.aux_layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        cfg.norm_before_residual = bool(raw.get("norm_before_residual", False))
        cfg.architectures = list(raw.get("architectures") or [])
    cfg.aux_convention = raw.get("draftport_aux_convention")
    if cfg.aux_layer_ids is not None:
        ids = cfg.aux_layer_ids
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise DraftportError(
                path, f"eagle_aux_hidden_state_layer_ids must be a list of non-negative ints, got {ids!r}"
            )
        if len(ids) != 3:
            raise DraftportError(path, f"EAGLE-3 needs 3 aux layer ids, got {len(ids)}: {ids}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        raise DraftportError(path, f"draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
    if cfg.aux_convention is not None and cfg.aux_convention not in CONVENTIONS:
        raise DraftportError(path, f"draftport_aux_convention must be one of {CONVENTIONS}, got {cfg.aux_convention!r}")
    return cfg


def read_config(folder: str | Path) -> tuple[DrafterConfig, dict]:
    path = Path(folder) / "config.json"
    raw = load_json(path, "no config.json in the drafter folder")
    return parse_config(raw, path), raw


def target_text_config(path) -> dict:
    """A target's text decoder config: its config.json, or the `text_config` of a multimodal
    wrapper (Kimi-K2.5). One-line errors name the folder or the file. No torch."""
    f = Path(path) / "config.json"
    cfg = load_json(f, "not a model folder (no config.json)", where=path)
    if not isinstance(cfg, dict):
        raise DraftportError(f, "config is not a JSON object")
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        return cfg["text_config"]
    return cfg


def served_positions(max_position_embeddings, rope_scaling) -> int | None:
    """The longest context an engine serves a config at, as vLLM derives max_model_len: the
    max_position_embeddings, times the RoPE scaling factor (yarn: of its original length) except
    for the types whose max_position_embeddings already holds the scaled length."""
    if not isinstance(max_position_embeddings, int):
        return None
    scaling = rope_scaling if isinstance(rope_scaling, dict) else {}
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling.get("factor")
    if kind in (None, "default", "su", "longrope", "llama3") or not isinstance(factor, (int, float)):
        return max_position_embeddings
    base = scaling.get("original_max_position_embeddings", max_position_embeddings) if kind == "yarn" else None
    return int((base if isinstance(base, int) else max_position_embeddings) * factor)


def context_limit(drafter_dir, target_dir) -> dict:
    """How far the source drafter's positions reach against the new target's serving length."""
    cfg, _ = read_config(drafter_dir)
    tcfg = target_text_config(target_dir)
    rope = tcfg.get("rope_scaling") or _scaling_of(tcfg.get("rope_parameters") or {})
    source = served_positions(cfg.max_position_embeddings, cfg.rope_scaling)
    serving = served_positions(tcfg.get("max_position_embeddings"), rope)
    return {
        "source_max_position_embeddings": cfg.max_position_embeddings,
        "source_rope_scaling": cfg.rope_scaling,
        "source_limit": source,
        "serving_length": serving,
        "limited": source is not None and serving is not None and source < serving,
    }
