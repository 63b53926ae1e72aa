"""The capture benchmark on the CPU: it runs at toy size through draftport's own featurizer and
writer and writes the fields the estimate reads; its FLOP count is the issue's roofline at the 8B
shape."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "bench_capture_h200.py"
sys.path.insert(0, str(BENCH.parent))


def test_bench_runs_toy_on_cpu_and_writes_what_the_estimate_reads(tmp_path):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, str(BENCH), "--toy", "--out", str(out), "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
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
        w["profile_seconds"])
    assert res["host"]["sha256_GB_s"] > 0 and res["host"]["disk_write_fsync_MB_s"] > 0
    assert not list(tmp_path.glob("bench-capture.*"))  # its shards are gone
    assert "summary:" in r.stdout

    from draftport.estimate import capture_bench

    got = capture_bench(out)
    assert got["source"] == "measured" and got["capture_write"] == pytest.approx(w["fraction_of_roofline"])


def test_roofline_is_the_issues_at_the_8b_shape():
    from bench_capture_h200 import SHAPES, flops_per_token, length_mix, params_of, roofline

    p = params_of(SHAPES["8b"])
    assert p["non_embedding"] == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 128256 * 4096
    # 790 TFLOP/s over 2 x 7.50B params + causal attention at T = 2048: the issue's 50.8K tok/s
    assert roofline(SHAPES["8b"], [2048], 790) == pytest.approx(50.8e3, rel=1e-3)
    f = flops_per_token(SHAPES["8b"], [2048])
    assert f["attention"] == 2 * 32 * 32 * (2 * 128) * 1024
    mix = length_mix(192, 1500, 2048)
    assert sum(mix) / len(mix) == pytest.approx(1500, rel=0.01) and max(mix) == 2048 and min(mix) >= 32
