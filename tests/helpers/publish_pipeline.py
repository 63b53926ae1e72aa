"""A tiny pipeline's outputs as the publish step finds them: a stub target (embedding + lm_head),
random feature sets, real (short) trainings of the source, Phase 1 (fine-tune), its scratch
control and Phase 2, real evaluations, a real fetch from a hub cache and a real decision."""

import json
from pathlib import Path

import torch
from repo import ROOT
from tiny_targets import STUB_CTX, STUB_VOCAB, H, stub_target

from draftport.data.capture import target_identity
from draftport.data.draftmap import build_vocab
from draftport.data.fetch import fetch, publish_to_cache
from draftport.data.shards import Sequence, write_features
from draftport.evaluation.accept import evaluate_drafter
from draftport.evaluation.decision import decide
from draftport.model.bind import new_drafter_config
from draftport.plan import params, registry
from draftport.training.loop import TrainConfig
from draftport.training.phases import train_phase

AUX = [1, 2, 3]
K = 3


def _features(folder, target, n, seed, offset=0, samples_file="prompts.jsonl"):
    """n sequences of random tokens and random states (what is compared here is how a drafter is
    stored, loaded and computed, not how well it drafts)."""
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(n):
        T = int(torch.randint(12, 24, (1,), generator=g))
        seqs.append(Sequence(torch.randint(0, STUB_VOCAB, (T,), generator=g).tolist(), 4))

    def featurize(batch):
        T = max(len(s.tokens) for s in batch)
        return torch.randn(len(batch), T, 3 * H, generator=g), torch.randn(len(batch), T, H, generator=g) * 3

    write_features(
        folder,
        seqs,
        featurize,
        shard_samples=64,
        dtype="float32",
        meta={
            "aux_layer_ids": AUX,
            "aux_convention": "vllm",
            "target": target_identity(target),
            "regenerated": True,
            "samples_file": samples_file,
            "offset": offset,
        },
    )
    return folder


def build_pipeline(root: Path, *, rope_theta: float = 10000.0, verifier_is_folder: bool = False) -> dict:
    """artifacts/<step>/ as the steps leave them, for the publish step's inputs; -> {inputs, params}.
    The trainings name their target org/target-new (a hub id), or its folder (verifier_is_folder:
    as targets.new is in the embedded world), which speculators can read offline."""
    a = root / "artifacts"
    target = stub_target(root / "target_new", seed=2)
    verifier = str(target) if verifier_is_folder else "org/target-new"
    old = stub_target(root / "target_old", seed=1)
    f1 = _features(a / "features_new" / "train", target, 48, seed=1)
    f2 = _features(a / "features_phase2" / "train", target, 48, seed=2, offset=48)
    fe = _features(a / "features_eval" / "eval_new", target, 24, seed=3, samples_file="heldout.jsonl")
    fo = _features(root / "old_feats", old, 48, seed=4)
    build_vocab(f1, a / "vocab_new" / "vocab.safetensors", draft_vocab_size=40, vocab_size=STUB_VOCAB)
    build_vocab(fo, root / "old_vocab.safetensors", draft_vocab_size=40, vocab_size=STUB_VOCAB)
    cfg = new_drafter_config(
        {"num_attention_heads": 2, "head_dim": 32, "intermediate_size": 128, "rope_theta": rope_theta},
        vocab_size=STUB_VOCAB,
        hidden_size=H,
        aux_layer_ids=AUX,
        convention="vllm",
        draft_vocab_size=40,
        max_positions=STUB_CTX,
    )
    tc = TrainConfig(steps=12, batch_size=8, lr=3e-3, warmup_steps=2, ttt_steps=K, checkpoint_every=12)
    # the source: trained for the old target, published to a hub cache, fetched at its commit
    train_phase(
        root / "src",
        features_dir=fo,
        target_dir=old,
        vocab_path=root / "old_vocab.safetensors",
        init="scratch",
        arch=cfg,
        train_cfg=tc,
        progress=False,
        verifier="org/target-old",
    )
    publish_to_cache(root / "src" / "drafter", root / "hub", "org/src-eagle3")
    fetch("org/src-eagle3", a / "fetch" / "source", cache_dir=root / "hub", offline=True)
    src = a / "fetch" / "source"
    common = dict(
        target_dir=target,
        vocab_path=a / "vocab_new" / "vocab.safetensors",
        train_cfg=tc,
        progress=False,
        source_dir=src,
        verifier=verifier,
    )
    runs = {"phase1_scratch": dict(features_dir=f1, init="scratch"), "phase1": dict(features_dir=f1, init="source")}
    for ph, kw in runs.items():
        rep = train_phase(a / f"train_{ph}", **kw, **common)
        (a / f"train_{ph}" / "metrics.json").write_text(
            json.dumps({"train_steps": rep["train_steps"], "final_loss": rep["final"].get("loss")})
        )
    rep = train_phase(a / "train_phase2", features_dir=f2, init=str(a / "train_phase1" / "drafter"), **common)
    (a / "train_phase2" / "metrics.json").write_text(json.dumps({"train_steps": rep["train_steps"]}))
    evals = {}
    for ph in ("phase1_scratch", "phase1", "phase2"):
        evals[ph] = evaluate_drafter(a / f"train_{ph}" / "drafter", target, fe, k=K, batch_size=8)
        evals[ph].pop("eval_seconds")
        (a / f"eval_{ph}").mkdir(parents=True)
        (a / f"eval_{ph}" / "eval.json").write_text(json.dumps(evals[ph]))
    p = params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")
    p["targets"]["new"] = verifier  # what the trainings named (the steps pass targets.new)
    p["decision"]["n_boot"] = 200
    dec = decide(None, evals, costmodel=p["costmodel"], k=K, n_boot=200, level=0.95, seed=0)
    (a / "decision").mkdir()
    (a / "decision" / "decision.json").write_text(json.dumps(dec))
    where = json.loads(json.dumps(p))
    where["targets"]["new"] = str(target)  # a folder: the registry passes it as is
    inputs = {
        name: Path(path) if name == "target" else a / Path(path).relative_to("artifacts")
        for name, path in registry.inputs(registry.BY_NAME["publish"], where).items()
    }
    sp = registry.step_params(p, "publish")
    sp["publish"]["k"] = [1, 3]
    return {
        "inputs": inputs,
        "params": sp,
        "target": target,
        "evals": evals,
        "decision": dec,
        "root": root,
        "features": fe,
    }
