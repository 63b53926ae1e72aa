"""Sequence packing (draftport.data.packing): several samples per row give the same TTT loss and
gradients as the same samples right-padded, on the reference (dense-mask) path and on the fused
path (per-segment flash attention + log-sum-exp merge); samples in one row never see each other;
train() with packing follows the padded run, alone and under DDP / FSDP (2 gloo processes).

Run as a script by torchrun (test_packing.py FEATS OUT PARALLEL IMPL PACKING): the distributed
worker of the last test."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from toys import LossLog, make_features, make_samples, toy_cfg, toy_drafter

from draftport.data.packing import pack, plan_rows
from draftport.data.shards import Batch, FeatureSet, collate
from draftport.model.drafter import Attention
from draftport.model.fast import unroll as fast_unroll
from draftport.model.fast.attention import Segments, ttt_attention
from draftport.model.fast.path import FastPath
from draftport.training.loop import TrainConfig, init_distributed, train
from draftport.training.ttt import combine, packed_args, ttt_terms

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # what the torchrun worker (this file) imports


def loss_and_grads(d, batch, head, steps, fused, chunk=5):
    """The reference loss's (fused False) or the fast path's, in chunks of `chunk` rows (None:
    its default sizes) -> (loss, stats, gradients)."""
    d.zero_grad(set_to_none=True)
    fast = (FastPath(target_chunk=chunk, loss_chunk=chunk) if chunk else FastPath()) if fused else None
    terms = ttt_terms(d, batch, head, steps, fast)
    loss, stats = combine(terms, 0.8)
    loss.backward()
    return float(loss.detach()), stats, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


def assert_same(a, b, rtol=1e-5):
    (la, sa, ga), (lb, sb, gb) = a, b
    assert abs(la - lb) <= rtol * abs(la), (la, lb)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert abs(sa[k] - sb[k]) <= rtol * max(1.0, abs(sa[k])), (k, sa[k], sb[k])
    assert ga.keys() == gb.keys()
    for k in ga:
        assert torch.allclose(ga[k], gb[k], rtol=1e-4, atol=1e-6 * float(ga[k].abs().max())), k


LENGTHS = (9, 5, 12, 3, 7, 2)


def test_pack_layout_positions_restart_and_segments_cover_every_row():
    cfg = toy_cfg()
    samples = make_samples(cfg, LENGTHS)
    b, starts = pack(samples, row_len=14)
    assert starts == [s["response_start"] for s in samples]
    assert b.tokens.shape == (3, 14) and b.n_samples == 6 and b.real_tokens == sum(LENGTHS)
    assert plan_rows(list(LENGTHS), 14) == [[2, 5], [0, 1], [3, 4]]  # first-fit decreasing
    cu = b.cu_seqlens
    assert cu[0] == 0 and cu[-1] == 3 * 14 and cu == sorted(cu)
    flat_doc, flat_pos, flat_valid = b.doc.flatten(), b.positions.flatten(), b.valid.flatten()
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        assert (flat_doc[s:e] == flat_doc[s]).all() and (s == 0 or flat_doc[s] != flat_doc[s - 1])
        assert torch.equal(flat_pos[s:e], torch.arange(e - s))  # positions restart
        assert flat_valid[s:e].all() or not flat_valid[s:e].any()  # a sample or a padding tail
    assert b.max_seqlen == max(e - s for s, e in zip(cu[:-1], cu[1:]))
    # the rows hold each sample's tokens, in order
    row1 = b.tokens[1]
    assert torch.equal(row1[:9], samples[0]["tokens"]) and torch.equal(row1[9:14], samples[1]["tokens"])
    one, _ = pack(samples, multiple=8)
    assert one.tokens.shape == (1, 40) and not one.valid[0, sum(LENGTHS) :].any()
    with pytest.raises(ValueError, match="does not fit"):
        pack(samples, row_len=10)


@pytest.mark.parametrize("train_head", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("row_len", [None, 14])
@pytest.mark.parametrize("chunk", [5, None])
def test_packed_loss_and_grads_equal_the_padded_batch(train_head, fused, row_len, chunk):
    """The reference path on the padded batch is the definition; packed rows (one row, or rows
    of 14) must give the same loss, stats and gradients on either path (fp64), the fused loss in
    chunks of 5 rows or in one chunk per row (its default sizes: the lm_head-trained gradient
    then kept as the kernel made it, no gather)."""
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=1).double()
    d.lm_head.weight.requires_grad_(train_head)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    samples = make_samples(cfg, LENGTHS)
    ref = loss_and_grads(d, collate(samples, torch.float64)[0], head, 4, fused=False)
    packed = pack(samples, row_len=row_len, dtype=torch.float64)[0]
    assert_same(ref, loss_and_grads(d, packed, head, 4, fused=fused, chunk=chunk))


def test_packing_without_document_masks_would_differ():
    """The control: the same rows with the sample boundaries dropped (a plain Batch of the packed
    tensors: attention, positions and shifts run across samples) give another loss. So the
    equality above is the document masks' doing, not a test that cannot fail."""
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=1).double()
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    samples = make_samples(cfg, LENGTHS)
    ref = loss_and_grads(d, collate(samples, torch.float64)[0], head, 4, fused=False)
    p = pack(samples, dtype=torch.float64)[0]
    plain = Batch(p.aux, p.final, p.tokens, p.loss_mask, p.valid)
    assert abs(loss_and_grads(d, plain, head, 4, fused=False)[0] - ref[0]) > 1e-3 * abs(ref[0])


