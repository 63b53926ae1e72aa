"""The world's source drafter ("AQ-MedAI's"): an EAGLE-3 drafter trained for target_old on its
own greedy answers, published as a hub-cache entry (world_dir/hub) that the fetch step pins.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def build_source_drafter(world_dir, *, n_samples: int, max_new_tokens: int, draft_vocab_ratio: float,
                         aux_layer_ids, arch: dict, train_cfg, repo_id: str, branch: str = "main",
                         convention: str = "vllm", batch_size: int = 32, progress=True) -> dict:
    """Features of target_old on old-corpus prompts (its own greedy answers), the draft vocab of
    those generations, a drafter trained on them, published as a hub-cache entry under
    world_dir/hub. Intermediate features are deleted: the world stays small."""
    import tempfile

    from ..bind import new_drafter_config
    from ..draftmap import build_vocab
    from ..evaluate import evaluate_drafter
    from ..features import build_features
    from ..fetch import publish_to_cache
    from ..phases import train_phase

    world = Path(world_dir)
    target = world / "target_old"
    world.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".source-build.", dir=world))
    try:
        build_features(target, world / "corpus" / "old.jsonl", work / "features", n_samples=n_samples,
                       aux_layer_ids=aux_layer_ids, convention=convention, max_new_tokens=max_new_tokens,
                       batch_size=batch_size, dtype="float32")
        tcfg = json.loads((target / "config.json").read_text())
        vocab, hidden = tcfg["vocab_size"], tcfg["hidden_size"]
        dv = max(8, int(round(vocab * draft_vocab_ratio)))
        vstats = build_vocab(work / "features", work / "vocab.safetensors", draft_vocab_size=dv, vocab_size=vocab)
        cfg = new_drafter_config(arch, vocab_size=vocab, hidden_size=hidden, aux_layer_ids=aux_layer_ids,
                                 convention=convention, draft_vocab_size=dv,
                                 max_positions=tcfg.get("max_position_embeddings", 2048))
        cfg.extra["verifier"] = "draftport/world-target-old"
        rep = train_phase(work / "train", features_dir=work / "features", target_dir=target,
                          vocab_path=work / "vocab.safetensors", init="scratch", arch=cfg,
                          train_cfg=train_cfg, progress=progress)
        ev = evaluate_drafter(work / "train" / "drafter", target, work / "features", k=train_cfg.ttt_steps,
                              max_samples=min(n_samples, 200))
        commit = publish_to_cache(work / "train" / "drafter", world / "hub", repo_id, branch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"repo_id": repo_id, "commit": commit, "branch": branch, "draft_vocab_size": dv,
            "vocab": vstats, "train": rep, "train_set_accept_length": ev["accept_length"]}
