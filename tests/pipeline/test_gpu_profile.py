"""configs/gpu.yaml, the plan on one GPU, as the CPU can check it: the world's drafter has a real
drafter's shape and every step asks for the GPU; the plan is whole; and the same profile at toy
size with every device cpu (tests/helpers/gpu-toy.yaml) runs end to end through the project's own
runner without MLflow, driven by benchmarks/bench_pipeline_gpu.py, whose results file then names
each step's device and the trainings' rates. The GPU run itself: benchmarks/README.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from repo import BIN, ROOT, copy_repo, smk

from draftport.pipeline import bridge, local
from draftport.plan import cluster, params, registry
from draftport.profile.rates import drafter_shape

GPU = "configs/gpu.yaml"
TOY = "tests/helpers/gpu-toy.yaml"


def test_the_gpu_world_has_a_real_drafters_shape_and_every_step_asks_for_the_gpu():
    cfg = params.load(ROOT / GPU)
    shape, _ = drafter_shape(cfg)
    assert {
        k: shape[k]
        for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "draft_vocab_size")
    } == {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "draft_vocab_size": 32000,
    }
    assert shape["vocab_size"] >= 32000 and cfg["world"]["model"]["arch"] == "deepseek_v3"
    assert cfg["vocab_new"]["draft_vocab_size"] == 32000
    trains = [
        cfg["world"]["source_drafter"]["train"],
        cfg["phase1"]["train"],
        cfg["phase2"]["train"],
        cfg["curves"]["train"],
    ]
    devices = {cfg["world"]["device"], cfg["features"]["device"], cfg["eval"]["device"], *(t["device"] for t in trains)}
    assert devices == {"cuda"}
    assert cfg["resources"]["default"]["gpu"] == 1


def test_the_gpu_profile_plans_the_whole_plan():
    out = smk("-n", "--forceall", "--configfile", GPU, "--cores", "16", "all").stdout
    want = {r.name for r in registry.active(params.load(ROOT / GPU))} - {"online_phase0", "online_phase1", "publish"}
    planned = {line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in registry.BY_NAME}
    assert want <= planned, want - planned


@pytest.mark.slow
def test_the_gpu_profile_at_toy_size_runs_end_to_end_on_the_cpu(tmp_path):
    repo = tmp_path / "repo"
    copy_repo(repo)
    # a `python` on PATH that is not this interpreter (a bare GPU node's is another one, or none):
    # the runner must launch every step with its own
    other = tmp_path / "other-python"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho 'not the runner's interpreter' >&2\nexit 97\n")
    (other / "python").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{other}:{BIN}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(repo / "src"),
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:9",
    }  # unreachable: --no-tracking must open no run
    env.pop("OUT", None)
    out = tmp_path / "pipeline.json"
    cmd = [
        sys.executable,
        "benchmarks/bench_pipeline_gpu.py",
        "--configfile",
        GPU,
        "--configfile",
        TOY,
        "--runner",
        "local",
        "--no-tracking",
        "--no-bench",
        "--json",
        str(out),
    ]
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["plan"] == {**res["plan"], "runner": "local", "tracking": False, "rc": 0}
    ran = {k: v for k, v in res["steps"].items() if v["ran"]}
    assert {
        "world",
        "features_new",
        "train_phase1",
        "train_phase2",
        "eval_phase2",
        "train_curves",
        "decision",
        "report",
    } <= set(ran)
    for name in (
        "train_phase1_scratch",
        "train_phase1",
        "train_phase2",
        "eval_phase0",
        "eval_phase2",
        "drift",
        "eval_curves",
        "train_curves",
    ):
        assert ran[name]["devices"] == ["cpu"], name
    for name, rate in res["training"].items():
        assert rate["device"] == "cpu" and rate["processes"] == 1 and rate["tokens_per_s"] > 0, name
        assert rate["mfu"] is None  # no GPU peak on the CPU
        # the warm-up apart: the process's start before the first step, and the compiles (the
        # reference impl the CPU runs compiles none)
        assert rate["start_s"] > 0 and rate["compiles"] == 0 and rate["last_compile_step"] == 0, name
    cap = res["capture"]["features_new/train"]
    assert cap["tokens"] > 0 and cap["tok_s"] > 0 and 0 < cap["of_roofline"]
    assert res["decision"]["init"] in ("source", "scratch")
    # the metrics stay free of rates (identical runs, identical bytes): the device record is in logs/
    metrics = json.loads((repo / "artifacts/train_phase2/metrics.json").read_text())
    assert "tokens_per_s" not in json.dumps(metrics)
    # the runner keeps what is done
    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftport.pipeline.local",
            "all",
            "--configfile",
            GPU,
            "--configfile",
            TOY,
            "--no-tracking",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert again.returncode == 0 and again.stdout.count("done before, kept") == len(ran), again.stdout[-2000:]


def test_the_local_runner_launches_steps_with_its_own_interpreter():
    assert local.this_interpreter("python") == sys.executable
    assert local.this_interpreter("torchrun --standalone --nproc_per_node 1") == (
        f"{sys.executable} -m torch.distributed.run --standalone --nproc_per_node 1"
    )
    cfg = params.load(ROOT / GPU, ROOT / TOY)
    base = params.load()
    cmd = bridge.shell_command("world", cfg, base, local.this_interpreter(cluster.launcher(cfg, "world")))
    assert cmd.startswith(f"{sys.executable} scripts/world.py ")


def test_the_local_runner_refuses_an_unknown_target_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "draftport.pipeline.local", "phase9", "--configfile", GPU],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: target: 'phase9': not a target")
    r = subprocess.run(
        [sys.executable, "-m", "draftport.pipeline.local", "all", "--configfile", "configs/nope.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stderr.strip() == "error: configs/nope.yaml: no such parameter file"


def test_every_step_process_compiles_into_the_run_s_one_cache(tmp_path, monkeypatch):
    """torch.compile's caches go to one folder of the run (DRAFTPORT_COMPILE_CACHE, else
    .draftport/compile-cache), set before the step computes; a cache the user set is kept."""
    from draftport.pipeline import runner

    for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "DRAFTPORT_COMPILE_CACHE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    runner._compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / ".draftport/compile-cache/inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / ".draftport/compile-cache/triton")
    monkeypatch.setenv("DRAFTPORT_COMPILE_CACHE", str(tmp_path / "shared"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    runner._compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "shared/triton")
