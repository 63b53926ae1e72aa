"""The training-speed benchmark on the CPU: it runs at toy size and writes its fields, its FLOP
count and scoring, and the train step's clipping inside the optimizer. That the fast path it
times computes the reference's loss and gradients: tests/model/test_fast_path.py."""

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import bench_train_h200 as bench_mod
import pytest
import torch
from bench_train_h200 import SIZES, flops_per_token, score
from bench_train_h200 import main as bench_main
from toys import toy_batch, toy_cfg, toy_drafter

from draftport.model.config import DrafterConfig
from draftport.model.fast.path import FastPath
from draftport.training.loop import TrainConfig, train_step
from draftport.training.optim import AdamW

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_train_h200.py"


def test_bench_runs_toy_on_cpu_and_writes_fields(tmp_path):
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--size",
            "toy",
            "--no-peers",
            "--iters",
            "1",
            "--warmup",
            "1",
            "--ladder",
            "--check",
            "--mix",
            "6",
            "--mix-computed",
            "--json",
            str(out),
            "--log",
            str(log),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for k in (
        "tokens_per_s",
        "mfu",
        "mfu_with_mask",
        "peak_mem_gib",
        "config",
        "versions",
        "flops_per_token",
        "tokens_per_s_lm_head_trainable",
        "ours",
        "check",
        "check_packed",
        "by_length",
        "mix",
        "mix_results",
        "goals",
        "packed_real_tokens_per_s",
    ):
        assert k in res, k
    assert res["tokens_per_s"] > 0 and res["mfu"] > 0
    assert res["config"]["ttt_steps"] == 7 and res["config"]["size"] == "toy"
    assert [o["name"].split()[0] for o in res["ours"]][:4] == ["L0", "L1", "L2", "L3"]
    assert {o["lm_head"] for o in res["ours"]} == {"frozen", "trainable"}
    assert not [o for o in res["ours"] if "failed" in o]
    assert res["check"]["loss_rel_err"] < 1e-5 and res["check"]["grad_rel_err_max"] < 1e-4
    cp = res["check_packed"]
    assert cp["packed_fused_loss_rel_err"] < 1e-5 and cp["packed_fused_grad_rel_err_max"] < 1e-4
    assert cp["seg_attn_out_rel_err"] < 1e-5 and cp["seg_attn_grad_rel_err_max"] < 1e-4
    mix = res["mix"]
    assert mix["n"] == 6 and max(mix["lengths"]) <= 64 and mix["total_tokens"] == sum(mix["lengths"])
    assert 0 < mix["packed_real_fraction"] <= 1 and 0 < mix["padded_real_fraction"] <= 1
    # the loss counts no padding and no prompt row, fewer still in later TTT steps
    assert 0 < mix["packed_counted_fraction"] < mix["packed_real_fraction"]
    assert 0 < mix["padded_counted_fraction"] < mix["padded_real_fraction"]
    # the timing head puts the target's greedy choice in the draft vocab, as real data does
    assert res["target_argmax_in_draft"] >= 0.99 and res["skip_uncounted"]["on"] is True
    mr = res["mix_results"]
    assert set(mr) == {
        "packed_frozen_computed",
        "padded_frozen_computed",
        "packed_frozen_stored",
        "padded_frozen_stored",
        "packed_trainable_stored",
        "padded_trainable_stored",
    }
    assert res["packed_real_tokens_per_s"] == mr["packed_trainable_stored"]["real_tokens_per_s"] > 0
    # the mix is timed over --mix-passes passes (3 by default); its rate is one pass's real tokens
    # over the median pass
    assert mix["timed_passes"] == 3
    for k, r_ in mr.items():
        per_pass = mix["packed_rows"] if k.startswith("packed") else mix["padded_steps"]
        assert r_["passes"] == 3 and len(r_["pass_s"]) == 3 and r_["steps_timed"] == 3 * per_pass
        assert r_["real_tokens_per_s"] == pytest.approx(mix["total_tokens"] / statistics.median(r_["pass_s"]))
    assert {g["goal"].split()[0] for g in res["goals"]} >= {"T64", "length"}
    text = log.read_text()
    assert "tok/s" in text and "FLOPs/token" in text and "summary:" in text


