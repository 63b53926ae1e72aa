"""draftport estimate's training figure is that of the profile's own drafter shape
(draftport.profile.rates): measured when a result of that shape exists, interpolated in log H
between the measured shapes around it, else the nearest one's, and it says which."""

import json
import math
from pathlib import Path

import bench_train_h200 as bench
import pytest
import yaml

from draftport.errors import DraftportError
from draftport.model.config import DrafterConfig
from draftport.profile import estimate
from draftport.profile import rates as train_rates

ROOT = Path(__file__).resolve().parents[2]
KIMI = train_rates.KIMI_K2_DRAFTER
FIGS = tuple(train_rates.FIGURES)


def write_result(folder: Path, name: str, shape: dict, mfu: float, date="2026-12-04", lengths=(1000, 2000)) -> Path:
    """A bench_train_h200 result of this shape whose four mix figures run at `mfu`."""
    shape = {**shape, "vocab_size": shape.get("vocab_size", 100_000)}
    res = {}
    for key, fig in train_rates.FIGURES.items():
        fpt = train_rates.mix_flops_per_token(shape, list(lengths), 7, key.endswith("trainable"))
        res[fig] = {"mfu": mfu, "real_tokens_per_s": mfu * 790e12 / fpt}
    d = {
        "date": date,
        "device": "NVIDIA H200",
        "config": {"shape": name, **shape, "seq": 2048, "ttt_steps": 7, "peak_tflops": 790.0},
        "mix": {
            "n": len(lengths),
            "mean": sum(lengths) / len(lengths),
            "max": max(lengths),
            "pad_batch": 4,
            "lengths": list(lengths),
        },
        "mix_results": res,
    }
    p = folder / f"{date}-h200-train-{name}.json"
    p.write_text(json.dumps(d))
    return p


SMALL = {
    "hidden_size": 2048,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "draft_vocab_size": 32000,
}


def test_flop_count_by_hand():
    """The one FLOP count (model.flops; the benchmark's MFU reads it too), term by term on a toy
    shape: H 4, I 8, 2 heads and 1 kv head of 2, draft vocab 10, fc input 12; T 3, 2 TTT steps."""
    toy = {
        "hidden_size": 4,
        "intermediate_size": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "draft_vocab_size": 10,
        "fc_in": 12,
    }
    qkv, o, mlp, head = 2 * 2 * 4 * (4 + 2 * 2), 2 * 4 * 4, 2 * 3 * 4 * 8, 2 * 4 * 10  # 128, 32, 192, 80
    attn = 2 * 2 * 4 * ((3 + 1) / 2 + 0) + 2 * 2 * 4 * ((3 + 1) / 2 + 1)  # 32 + 48
    fc = 2 * 12 * 4
    trained_head = 2 * 3 * (qkv + o + mlp) + 3 * attn + 2 * 3 * head + 2 * fc + head
    assert trained_head == 3104
    assert train_rates.flops_per_token(toy, 3, 2, True) == 3104
    assert train_rates.flops_per_token(toy, 3, 2, False) == 3104 - 2 * head  # a frozen head: 2x, not 3x
    cfg = DrafterConfig(**{k: v for k, v in toy.items() if k != "fc_in"}, vocab_size=16, aux_layer_ids=[0, 1, 2])
    assert bench.flops_per_token(cfg, 3, 2, True)["train"] == 3104  # fc_in 3H = 12


def test_measured_interpolated_nearest(tmp_path):
    write_result(tmp_path, "small", SMALL, 0.60)
    write_result(tmp_path, "kimi", KIMI, 0.90)
    write_result(tmp_path, "kimi", KIMI, 0.80, date="2026-12-01")  # older: not read
    (tmp_path / "2026-12-05-h200-train-7.json").write_text("{}")  # not named by its shape
    got = train_rates.rates_for(KIMI, tmp_path)
    assert got["source"] == "measured" and got["from"][0]["date"] == "2026-12-04"
    fpt = train_rates.mix_flops_per_token(KIMI, [1000, 2000], 7, True)
    assert got["figures"]["lm_head_trainable"] == pytest.approx(0.90 * 790e12 / fpt)
    mid = {**KIMI, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8}
    got = train_rates.rates_for(mid, tmp_path)
    x = math.log(4096 / 2048) / math.log(7168 / 2048)
    assert got["source"] == "interpolated" and got["weights"] == pytest.approx([1 - x, x])
    for k in FIGS:
        fpt = train_rates.mix_flops_per_token(mid, [1000, 2000], 7, k.endswith("trainable"))
        assert got["figures"][k] == pytest.approx((0.60 * (1 - x) + 0.90 * x) * 790e12 / fpt)
    big = {**KIMI, "hidden_size": 12288}
    got = train_rates.rates_for(big, tmp_path)
    assert got["source"] == "nearest" and got["from"][0]["name"] == "kimi"
    fpt = train_rates.mix_flops_per_token(big, [1000, 2000], 7, False)
    assert got["figures"]["lm_head_frozen"] == pytest.approx(0.90 * 790e12 / fpt)
    with pytest.raises(DraftportError, match="no training benchmark result"):
        train_rates.rates_for(KIMI, tmp_path / "none")


def test_the_profiles_drafter_shape(tmp_path):
    kimi = yaml.safe_load((ROOT / "configs/kimi-k2.5.yaml").read_text())
    shape, where = train_rates.drafter_shape(kimi)
    assert shape == KIMI and "AQ-MedAI/Kimi-K2-Instruct-eagle3" in where
    base = yaml.safe_load((ROOT / "params.yaml").read_text())  # the embedded world
    shape, where = train_rates.drafter_shape(base)
    w = base["world"]
    assert shape["hidden_size"] == w["model"]["hidden_size"] and "world" in where
    assert shape["draft_vocab_size"] == max(8, round(w["vocab_size"] * w["source_drafter"]["draft_vocab_ratio"]))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "hidden_size": 4096,
                "intermediate_size": 14336,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 128256,
                "draft_vocab_size": 32000,
            }
        )
    )
    shape, where = train_rates.drafter_shape({"world": {"build": False}, "source": {"repo_id": str(tmp_path / "d")}})
    assert (shape["hidden_size"], shape["num_key_value_heads"]) == (4096, 8) and where.endswith("config.json")
    assert train_rates.drafter_shape({"world": {"build": False}, "source": {"repo_id": "org/unknown"}})[0] is None


def test_estimate_reads_the_profiles_shape_and_says_which():
    """The committed results: the kimi profile's drafter is measured (the Kimi result, the default
    file); a drafter of another shape gets its own figure; a file given stays that file."""
    kimi = yaml.safe_load((ROOT / "configs/kimi-k2.5.yaml").read_text())
    b = estimate.bench_throughput(estimate.DEFAULT_BENCH, kimi)
    assert b["shape_source"] == "measured" and b["files"] == ["benchmarks/results/2026-12-03-h200-train-kimi.json"]
    assert b["lm_head_trainable"] == pytest.approx(
        json.loads(estimate.DEFAULT_BENCH.read_text())["packed_real_tokens_per_s"]
    )
    assert "measured: benchmarks/results/2026-12-03-h200-train-kimi.json" in b["rate"]
    other = {"world": {"build": False}, "source": {"repo_id": "org/unknown"}}
    b = estimate.bench_throughput(estimate.DEFAULT_BENCH, other)
    assert b["shape_source"] == "default" and "not known" in b["rate"]
    b = estimate.bench_throughput(Path(str(estimate.DEFAULT_BENCH)), kimi)  # a path given (--bench): that file
    assert "shape_source" not in b
