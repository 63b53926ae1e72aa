"""The steps that make the plan's inputs: the embedded world, the fetched source drafter, the new
target's data (its answers and hidden states) and its draft map."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from draftport.errors import DraftportError
from draftport.model.config import read_config, target_text_config
from draftport.pipeline.runner import StepContext, write_json
from draftport.plan.params import TrainConfig
from draftport.plan.registry import is_hub_id


def world(s: StepContext) -> dict:
    """The embedded K2 -> K2.5 analog (corpus, tokenizer, target_old, target_new) and the source
    drafter trained on target_old, published as a hub-cache entry in artifacts/world/hub."""
    # lazy (registry): only the world step runs draftport.world
    from draftport.world import build_source_drafter, build_world_base, world_device

    w, f = s.p["world"], s.p["features"]
    manifest = build_world_base(s.dir, w, progress=True)  # on world.threads threads
    torch.set_num_threads(1)  # the drafter is small: one thread, no OpenMP spinning on busy cores
    sd = w["source_drafter"]
    src = build_source_drafter(
        s.dir,
        n_samples=sd["n_samples"],
        max_new_tokens=sd["max_new_tokens"],
        draft_vocab_ratio=sd["draft_vocab_ratio"],
        aux_layer_ids=f["aux_layer_ids"],
        convention=f["aux_convention"],
        arch=sd["arch"],
        train_cfg=TrainConfig(**sd["train"]),
        repo_id=s.p["source"]["repo_id"],
        batch_size=sd["batch_size"],
        answers=sd["answers"],
        monitor_samples=sd["monitor_samples"],
        device=world_device(w),
    )
    src["train"].pop("train_seconds", None)  # outputs stay byte-identical between identical runs
    write_json(s.path("source_drafter.json"), src)
    m = manifest["metrics"]
    return {
        "targets": {k: m[k] for k in sorted(m) if not k.startswith("assistant_tokens")},
        "source": {
            "train_set_accept_length": src["train_set_accept_length"],
            "n_samples": src["n_samples"],
            **(
                {
                    "held_out_accept_length": src["monitor"][-1]["accept_length"],
                    "best_held_out_accept_length": max(c["accept_length"] for c in src["monitor"]),
                }
                if src["monitor"]
                else {}
            ),
            "draft_vocab_size": src["draft_vocab_size"],
            "vocab_coverage": src["vocab"]["coverage"],
        },
        "world_mb": round(manifest["bytes"]["total"] / 1e6, 2),
    }


def fetch(s: StepContext) -> dict:
    """The source drafter at its pinned revision, through the hub cache (offline for the embedded
    world, whose hub is artifacts/world/hub), into source/; a target given as a hub id (the kimi
    profile) into target_new/ (target_old/ likewise); the reference drafter, when the profile
    names one, into reference/."""
    # lazy (registry): only the fetch step runs data.fetch
    from draftport.data import fetch as fetching

    src, t = s.p["source"], s.p["targets"]
    if src["offline"]:
        os.environ["HF_HUB_OFFLINE"] = "1"
    pickle = src["allow_pickle"]  # off by default: .bin/.pt weights are refused
    lock = fetching.fetch(
        src["repo_id"],
        s.path("source"),
        revision=src["revision"],
        cache_dir=src["cache_dir"],
        offline=src["offline"],
        lock_file=src["lock_file"],
        allow_pickle=pickle,
    )
    out = {"source": {"files": len(lock["files"])}}
    ref = s.p["reference"]
    if ref:  # the upper bound Phase 0 evaluates next to the source, fetched the same way
        rl = fetching.fetch(
            ref["repo_id"],
            s.path("reference"),
            revision=ref["revision"],
            cache_dir=src["cache_dir"],
            offline=src["offline"],
            allow_pickle=pickle,
        )
        lock["reference"] = {"repo_id": ref["repo_id"], "requested": ref["revision"], "commit": rl["commit"]}
        out["reference"] = {"files": len(rl["files"])}
    for which in ("new", "old"):  # a target given as a hub id (the old one: the source's own reference)
        if t[which] and is_hub_id(t[which]):
            tl = fetching.fetch(
                t[which],
                s.path(f"target_{which}"),
                revision=None,
                patterns=fetching.TARGET_PATTERNS,
                offline=src["offline"],
                allow_pickle=pickle,
                trust_remote_code=t[which] in t["trust_remote_code"],  # its *.py only when named
            )
            lock[f"target_{which}"] = {"source": t[which], "commit": tl["commit"]}
    write_json(
        s.path("revision.json"),
        {
            "repo_id": src["repo_id"],
            "requested": src["revision"],
            "commit": lock["commit"],
            **{k: lock[k] for k in ("target_new", "target_old", "reference") if k in lock},
        },
    )
    cfg, _ = read_config(s.path("source"))
    out["source"].update(
        draft_vocab_size=cfg.draft_vocab_size,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        bytes=sum(p.stat().st_size for p in s.path("source").iterdir()),
    )
    print(f"fetch: {src['repo_id']}@{src['revision']} -> commit {lock['commit']}")
    return out


def _check_source_fits(source: Path, features: dict) -> None:
    """The features must be captured at the aux layers the source drafter reads: fail before compute."""
    cfg, _ = read_config(source)
    if cfg.aux_layer_ids is not None and list(cfg.aux_layer_ids) != list(features["aux_layer_ids"]):
        raise DraftportError(
            "features.aux_layer_ids",
            f"{features['aux_layer_ids']} but the source drafter "
            f"reads {list(cfg.aux_layer_ids)}: the features would not fit it",
        )
    if cfg.aux_convention and cfg.aux_convention != features["aux_convention"]:
        raise DraftportError(
            "features.aux_convention",
            f"{features['aux_convention']} but the source drafter was trained under {cfg.aux_convention}",
        )


def _features(
    s: StepContext,
    out_dir,
    target,
    prompts,
    *,
    n: int,
    offset: int = 0,
    training: bool = False,
    regenerate: bool = True,
) -> dict:
    """training: a training set (features.storage applies: online / hybrid store the answers
    only); held-out and evaluation sets are always stored with their states. regenerate false:
    the prompts file's own answers, teacher-forced (one prefill per sample)."""
    # lazy (registry): fetch and vocab_new run this module without the capture
    from draftport.data.capture import trusted
    from draftport.data.features import build_features
    from draftport.model.device import out_of_memory

    f = s.p["features"]
    storage = f["storage"] if training else "disk"
    with out_of_memory(f"capture {Path(out_dir).name}", "features.batch_size"):
        idx = build_features(
            target,
            prompts,
            out_dir,
            n_samples=n,
            offset=offset,
            trust_remote_code=trusted(target, s.p["targets"]["trust_remote_code"]),
            aux_layer_ids=f["aux_layer_ids"],
            convention=f["aux_convention"],
            regenerate_responses=regenerate,
            max_new_tokens=f["max_new_tokens"],
            batch_size=f["batch_size"],
            dtype=f["dtype"],
            device=f["device"],
            engine=f["engine"],
            tensor_parallel_size=f["tensor_parallel_size"],
            regenerate_via=f["regenerate"],
            base_url=f["base_url"],
            served_model=f["served_model"],
            storage=storage,
            compile=f["compile"],
        )
    out = {
        "samples": idx["samples"],
        "tokens": idx["tokens"],
        "mb": round(idx["tokens"] * idx["bytes_per_token"] / 1e6, 2),
    }
    s.timing[Path(out_dir).name] = {"samples": idx["samples"], **idx["seconds"]}
    if storage != "disk":  # mb: what the states would take on disk; stored: the answers alone
        out.update(storage=storage, stored_mb=round(sum(p.stat().st_size for p in Path(out_dir).iterdir()) / 1e6, 3))
    return out


