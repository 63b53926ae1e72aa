"""bench_train_h200.py at any drafter shape (issue #41): --shape NAME or H,I,heads,kv,head_dim,Vd,V,
the peers' runners handed the same shape, results named by it, the GEMM ceiling's set of GEMMs,
and the MFU goal by hidden size. No step runs here (tests/bench/test_bench_train.py runs one)."""

import json
from types import SimpleNamespace

import bench_train_h200 as bench
import pytest
import torch

from draftport.model.config import DrafterConfig


def test_named_and_numeric_shapes():
    name, s = bench.parse_shape("qwen3-30b-a3b")
    assert name == "qwen3-30b-a3b" and (s["hidden_size"], s["intermediate_size"], s["num_key_value_heads"]) == (
        2048,
        12288,
        4,
    )
    assert bench.parse_shape("llama70b")[1] == dict(zip(bench.SHAPE_KEYS, (8192, 28672, 64, 8, 128, 32000, 128256)))
    # the sizes of a named shape get its name; others a name of their sizes
    assert bench.parse_shape(bench.shape_arg(bench.SIZES["kimi"]))[0] == "kimi"
    name, s = bench.parse_shape(" 4096, 14336,32,8,128,32000,128256")
    assert name == "h4096-i14336-a32-kv8-d128-vd32000-v128256" and s["num_attention_heads"] == 32
    assert bench.shape_arg(s) == "4096,14336,32,8,128,32000,128256"
    for bad, why in (
        ("gpt5", "a name"),
        ("1,2,3", "a name"),
        ("64,128,4,x,16,256,1024", "integers"),
        ("64,128,4,3,16,256,1024", "multiple"),
        ("64,128,4,4,16,2048,1024", "exceeds"),
        ("64,128,4,4,15,256,1024", "even"),
        ("64,128,4,4,16,0,1024", ">= 1"),
    ):
        with pytest.raises(ValueError, match=why):
            bench.parse_shape(bad)


def test_parse_fills_names_and_refuses_two_shapes(capsys):
    a = bench.parse(
        ["--shape", "64,128,4,2,16,256,1024", "--json", "/tmp/{date}-h200-train-{shape}.json", "--log", "x-{shape}.log"]
    )
    assert a.size == "h64-i128-a4-kv2-d16-vd256-v1024" and a.shape["num_key_value_heads"] == 2
    assert a.json.endswith("-h200-train-h64-i128-a4-kv2-d16-vd256-v1024.json") and "{date}" not in a.json
    assert a.log == "x-h64-i128-a4-kv2-d16-vd256-v1024.log"
    assert bench.parse(["--size", "toy"]).shape == bench.SIZES["toy"]
    for argv in (["--shape", "kimi", "--size", "toy"], ["--shape", "1,2"]):
        with pytest.raises(SystemExit):
            bench.parse(argv)
    assert "--shape" in capsys.readouterr().err
    # a peer file of another shape is other work (--peers-from / --rescore refuse it)
    key = bench.run_key(bench.parse(["--shape", "toy", "--mix", "0"]))
    assert key["shape"] == {k: bench.SIZES["toy"][k] for k in bench.SHAPE_KEYS}
    assert (
        bench.file_key(
            {
                "config": {
                    **bench.SIZES["toy"],
                    "seqs": [64],
                    "ttt_steps": 7,
                    "peer_process": "per-shape",
                    "target_off_draft_scale": bench.OFF_DRAFT_SCALE,
                }
            }
        )["shape"]
        == key["shape"]
    )


def test_the_peers_get_the_shape(monkeypatch):
    cmds = []

    def fake_run_peer(name, cmd, t, log, one):
        cmds.append(cmd)
        one.update(status="done")
        return []

    monkeypatch.setattr(bench, "run_peer", fake_run_peer)
    a = bench.parse(["--shape", "llama70b", "--mix", "0", "--seqs", "2048"])
    bench.run_peers(a, None, False, lambda: 100.0, lambda m: None, lambda p, r: None, peers_only=True)
    assert len(cmds) == 2 and all(c[c.index("--shape") + 1] == "8192,28672,64,8,128,32000,128256" for c in cmds)
    assert not any("--toy" in c for c in cmds)


