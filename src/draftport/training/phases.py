"""A training phase's drafter: its initial weights (the source on the new map, a random init, or
an earlier phase's drafter), trained by draftport.training.loop on a feature set, saved flat."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import torch

from draftport.data.draftmap import cfg_d2t, read_vocab
from draftport.data.shards import FeatureChain, FeatureSet, chain_parts, check_disjoint, open_set
from draftport.data.storage import SPOOL_GB
from draftport.errors import DraftportError
from draftport.evaluation.accept import held_out_monitor
from draftport.files import atomic_write_text, sha256
from draftport.model.bind import check_features_fit, drafter_for_target, target_head
from draftport.model.config import DrafterConfig, read_config
from draftport.model.device import pick as pick_device
from draftport.model.formats import load_drafter_state, save_drafter
from draftport.model.vocab import check_maps, compare_maps, remap_lm_head
from draftport.training.loop import train

# where a training starts: "source" (the source drafter on the new map), "scratch" (random weights),
# or the folder of a drafter an earlier phase saved (Phase 2 continues Phase 1's), as params give it
InitChoice = Literal["source", "scratch"] | str


def feature_dirs(features_dir) -> list:
    """One feature folder or several that continue one another, as a list (a chain folder: its parts)."""
    dirs = [features_dir] if isinstance(features_dir, (str, Path)) else list(features_dir)
    return [part for d in dirs for part in chain_parts(d)]


def inputs_fingerprint(
    *,
    features_dir,
    vocab_path,
    init: InitChoice,
    source_dir=None,
    vocab_policy: str = "remap",
    arch=None,
    n_samples: int | None = None,
    monitor: dict | None = None,
) -> dict:
    """What a training run learns from, as digests: its checkpoints resume only a run on the same
    inputs (train's `inputs`). Features by their index (it holds every shard's sha256)."""

    def folder(f) -> str:
        f = Path(f)
        lock = f / "fetch.lock.json"
        if lock.is_file():  # a fetch recorded every file's sha256
            return hashlib.sha256(
                json.dumps(json.loads(lock.read_text())["files"], sort_keys=True).encode()
            ).hexdigest()
        files = sorted(p for p in f.iterdir() if p.name == "config.json" or p.suffix == ".safetensors")
        return hashlib.sha256("".join(f"{p.name}:{sha256(p)};" for p in files).encode()).hexdigest()

    feats = [sha256(Path(f) / "index.json") for f in feature_dirs(features_dir)]
    out = {
        "features": feats[0] if len(feats) == 1 and n_samples is None else {"chain": feats, "n": n_samples},
        "vocab": sha256(Path(vocab_path)),
        "init": init,
        "vocab_policy": vocab_policy,
    }
    if monitor is not None:
        out["monitor"] = {"features": sha256(Path(monitor["features"]) / "index.json"), "k": monitor["k"]}
    if init in ("source", "scratch") and source_dir is not None:
        out["source"] = folder(source_dir)
    elif init not in ("source", "scratch"):
        out["init_drafter"] = folder(init)
    if arch is not None:
        out["arch"] = json.loads(json.dumps(arch, default=str))
    return out


def train_phase(
    out_dir,
    *,
    features_dir,
    target_dir,
    vocab_path,
    init: InitChoice,
    train_cfg,
    source_dir=None,
    vocab_policy: str = "remap",
    arch: dict | None = None,
    logger=None,
    progress=True,
    ckpt_dir=None,
    n_samples: int | None = None,
    monitor: dict | None = None,
    verifier: str | None = None,
    spool: dict | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """Train a drafter for the new target and save it (flat format) to out_dir/drafter.

    init 'source': start from the source drafter; its lm_head is moved onto the new map by
    target id (vocab_policy 'remap', new rows from the target's lm_head) or the source map is
    kept ('keep'). The map is never rebuilt silently: it comes from vocab_path.
    init 'scratch': same architecture, random init, the new map.
    init '<folder>': continue a drafter saved by an earlier phase (its map is kept).
    The initial weights are train_cfg.l2sp_lambda's anchor w0 (refused for init scratch): built
    here the same way on every run, so a resumed training anchors to them again.
    ckpt_dir: where the periodic checkpoints live (default out_dir/checkpoints); a run on the
    same config and inputs (inputs_fingerprint) resumes from them.
    features_dir: a feature folder, or several that continue one another (draftport.data.shards.
    FeatureChain: Phase 1's capture, then Phase 2's); n_samples: train on their first n only.
    monitor: {"features": a held-out feature folder (its prompts disjoint from the training
    ones), "k", "batch_size"}: the held-out tau train_cfg.eval_every steps (train's `monitor`).
    verifier: the target the drafter is trained against, as its config.json names it (`verifier`;
    speculators' verifier.name_or_path): the params' targets.new (a hub id or a folder), default
    target_dir. Always this training's target, never the name an initial drafter carried (the
    source's names the old target).
    Folders of sequences without states (features.storage online / hybrid, data.write_sequences):
    the states are captured during training (draftport.training.spool.online_features) into the bounded
    spool spool["dir"] of spool["gb"] GB (default: beside the checkpoints), hybrid's first-epoch
    cache in spool["cache_dir"] (default: beside the spool); the target's code runs only when
    trust_remote_code.
    """
    _refuse_scratch_anchor(init, train_cfg)
    device = pick_device(train_cfg.device, "train.device")  # before any load: cuda without a GPU fails here
    out_dir = Path(out_dir)
    sets = [open_set(d) for d in feature_dirs(features_dir)]
    fs = sets[0] if len(sets) == 1 and n_samples is None else FeatureChain(sets, n_samples)
    head = target_head(target_dir).to(device)  # the monitor's held-out batches are placed beside it
    # where the initial weights come from: the initial drafter and the fingerprint both read it
    origin = dict(vocab_path=vocab_path, source_dir=source_dir, vocab_policy=vocab_policy, arch=arch)
    d, cfg, report = initial_drafter(
        init, fs, features_dir, target_dir=target_dir, head=head, seed=train_cfg.seed, **origin
    )
    cfg = DrafterConfig(**{**cfg.__dict__, "extra": {**cfg.extra, "verifier": str(verifier or target_dir)}})
    watch = _held_out_watch(monitor, cfg, fs, head)
    inputs = inputs_fingerprint(features_dir=features_dir, init=init, n_samples=n_samples, monitor=monitor, **origin)
    if fs.index.get("storage") in ("online", "hybrid"):
        fs = _online(fs, target_dir, out_dir, ckpt_dir, spool, trust_remote_code, progress)
    res = _train_to_end(d, fs, head, out_dir, train_cfg, logger, progress, ckpt_dir, inputs, watch)
    return _save_phase(out_dir, d, cfg, init, report, res, fs)


def _refuse_scratch_anchor(init: InitChoice, train_cfg) -> None:
    """The L2-SP anchor is the initial weights, which init scratch draws at random."""
    if init == "scratch" and train_cfg.l2sp_lambda:
        raise DraftportError(
            "train.l2sp_lambda",
            f"{train_cfg.l2sp_lambda}: the L2-SP anchor holds a training near "
            "the weights it starts from, and init scratch starts from random ones (set 0)",
        )


def _held_out_watch(monitor: dict | None, cfg: DrafterConfig, fs, head: torch.Tensor):
    """train's `monitor` from train_phase's: the held-out set checked against the drafter and
    the training features; None without one."""
    if monitor is None:
        return None
    held = FeatureSet(monitor["features"])
    check_features_fit(cfg, held, monitor["features"])
    check_disjoint(fs, held, str(monitor["features"]))
    return held_out_monitor(held, head, k=monitor["k"], batch_size=monitor.get("batch_size", 32))


def _train_to_end(d, fs, head, out_dir: Path, train_cfg, logger, progress, ckpt_dir, inputs: dict, watch) -> dict:
    """train() on the features, which are closed however it ends; -> its result."""
    try:
        res = train(
            d,
            fs,
            head,
            out_dir,
            train_cfg,
            logger=logger,
            progress=progress,
            ckpt_dir=ckpt_dir,
            inputs=inputs,
            monitor=watch,
        )
    finally:
        if hasattr(fs, "close"):
            fs.close()
    if hasattr(fs, "discard_cache"):  # trained to the end: hybrid's first-epoch cache has served
        fs.discard_cache()
    return res


def _save_phase(out_dir: Path, d, cfg: DrafterConfig, init: InitChoice, report: dict, res: dict, fs) -> dict:
    """The trained drafter saved flat to out_dir/drafter and its loss history beside it; -> the report."""
    d.to("cpu")  # saved from host memory, as every caller reads it
    save_drafter(out_dir / "drafter", cfg, d.export_state(), metadata={"draftport_phase_init": init})
    report.update(
        train_steps=res["steps"],
        train_seconds=res["seconds"],
        final=res["final"],
        resumed_from_step=res["resumed_from"],
        curve=res["curve"],
        stopped_early=res["stopped_early"],
        train_samples=len(fs),
        run=res["run"],
    )
    atomic_write_text(out_dir / "train_history.json", json.dumps(res["history"]) + "\n")
    return report


def initial_drafter(
    init: InitChoice,
    fs,
    features_dir,
    *,
    target_dir,
    vocab_path,
    source_dir,
    vocab_policy: str,
    arch,
    head: torch.Tensor,
    seed: int,
) -> tuple:
    """(drafter, its config, the report so far) a training starts from, bound to the target on the
    new map (train_phase's `init`); head: the target's lm_head, whose rows a remap gives new ids."""
    d2t_new, t2d_new = read_vocab(vocab_path, vocab_size=head.shape[0])
    report: dict = {"init": init}
    if init == "scratch":
        if source_dir is None and arch is None:
            raise DraftportError("phase", "a scratch drafter needs the source's architecture or `arch`")
        if source_dir is not None:
            src_cfg, _ = read_config(source_dir)
            cfg = DrafterConfig(**{**src_cfg.__dict__, "draft_vocab_size": int(d2t_new.shape[0])})
        else:
            cfg = arch
        check_features_fit(cfg, fs, features_dir)
        torch.manual_seed(seed)
        d = drafter_for_target(cfg, target_dir)
        d.set_vocab_maps(d2t_new, t2d_new)
        return d, cfg, report
    src = Path(source_dir if init == "source" else init)
    cfg, state = load_drafter_state(src)
    check_features_fit(cfg, fs, src)
    if init == "source":
        lm, d2t, stats = remap_lm_head(
            state["lm_head.weight"].float(),
            state["d2t"].numpy(),
            d2t_new,
            init_rows=head.cpu() if cfg.hidden_size == head.shape[1] else None,
            policy=vocab_policy,
        )
        state["lm_head.weight"] = lm
        t2d = t2d_new if vocab_policy == "remap" else state["t2d"].numpy()
        check_maps(d2t, t2d, cfg.vocab_size, d2t.shape[0], vocab_path)
        state["d2t"], state["t2d"] = torch.as_tensor(d2t), torch.as_tensor(t2d)
        cfg = DrafterConfig(**{**cfg.__dict__, "draft_vocab_size": int(d2t.shape[0])})
        report["vocab"] = {**stats, **compare_maps(cfg_d2t(source_dir), d2t_new)}
    return drafter_for_target(cfg, target_dir, state), cfg, report


def _online(fs, target_dir, out_dir: Path, ckpt_dir, spool: dict | None, trust_remote_code: bool, progress: bool):
    """Folders of sequences without states: the states captured during training into the bounded
    spool (draftport.training.spool.online_features)."""
    # lazy (registry): only online / hybrid storage runs training.spool; world's row does not list it
    from draftport.training.spool import online_features

    sp = spool or {}
    ck = Path(ckpt_dir) if ckpt_dir is not None else out_dir / "checkpoints"
    sdir = Path(sp.get("dir") or ck.with_name(f"{ck.name}.spool"))
    return online_features(
        fs,
        target_dir=target_dir,
        spool_dir=sdir,
        spool_gb=sp.get("gb") or SPOOL_GB,
        cache_dir=sp.get("cache_dir") or sdir.with_name(f"{sdir.name}-cache"),
        trust_remote_code=trust_remote_code,
        log=print if progress else (lambda _m: None),
    )
