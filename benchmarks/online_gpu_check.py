"""features.storage online with the capture on a GPU: the micro world's new target captured on CUDA
(bf16; eager, then with features.compile) by the training step's producer thread, against the
same capture stored on disk first. Prints, per compile setting, the largest weight difference
between the drafter trained on the disk capture and the one trained online (same samples, same
order, same seed; the drafter trains on the CPU, as train_phase does), whether the spool is gone,
and the seconds of each training. Needs CUDA; never asserts: it prints one JSON object.

    python benchmarks/online_gpu_check.py [--samples 64] [--steps 24]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from safetensors.torch import load_file  # noqa: E402

from draftport.data.draftmap import build_vocab  # noqa: E402
from draftport.data.features import build_features  # noqa: E402
from draftport.model.bind import new_drafter_config  # noqa: E402
from draftport.model.config import target_text_config  # noqa: E402
from draftport.plan.params import TrainConfig, load  # noqa: E402
from draftport.training.phases import train_phase  # noqa: E402
from draftport.world import build_world_base  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--device", default="cuda", help="cpu: the same run on the CPU (a dry run of the script)")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("online_gpu_check: no CUDA device", file=sys.stderr)
        return 2
    out = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "samples": a.samples,
        "steps": a.steps,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="online-gpu-") as tmp:
        root = Path(tmp)
        build_world_base(
            root / "w", load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")["world"], progress=False
        )
        target, prompts = root / "w" / "target_new", root / "w" / "corpus" / "new.jsonl"
        tc = target_text_config(target)
        arch = new_drafter_config(
            {"num_attention_heads": 2, "intermediate_size": 128},
            vocab_size=tc["vocab_size"],
            hidden_size=tc["hidden_size"],
            aux_layer_ids=[0, 1, 2],
            convention="vllm",
            draft_vocab_size=100,
            max_positions=512,
        )
        cfg = TrainConfig(steps=a.steps, batch_size=8, lr=3e-3, warmup_steps=1, log_every=4, checkpoint_every=8)
        for compiled in (False, True):
            kw = dict(
                n_samples=a.samples,
                aux_layer_ids=[0, 1, 2],
                convention="vllm",
                max_new_tokens=24,
                dtype="bfloat16",
                batch_size=8,
                shard_samples=16,
                device=a.device,
                compile=compiled,
            )
            tag = "compiled" if compiled else "eager"
            for mode in ("disk", "online"):
                build_features(target, prompts, root / f"{tag}_{mode}", storage=mode, **kw)
            vocab = root / f"{tag}_vocab.safetensors"
            build_vocab(root / f"{tag}_disk", vocab, draft_vocab_size=100, vocab_size=tc["vocab_size"])
            w, secs = {}, {}
            for mode in ("disk", "online"):
                t = time.perf_counter()
                train_phase(
                    root / f"{tag}_run_{mode}",
                    features_dir=root / f"{tag}_{mode}",
                    target_dir=target,
                    vocab_path=vocab,
                    init="scratch",
                    arch=arch,
                    train_cfg=cfg,
                    progress=False,
                    spool={"gb": 0.002},
                )
                secs[mode] = round(time.perf_counter() - t, 2)
                w[mode] = load_file(str(root / f"{tag}_run_{mode}" / "drafter" / "model.safetensors"))
            diff = max((w["disk"][k].float() - w["online"][k].float()).abs().max().item() for k in w["disk"])
            out["runs"][tag] = {
                "max_abs_weight_diff": diff,
                "train_seconds": secs,
                "spool_left": [str(p) for p in root.glob(f"{tag}_run_online/*.spool*")],
            }
            print(f"{tag}: online vs disk max |diff| {diff:.3g}; train s {secs}", flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
