"""Step world: the embedded K2 -> K2.5 analog (corpus, tokenizer, target_old, target_new) and the
source drafter trained on target_old, published as a hub-cache entry in artifacts/world/hub."""

import torch

from draftport import plan
from draftport.pipeline import run_step, write_json
from draftport.train import TrainConfig
from draftport.world import build_world_base


def world(s):
    w, f = s.p["world"], s.p["features"]
    base = {k: v for k, v in w.items() if k not in ("build", "source_drafter")}
    manifest = build_world_base(s.dir, base, progress=True)  # on world.threads threads
    torch.set_num_threads(1)  # the drafter is small: one thread, no OpenMP spinning on busy cores
    sd = w["source_drafter"]
    src = plan.build_source_drafter(
        s.dir, n_samples=sd["n_samples"], max_new_tokens=sd["max_new_tokens"],
        draft_vocab_ratio=sd["draft_vocab_ratio"], aux_layer_ids=f["aux_layer_ids"],
        convention=f["aux_convention"], arch=sd["arch"], train_cfg=TrainConfig(**sd["train"]),
        repo_id=s.p["source"]["repo_id"], batch_size=sd["batch_size"])
    write_json(s.path("source_drafter.json"), src)
    m = manifest["metrics"]
    return {
        "targets": {k: m[k] for k in sorted(m) if not k.startswith("assistant_tokens")},
        "source": {"train_set_accept_length": src["train_set_accept_length"],
                   "draft_vocab_size": src["draft_vocab_size"],
                   "vocab_coverage": src["vocab"]["coverage"]},
        "world_mb": round(manifest["bytes"]["total"] / 1e6, 2),
    }


if __name__ == "__main__":
    raise SystemExit(run_step("world", world))