def test_gemm_set_is_the_model_count_without_the_attention():
    cfg = DrafterConfig(**bench.SIZES["qwen3-30b-a3b"], aux_layer_ids=[2, 30, 58])
    for trained in (False, True):
        fl = bench.flops_per_token(cfg, 2048, 7, trained)
        gemm = sum(2 * M * K * N * c for _, _, M, K, N, c in bench.gemm_set(cfg, 2048, 7, trained))
        assert gemm == pytest.approx(2048 * (fl["train"] - 3 * sum(fl["attn_fwd_per_ttt_step"])))


def test_gemm_ceiling_times_each_shape_once_on_cpu():
    cfg = DrafterConfig(**bench.SIZES["toy"], aux_layer_ids=[2, 30, 58])
    out = bench.gemm_ceiling(cfg, 32, 3, 790.0, lambda m: None, reps=1, dev="cpu")
    fr, tr = out["sets"]["frozen"], out["sets"]["trainable"]
    assert tr["gemm_flop"] > fr["gemm_flop"] and tr["gemm_s"] > 0
    assert fr["mfu_ceiling"] == pytest.approx(fr["gemm_flop"] / fr["gemm_s"] / 790e12)
    assert {g["gemm"] for g in tr["gemms"]} == {"q", "k", "v", "o", "gate", "up", "down", "lm_head", "fc", "target"}


def _rec(mfu, tps=100.0):
    return {"real_tokens_per_s": tps, "mfu": mfu, "peak_mem_gib": 1.0}


@pytest.mark.parametrize("hidden, kind", [(7168, "absolute"), (2048, "ceiling")])
def test_mfu_goal_by_hidden_size(hidden, kind):
    """H >= 4096: model-FLOPs MFU >= 75% at 2048 and >= 80% at 4096; below: >= 90% of the MFU the
    step's GEMMs alone reach through cuBLAS (no ceiling timed: not scored)."""
    by_len = {}
    for T in ("2048", "4096"):
        ours = {f"{k}_{m}": _rec(0.77) for k in ("frozen", "trainable") for m in ("computed", "stored")}
        by_len[T] = {
            "ours": ours,
            "gemm_ceiling": {"sets": {"frozen": {"mfu_ceiling": 0.95}, "trainable": {"mfu_ceiling": 0.96}}},
        }
    out = {"config": {"hidden_size": hidden}, "by_length": by_len, "peers_raw": {}, "peers_requested": []}
    goals = {g["goal"]: g for g in bench.score(json.loads(json.dumps(out)))}
    if kind == "absolute":
        assert goals["T2048 MFU, lm_head frozen, mask stored"]["met"] is True  # 0.77 >= 0.75
        assert goals["T4096 MFU, lm_head frozen, mask stored"]["met"] is False  # 0.77 < 0.80
    else:
        g = goals["T2048 MFU over the step's cuBLAS GEMM ceiling, lm_head frozen, mask stored"]
        assert g["value"] == pytest.approx(0.77 / 0.95) and g["met"] is False and g["target"] == 0.9
        del out["by_length"]["4096"]["gemm_ceiling"]
        goals = {g["goal"]: g for g in bench.score(out)}
        assert goals["T4096 MFU over the step's cuBLAS GEMM ceiling, lm_head frozen, mask stored"]["met"] is None


def test_rescore_names_a_file_from_before_shapes(tmp_path):
    res = {
        "date": "2026-12-03",
        "device": "NVIDIA H200",
        "config": {**bench.SIZES["kimi"], "seqs": [2048]},
        "by_length": {},
        "peers_raw": {},
    }
    f = tmp_path / "r.json"
    f.write_text(json.dumps(res))
    bench.rescore(str(f))
    out = json.loads(f.read_text())
    assert out["config"]["shape"] == "kimi" and "config.shape kimi added" in out["rescored"]


