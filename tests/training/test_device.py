"""The device rule (draftport.model.device) as the CPU can check it: auto is the CPU here, cuda is
refused in one line naming its key, a CUDA out-of-memory error names the knob that lowers the
memory, and what a training or an evaluation ran on (device, process count, real tokens per
second) comes back with it. The GPU side runs on the device machine (docs/performance.md)."""

from __future__ import annotations

import pytest
import torch
from toys import make_features, toy_drafter

from draftport.errors import DraftportError
from draftport.evaluation.accept import evaluate_drafter
from draftport.model import device
from draftport.model.flops import sample_flops, shape_of
from draftport.plan.params import TrainConfig
from draftport.training.loop import OOM_KNOB, init_distributed, train

requires_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU side of the rule")


@requires_no_gpu
def test_auto_and_cpu_pick_the_cpu_and_cuda_is_refused_by_its_key():
    assert device.pick("auto", "train.device") == torch.device("cpu")
    assert device.pick("cpu", "eval.device") == torch.device("cpu")
    with pytest.raises(
        DraftportError,
        match=r"^phase1\.train\.device: cuda asked for, but torch sees no CUDA "
        r"device on this machine .*use auto or cpu$",
    ):
        device.pick("cuda", "phase1.train.device")
    with pytest.raises(DraftportError, match=r"^eval\.device: 'gpu' is not one of auto, cuda, cpu$"):
        device.pick("gpu", "eval.device")


def test_params_take_the_three_choices_and_nothing_else():
    assert TrainConfig().device == "auto"
    assert TrainConfig(device="cpu").device == "cpu"
    with pytest.raises(DraftportError, match=r"train\.device"):
        TrainConfig(device="gpu")


def test_describe_and_the_mfu_peak():
    assert device.describe(torch.device("cpu"), 2) == {"device": "cpu", "gpu": None, "processes": 2}
    assert device.peak_tflops("NVIDIA H100 80GB HBM3") == device.peak_tflops("NVIDIA H200") == 790.0
    assert device.peak_tflops("NVIDIA A10G") is None and device.peak_tflops(None) is None


def test_out_of_memory_names_the_knob_and_other_errors_pass():
    with pytest.raises(DraftportError) as e:
        with device.out_of_memory("train step 3", OOM_KNOB):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total)")
    assert str(e.value).startswith("train step 3: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "lower train.batch_size" in str(e.value) and "the rerun resumes" in str(e.value)
    with pytest.raises(ValueError):
        with device.out_of_memory("evaluation", "eval.batch_size"):
            raise ValueError("not a memory error")


def test_oom_in_a_training_step_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """A step that runs out of GPU memory: one line naming train.batch_size, the checkpoint of the
    step before kept, and the rerun resumes from it."""
    from draftport.training import loop

    fs, head = make_features(tmp_path)
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=2, log_every=2)
    real, calls = loop.train_step, []

    def step(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        return real(*a, **kw)

    monkeypatch.setattr(loop, "train_step", step)
    with pytest.raises(DraftportError, match=r"^train step 3: out of GPU memory .*lower train\.batch_size"):
        train(toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, progress=False)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_0000002"]
    res = train(toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, progress=False)
    assert res["resumed_from"] == 2 and res["steps"] == 6


@requires_no_gpu
def test_training_reports_where_it_ran_and_its_real_token_rate(tmp_path):
    fs, head = make_features(tmp_path)
    d = toy_drafter(seed=5)
    cfg = TrainConfig(steps=5, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=5, log_every=1)
    run = train(d, fs, head, tmp_path / "run", cfg, progress=False)["run"]
    from draftport.training.loop import batch_ids

    lengths = [int(fs.sample(i)["tokens"].shape[0]) for s in range(5) for i in batch_ids(s, len(fs), 4, cfg.seed)]
    assert run["device"] == "cpu" and run["gpu"] is None and run["processes"] == 1 and run["steps"] == 5
    assert run["tokens"] == sum(lengths)  # real tokens, no padding counted
    assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["step_seconds"], rel=0.01)  # seconds rounded
    assert run["mfu"] is None and run["steady_mfu"] is None  # no GPU peak to count against
    assert run["steady_tokens_per_s"] > 0  # past the warm-up (step 1 of 5): what the bench compares with
    assert next(d.parameters()).device.type == "cpu"
    # the FLOPs behind MFU: the benchmark's count, per sample at its own length
    shp = shape_of(d.cfg)
    assert sample_flops(shp, [10, 20], 3, True) == sample_flops(shp, [10], 3, True) + sample_flops(shp, [20], 3, True)


@requires_no_gpu
def test_evaluation_reports_where_it_ran(tmp_path):
    from draftport.model.formats import save_drafter, save_safetensors

    fs, head = make_features(tmp_path)
    d = toy_drafter(seed=5)
    save_drafter(tmp_path / "drafter", d.cfg, d.export_state())
    target = tmp_path / "target"
    target.mkdir()
    save_safetensors(
        {"model.embed_tokens.weight": d.embed_tokens.weight.detach().clone(), "lm_head.weight": head},
        target / "model.safetensors",
    )
    (target / "config.json").write_text(
        '{"hidden_size": %d, "vocab_size": %d}\n' % (d.cfg.hidden_size, d.cfg.vocab_size)
    )
    res = evaluate_drafter(tmp_path / "drafter", target, tmp_path / "feats", k=2, batch_size=8, device="auto")
    total = sum(int(fs.sample(i)["tokens"].shape[0]) for i in range(len(fs)))
    assert res["run"]["device"] == "cpu" and res["run"]["tokens"] == total
    with pytest.raises(DraftportError, match=r"^eval\.device: cuda asked for"):
        evaluate_drafter(tmp_path / "drafter", target, tmp_path / "feats", k=2, device="cuda")


def test_one_process_joins_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed("cpu") == (0, 1)
