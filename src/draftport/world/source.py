"""The world's source drafter ("AQ-MedAI's"): an EAGLE-3 drafter trained for target_old on many
more samples than Phase 1 gets (the real case: 1.4M vs 37K), to a plateau of its tau on the old
target, published as a hub-cache entry (world_dir/hub) that the fetch step pins.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from draftport.data.draftmap import build_vocab
from draftport.data.features import build_features, read_samples
from draftport.data.fetch import publish_to_cache
from draftport.errors import DraftportError
from draftport.evaluation.accept import evaluate_drafter
from draftport.model.bind import new_drafter_config, target_sizes
from draftport.training.phases import train_phase


def _old_corpus_size(corpus: Path, n_samples: int, monitor_samples: int) -> int:
    """The old corpus's sample count, checked to hold the training and monitor prompts."""
    n_old = len(read_samples(corpus))
    if n_samples + monitor_samples > n_old:
        raise DraftportError(
            "world.source_drafter.n_samples",
            f"{n_samples} + monitor_samples {monitor_samples} exceed the old corpus's {n_old} samples (world.n_old)",
        )
    return n_old


def _capture_source_features(
    target: Path, corpus: Path, work: Path, *, n_samples, n_old, monitor_samples, answers, train_cfg, batch_size, common
) -> dict | None:
    """target_old's features on the training prompts (work/features) and, with monitor_samples,
    on the last old-corpus prompts (work/monitor); returns train_phase's `monitor` (None: none)."""
    build_features(
        target,
        corpus,
        work / "features",
        n_samples=n_samples,
        dtype="bfloat16",
        regenerate_responses=answers == "regenerated",
        **common,
    )
    if not monitor_samples:
        return None
    build_features(
        target,
        corpus,
        work / "monitor",
        n_samples=monitor_samples,
        offset=n_old - monitor_samples,
        dtype="float32",
        regenerate_responses=True,
        **common,
    )
    return {"features": work / "monitor", "k": train_cfg.ttt_steps, "batch_size": batch_size}


def _train_source(
    work: Path,
    target: Path,
    *,
    arch,
    aux_layer_ids,
    convention,
    draft_vocab_ratio,
    train_cfg,
    progress,
    monitor,
    n_samples,
    device,
) -> tuple[int, dict, dict, dict]:
    """The draft vocab of the captured answers, a drafter trained from scratch on them and its
    acceptance on its own training prompts: (draft vocab size, the vocab's stats, train_phase's
    report, evaluate_drafter's result)."""
    sizes = target_sizes(target)  # hidden, vocab, context: all a drafter takes from its target
    vocab = sizes["vocab_size"]
    dv = max(8, int(round(vocab * draft_vocab_ratio)))
    vstats = build_vocab(work / "features", work / "vocab.safetensors", draft_vocab_size=dv, vocab_size=vocab)
    cfg = new_drafter_config(arch, **sizes, aux_layer_ids=aux_layer_ids, convention=convention, draft_vocab_size=dv)
    rep = train_phase(
        work / "train",
        features_dir=work / "features",
        target_dir=target,
        vocab_path=work / "vocab.safetensors",
        init="scratch",
        arch=cfg,
        train_cfg=train_cfg,
        progress=progress,
        monitor=monitor,
        verifier="draftport/world-target-old",
    )
    ev = evaluate_drafter(
        work / "train" / "drafter",
        target,
        work / "features",
        k=train_cfg.ttt_steps,
        max_samples=min(n_samples, 200),
        device=device,
    )
    return dv, vstats, rep, ev


def _source_summary(
    rep: dict, ev: dict, repo_id, commit, branch, dv, vstats, n_samples, answers, monitor_samples
) -> dict:
    """What build_source_drafter returns, the training's rate printed and left out of it."""
    curve = rep.pop("curve", [])
    run = rep.pop("run", {})  # a rate: the world's metrics stay byte-identical between runs
    print(f"world: source drafter trained on {run.get('device')} at {run.get('tokens_per_s') or 0:,.0f} tok/s")
    return {
        "repo_id": repo_id,
        "commit": commit,
        "branch": branch,
        "draft_vocab_size": dv,
        "n_samples": n_samples,
        "answers": answers,
        "monitor_samples": monitor_samples,
        "vocab": vstats,
        "train": rep,
        "train_set_accept_length": ev["accept_length"],
        "monitor": curve,
    }


def build_source_drafter(
    world_dir,
    *,
    n_samples: int,
    max_new_tokens: int,
    draft_vocab_ratio: float,
    aux_layer_ids,
    arch: dict,
    train_cfg,
    repo_id: str,
    branch: str = "main",
    convention: str = "vllm",
    batch_size: int = 32,
    answers: str = "regenerated",
    monitor_samples: int = 0,
    progress=True,
    device: str = "cpu",
) -> dict:
    """Features of target_old on the first n_samples old-corpus prompts, the draft vocab of their
    answers, a drafter trained on them, published as a hub-cache entry under world_dir/hub.

    answers 'regenerated': target_old's own greedy answers (a generation per sample);
    'corpus': the corpus's answers, teacher-forced (one prefill per sample; the training signal is
    the target's own choice at every position either way). monitor_samples > 0: the last that many
    old-corpus prompts, answered by target_old itself (what it will verify), are the held-out set
    whose tau train_cfg.eval_every steps traces the plateau (`monitor` in the result).
    device: "cpu" or "cuda", where target_old answers and is captured (world.device); the training's
    is train_cfg.device. Intermediate features are deleted: the world stays small."""
    world = Path(world_dir)
    target = world / "target_old"
    corpus = world / "corpus" / "old.jsonl"
    n_old = _old_corpus_size(corpus, n_samples, monitor_samples)
    world.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".source-build.", dir=world))
    common = dict(
        aux_layer_ids=aux_layer_ids,
        convention=convention,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        device=device,
    )
    try:
        monitor = _capture_source_features(
            target,
            corpus,
            work,
            n_samples=n_samples,
            n_old=n_old,
            monitor_samples=monitor_samples,
            answers=answers,
            train_cfg=train_cfg,
            batch_size=batch_size,
            common=common,
        )
        dv, vstats, rep, ev = _train_source(
            work,
            target,
            arch=arch,
            aux_layer_ids=aux_layer_ids,
            convention=convention,
            draft_vocab_ratio=draft_vocab_ratio,
            train_cfg=train_cfg,
            progress=progress,
            monitor=monitor,
            n_samples=n_samples,
            device=device,
        )
        commit = publish_to_cache(work / "train" / "drafter", world / "hub", repo_id, branch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return _source_summary(rep, ev, repo_id, commit, branch, dv, vstats, n_samples, answers, monitor_samples)
