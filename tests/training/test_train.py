"""The training loop: learns, resumes bit-exactly, and runs under torchrun with 2 gloo ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from toys import make_features, toy_cfg, toy_drafter, weights

from draftport.data.shards import FeatureChain, FeatureSet, Sequence, check_disjoint, write_features
from draftport.errors import DraftportError
from draftport.evaluation.accept import held_out_monitor
from draftport.model.fast.path import FastPath
from draftport.training import loop
from draftport.training.loop import TrainConfig, batch_ids, lr_at, train

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # the torchrun worker and what it imports


def test_batch_ids_cover_epochs_deterministically():
    a = batch_ids(3, 10, 4, seed=1)
    assert a == batch_ids(3, 10, 4, seed=1) and len(a) == 4
    epoch0 = sum((batch_ids(s, 10, 5, 1) for s in range(2)), [])
    assert sorted(epoch0) == list(range(10))


def test_lr_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == 0.1 and lr_at(9, cfg) == 1.0
    assert abs(lr_at(100, cfg) - 0.1) < 1e-9 and lr_at(50, cfg) < lr_at(20, cfg)


def test_loss_goes_down(tmp_path):
    fs, head = make_features(tmp_path)
    d = toy_drafter()
    cfg = TrainConfig(steps=40, batch_size=4, lr=3e-3, warmup_steps=5, checkpoint_every=20, log_every=5)
    out = train(d, fs, head, tmp_path / "run", cfg, progress=False)
    h = out["history"]
    assert h[-1]["loss"] < 0.8 * h[0]["loss"]
    assert (tmp_path / "run" / "checkpoints").is_dir()


def test_resume_after_interrupt_is_bit_exact(tmp_path):
    fs, head = make_features(tmp_path)
    cfg = TrainConfig(steps=12, batch_size=4, lr=3e-3, warmup_steps=2, checkpoint_every=4, log_every=2)
    full = toy_drafter(seed=5)
    train(full, fs, head, tmp_path / "full", cfg, progress=False)

    part = toy_drafter(seed=5)
    train(part, fs, head, tmp_path / "part", cfg, progress=False, stop_after=6)  # killed at 6; ckpt at 4
    # a new process: trained weights come from the checkpoint; the frozen embedding, as always,
    # from the target
    fresh = toy_drafter(seed=99)
    fresh.set_embedding(full.embed_tokens.weight)
    res = train(fresh, fs, head, tmp_path / "part", cfg, progress=False)
    assert res["steps"] == 12
    a, b = weights(full), weights(fresh)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_ddp_two_gloo_ranks_equal_one_process(tmp_path):
    fs, head = make_features(tmp_path)
    script = HELPERS / "ddp_worker.py"
    env = dict(os.environ, PYTHONPATH=str(HELPERS), OMP_NUM_THREADS="1")
    for nproc in (1, 2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            str(tmp_path / "feats"),
            str(tmp_path / f"ddp{nproc}"),
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    one = json.loads((tmp_path / "ddp1" / "result.json").read_text())
    two = json.loads((tmp_path / "ddp2" / "result.json").read_text())
    assert len(one["losses"]) == len(two["losses"]) == 6
    for a, b in zip(one["losses"], two["losses"]):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a))
    assert abs(one["weight_sum"] - two["weight_sum"]) < 1e-3


def test_ddp_fused_path_two_gloo_ranks_equal_reference_one_process(tmp_path):
    """The fused loss applies lm_head outside DDP's forward: its gradient must still be reduced."""
    fs, head = make_features(tmp_path)
    script = HELPERS / "ddp_worker.py"
    env = dict(os.environ, PYTHONPATH=str(HELPERS), OMP_NUM_THREADS="1")
    runs = {}
    for impl, nproc in (("reference", 1), ("fused", 2)):
        out = tmp_path / f"{impl}{nproc}"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(script),
            str(tmp_path / "feats"),
            str(out),
            impl,
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[impl] = json.loads((out / "result.json").read_text())
    for a, b in zip(runs["reference"]["losses"], runs["fused"]["losses"]):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a))
    assert abs(runs["reference"]["weight_sum"] - runs["fused"]["weight_sum"]) < 1e-3