def test_build_takes_a_shape_dict():
    _, s = bench.parse_shape("64,128,4,2,16,256,1024")
    cfg, d, head = bench.build(s, torch.device("cpu"), torch.float32)
    assert d.midlayer.self_attn.k_proj.weight.shape == (2 * 16, 2 * 64) and head.shape == (1024, 64)


def test_ratio_goals_state_the_bound_of_a_step_of_gemms_alone():
    """Each ratio goal's note carries the ratio a step made of its GEMMs alone at cuBLAS's rate
    would reach: T rows over the set's GEMM time (mask computed: plus the target logits' GEMM over
    the non-draft vocab at the same rate), over the peer's rate."""
    H, V, Vd, T = 64, 1000, 200, 2048
    ceil = {
        "rows": T,
        "sets": {
            "frozen": {"gemm_s": 0.1, "tflops": 100.0, "mfu_ceiling": 0.9},
            "trainable": {"gemm_s": 0.2, "tflops": 100.0, "mfu_ceiling": 0.9},
        },
    }
    ours = {f"{k}_{m}": _rec(0.8, 1000.0) for k in ("frozen", "trainable") for m in ("computed", "stored")}
    peers = {
        "speculators": [
            {
                "config": f"seq{T}",
                "set": s,
                "real_tokens_per_s": 500.0,
                "peak_mem_gib": 1.0,
                "impl": "speculators-x",
                "lm_head_trainable": s == "trained",
            }
            for s in ("frozen", "trained")
        ],
        "specforge": [
            {
                "config": f"seq{T}",
                "set": s,
                "real_tokens_per_s": 400.0,
                "peak_mem_gib": 1.0,
                "impl": "specforge-x",
                "lm_head_trainable": s == "trained",
            }
            for s in ("frozen", "trained")
        ],
    }
    out = {
        "config": {"hidden_size": H, "vocab_size": V, "draft_vocab_size": Vd},
        "by_length": {str(T): {"ours": ours, "gemm_ceiling": ceil}},
        "peers_raw": peers,
        "peers_requested": ["speculators", "specforge"],
    }
    goals = {g["goal"]: g for g in bench.score(out)}
    r = out["by_length"][str(T)]["ratios"]
    assert r["speedup_vs_best_peer_stored_at_gemm_ceiling"] == pytest.approx(T / 0.1 / 500.0)
    mask_s = 2 * H * (V - Vd) * T / 100e12
    assert r["speedup_vs_best_peer_computed_at_gemm_ceiling"] == pytest.approx(T / (0.1 + mask_s) / 500.0)
    assert r["vs_specforge_lm_head_trained_stored_at_gemm_ceiling"] == pytest.approx(T / 0.2 / 400.0)
    note = goals[f"T{T} vs the faster peer, lm_head frozen, mask stored"]["note"]
    assert note.endswith(f"at the step's GEMMs alone (cuBLAS ceiling): {T / 0.1 / 500.0:.3f}")
    del out["by_length"][str(T)]["gemm_ceiling"]
    bench.score(out)
    assert out["by_length"][str(T)]["ratios"]["speedup_vs_best_peer_stored_at_gemm_ceiling"] is None


def test_mix_ceiling_sums_each_packed_rows_gemms_once_per_row_count(monkeypatch):
    cfg = DrafterConfig(**bench.SIZES["toy"], aux_layer_ids=[2, 30, 58])
    batches = [SimpleNamespace(tokens=torch.zeros(1, n), valid=torch.arange(n) < n - 3) for n in (64, 128, 64)]
    calls = []
    real = bench.gemm_ceiling

    def spy(cfg_, M, *args, **kw):
        calls.append(M)
        return real(cfg_, M, *args, **kw)

    monkeypatch.setattr(bench, "gemm_ceiling", spy)
    out = bench.mix_gemm_ceiling(cfg, batches, SimpleNamespace(ttt=3, peak_tflops=790.0), lambda m: None, dev="cpu")
    assert sorted(calls) == [64, 128]
    for k in ("frozen", "trainable"):
        assert out[k]["real_tokens_per_s"] == pytest.approx((61 + 125 + 61) / out[k]["gemm_s"])
    assert out["trainable"]["gemm_s"] > out["frozen"]["gemm_s"]


