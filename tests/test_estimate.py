"""The README's wall-time figures come from draftport.estimate: arithmetic checked by hand."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from draftport import estimate as E
from draftport import params as P
from draftport.errors import DraftportError

ROOT = Path(__file__).resolve().parents[1]


def test_train_seconds_is_tokens_over_aggregate_throughput():
    # 1200 steps x 64 samples x 2048 tokens = 157,286,400 tokens; 12,000 tok/s x 8 GPUs x 0.9
    assert E.train_seconds(steps=1200, batch_size=64, tokens_per_sample=2048, tok_s_per_gpu=12000.0,
                           gpus=8, efficiency=0.9) == pytest.approx(157_286_400 / 86_400)
    with pytest.raises(DraftportError):
        E.train_seconds(steps=1, batch_size=1, tokens_per_sample=1, tok_s_per_gpu=1.0, gpus=1, efficiency=1.5)


def test_kimi_profile_estimate_uses_the_measured_h200_figures():
    cfg = P.load(ROOT / "configs/kimi-k2.5.yaml", base=ROOT / "params.yaml")
    rep = E.estimate(cfg, efficiency=0.9)
    bench = json.loads((ROOT / "benchmarks/results/2026-11-29-h200.json").read_text())
    rate = bench["tokens_per_s_lm_head_trainable"]  # draftport's default: lm_head trained
    rows = {r["rule"]: r for r in rep["rows"]}
    assert rows["phase1"]["gpus"] == 8 and rows["phase1"]["tokens"] == 1200 * 64 * 2048
    assert rows["phase1"]["seconds"] == pytest.approx(1200 * 64 * 2048 / (rate * 8 * 0.9))
    assert rows["phase2"]["seconds"] == pytest.approx(6000 * 64 * 2048 / (rate * 8 * 0.9))
    assert rep["phase1_hours"] == pytest.approx(2 * rows["phase1"]["hours"])  # control + fine-tune
    # 57 KB/token at H 7168, as DESIGN.md states
    assert rep["bytes_per_token"] == 4 * 7168 * 2 + 5
    frozen = P.merge(cfg, {"phase2": {"train": {"train_lm_head": False}}})
    assert {r["rule"]: r for r in E.estimate(frozen)["rows"]}["phase2"]["tok_s_per_gpu"] == round(
        bench["tokens_per_s_mask_precomputed"])


def test_estimate_command_prints_the_readme_figures():
    r = subprocess.run([sys.executable, "-m", "draftport.cli", "estimate", "--profile", "configs/kimi-k2.5.yaml"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Phase 1 (control + fine-tune): 1.01 h;  Phase 2: 2.52 h" in r.stdout
    readme = (ROOT / "README.md").read_text()
    assert "1.01 h" in readme and "2.52 h" in readme  # the README quotes this command's output
