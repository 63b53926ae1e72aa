"""FSDP (TrainConfig.parallel = "fsdp"): 2 gloo processes under torchrun make the same updates as
one process on the same global batch, write the same flat checkpoint files, and resume (under
FSDP, or in one process); the multi-GPU benchmark runs at toy size on the CPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from toys import make_features, toy_drafter

from draftport.errors import DraftportError
from draftport.training.loop import TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"  # the torchrun worker and what it imports
WORKER = HELPERS / "fsdp_worker.py"
BENCH = ROOT / "benchmarks" / "bench_train_multigpu.py"
ENV = dict(os.environ, PYTHONPATH=str(HELPERS), OMP_NUM_THREADS="1")


def run(feats: Path, out: Path, nproc: int, *args: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(WORKER),
        str(feats),
        str(out),
        *args,
    ]
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


def close(a: dict, b: dict, atol: float):
    assert a.keys() == b.keys(), set(a) ^ set(b)
    for k in a:
        assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, k
        if a[k].is_floating_point():
            assert float((a[k] - b[k]).abs().max()) < atol, k
        else:
            assert torch.equal(a[k], b[k]), k


def same_losses(a, b, rel=1e-4):
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert abs(x - y) < rel * max(1.0, abs(x)), (a, b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """6 steps, checkpoints at 3 and 6: one process, FSDP x2 (reference), FSDP x2 (fused)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    make_features(tmp)
    feats = tmp / "feats"
    out = {"feats": feats}
    for name, nproc, impl in (("one", 1, "reference"), ("fsdp", 2, "reference"), ("fsdp_fused", 2, "fused")):
        out[name] = tmp / name
        out[name + "_res"] = run(
            feats, tmp / name, nproc, "--impl", impl, "--parallel", "fsdp", "--checkpoint-every", "3"
        )
    return out


def test_fsdp_two_gloo_ranks_equal_one_process(runs):
    assert runs["fsdp_res"]["world"] == 2 and runs["one_res"]["world"] == 1
    same_losses(runs["one_res"]["losses"], runs["fsdp_res"]["losses"])
    assert len(runs["one_res"]["losses"]) == 6
    # train() hands back full weights on every rank, as DDP or one process would
    close(
        load_file(str(runs["one"] / "weights.safetensors")),
        load_file(str(runs["fsdp"] / "weights.safetensors")),
        atol=1e-4,
    )


def test_fsdp_fused_path_with_inplace_wgrad_sums_equals_one_process(runs):
    """The fused loss applies lm_head outside the drafter's forward and sums weight gradients in
    place across TTT steps; under FSDP both must still be reduce-scattered."""
    same_losses(runs["one_res"]["losses"], runs["fsdp_fused_res"]["losses"])
    close(
        load_file(str(runs["one"] / "weights.safetensors")),
        load_file(str(runs["fsdp_fused"] / "weights.safetensors")),
        atol=1e-4,
    )


def test_fsdp_checkpoint_files_are_the_flat_single_process_files(runs):
    for step in ("step_0000003", "step_0000006"):
        a, b = runs["one"] / "checkpoints" / step, runs["fsdp"] / "checkpoints" / step
        close(load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors")), atol=1e-4)
        close(load_file(str(a / "optimizer.safetensors")), load_file(str(b / "optimizer.safetensors")), atol=1e-4)
        sa, sb = json.loads((a / "state.json").read_text()), json.loads((b / "state.json").read_text())
        assert sa["step"] == sb["step"] and sa["adam_steps"] == sb["adam_steps"]
        assert sb["config"]["parallel"] == "fsdp"


def test_fsdp_resume_is_exact_and_a_single_process_can_resume_it(runs, tmp_path):
    """Interrupted after step 3 (its checkpoint), resumed by a fresh set of processes under FSDP:
    the same weights as the uninterrupted FSDP run; resumed in one process instead: the same
    weights as the one-process run."""
    ck = runs["fsdp"] / "checkpoints" / "step_0000003"
    for name in ("again", "alone"):
        (tmp_path / name / "checkpoints").mkdir(parents=True)
        shutil.copytree(ck, tmp_path / name / "checkpoints" / ck.name)
    again = run(
        runs["feats"], tmp_path / "again", 2, "--parallel", "fsdp", "--checkpoint-every", "3", "--drafter-seed", "99"
    )
    alone = run(
        runs["feats"], tmp_path / "alone", 1, "--parallel", "fsdp", "--checkpoint-every", "3", "--drafter-seed", "99"
    )
    # a resumed run first replays the checkpoint's loss history to its logger (the new MLflow run
    # shows the whole curve), then logs steps 4-6
    assert again["steps"] == alone["steps"] == 6 and len(again["losses"]) == len(alone["losses"]) == 6
    assert again["losses"][:3] == alone["losses"][:3]  # from the checkpoint, stored to 6 decimals
    assert again["losses"][:3] == pytest.approx(runs["fsdp_res"]["losses"][:3], abs=1e-6)
    assert again["losses"][3:] == runs["fsdp_res"]["losses"][3:]
    close(
        load_file(str(runs["fsdp"] / "weights.safetensors")),
        load_file(str(tmp_path / "again" / "weights.safetensors")),
        atol=0.0 + 1e-12,
    )
    same_losses(runs["one_res"]["losses"][3:], alone["losses"][3:])
    close(
        load_file(str(runs["one"] / "weights.safetensors")),
        load_file(str(tmp_path / "alone" / "weights.safetensors")),
        atol=1e-4,
    )


def test_unknown_parallel_mode_is_refused(tmp_path):
    fs, head = make_features(tmp_path)
    with pytest.raises(DraftportError, match="parallel"):  # TrainConfig itself refuses it (a ParamsError)
        cfg = TrainConfig(steps=1, batch_size=2, parallel="zero3")
        train(toy_drafter(), fs, head, tmp_path / "run", cfg, progress=False)


def test_multigpu_bench_runs_toy_on_cpu_with_two_gloo_processes(tmp_path):
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--size",
            "toy",
            "--device",
            "cpu",
            "--nproc",
            "2",
            "--iters",
            "2",
            "--warmup",
            "1",
            "--loss-steps",
            "3",
            "--json",
            str(out),
            "--log",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["tokens_per_s_1gpu"] > 0 and res["config"]["global_batch"] == 2
    assert len(res["single_losses"]) == 3 and res["single_losses"][-1] < res["single_losses"][0]
    for mode in ("ddp", "fsdp"):
        m = res[mode]
        assert m["world"] == 2 and m["tokens_per_s_per_gpu"] > 0 and m["scaling_efficiency"] > 0
        assert m["loss_check"]["match"] and m["loss_check"]["max_rel_diff"] < 1e-4
        assert m["loss_check"]["final_diff_over_moved"] < 1e-2
    # FSDP holds half the trainable elements per rank
    assert res["fsdp"]["local_trainable_elems_rank0"] < 0.6 * res["ddp"]["local_trainable_elems_rank0"]
    text = log.read_text()
    assert "scaling efficiency" in text and "summary:" in text