def test_flop_count_matches_the_anchor_formula_at_kimi_size():

    cfg = DrafterConfig(**SIZES["kimi"], aux_layer_ids=[2, 30, 58])
    H, I, q, DV, T, S = 7168, 18432, 64 * 128, 32000, 2048, 7
    layer = 2 * (3 * 2 * H * q + q * H + 3 * H * I)
    anchor = S * (3 * layer + 2 * 2 * H * DV + 3 * 2 * 2 * (T / 2) * q) + 2 * 2 * 3 * H * H + 2 * H * DV
    ours = flops_per_token(cfg, T, S, lm_head_trainable=False)
    assert abs(ours["train"] / anchor - 1) < 1e-3  # differs only by the diagonal keys and (T+1)/2
    assert flops_per_token(cfg, T, S, True)["train"] - ours["train"] == S * 2 * H * DV
    assert ours["mask_extra"] == 2 * H * (163840 - DV)


@pytest.mark.parametrize("optimizer", ["torch_fused", "draftport"])
def test_clipping_inside_fused_adamw_equals_clip_grad_norm(optimizer):
    """train_step clips inside the optimizer (grad_scale; by default for torch's fused AdamW and
    draftport.training.optim's) as clip_grad_norm_ before the update would."""
    cfg = toy_cfg()
    batch = toy_batch(cfg)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    out = []
    for in_opt in (False, None):  # None: train_step's default
        d = toy_drafter(cfg, seed=2)
        params = [p for p in d.parameters() if p.requires_grad]
        opt = (
            torch.optim.AdamW(params, lr=1e-2, fused=True)
            if optimizer == "torch_fused"
            else AdamW(params, lr=1e-2, compiled=False)
        )
        tcfg = TrainConfig(ttt_steps=3, grad_clip=0.05)  # clipping active
        for _ in range(3):
            _, _, _, _, gnorm = train_step(d, batch, head, opt, params, tcfg, fast=FastPath(), clip_in_optimizer=in_opt)
        out.append((float(gnorm), getattr(opt, "grad_scale", None), [p.detach().clone() for p in params]))
    (n0, s0, p0), (n1, s1, p1) = out
    assert s0 is None and s1 is not None and float(s1) > 1.0  # the default clipped inside
    assert n0 > 0.05 and abs(n0 - n1) < 1e-5 * n0
    for a, b in zip(p0, p1):
        assert torch.allclose(a, b, atol=1e-4)  # AdamW divides by sqrt(v): rounding grows


