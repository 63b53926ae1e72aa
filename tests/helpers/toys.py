"""The 64-wide toy drafter and what trains it: its config, the drafter (seeded), a batch, samples
to pack, a learnable synthetic feature set with its head, a drafter's weights to compare, and a
logger that keeps the loss of every logged step (what the torchrun workers report)."""

from pathlib import Path

import numpy as np
import torch

from draftport.data.shards import Batch, FeatureSet, Sequence, write_features
from draftport.model.config import DrafterConfig
from draftport.model.drafter import Eagle3Drafter
from draftport.model.vocab import build_maps
from draftport.progress import Logger


def toy_cfg(**kw):
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        draft_vocab_size=40,
        aux_layer_ids=[1, 2, 3],
        max_position_embeddings=256,
    )
    base.update(kw)
    return DrafterConfig(**base)


def toy_drafter(cfg=None, seed=0):
    torch.manual_seed(seed)
    cfg = cfg or toy_cfg()
    d = Eagle3Drafter(cfg, embed_weight=torch.randn(cfg.vocab_size, cfg.hidden_size))
    counts = np.random.default_rng(seed).integers(0, 1000, cfg.vocab_size)
    d.set_vocab_maps(*build_maps(counts, cfg.draft_vocab_size))
    return d


def toy_state(cfg=None, seed=0):
    """-> (cfg, exported state) of a toy drafter without an embedding."""
    torch.manual_seed(seed)
    cfg = cfg or toy_cfg()
    d = Eagle3Drafter(cfg)
    counts = np.random.default_rng(seed).integers(0, 1000, cfg.vocab_size)
    d.set_vocab_maps(*build_maps(counts, cfg.draft_vocab_size))
    return cfg, d.export_state()


def toy_batch(cfg, B=2, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    valid = torch.ones(B, T, dtype=torch.bool)
    if B > 1:
        valid[1, -3:] = False
    return Batch(
        aux=torch.randn(B, T, 3 * H, generator=g),
        final=torch.randn(B, T, H, generator=g),
        tokens=torch.randint(0, cfg.vocab_size, (B, T), generator=g),
        loss_mask=valid.clone(),
        valid=valid,
    )


def make_samples(cfg, lengths, seed=0, dtype=torch.float64, target_arg=None):
    """One sample dict per length (what pack / collate take); with target_arg (a head) each carries
    its captured argmax."""
    g = torch.Generator().manual_seed(seed)
    H, out = cfg.hidden_size, []
    for n in lengths:
        rs = min(2, n - 1)
        lm = torch.zeros(n, dtype=torch.bool)
        lm[rs:] = True
        s = {
            "tokens": torch.randint(0, cfg.vocab_size, (n,), generator=g),
            "loss_mask": lm,
            "aux": torch.randn(n, 3 * H, generator=g, dtype=dtype),
            "final": torch.randn(n, H, generator=g, dtype=dtype),
            "response_start": rs,
        }
        if target_arg is not None:
            s["target_arg"] = (s["final"] @ target_arg.t()).argmax(-1)
        out.append(s)
    return out


def make_features(tmp: Path, n=24, seed=0):
    """A learnable synthetic world: the final state is a fixed function of the aux states.
    -> (FeatureSet at tmp/feats, head)."""
    cfg = toy_cfg()
    g = torch.Generator().manual_seed(seed)
    H = cfg.hidden_size
    mix = torch.randn(3 * H, H, generator=g) / (3 * H) ** 0.5
    seqs = []
    for i in range(n):
        T = int(torch.randint(10, 20, (1,), generator=g))
        seqs.append(Sequence(torch.randint(0, cfg.vocab_size, (T,), generator=g).tolist(), 3))

    def featurize(batch):
        T = max(len(s.tokens) for s in batch)
        aux = torch.randn(len(batch), T, 3 * H, generator=g)
        return aux, torch.tanh(aux @ mix) * 3

    write_features(tmp / "feats", seqs, featurize, meta={"aux_layer_ids": [1, 2, 3]}, shard_samples=10, dtype="float32")
    head = torch.randn(cfg.vocab_size, H, generator=g)
    return FeatureSet(tmp / "feats"), head


def weights(d):
    """A drafter's exported weights, cloned."""
    return {k: v.clone() for k, v in d.export_state().items()}


class LossLog(Logger):
    """Keeps the loss of every logged step."""

    def __init__(self):
        self.losses = []

    def log_metrics(self, m, step):
        self.losses.append(m["loss"])