def test_rescore_of_a_killed_call_takes_the_config_of_the_peer_file_it_checked(tmp_path):
    """A call killed at its limit before writing its config is scored with the config of the peer
    file it was run against (--peers-from named in its own peers_from), and refused with any other."""
    cfg = {
        **bench.SIZES["llama70b"],
        "shape": "llama70b",
        "seqs": [2048],
        "ttt_steps": 7,
        "target_off_draft_scale": 0.5,
        "peer_process": "per-shape",
    }
    peers = {
        "date": "2026-12-04",
        "device": "NVIDIA H200",
        "mode": "peers-only",
        "config": cfg,
        "peers_raw": {"speculators": [{"config": "seq2048", "set": "frozen", "real_tokens_per_s": 100.0}]},
    }
    pf, other = tmp_path / "peers-a.json", tmp_path / "peers-b.json"
    pf.write_text(json.dumps(peers))
    other.write_text(json.dumps(peers))
    ours = {"ours": {"frozen_stored": _rec(0.8, 125.0)}}
    res = {
        "date": "2026-12-04",
        "device": "NVIDIA H200",
        "by_length": {"2048": ours},
        "peers_from": {"file": str(pf)},
        "peers_raw": {},
    }
    f = tmp_path / "r.json"
    f.write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="no config"):
        bench.rescore(str(f), str(other))
    out = bench.rescore(str(f), str(pf))
    assert out["config"]["hidden_size"] == 8192 and "config taken from the peer file" in out["rescored"]
    assert out["by_length"]["2048"]["ratios"]["vs_speculators_stored"] == pytest.approx(1.25)


def test_a_peer_whose_shape_timed_out_skips_the_shapes_its_share_cannot_hold(monkeypatch):
    """Each shape compiles anew: after one ran out of its timeout, a later shape of the same peer
    with less than 1.25x that time is skipped (its time left to the next peer), and says why."""
    ran, clock = [], [0.0]

    def fake_run_peer(name, cmd, t, log, one):
        ran.append((name, cmd[cmd.index("--seqs") + 1]))
        timed_out = name == "speculators"
        clock[0] += t if timed_out else 1.0  # a timed-out run used all of its time
        one.update(status="timed out" if timed_out else "done")
        return []

    monkeypatch.setattr(bench, "run_peer", fake_run_peer)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    a = bench.argparse.Namespace(
        size="toy",
        ttt=7,
        peer_iters=1,
        peer_warmup=1,
        seqs=[2048, 4096],
        mix_passes=1,
        no_speculators=False,
        no_specforge=False,
        pack_len=128,
        spec_loss="eager",
        spec_attn=None,
        sf_attn=None,
        speculators_share=0.5,
    )
    runs = {}
    bench.run_peers(a, None, False, lambda: 100.0, lambda m: None, lambda p, r: runs.update(r), peers_only=True)
    assert ran == [("speculators", "2048"), ("specforge", "2048"), ("specforge", "4096")]
    skipped = runs["speculators"]["shapes"][1]
    assert skipped["status"].startswith("skipped: 4096 (a shape before timed out") and "--budget-s" in skipped["status"]
    assert runs["speculators"]["status"].startswith("skipped") and "timed out" in runs["speculators"]["status"]


