"""Tiny target folders, two kinds, and a toy drafter next to them:

- stub_target: what the export validator reads of a target (config.json, its embedding and
  lm_head), no layers; STUB_* are its sizes.
- tiny_llama: a real 2-layer random Llama a capture runs (vllm convention, LLAMA_AUX);
  seed_folder: token sequences for it in a feature folder.
- stub_drafter: a flat EAGLE-3 drafter sized for stub_target.

Both are H wide."""

import json

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftport.data.shards import Sequence, write_features
from draftport.model.config import DrafterConfig
from draftport.model.drafter import Eagle3Drafter
from draftport.model.formats import save_drafter
from draftport.model.vocab import build_maps

H = 64
STUB_VOCAB, STUB_LAYERS, STUB_CTX = 100, 4, 512
LLAMA_VOCAB = 128
LLAMA_AUX = [0, 1, 2]  # vllm convention: 0 = embedding output, 2 = leaving the last layer


def stub_target(folder, seed=0, embed_name="model.embed_tokens.weight", dtype=torch.float32):
    """A target folder as far as the validator reads it: config.json + its embedding (random under
    `seed`, stored as `embed_name` in `dtype`) and lm_head."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": STUB_VOCAB,
                "hidden_size": H,
                "num_hidden_layers": STUB_LAYERS,
                "max_position_embeddings": STUB_CTX,
                "rope_theta": 10000.0,
            }
        )
    )
    g = torch.Generator().manual_seed(seed)
    save_file(
        {
            embed_name: torch.randn(STUB_VOCAB, H, generator=g).to(dtype),
            "lm_head.weight": torch.randn(STUB_VOCAB, H, generator=g),
        },
        str(folder / "model.safetensors"),
    )
    return folder


def stub_drafter(folder, embed_from=None, *, include_embed=None, **cfg_kw):
    """A flat drafter for stub_target (seeded): with embed_from (a target folder) its embedding is
    that target's, saved in the folder when include_embed (default: when embed_from is given)."""
    kw = dict(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=STUB_VOCAB,
        draft_vocab_size=40,
        aux_layer_ids=[1, 2, 3],
        max_position_embeddings=STUB_CTX,
        aux_convention="vllm",
    )
    kw.update(cfg_kw)
    cfg = DrafterConfig(**kw)
    torch.manual_seed(0)
    embed = load_file(str(embed_from / "model.safetensors"))["model.embed_tokens.weight"] if embed_from else None
    d = Eagle3Drafter(cfg, embed_weight=embed)
    d.set_vocab_maps(*build_maps(np.random.default_rng(0).integers(0, 1000, STUB_VOCAB), cfg.draft_vocab_size))
    include = embed_from is not None if include_embed is None else include_embed
    return save_drafter(folder, cfg, d.export_state(include_embed=include))


def tiny_llama(path, *, seed=0, hidden=H, vocab=LLAMA_VOCAB, base=None, noise=0.0):
    """A 2-layer random Llama (or `base`'s weights plus relative Gaussian noise), saved to path."""
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=hidden // 2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    m = LlamaForCausalLM(cfg).eval()
    if base is not None:
        m.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=g))
    m.save_pretrained(path)
    return m


def seed_folder(path, n=10, seed=0):
    """Token sequences (prompt + answer) in a feature folder; its states are placeholders."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        T = int(torch.randint(12, 30, (1,), generator=g))
        start = int(torch.randint(3, 8, (1,), generator=g))
        seqs.append(Sequence(torch.randint(0, LLAMA_VOCAB, (T,), generator=g).tolist(), start))

    def featurize(batch):
        T = max(len(s.tokens) for s in batch)
        return torch.zeros(len(batch), T, 3 * H), torch.zeros(len(batch), T, H)

    write_features(
        path,
        seqs,
        featurize,
        meta={"aux_layer_ids": LLAMA_AUX, "aux_convention": "vllm"},
        shard_samples=4,
        dtype="float32",
    )
    return path
