"""The capture benchmark on the CPU: it runs at toy size through draftport's own featurizer and
writer and writes the fields the estimate reads; its FLOP count is the issue's roofline at the 8B
shape."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_capture_h200 import (
    SHAPES,
    aux_ids,
    build_target,
    compile_layers,
    flops_per_token,
    length_mix,
    make_sequences,
    padded_inputs,
    params_of,
    roofline,
    uncompile_layers,
)

from draftport.data.features import featurizer
from draftport.profile.estimate import capture_bench

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_capture_h200.py"


def test_bench_runs_toy_on_cpu_and_writes_what_the_estimate_reads(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--toy", "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["shapes"]["toy"]
    for k in ("forward", "capture", "capture_write", "capture_write_fp8"):
        assert s[k]["tok_s"] > 0 and s[k]["fraction_of_roofline"] == pytest.approx(s[k]["tok_s"] / s["roofline_tok_s"])
    w, w8 = s["capture_write"], s["capture_write_fp8"]
    assert w["tokens"] == 4 * 4 * 64 and w["dtype"] == "bfloat16" and w8["dtype"] == "fp8_e4m3"
    assert w["bytes"] / w["tokens"] == pytest.approx(w["bytes_per_token"] + 4, rel=0.05)  # + target_arg
    assert w8["bytes"] / w8["tokens"] < 0.6 * w["bytes"] / w["tokens"]
    mix = s["mix"]
    assert mix["capture_write"]["tokens"] == round(mix["mean_tokens"] * mix["samples"])
    assert mix["padding_fraction_by_length"] < mix["padding_fraction_input_order"]
    assert {"main: put (waiting on the writer queue)", "writer: pwrite rows in place", "pool: sha256"} <= set(
        w["profile_seconds"]
    )
    assert res["host"]["sha256_GB_s"] > 0 and res["host"]["disk_write_fsync_MB_s"] > 0
    assert not list(tmp_path.glob("bench-capture.*"))  # its shards are gone
    assert "summary:" in r.stdout

    got = capture_bench(out)
    assert got["source"] == "measured" and got["capture_write"] == pytest.approx(w["fraction_of_roofline"])


def test_roofline_is_the_issues_at_the_8b_shape():
    p = params_of(SHAPES["8b"])
    assert p["non_embedding"] == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
    # 790 TFLOP/s over 2 x 7.50B params + causal attention at T = 2048: the issue's 50.8K tok/s
    assert roofline(SHAPES["8b"], [2048], 790) == pytest.approx(50.8e3, rel=1e-3)
    f = flops_per_token(SHAPES["8b"], [2048])
    assert f["attention"] == 2 * 32 * 32 * (2 * 128) * 1024
    mix = length_mix(192, 1500, 2048)
    assert sum(mix) / len(mix) == pytest.approx(1500, rel=0.01) and max(mix) == 2048 and min(mix) >= 32


def test_bench_compile_lever_runs_toy_on_cpu_beside_the_eager_rows(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--toy", "--compile", "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    s = res["shapes"]["toy"]
    c = s["compiled"]
    assert "failed" not in c and c["mode"] == "default" and c["dynamic"] is False and c["warmup_s"] > 0
    for row in (
        s["capture"],
        s["capture_write"],
        s["mix"]["capture_write"],  # the eager rows stay
        c["capture"],
        c["capture_write"],
        c["mix"]["capture_write"],
    ):
        assert row["tok_s"] > 0
    assert c["capture_write"]["tokens"] == s["capture_write"]["tokens"]
    assert c["mix"]["capture_write"]["tokens"] == s["mix"]["capture_write"]["tokens"]
    assert c["mix_warmup_s"] >= 0 and c["mix_shapes"] and c["mix"]["graphs_compiled_in_timed_rows"] == 0
    assert res["config"]["compile"]["mode"] == "default" and "compiled: capture" in r.stdout
    assert not list(tmp_path.glob("bench-capture.*"))


def test_compiled_featurizer_matches_eager_on_the_toy_target():
    """Each decoder layer's forward compiled, the capture hooks outside it, and the input padded
    to a multiple of 16 tokens: the same aux / final states and greedy choice as eager."""
    shape = SHAPES["toy"]
    model = build_target(shape, "cpu", torch.float32)
    batch = make_sequences([37, 30, 21], shape["vocab_size"], seed=4)  # padded: a mask on the CPU
    ref = featurizer(model, aux_ids(shape), "vllm", "cpu")(batch)
    compile_layers(model)
    try:
        with padded_inputs(model, 16, 64):
            got = featurizer(model, aux_ids(shape), "vllm", "cpu")(batch)
    finally:
        uncompile_layers(model)
        torch._dynamo.reset()
    assert got[0].shape[1] == 48 and got[1].shape[1] == 48  # 37 -> 48 tokens
    for i, s in enumerate(batch):
        n = len(s.tokens)
        assert torch.allclose(got[0][i, :n], ref[0][i, :n], atol=1e-5)
        assert torch.allclose(got[1][i, :n], ref[1][i, :n], atol=1e-5)
        assert torch.equal(got[2][i, :n], ref[2][i, :n])
    assert "forward" not in model.__dict__ and all("forward" not in l.__dict__ for l in model.model.layers)


def test_bench_budget_skips_rows_and_still_writes(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), "--toy", "--budget-s", "0.001", "--out", str(out), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(out.read_text())["shapes"]["toy"]
    assert s["forward"]["tok_s"] > 0 and "capture" in s["skipped_for_budget"] and "capture_write" not in s
    assert "summary:" in r.stdout