def features_new(s: StepContext) -> dict:
    """The new target's own greedy answers to Phase 1's training prompts, and its hidden states
    at the source drafter's aux layers (train/; features.storage online / hybrid: the answers
    only, the training steps capture the states)."""
    _check_source_fits(s.input("source"), s.p["features"])
    return {
        "train": _features(
            s,
            s.path("train"),
            s.input("target"),
            s.p["targets"]["prompts_train"],
            n=s.p["phase1"]["n_samples"],
            training=True,
        )
    }


def features_monitor(s: StepContext) -> dict:
    """The held-out set of tau during training (train.eval_every): the last monitor.n_samples
    prompts of the training prompt file, answered by the new target; no training prefix reaches
    them (each training step checks its prompts are disjoint from these)."""
    # lazy (registry): fetch and vocab_new run this module without the capture
    from draftport.data.features import read_samples

    prompts = s.p["targets"]["prompts_train"]
    n, total = s.p["monitor"]["n_samples"], len(read_samples(prompts))
    if n >= total:
        raise DraftportError("monitor.n_samples", f"{n} but {prompts} holds {total} prompts: none left to train on")
    _check_source_fits(s.input("source"), s.p["features"])
    return {
        "held_out": _features(s, s.path("held_out"), s.input("target"), prompts, n=n, offset=total - n),
        "offset": total - n,
    }