def test_captured_argmax_packs_with_its_sample():
    cfg = toy_cfg()
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    d = toy_drafter(cfg, seed=4).double()
    samples = make_samples(cfg, LENGTHS, target_arg=head)
    ref = loss_and_grads(d, collate(samples, torch.float64)[0], head, 3, fused=False)
    rows = head[d.hot_ids]  # with the captured argmax the draft rows suffice
    assert_same(ref, loss_and_grads(d, pack(samples, row_len=14, dtype=torch.float64)[0], rows, 3, fused=True))


def test_a_sample_sees_nothing_of_its_row_neighbours():
    """Every step's output at a sample's rows is what the sample alone gives: changing the other
    samples of the row (their states and tokens) changes nothing there."""
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=2).double()
    samples = make_samples(cfg, (6, 8, 5))
    other = make_samples(cfg, (6, 8, 5), seed=9)
    mixed = [samples[0], other[1], samples[2]]
    for fused in (False, True):
        outs = []
        for s in (samples, mixed):
            b = pack(s, dtype=torch.float64)[0]
            with torch.no_grad():
                if fused:
                    outs.append(
                        fast_unroll.unroll(
                            d,
                            b.aux,
                            b.tokens,
                            4,
                            fast=FastPath(),
                            valid=b.valid,
                            return_normed=True,
                            **fast_unroll.packed_args(b),
                        )
                    )
                else:
                    outs.append(d.unroll(b.aux, b.tokens, 4, valid=b.valid, return_normed=True, **packed_args(b)))
        keep = torch.zeros(19, dtype=torch.bool)
        keep[:6] = keep[14:] = True  # samples 0 and 2
        for a, b in zip(*outs):
            assert torch.allclose(a[0, keep], b[0, keep], atol=1e-12)
            assert not torch.allclose(a[0, 6:14], b[0, 6:14])


@pytest.mark.parametrize("n_diag", [0, 2])
def test_segment_attention_matches_a_dense_document_mask(n_diag):
    g = torch.Generator().manual_seed(n_diag)
    B, h, T, d = 2, 3, 11, 8
    cu = [0, 4, 9, 11, 14, 22]  # row 0: 4 + 5 + 2; row 1: 3 + 8 (segments over the B*T rows)
    doc = torch.zeros(B * T, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        doc[s:e] = i
    doc = doc.view(B, T)

    def r():
        return torch.randn(B, h, T, d, dtype=torch.float64, generator=g).requires_grad_(True)

    q, ks, vs = r(), [r() for _ in range(n_diag + 1)], [r() for _ in range(n_diag + 1)]
    keep = torch.ones(T, T, dtype=torch.bool).tril()[None] & (doc[:, :, None] == doc[:, None, :])
    bias = torch.zeros(B, 1, T, T, dtype=torch.float64).masked_fill(~keep[:, None], float("-inf"))

    class Cfg:
        head_dim = d

    ref = Attention.attend_core(Cfg(), q, ks, vs, bias)
    fast = ttt_attention(q, ks, vs, 1 / math.sqrt(d), Segments(cu, 8))
    go = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    gr = torch.autograd.grad((ref * go).sum(), [q, *ks, *vs])
    gf = torch.autograd.grad((fast * go).sum(), [q, *ks, *vs])
    # the reference softmax runs in fp32: agreement to its rounding
    assert torch.allclose(fast, ref, atol=1e-6, rtol=1e-6)
    for a, b in zip(gf, gr):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_train_with_packing_follows_the_padded_run(tmp_path):
    fs, head = make_features(tmp_path)
    hist = {}
    for packing in (False, True):
        cfg = TrainConfig(
            steps=4,
            batch_size=4,
            lr=3e-3,
            warmup_steps=1,
            checkpoint_every=100,
            log_every=1,
            impl="fused",
            packing=packing,
        )
        hist[packing] = train(toy_drafter(seed=5), fs, head, tmp_path / str(packing), cfg, progress=False)["history"]
    assert len(hist[True]) == 4
    for a, b in zip(hist[False], hist[True]):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)
        assert a["n_0"] == b["n_0"]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_packing_under_two_gloo_processes_equals_one_padded_process(tmp_path, parallel):
    make_features(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(HELPERS), OMP_NUM_THREADS="1")
    res = {}
    for name, nproc, impl, packing in (("one", 1, "reference", "0"), ("two", 2, "fused", "1")):
        out = tmp_path / name
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(Path(__file__)),
            str(tmp_path / "feats"),
            str(out),
            parallel,
            impl,
            packing,
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        res[name] = json.loads((out / "result.json").read_text())
    assert res["two"]["world"] == 2 and len(res["one"]["losses"]) == 5
    for a, b in zip(res["one"]["losses"], res["two"]["losses"]):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (res["one"]["losses"], res["two"]["losses"])
    assert abs(res["one"]["weight_sum"] - res["two"]["weight_sum"]) < 1e-3


if __name__ == "__main__":  # the torchrun worker of the test above
    feats, out, parallel, impl, packing = sys.argv[1:6]
    rank, world = init_distributed()
    head = torch.randn(100, 64, generator=torch.Generator().manual_seed(7))
    d = toy_drafter(seed=3)
    log = LossLog()
    cfg = TrainConfig(
        steps=5,
        batch_size=4,
        lr=3e-3,
        warmup_steps=1,
        checkpoint_every=100,
        log_every=1,
        impl=impl,
        parallel=parallel,
        packing=packing == "1",
    )
    train(d, FeatureSet(feats), head, Path(out), cfg, logger=log, progress=False)
    if rank == 0:
        s = sum(float(v.double().sum()) for k, v in d.export_state().items() if v.is_floating_point())
        (Path(out) / "result.json").write_text(json.dumps({"losses": log.losses, "weight_sum": s, "world": world}))
