"""Launched by torchrun from tests/training/test_fsdp.py: train the toy drafter on a fixed global batch under
`parallel` (ddp or fsdp; one process runs plain), then write per-step losses and the final
weights (rank 0).

    fsdp_worker.py FEATS OUT [--impl reference|fused] [--parallel ddp|fsdp] [--steps N]
                   [--stop-after K] [--checkpoint-every C]
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from toys import LossLog, toy_drafter

from draftport.data.shards import FeatureSet
from draftport.training.loop import TrainConfig, init_distributed, train

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("feats")
    ap.add_argument("out")
    ap.add_argument("--impl", default="reference")
    ap.add_argument("--parallel", default="fsdp")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--drafter-seed", type=int, default=3)
    a = ap.parse_args()
    out = Path(a.out)
    rank, world = init_distributed()
    torch.manual_seed(0)
    head = torch.randn(100, 64, generator=torch.Generator().manual_seed(7))
    d = toy_drafter(seed=a.drafter_seed)
    # the frozen embedding always comes from the target, never from a checkpoint
    d.set_embedding(toy_drafter(seed=3).embed_tokens.weight)
    log = LossLog()
    cfg = TrainConfig(
        steps=a.steps,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        log_every=1,
        checkpoint_every=a.checkpoint_every,
        impl=a.impl,
        parallel=a.parallel,
    )
    res = train(d, FeatureSet(a.feats), head, out, cfg, logger=log, progress=False, stop_after=a.stop_after)
    if rank == 0:
        w = {k: v.detach().clone().contiguous() for k, v in d.export_state().items()}
        save_file(w, str(out / "weights.safetensors"))
        (out / "result.json").write_text(json.dumps({"losses": log.losses, "steps": res["steps"], "world": world}))