def features_eval(s: StepContext) -> dict:
    """Held-out evaluation sets, answers regenerated by each target: the new target's (every
    phase is measured on it) and the old target's (the source drafter's home). Named eval sets
    (targets.eval_sets) are captured one after the other, sets.json beside the features naming
    each one's range and traffic share."""
    # lazy (registry): only this step reads the eval sets' files
    from draftport.data.evalsets import read_eval_sets
    from draftport.plan.params import resolved_eval_sets

    t, f = s.p["targets"], s.p["features"]
    _check_source_fits(s.input("source"), f)
    which = {"new": "target", **({"old": "target_old"} if "target_old" in s.inputs else {})}
    sets = {side: resolved_eval_sets(s.p, side) for side in which}
    sets = {side: v for side, v in sets.items() if all(x["prompts"] for x in v)}
    # named sets are the same for both targets: every file checked (and read) once, before any
    # compute, so a bad one leaves nothing behind
    named = read_eval_sets(sets["new"], t["prompts_train"]) if t.get("eval_sets") else None
    out = {}
    for side, key in which.items():
        if side not in sets:
            continue
        if named is None:  # one set, today's: the prompts file itself
            out[f"eval_{side}"] = _features(
                s, s.path(f"eval_{side}"), s.input(key), sets[side][0]["prompts"], n=f["eval_samples"]
            )
        else:
            out[f"eval_{side}"] = _set_features(s, side, s.input(key), named)
    return out


def _set_features(s: StepContext, side: str, target, rows: list) -> dict:
    """Named eval sets captured as one folder, in order: their prompts written to one file, their
    ranges and shares to sets.json in the folder (read by every evaluation)."""
    # lazy (registry): fetch runs this module without data.shards
    from draftport.data.shards import SETS_FILE
    from draftport.files import atomic_write_text

    prompts, sets = s.path(f"prompts_eval_{side}.jsonl"), []
    lines = []
    for x, taken in rows:
        sets.append({"name": x["name"], "share": float(x["share"]), "start": len(lines), "count": len(taken)})
        lines.extend(json.dumps({"user": r["user"]}, ensure_ascii=False) for r in taken)
    atomic_write_text(prompts, "\n".join(lines) + "\n")
    res = _features(s, s.path(f"eval_{side}"), target, prompts, n=len(lines))
    folder = s.path(f"eval_{side}")
    # the prompts' file as it will be named once the step's folder is in place (not the build's temp name)
    index = json.loads((folder / "index.json").read_text())
    index["samples_file"] = str(s.dir.parent / s.name / prompts.name)
    atomic_write_text(folder / "index.json", json.dumps(index, indent=2) + "\n")
    atomic_write_text(folder / SETS_FILE, json.dumps({"sets": sets}, indent=2) + "\n")
    return {**res, "sets": {x["name"]: x["count"] for x in sets}}


def features_phase2(s: StepContext) -> dict:
    """Phase 2's scaled data: the next prompts after Phase 1's (no overlap), answered by the new
    target, up to phase2.n_samples in all."""
    _check_source_fits(s.input("source"), s.p["features"])
    n1, n2 = s.p["phase1"]["n_samples"], s.p["phase2"]["n_samples"]
    return {
        "train": _features(
            s, s.path("train"), s.input("target"), s.p["targets"]["prompts_train"], n=n2 - n1, offset=n1, training=True
        ),
        "offset": n1,
    }


def features_dataset(s: StepContext) -> dict:
    """The regenerate-or-not arm's data: the first prompts of Phase 1's + Phase 2's (the same
    prompts the regenerated points read), with the answers the prompts file gives them,
    teacher-forced through the new target: a prefill per sample, no decoding."""
    _check_source_fits(s.input("source"), s.p["features"])
    return {
        "train": _features(
            s,
            s.path("train"),
            s.input("target"),
            s.p["targets"]["prompts_train"],
            n=max(s.p["curves"]["arms_n_samples"]),
            training=True,
            regenerate=False,
        )
    }


def vocab_new(s: StepContext) -> dict:
    """The new target's draft vocabulary (d2t/t2d from its own answers to Phase 1's prompts), and
    how it overlaps the source drafter's map."""
    # lazy (registry): only vocab_new runs the draft map
    from draftport.data.draftmap import build_vocab, cfg_d2t, read_vocab
    from draftport.model.vocab import compare_maps

    vocab = target_text_config(s.input("target"))["vocab_size"]
    stats = build_vocab(
        s.input("features"),
        s.path("vocab.safetensors"),
        draft_vocab_size=s.p["vocab_new"]["draft_vocab_size"],
        vocab_size=vocab,
    )
    new_d2t, _ = read_vocab(s.path("vocab.safetensors"))
    cmp = compare_maps(cfg_d2t(s.input("source")), new_d2t)
    return {
        **stats,
        "vs_source": {
            k: cmp[k] for k in ("overlap", "jaccard", "src_only", "dst_only", "positions_differ", "overlap_frac_of_src")
        },
    }
