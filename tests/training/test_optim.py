"""draftport.training.optim.AdamW: torch's fused AdamW arithmetic as one compiled kernel per parameter (the
GPU training path). Here on the CPU: the same updates as torch's fused AdamW (which also divides
gradients by a grad_scale), eagerly and compiled (inductor's C++ kernel on this machine, Triton's
on a GPU), the same checkpoint files, and the clipping norm (train_step's clipping through it:
tests/bench/test_bench_train.py)."""

from __future__ import annotations

import pytest
import torch
from toys import toy_batch, toy_cfg, toy_drafter

from draftport.model.fast.path import FastPath
from draftport.plan.params import TrainConfig
from draftport.training.loop import load_model_state, load_optimizer_state, save_checkpoint, train_step, trainable
from draftport.training.optim import AdamW


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(24, 40), (40,), (7, 3, 5)]
    return [(torch.randn(s, generator=g) * 0.1).to(dtype) for s in shapes]


def _run(kind, dtype, steps=6, compiled=False, scale=True):
    ps = [p.clone() for p in _params(dtype)]
    groups = [{"params": ps[:1] + ps[2:], "weight_decay": 0.05}, {"params": ps[1:2], "weight_decay": 0.0}]
    if kind == "torch":
        opt = torch.optim.AdamW(groups, lr=3e-2, betas=(0.9, 0.95), fused=True)
    else:
        opt = AdamW(groups, lr=3e-2, betas=(0.9, 0.95), compiled=compiled)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        if i == 3:  # a learning-rate change mid-run (the schedule)
            for grp in opt.param_groups:
                grp["lr"] = 1e-2
        opt.grad_scale = torch.tensor(2.5 + i) if scale else None
        opt.step()
    return ps, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_updates_equal_torch_fused_adamw(dtype):
    ref, ropt = _run("torch", dtype)
    ours, oopt = _run("draftport", dtype)
    # fp32: the same arithmetic up to the bias corrections (torch's in double); bf16: a last-bit
    # difference of the fp32 value can round to the neighbouring bf16
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    for a, b in zip(ref, ours):
        assert b.dtype == dtype
        assert torch.allclose(a.float(), b.float(), **tol)
    if dtype == torch.float32:
        for a, b in zip(ref, ours):
            sa, sb = ropt.state[a], oopt.state[b]
            assert float(sb["step"]) == float(sa["step"]) == 6.0
            assert torch.allclose(sa["exp_avg"], sb["exp_avg"], rtol=1e-5, atol=1e-8)
            assert torch.allclose(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-10)
    # and the grad scale matters (not silently ignored)
    unscaled, _ = _run("draftport", dtype, scale=False)
    assert not all(torch.allclose(a.float(), b.float(), **tol) for a, b in zip(ours, unscaled))


def test_gradients_are_left_as_they_were():
    """torch's fused AdamW stores the unscaled gradient back; this one only reads it."""
    ps = _params(torch.float32)
    for p in ps:
        p.grad = torch.ones_like(p) * 3.0
    opt = AdamW(ps, lr=1e-2, compiled=False)
    opt.grad_scale = torch.tensor(2.0)
    opt.step()
    assert all(torch.equal(p.grad, torch.ones_like(p) * 3.0) for p in ps)


@pytest.mark.slow
def test_compiled_equals_eager():
    """The compiled kernel (what runs on CUDA) computes what the eager function does."""
    eager, _ = _run("draftport", torch.float32)
    comp, _ = _run("draftport", torch.float32, compiled=True)
    for a, b in zip(eager, comp):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)  # fused multiply-adds round differently
    ref, _ = _run("torch", torch.bfloat16)
    comp16, _ = _run("draftport", torch.bfloat16, compiled=True)
    for a, b in zip(ref, comp16):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-4)


def test_bad_hyperparameters_refused():
    with pytest.raises(ValueError, match="betas"):
        AdamW(_params(torch.float32), lr=1e-3, betas=(0.9, 1.0))


def test_checkpoint_round_trip_and_resume_under_either_optimizer(tmp_path):
    """save_checkpoint writes draftport's AdamW state as torch's (the same files); a resume into
    either optimizer takes the same next step as the run that was not interrupted."""
    cfg = toy_cfg()
    batch = toy_batch(cfg)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    tcfg = TrainConfig(ttt_steps=3, grad_clip=0.05, lr=1e-2)

    def steps(d, opt, n):
        params = list(trainable(d).values())
        for _ in range(n):
            train_step(d, batch, head, opt, params, tcfg, fast=FastPath())

    d = toy_drafter(cfg, seed=4)
    opt = AdamW(list(trainable(d).values()), lr=1e-2, compiled=False)
    steps(d, opt, 2)
    ck = save_checkpoint(tmp_path / "ck", 2, d, opt, [], tcfg)
    steps(d, opt, 1)  # the uninterrupted run's third step
    want = {n: p.detach().clone() for n, p in trainable(d).items()}
    for make in (lambda ps: AdamW(ps, lr=1e-2, compiled=False), lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)):
        d2 = toy_drafter(cfg, seed=4)  # its init (and the frozen embedding), then step 2's state
        load_model_state(ck, d2)
        opt2 = make(list(trainable(d2).values()))
        load_optimizer_state(ck, d2, opt2)
        steps(d2, opt2, 1)
        for n, p in trainable(d2).items():
            assert torch.allclose(p.detach(), want[n], rtol=1e-5, atol=1e-6), n


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_grad_norm_is_clip_grad_norms(compiled):
    ps = _params(torch.float32)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    want = torch.nn.utils.clip_grad_norm_(ps, 1e9)
    got = AdamW(ps, lr=1e-3, compiled=compiled).grad_norm(grads)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(float(want), rel=1e-6)
