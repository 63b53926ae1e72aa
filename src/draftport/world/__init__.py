"""The embedded analog world: a small Kimi-K2 -> Kimi-K2.5 pair, built from a seed, no download.

Why it exists: the port has to be exercised end to end on a laptop with no GPU and no hub. So the
pipeline builds its own pair of targets with real maths at small scale:

    synthetic language ─► corpus/old.jsonl ─┐
                       └► corpus/new.jsonl ─┼► tokenizer/ (BPE over old ∪ new)
                                            ├► target_old/  "K2":   a decoder trained on old
                                            └► target_new/  "K2.5": target_old continued on new

The targets are transformers' own LlamaForCausalLM (the embedded world), DeepseekV3ForCausalLM
(Kimi-K2's architecture: MLA attention, MoE layers) or Qwen3ForCausalLM: params world.model.arch.

The modules: `language` (the made-up language and the two corpora), `tokenizer` (byte-level
BPE and the chat template), `targets` (training and measuring the two targets), `source` (the
source drafter trained for target_old, published in a local hub cache). Here: `build_world_base`
(corpus, tokenizer and both targets) from the params' `world` group, whose defaults
(draftport.plan.params.WorldParams) are the embedded world.

Everything is deterministic from (seed, language_seed): per-sample RNGs are seeded by strings
(`random.Random(str)` hashes with sha512, not with the salted `hash()`), training uses a seeded
torch.Generator and deterministic algorithms on a fixed number of threads.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

from draftport.plan.params import WorldParams
from draftport.world.language import generate_corpus, topic_distribution, write_jsonl
from draftport.world.source import build_source_drafter
from draftport.world.targets import measure_targets, train_target
from draftport.world.tokenizer import load_world_tokenizer, train_tokenizer

__all__ = ["PIPELINE_KEYS", "base_params", "build_source_drafter", "build_world_base", "world_device"]

# keys of the params' world group that are the pipeline's, not the base world's
PIPELINE_KEYS = ("build", "source_drafter")


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def world_device(world: dict) -> str:
    """ "cuda" or "cpu": where a world group's targets train (world.device, draftport.model.device's rule)."""
    from draftport.model.device import pick

    return pick(world.get("device", "auto"), "world.device").type


def base_params(world: dict | None = None) -> dict:
    """The keys of a params `world` group that build_world_base takes (all but the pipeline's
    `build` and `source_drafter`), copied; None: the embedded world (WorldParams' defaults)."""
    if world is None:
        world = WorldParams().model_dump()
    return {k: copy.deepcopy(v) for k, v in world.items() if k not in PIPELINE_KEYS}


def _write_corpora(out: Path, p: dict) -> tuple[list, list, dict, dict]:
    """The old and new corpora, their held-out continuations and the long-prompt held-out set,
    written under out/corpus: (old, new, {"old", "new"} held-out samples, the five files by name)."""
    seed, lseed = int(p["seed"]), int(p["language_seed"])
    old = generate_corpus("old", p["n_old"], seed, language_seed=lseed)
    new = generate_corpus("new", p["n_new"], seed, language_seed=lseed)
    heldout = {
        "old": generate_corpus("old", p["n_heldout"], seed, start=p["n_old"], language_seed=lseed),
        "new": generate_corpus("new", p["n_heldout"], seed, start=p["n_new"], language_seed=lseed),
    }
    corpus = {
        "old": out / "corpus/old.jsonl",
        "new": out / "corpus/new.jsonl",
        "heldout_old": out / "corpus/heldout_old.jsonl",
        "heldout_new": out / "corpus/heldout_new.jsonl",
        "heldout_long": out / "corpus/heldout_long.jsonl",
    }
    write_jsonl(corpus["old"], old)
    write_jsonl(corpus["new"], new)
    write_jsonl(corpus["heldout_old"], heldout["old"])
    write_jsonl(corpus["heldout_new"], heldout["new"])
    # new-distribution long prompts, a stream of their own (start = n_new: a later training set of
    # long prompts would take 0..n_new); not measured on the targets, whose metrics stay as they were
    long = generate_corpus("new", p["n_heldout"], seed, start=p["n_new"], language_seed=lseed, prompts="long")
    write_jsonl(corpus["heldout_long"], long)
    return old, new, heldout, corpus


def _train_targets(
    out: Path, tok_dir: Path, old: list, new: list, p: dict, *, device: str, progress: bool, timings: dict
) -> tuple[dict, dict]:
    """target_old trained on the old corpus, then target_new continued from it on the new one;
    their summaries (each one's seconds added to timings)."""
    seed, threads = int(p["seed"]), p.get("threads")
    t = time.time()
    meta_old = train_target(
        out / "target_old",
        tok_dir,
        old,
        config=p["model"],
        seed=seed,
        name="target_old",
        trained_on="corpus/old.jsonl",
        threads=threads,
        progress=progress,
        device=device,
        vocab_size=p["vocab_size"],
        **p["target_old"],
    )
    timings["target_old"] = time.time() - t
    t = time.time()
    meta_new = train_target(
        out / "target_new",
        tok_dir,
        new,
        init_from=out / "target_old",
        seed=seed + 1,
        name="target_new",
        trained_on="corpus/new.jsonl",
        threads=threads,
        progress=progress,
        device=device,
        **p["target_new"],
    )
    timings["target_new"] = time.time() - t
    return meta_old, meta_new


def _record_world(out: Path, manifest: dict, total_seconds: float, progress: bool) -> None:
    """Write world_base.json (without the times) and print the one-line summary."""
    # the file without the times: identical runs write identical bytes
    timeless = {k: v for k, v in manifest.items() if k != "seconds"}
    timeless["targets"] = {t: {k: v for k, v in m.items() if k != "seconds"} for t, m in manifest["targets"].items()}
    (out / "world_base.json").write_text(json.dumps(timeless, indent=2) + "\n")
    if progress:
        m = manifest["metrics"]
        print(
            f"world base: {total_seconds:.0f} s | {manifest['bytes']['total'] / 1e6:.1f} MB | "
            f"top1 A/old {m['top1_A_old']:.3f} B/new {m['top1_B_new']:.3f} | "
            f"agree A-B new {m['agree_AB_new']:.3f} old {m['agree_AB_old']:.3f}"
        )


def build_world_base(out_dir: str | Path, params: dict | None = None, progress: bool = True) -> dict:
    """Corpus, tokenizer, target_old ("K2") and target_new ("K2.5") under out_dir.

    params: a params `world` group (its `build` and `source_drafter` are not the base's and are
    left out); None: the embedded world. Layout: tokenizer/, corpus/{old,new,heldout_old,
    heldout_new,heldout_long}.jsonl, target_old/, target_new/, world_base.json (the manifest
    returned). Held-out samples continue the training streams (start = n_train), so they are never
    in the training set by construction; heldout_long (long prompts, the new distribution) is a
    stream of its own.
    """
    out = Path(out_dir)
    p = base_params(params)
    timings: dict[str, float] = {}
    t_all = t = time.time()
    cpu_all = time.process_time()  # CPU seconds: a fairer figure than wall time on a shared box
    old, new, heldout, corpus = _write_corpora(out, p)
    timings["corpus"] = time.time() - t

    t = time.time()
    tok_dir = train_tokenizer(
        out / "tokenizer", old + new, vocab_size=p["vocab_size"], model_max_length=p["model"]["max_position_embeddings"]
    )
    timings["tokenizer"] = time.time() - t

    threads = p.get("threads")
    device = world_device(p)
    meta_old, meta_new = _train_targets(out, tok_dir, old, new, p, device=device, progress=progress, timings=timings)

    t = time.time()
    n_m = p.get("measure_samples", p["n_heldout"])
    metrics = measure_targets(
        out / "target_old", out / "target_new", {k: v[:n_m] for k, v in heldout.items()}, threads=threads, device=device
    )
    timings["measure"] = time.time() - t
    timings["total"] = time.time() - t_all
    timings["cpu_total"] = time.process_time() - cpu_all

    paths = {"tokenizer": tok_dir, "target_old": out / "target_old", "target_new": out / "target_new", **corpus}
    manifest = {
        "paths": {k: str(v.relative_to(out)) for k, v in paths.items()},
        "bytes": {k: (_dir_size(v) if v.is_dir() else v.stat().st_size) for k, v in paths.items()},
        "samples": {
            "old": len(old),
            "new": len(new),
            "heldout_old": len(heldout["old"]),
            "heldout_new": len(heldout["new"]),
            "heldout_long": p["n_heldout"],
        },
        "topics": {"old": topic_distribution(old), "new": topic_distribution(new)},
        "vocab_size": load_world_tokenizer(tok_dir).get_vocab_size(),
        "targets": {"target_old": meta_old, "target_new": meta_new},
        "metrics": metrics,
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "params": p,
    }
    manifest["bytes"]["total"] = _dir_size(out)
    _record_world(out, manifest, timings["total"], progress)
    return manifest
