"""A/B on the GPU: the fused loss's row chunk (draftport.training.ttt.LOSS_CHUNK) in the whole training step.

benchmarks/probe_loss_attn_h200.py times the loss alone; this times train_step (the main variant of
bench_train_h200.py: lm_head frozen, greedy choice stored, cuDNN attention) at the Kimi size with
LOSS_CHUNK 1024 and 4096 alternating (A B A B), at each length, in one process. Prints tok/s per
run and the ratio of the medians; asserts nothing.

    python benchmarks/ab_loss_chunk_h200.py [--seqs 4096 2048] [--chunks 1024 4096] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train_h200 as B  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[4096, 2048])
    ap.add_argument("--chunks", type=int, nargs=2, default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", default="kimi", choices=sorted(B.SIZES))
    ap.add_argument("--json", default=None)
    x = ap.parse_args()
    cuda = torch.cuda.is_available()
    a = B.parse(["--attn-backend", "cudnn", "--size", x.size])
    dev, dt = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    cfg, d, head = B.build(x.size, dev, dt)
    hot = d.hot_ids
    rows = head.index_select(0, hot).contiguous()
    default = B.ttt_mod.LOSS_CHUNK
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "default_loss_chunk": default, "runs": {}}
    try:
        for T in x.seqs:
            batch = B.with_stored_mask([B.make_batch(cfg, 1, T, dev, dt)], head, hot, a.chunk)[0]
            got = {c: [] for c in x.chunks}
            for _ in range(x.rounds):
                for c in x.chunks:
                    B.ttt_mod.LOSS_CHUNK = c
                    v = B.Variant(f"T{T} lm_head frozen, mask stored, loss chunk {c}", attn="cudnn", mask="stored")
                    r = B.run_variant(v, d, rows, [batch], a, dev, cfg, print)
                    got[c].append(r["real_tokens_per_s"])
            med = {c: statistics.median(v) for c, v in got.items()}
            lo, hi = x.chunks
            out["runs"][str(T)] = {"tokens_per_s": {str(c): v for c, v in got.items()},
                                   "ratio_median": med[hi] / med[lo]}
            print(f"[ab] T {T}: loss chunk {hi} / {lo}: x{med[hi] / med[lo]:.4f} "
                  f"({', '.join(f'{c}: {v}' for c, v in got.items())})", flush=True)
    finally:
        B.ttt_mod.LOSS_CHUNK = default
    if x.json:
        Path(x.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