def test_checkpoint_of_other_config_is_set_aside_not_resumed(tmp_path):
    fs, head = make_features(tmp_path)
    cfg = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=2, log_every=2)
    train(toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, progress=False)
    edited = TrainConfig(steps=4, batch_size=4, lr=1e-3, warmup_steps=1, checkpoint_every=2, log_every=2)
    res = train(toy_drafter(seed=5), fs, head, tmp_path / "run", edited, progress=False)
    assert res["steps"] == 4 and len(res["history"]) == 2  # trained from step 0, not resumed
    assert list(tmp_path.glob("run/checkpoints.stale-*"))


def test_fast_params_describe_each_step_and_a_change_of_them_still_resumes(tmp_path, monkeypatch):
    """train.fast and train.impl are all a training's fast path is made of: every step gets the
    FastPath they describe (weight gradients summed in place in one process; compiled for impl
    compiled; none for impl reference). The CPU trains under any kernel name (the H200 benchmark
    runs the kernels), and a checkpoint made under one kernel is continued under another."""
    fs, head = make_features(tmp_path)
    seen = []
    step = loop.train_step
    monkeypatch.setattr(loop, "train_step", lambda *a, **kw: seen.append(kw["fast"]) or step(*a, **kw))
    base = dict(
        steps=4, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=2, log_every=2, impl="fused", packing=True
    )
    train(
        toy_drafter(seed=5),
        fs,
        head,
        tmp_path / "run",
        TrainConfig(**base, fast={"attention": "cudnn"}),
        progress=False,
        stop_after=2,
    )
    # 4 steps: under fast.tune_min_steps, so compiled without the tuning search
    assert seen[-1] == FastPath(attention="cudnn", compile_tuning=False, accumulate_wgrad=True)
    assert seen[-1].packed == "varlen"
    other = {"attention": "fa4", "packed_attention": "segments", "compile_tuning": False}
    res = train(toy_drafter(seed=5), fs, head, tmp_path / "run", TrainConfig(**base, fast=other), progress=False)
    assert res["resumed_from"] == 2 and res["steps"] == 4
    assert set(seen[2:]) == {FastPath(**other, accumulate_wgrad=True)}
    train(
        toy_drafter(seed=5),
        fs,
        head,
        tmp_path / "ref",
        TrainConfig(**dict(base, steps=1, impl="reference")),
        progress=False,
    )
    assert seen[-1] is None
    # the tuning search only for a training long enough to earn it back
    assert loop.fast_path(TrainConfig(steps=1000), "compiled", False) == FastPath(compile=True)
    assert loop.fast_path(TrainConfig(steps=999), "compiled", False) == FastPath(compile=True, compile_tuning=False)
    short = TrainConfig(steps=50, fast={"tune_min_steps": 50})
    assert loop.fast_path(short, "compiled", False).compile_tuning
    with pytest.raises(DraftportError, match=r"train\.fast\.attention: must be one of flash, cudnn, fa4"):
        TrainConfig(**base, fast={"attention": "math"})
    with pytest.raises(DraftportError, match=r"train\.attention: unknown key"):
        TrainConfig(**base, attention="cudnn")


# ---- held-out tau during training (train.eval_every, train.patience) ----------------------------
def _monitor(tmp: Path, head):
    held, _ = make_features(tmp / "held", n=8, seed=7)
    return held_out_monitor(held, head, k=2, batch_size=4)