def test_the_mix_goal_states_its_bound_by_the_same_rule_as_its_figure():
    """The mix goal's figure is min(frozen / speculators, trainable / the faster peer trained); its
    bound is the same rule over the packed rows' GEMMs-alone rates."""
    recs = [{"config": "mix", "set": s, "real_tokens_per_s": v} for s, v in (("frozen", 100.0), ("trained", 90.0))]
    out = {
        "config": {"hidden_size": 7168},
        "by_length": {},
        "mix": {"gemm_ceiling": {"frozen": {"real_tokens_per_s": 180.0}, "trainable": {"real_tokens_per_s": 150.0}}},
        "mix_results": {
            "packed_frozen_stored": {"real_tokens_per_s": 160.0},
            "packed_trainable_stored": {"real_tokens_per_s": 126.0},
        },
        "peers_raw": {
            "speculators": recs,
            "specforge": [{"config": "mix", "set": "trained", "real_tokens_per_s": 60.0}],
        },
        "peers_requested": ["speculators", "specforge"],
    }
    goals = {g["goal"]: g for g in bench.score(out)}
    g = goals["length mix: real-token rate vs the faster peer (same trainable set each, mask stored)"]
    assert g["value"] == pytest.approx(min(160 / 100, 126 / 90))
    assert out["mix_ratios"]["speedup_vs_best_peer_at_gemm_ceiling"] == pytest.approx(min(180 / 100, 150 / 90))
    assert g["note"].endswith(f"(speculators); at the step's GEMMs alone (cuBLAS ceiling): {150 / 90:.3f}")


def test_peers_from_another_gpu_names_its_gemm_time_against_ours():
    """Peers measured on another GPU (--peers-from, or side_by_side.py's second GPU): the peer
    file's own GEMM probe (a --peers-only file's gemm_ceiling, or a full run's by_length) against
    this call's, per length, in the ratio and in the peer goals' notes; none without a probe."""
    T = 2048
    ceil = {
        "rows": T,
        "sets": {
            "frozen": {"gemm_s": 0.1, "tflops": 100.0, "mfu_ceiling": 0.9},
            "trainable": {"gemm_s": 0.2, "tflops": 100.0, "mfu_ceiling": 0.9},
        },
    }
    peers_only = {"gemm_ceiling": {str(T): json.loads(json.dumps(ceil))}}
    peers_only["gemm_ceiling"][str(T)]["sets"]["frozen"]["gemm_s"] = 0.102
    full = {"by_length": {str(T): {"gemm_ceiling": ceil}, "4096": {"ours": {}}}}
    assert bench.peer_gemm_s(peers_only) == {str(T): 0.102}
    assert bench.peer_gemm_s(full) == {str(T): 0.1}  # a length with no probe is left out
    assert bench.peer_gemm_s({"by_length": {}}) == {}
    ours = {f"{k}_{m}": _rec(0.8, 1000.0) for k in ("frozen", "trainable") for m in ("computed", "stored")}
    peers = {
        "speculators": [
            {
                "config": f"seq{T}",
                "set": s,
                "real_tokens_per_s": 500.0,
                "peak_mem_gib": 1.0,
                "impl": "speculators-x",
                "lm_head_trainable": s == "trained",
            }
            for s in ("frozen", "trained")
        ]
    }
    out = {
        "config": {"hidden_size": 64, "vocab_size": 1000, "draft_vocab_size": 200},
        "by_length": {str(T): {"ours": ours, "gemm_ceiling": ceil}},
        "peers_raw": peers,
        "peers_requested": ["speculators"],
        "device": "cpu",
    }
    bench.note_peers_from(out, dict(peers_only, device="cpu"), "p.json", ["speculators"])
    goals = {g["goal"]: g for g in bench.score(out)}
    assert out["by_length"][str(T)]["ratios"]["peer_gpu_gemm_time_vs_ours"] == pytest.approx(1.02)
    for name in (
        f"T{T} vs the faster peer, lm_head frozen, mask stored",
        f"T{T} vs SpecForge, lm_head trained, mask stored",
    ):
        assert "the peers' GPU took 1.020x this one's time at the step's GEMMs" in goals[name]["note"]
    out["peers_from"]["gemm_s"] = {}
    goals = {g["goal"]: g for g in bench.score(out)}
    assert out["by_length"][str(T)]["ratios"]["peer_gpu_gemm_time_vs_ours"] is None
    assert "peers' GPU" not in goals[f"T{T} vs the faster peer, lm_head frozen, mask stored"]["note"]