def test_faster_peer_ratio_needs_every_peer_asked_for():
    """score(): the ratio to the faster peer takes the faster of all the peers asked for; when one
    of them was not measured (it timed out) there is no such ratio, rather than one against the
    peer that happened to finish."""

    def run(peers_raw):
        ours = {
            f"{k}_{m}": {"real_tokens_per_s": v, "mfu": 0.7, "peak_mem_gib": 10.0}
            for k, v in (("frozen", 150.0), ("trainable", 120.0))
            for m in ("computed", "stored")
        }
        out = {
            "by_length": {"2048": {"ours": ours}},
            "peers_raw": peers_raw,
            "peers_requested": ["speculators", "specforge"],
        }
        score(out)
        return out["by_length"]["2048"]["ratios"], out["goals"]

    # speculators' records from before it ran two sets carry no "set": its default, frozen
    sp = {
        "config": "seq2048",
        "real_tokens_per_s": 100.0,
        "peak_mem_gib": 12.0,
        "impl": "speculators-0.9.0",
        "lm_head_trainable": False,
    }
    spt = dict(sp, set="trained", real_tokens_per_s=96.0, peak_mem_gib=11.0, lm_head_trainable=True)
    sff = {
        "config": "seq2048",
        "set": "frozen",
        "real_tokens_per_s": 80.0,
        "peak_mem_gib": 20.0,
        "impl": "specforge-0.2.0",
        "lm_head_trainable": False,
    }
    sft = dict(sff, set="trained", real_tokens_per_s=60.0, lm_head_trainable=True)
    trained_goal = "T2048 lm_head trainable vs the faster peer with lm_head trained, mask stored"
    r, goals = run({"speculators": [spt, sp], "specforge": [sff, sft]})
    assert r["best_peer_lm_head_frozen"] == "speculators" and r["speedup_vs_best_peer_stored"] == 1.5
    assert r["vs_specforge_lm_head_trained_stored"] == 2.0
    # lm_head trained on both sides: the faster of speculators' 96 and SpecForge's 60
    assert r["best_peer_lm_head_trained"] == "speculators" and r["lm_head_trainable_vs_best_peer_stored"] == 1.25
    assert r["lm_head_trainable_vs_best_peer_default_sets_stored"] == 1.2  # vs speculators' frozen 100
    assert {g["goal"]: g["met"] for g in goals}[trained_goal] is True
    # memory at the same set: speculators trained (11 GiB) against ours trainable (10 GiB)
    assert r["peak_mem_peer_over_ours_speculators_trained_stored"] == 1.1
    assert {g["goal"]: g["met"] for g in goals}["T2048 vs the faster peer, lm_head frozen, mask stored"] is True
    r, goals = run({"speculators": [sp], "specforge": [sff, sft]})  # its trained set not run
    assert r["best_peer_lm_head_trained"] is None and r["lm_head_trainable_vs_best_peer_stored"] is None
    assert r["missing_peers_lm_head_trained"] == ["speculators"] and r["speedup_vs_best_peer_stored"] == 1.5
    assert {g["goal"]: g["met"] for g in goals}[trained_goal] is None
    r, goals = run({"speculators": [], "specforge": [sff, sft]})  # speculators timed out
    assert r["best_peer_lm_head_frozen"] is None and r["speedup_vs_best_peer_stored"] is None
    assert r["missing_peers"] == ["speculators"] and r["vs_specforge_lm_head_frozen_stored"] == 150 / 80
    assert {g["goal"]: g["met"] for g in goals}["T2048 vs the faster peer, lm_head frozen, mask stored"] is None