def test_monitor_logs_tau_by_step_and_changes_no_update(tmp_path):
    """Held-out tau every eval_every steps joins the history, the logger and the curve; measuring
    it consumes no randomness and touches no weight: the trained drafter is bit-identical."""
    fs, head = make_features(tmp_path)
    base = dict(steps=12, batch_size=4, lr=3e-3, warmup_steps=2, checkpoint_every=12, log_every=4)
    plain = toy_drafter(seed=3)
    train(plain, fs, head, tmp_path / "plain", TrainConfig(**base), progress=False)

    logged = []

    class Rec:
        def log_metrics(self, m, step):
            if "accept_length" in m:
                logged.append((step, m["accept_length"]))

    watched = toy_drafter(seed=3)
    res = train(
        watched,
        fs,
        head,
        tmp_path / "watched",
        TrainConfig(**base, eval_every=5),
        progress=False,
        logger=Rec(),
        monitor=_monitor(tmp_path, head),
    )
    assert [c["step"] for c in res["curve"]] == [5, 10, 12]  # every 5 steps and the last one
    assert [s for s, _ in logged] == [5, 10, 12]
    assert all(1.0 <= c["accept_length"] <= 3.0 for c in res["curve"])  # 1 + at most k=2 drafts
    assert not res["stopped_early"]
    a, b = weights(plain), weights(watched)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_patience_stops_and_a_resume_stays_stopped(tmp_path):
    fs, head = make_features(tmp_path)
    cfg = TrainConfig(
        steps=40, batch_size=4, lr=3e-3, warmup_steps=2, checkpoint_every=40, log_every=10, eval_every=2, patience=2
    )
    flat = iter([1.5, 1.6, 1.6, 1.55] + [9.0] * 100)  # best 1.6 at step 4; steps 6, 8 no better -> stop at 8
    res = train(toy_drafter(seed=1), fs, head, tmp_path / "run", cfg, progress=False, monitor=lambda d: next(flat))
    assert res["stopped_early"] and res["steps"] == 8
    assert res["history"][-1]["early_stop"] == 1 and res["history"][-1]["step"] == 8
    again = train(
        toy_drafter(seed=1), fs, head, tmp_path / "run", cfg, progress=False, monitor=lambda d: 9.0
    )  # resumed from the stop's checkpoint: no more steps
    assert again["steps"] == 8 and again["stopped_early"] and again["resumed_from"] == 8


def test_patience_without_eval_every_and_eval_every_without_a_set_are_refused(tmp_path):
    fs, head = make_features(tmp_path)
    with pytest.raises(DraftportError, match="train.patience"):
        train(toy_drafter(), fs, head, tmp_path / "a", TrainConfig(steps=2, patience=3), progress=False)
    with pytest.raises(DraftportError, match="train.eval_every"):
        train(toy_drafter(), fs, head, tmp_path / "b", TrainConfig(steps=2, eval_every=1), progress=False)


def test_feature_chain_is_a_prefix_and_checks_continuity(tmp_path):
    cfg = toy_cfg()
    g = torch.Generator().manual_seed(0)

    def capture(name, offset, n):
        seqs = [Sequence(torch.randint(0, cfg.vocab_size, (8,), generator=g).tolist(), 2) for _ in range(n)]

        def featurize(batch):
            return torch.randn(len(batch), 8, 3 * cfg.hidden_size, generator=g), torch.randn(
                len(batch), 8, cfg.hidden_size, generator=g
            )

        write_features(
            tmp_path / name,
            seqs,
            featurize,
            shard_samples=4,
            dtype="float32",
            meta={"aux_layer_ids": [1, 2, 3], "samples_file": "p.jsonl", "offset": offset},
        )
        return FeatureSet(tmp_path / name)

    a, b = capture("a", 0, 6), capture("b", 6, 5)
    chain = FeatureChain([a, b], 8)
    assert len(chain) == 8 and chain.prompts == ("p.jsonl", 0, 8)
    assert torch.equal(chain.sample(7)["aux"], b.sample(1)["aux"])
    assert torch.equal(chain.sample(2)["tokens"], a.sample(2)["tokens"])
    with pytest.raises(DraftportError, match="12 samples asked"):
        FeatureChain([a, b], 12)
    with pytest.raises(DraftportError, match="does not continue"):
        FeatureChain([b, a])
    held = capture("held", 7, 3)
    with pytest.raises(DraftportError, match="overlaps the training"):
        check_disjoint(chain, held, "monitor")
    check_disjoint(FeatureChain([a, b], 7), held, "monitor")  # prompts 0-6 vs 7-9: disjoint
