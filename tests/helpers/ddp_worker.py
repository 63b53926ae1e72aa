"""Launched by torchrun from tests/training/test_train.py: 6 steps on a fixed global batch, loss per step."""

import json
import sys
from pathlib import Path

import torch
from toys import LossLog, toy_drafter

from draftport.data.shards import FeatureSet
from draftport.training.loop import TrainConfig, init_distributed, train

if __name__ == "__main__":
    feats, out = Path(sys.argv[1]), Path(sys.argv[2])
    impl = sys.argv[3] if len(sys.argv) > 3 else "auto"
    rank, world = init_distributed()
    torch.manual_seed(0)
    head = torch.randn(100, 64, generator=torch.Generator().manual_seed(7))
    d = toy_drafter(seed=3)
    log = LossLog()
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=100, log_every=1, impl=impl)
    train(d, FeatureSet(feats), head, out, cfg, logger=log, progress=False)
    if rank == 0:
        s = sum(float(v.double().sum()) for k, v in d.export_state().items() if v.is_floating_point())
        (out / "result.json").write_text(json.dumps({"losses": log.losses, "weight_sum": s}))
