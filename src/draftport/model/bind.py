"""A drafter bound to a target: its frozen embedding and the target's head come from the target
(never from a checkpoint), and the features it reads must be captured the way it was trained."""

from __future__ import annotations

import torch

from draftport.errors import DraftportError
from draftport.model.config import DrafterConfig, target_text_config
from draftport.model.drafter import Eagle3Drafter
from draftport.model.target import read_target_tensor


def drafter_for_target(cfg: DrafterConfig, target_dir, state: dict | None = None) -> Eagle3Drafter:
    """A drafter whose frozen embedding comes from the target (never from a checkpoint)."""
    embed = read_target_tensor(target_dir, "embed_tokens.weight").float()
    if tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftportError(
            target_dir,
            f"target embedding {list(embed.shape)} does not fit the drafter "
            f"(vocab {cfg.vocab_size}, hidden {cfg.hidden_size})",
        )
    d = Eagle3Drafter(cfg)
    if state is not None:
        d.load_flat_state(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items() if k != "embed_tokens.weight"}
        )
    d.set_embedding(embed)
    return d


def target_head(target_dir) -> torch.Tensor:
    return read_target_tensor(target_dir, "lm_head.weight").float()


def check_features_fit(cfg: DrafterConfig, fs, where) -> None:
    """fs: a feature set (data.shards' FeatureSet or a chain of them): its index must say the features
    were captured as the drafter reads them."""
    ids = fs.index.get("aux_layer_ids")
    if cfg.aux_layer_ids is not None and ids != list(cfg.aux_layer_ids):
        raise DraftportError(where, f"drafter reads aux layers {cfg.aux_layer_ids} but the features hold {ids}")
    conv = fs.index.get("aux_convention")
    if cfg.aux_convention and conv and cfg.aux_convention != conv:
        raise DraftportError(
            where, f"drafter was trained under the {cfg.aux_convention} aux convention, features use {conv}"
        )
    th = cfg.target_hidden_size or cfg.hidden_size
    if fs.index.get("hidden_size") != th:
        raise DraftportError(
            where, f"features have hidden size {fs.index.get('hidden_size')}, the drafter expects {th}"
        )


def target_sizes(target_dir) -> dict:
    """What a fresh drafter takes from its target, new_drafter_config's hidden_size, vocab_size and
    max_positions (the context), from the text decoder's config; nothing else: the drafter is a
    Llama-style EAGLE-3 layer whatever the target (DeepSeek-V3's head_dim, MLA sizes and RoPE
    keys are its attention's own)."""
    tcfg = target_text_config(target_dir)
    try:
        return {
            "hidden_size": int(tcfg["hidden_size"]),
            "vocab_size": int(tcfg["vocab_size"]),
            "max_positions": int(tcfg.get("max_position_embeddings") or 2048),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise DraftportError(target_dir, f"target config lacks a usable {e}") from None


def new_drafter_config(
    arch: dict,
    *,
    vocab_size: int,
    hidden_size: int,
    aux_layer_ids,
    convention,
    draft_vocab_size: int,
    max_positions: int,
) -> DrafterConfig:
    """A fresh drafter config for a target (scratch drafters, the world's source drafter): its
    sizes from `arch` (params world.source_drafter.arch) or derived, only hidden / vocab /
    context from the target (target_sizes)."""
    heads = arch.get("num_attention_heads", 4)
    return DrafterConfig(
        hidden_size=hidden_size,
        intermediate_size=arch.get("intermediate_size", 3 * hidden_size),
        num_attention_heads=heads,
        num_key_value_heads=arch.get("num_key_value_heads", heads),
        head_dim=arch.get("head_dim", hidden_size // heads),
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab_size,
        aux_layer_ids=list(aux_layer_ids),
        max_position_embeddings=max_positions,
        rope_theta=arch.get("rope_theta", 10000.0),
        aux_convention=convention,
    )