def test_peers_only_then_peers_from_scores_as_one_run(tmp_path):
    """--peers-only writes the peers' records (peers_raw, versions, device, config, mix, wall time);
    --peers-from scores a later call's own figures against them through score(), as --rescore
    would, names the source, and refuses a file that is missing, not JSON, without peers_raw, or
    from other work. The peers' packages are not installed on the CPU test machine: their runs
    fail fast and leave no records, so recorded ones stand in for them."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    peers_file, res_file = tmp_path / "peers.json", tmp_path / "r.json"
    toy = ["--size", "toy", "--mix", "4"]

    def bench(*args):
        return subprocess.run(
            [sys.executable, str(BENCH), *toy, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=tmp_path,
        )

    r = bench("--peers-only", "--json", str(peers_file))
    assert r.returncode == 0, r.stderr[-3000:]
    p = json.loads(peers_file.read_text())
    assert p["mode"] == "peers-only" and p["device"] == "cpu" and "versions" in p and p["wall_s"] > 0
    assert set(p["peers_raw"]) == {"speculators", "specforge"} == set(p["peer_runs"])
    assert p["peers_requested"] == ["speculators", "specforge"]
    assert p["config"]["seqs"] == [64] and p["config"]["ttt_steps"] == 7 and p["config"]["hidden_size"] == 64
    assert p["mix"]["n"] == 4 and "[ours]" not in r.stdout and "[attn]" not in r.stdout
    # each peer once per shape, each in a process of its own (after 2,048 in one process,
    # speculators read 3-6% low at 4,096 and on the mix): the length, then the mix
    for name, script in (("speculators", "speculators_run.py"), ("specforge", "specforge_run.py")):
        cmds = [ln for ln in r.stdout.splitlines() if ln.startswith(f"[{name}] ") and script in ln]
        assert len(cmds) == 2 and len(p["peer_runs"][name]["shapes"]) == 2, r.stdout
        assert "--seqs 64 " in cmds[0] and "--mix " not in cmds[0]
        assert "--mix " in cmds[1] and "--seqs 64" not in cmds[1]
    assert p["config"]["peer_process"] == "per-shape"
    # a peer missing from this Python stops before importing torch, saying so
    assert "speculators_run.py: speculators is not installed in" in r.stdout
    assert "specforge_run.py: specforge is not installed in" in r.stdout

    def rec(config, tps, impl, trained, **kw):
        return dict(
            config=config,
            real_tokens_per_s=tps,
            tokens_per_s=tps,
            peak_mem_gib=1.0,
            impl=impl,
            lm_head_trainable=trained,
            trainable_params=1000,
            step_s_median=0.1,
            **kw,
        )

    p["peers_raw"] = {
        "speculators": [
            rec("seq64", 100.0, "speculators-0.9.0", False, set="frozen"),
            rec("mix", 90.0, "speculators-0.9.0", False, set="frozen"),
            rec("seq64", 95.0, "speculators-0.9.0", True, set="trained"),
            rec("mix", 60.0, "speculators-0.9.0", True, set="trained"),
        ],
        "specforge": [
            rec("seq64", 80.0, "specforge-0.2.0", True, set="trained"),
            rec("seq64", 120.0, "specforge-0.2.0", False, set="frozen"),
            rec("mix", 70.0, "specforge-0.2.0", True, set="trained"),
        ],
    }
    p["versions"].update(speculators="0.9.0", specforge="0.2.0")
    peers_file.write_text(json.dumps(p))

    r = bench("--peers-from", str(peers_file), "--iters", "1", "--warmup", "1", "--json", str(res_file))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speculators_run.py" not in r.stdout and f"(from {peers_file})" in r.stdout  # no peer ran
    assert f"peer figures in these ratios come from {peers_file}" in r.stdout
    res = json.loads(res_file.read_text())
    pf = res["peers_from"]
    assert pf["file"] == str(peers_file.resolve()) and pf["device"] == "cpu" and pf["mode"] == "peers-only"
    assert res["versions"]["speculators"] == "0.9.0" and res["peers_raw"] == p["peers_raw"]
    ours = res["by_length"]["64"]["ours"]
    ra = res["by_length"]["64"]["ratios"]
    assert ra["best_peer_lm_head_frozen"] == "specforge" and ra["missing_peers"] == []
    assert ra["speedup_vs_best_peer_stored"] == pytest.approx(ours["frozen_stored"]["real_tokens_per_s"] / 120.0)
    assert ra["vs_specforge_lm_head_trained_stored"] == pytest.approx(
        ours["trainable_stored"]["real_tokens_per_s"] / 80
    )
    assert ra["best_peer_lm_head_trained"] == "speculators"
    assert ra["lm_head_trainable_vs_best_peer_stored"] == pytest.approx(
        ours["trainable_stored"]["real_tokens_per_s"] / 95
    )
    mr, mres = res["mix_ratios"], res["mix_results"]
    # trained on the mix: SpecForge's 70 beats speculators' 60
    assert mr["best_peer_lm_head_trained"] == "specforge"
    assert mr["speedup_vs_best_peer"] == pytest.approx(
        min(
            mres["packed_frozen_stored"]["real_tokens_per_s"] / 90.0,
            mres["packed_trainable_stored"]["real_tokens_per_s"] / 70,
        )
    )
    assert all(g["value"] is not None for g in res["goals"] if "faster peer" in g["goal"])
    # the same ratios and goals as --rescore computes from these records
    again = tmp_path / "again.json"
    again.write_text(res_file.read_text())
    assert (
        subprocess.run(
            [sys.executable, str(BENCH), "--rescore", str(again)], capture_output=True, timeout=120, env=env
        ).returncode
        == 0
    )
    assert json.loads(again.read_text())["goals"] == res["goals"]
    # --rescore with --peers-from: the same records of ours against another call's peers (twice as fast)
    p2 = json.loads(json.dumps(p))
    for recs in p2["peers_raw"].values():
        for r_ in recs:
            r_["real_tokens_per_s"] *= 2
    peers2 = tmp_path / "peers2.json"
    peers2.write_text(json.dumps(p2))
    r = subprocess.run(
        [sys.executable, str(BENCH), "--rescore", str(again), "--peers-from", str(peers2)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    re2 = json.loads(again.read_text())
    assert re2["peers_raw"] == p2["peers_raw"] and re2["peers_from"]["file"] == str(peers2.resolve())
    assert "peers2.json" in re2["rescored"]
    ra2 = re2["by_length"]["64"]["ratios"]
    assert ra2["speedup_vs_best_peer_stored"] == pytest.approx(ra["speedup_vs_best_peer_stored"] / 2)
    assert ra2["vs_specforge_lm_head_trained_stored"] == pytest.approx(ra["vs_specforge_lm_head_trained_stored"] / 2)
    p3 = dict(p2, config=dict(p2["config"], seqs=[32]))
    (tmp_path / "peers3.json").write_text(json.dumps(p3))
    before = again.read_text()
    r = subprocess.run(
        [sys.executable, str(BENCH), "--rescore", str(again), "--peers-from", str(tmp_path / "peers3.json")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.returncode == 1 and "config differs" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert again.read_text() == before

    # refusals: one line on stderr, exit 1, before any work
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "nopeers.json").write_text(json.dumps({"config": p["config"], "mix": p["mix"]}))
    shared = dict(p, config={k: v for k, v in p["config"].items() if k != "peer_process"})
    (tmp_path / "shared.json").write_text(json.dumps(shared))  # peers run several shapes per process
    for args, why in (
        ([str(tmp_path / "missing.json")], "no such file"),
        ([str(tmp_path / "bad.json")], "not JSON"),
        ([str(tmp_path / "nopeers.json")], "no peers_raw"),
        ([str(peers_file), "--ttt", "5"], "ttt_steps"),
        ([str(peers_file), "--mix-seed", "3"], "mix"),
        ([str(peers_file), "--seqs", "32"], "seqs"),
        ([str(tmp_path / "shared.json")], "peer_process"),
        ([str(peers_file), "--mix-prompt-share", "0.25"], "mix"),
    ):
        r = bench("--peers-from", *args, "--json", str(tmp_path / "x.json"))
        assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not (tmp_path / "x.json").exists()


def test_merge_peers_takes_each_peer_from_the_file_that_measured_it(tmp_path):
    """--merge-peers: two calls' peer files on one machine as one --peers-from file (a peer that
    failed in the first, measured in the second); files of other work or another device refused
    with one line."""

    def peers_file(name, raw, runs, device="NVIDIA H200", seqs=(2048, 4096)):
        f = tmp_path / name
        f.write_text(
            json.dumps(
                {
                    "date": "2026-12-02",
                    "device": device,
                    "mode": "peers-only",
                    "wall_s": 10.0,
                    "config": {"hidden_size": 7168, "seqs": list(seqs), "ttt_steps": 7},
                    "mix": {"lengths": [5, 7], "pack_len": 8192},
                    "peers_requested": ["speculators", "specforge"],
                    "peers_raw": raw,
                    "peer_runs": runs,
                }
            )
        )
        return str(f)

    sf = [{"config": "seq2048", "set": "trained", "real_tokens_per_s": 9000.0}]
    sp = [{"config": "seq2048", "set": "frozen", "real_tokens_per_s": 11900.0}]
    a = peers_file(
        "a.json",
        {"speculators": [], "specforge": sf},
        {"speculators": {"status": "failed (rc 1)"}, "specforge": {"status": "done"}},
    )
    b = peers_file("b.json", {"speculators": sp}, {"speculators": {"status": "done"}})

    out = tmp_path / "m.json"
    bench_main(["--merge-peers", a, b, "--json", str(out)])
    m = json.loads(out.read_text())
    assert m["peers_raw"] == {"speculators": sp, "specforge": sf}
    assert m["peer_runs"]["speculators"]["status"] == "done" and m["peer_runs"]["specforge"]["status"] == "done"
    assert [x["peers"] for x in m["merged_from"]] == [["specforge"], ["speculators"]] and m["wall_s"] == 20.0
    for bad, why in (
        (peers_file("c.json", {"speculators": sp}, {}, device="NVIDIA H100"), "measured on NVIDIA H100"),
        (peers_file("d.json", {"speculators": sp}, {}, seqs=(2048,)), "config differs"),
        (str(tmp_path / "none.json"), "no such file"),
    ):
        with pytest.raises(SystemExit) as e:  # the CLI prints it as one line and exits 1
            bench_main(["--merge-peers", a, bad, "--json", str(tmp_path / "x.json")])
        assert why in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "x.json").exists()


def test_mix_prompts_mask_the_same_rows_in_ours_and_name_them_for_the_peers(tmp_path, monkeypatch):
    """--mix-prompt-share: each mix sample's first share of tokens is a prompt (at least the
    default 16, a quarter of a shorter sample) in our samples' loss masks, and the mix file the
    peers' runners read lists the same prompt lengths (without it, no "prompts" key: the peers'
    loss takes every row, as before)."""

    lengths = [40, 100, 2048]
    assert bench_mod.mix_prompts(lengths) == [10, 16, 16]
    assert bench_mod.mix_prompts(lengths, 0.25) == [10, 25, 512]
    cfg = toy_cfg()
    for share in (0.0, 0.25):
        samples = bench_mod.mix_samples(cfg, lengths, torch.device("cpu"), torch.float32, prompt_share=share)
        for s_, n, p_ in zip(samples, lengths, bench_mod.mix_prompts(lengths, share)):
            assert s_["response_start"] == p_ and int((~s_["loss_mask"]).sum()) == p_ and len(s_["tokens"]) == n
    written = []

    def fake_run_peer(name, cmd, t, log, one):
        written.append(json.loads(Path(cmd[cmd.index("--mix") + 1]).read_text()))
        one.update(status="done")
        return []

    monkeypatch.setattr(bench_mod, "run_peer", fake_run_peer)
    for share in (0.0, 0.25):
        a = bench_mod.argparse.Namespace(
            size="toy",
            ttt=7,
            peer_iters=1,
            peer_warmup=1,
            seqs=[],
            mix_passes=1,
            no_speculators=False,
            no_specforge=True,
            pack_len=128,
            spec_loss="eager",
            spec_attn=None,
            speculators_share=0.5,
        )
        mix = {"lengths": lengths, "prompt_share": share}
        written.clear()
        bench_mod.run_peers(a, mix, False, lambda: 100.0, lambda m: None, lambda p, r: None, peers_only=True)
        assert written and written[0]["lengths"] == lengths
        assert written[0].get("prompts") == (bench_mod.mix_prompts(lengths, share) if share else None)


def test_profile_kinds_put_flash_varlen_under_attention():
    """The profile's breakdown by kind: FlashAttention's kernels name cutlass in their template
    arguments and were counted as GEMMs; attention is matched first."""
    spec = importlib.util.spec_from_file_location("bench_train_h200", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kind = bench.kernel_kind
    assert (
        kind(
            "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits"
            "<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>>"
        )
        == "attention"
    )
    assert (
        kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bfloat16_t>>") == "attention"
    )
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kind("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>") == "gemm"
    assert kind("triton_poi_fused__to_copy_mul_silu_0") == "compiled elementwise (triton)"
