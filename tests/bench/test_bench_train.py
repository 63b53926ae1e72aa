"""The training-speed work on the CPU: the benchmark runs at toy size and writes its fields, and
the fused GPU path (flash attention + log-sum-exp merge, chunked fused soft-CE) computes the same
loss and gradients as the reference path."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftport.model.config import DrafterConfig
from draftport.data.shards import Batch
from draftport.model.drafter import Attention
from draftport.model.fast.kernels import ttt_attention
from draftport.training.loop import TrainConfig, train
from draftport.training.ttt import combine, ttt_terms
from toys import make_features, make_samples, toy_batch, toy_cfg, toy_drafter

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "bench_train_h200.py"


def test_bench_runs_toy_on_cpu_and_writes_fields(tmp_path):
    out, log = tmp_path / "r.json", tmp_path / "r.log"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(BENCH), "--size", "toy", "--no-peers", "--iters", "1",
                        "--warmup", "1", "--ladder", "--check", "--mix", "6", "--mix-computed", "--json", str(out), "--log", str(log)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    for k in ("tokens_per_s", "mfu", "mfu_with_mask", "peak_mem_gib", "config", "versions",
              "flops_per_token", "tokens_per_s_lm_head_trainable", "ours", "check", "check_packed",
              "by_length", "mix", "mix_results", "goals", "packed_real_tokens_per_s"):
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
    assert set(mr) == {"packed_frozen_computed", "padded_frozen_computed", "packed_frozen_stored",
                       "padded_frozen_stored", "packed_trainable_stored", "padded_trainable_stored"}
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
    sys.path.insert(0, str(BENCH.parent))
    from bench_train_h200 import SIZES, flops_per_token

    cfg = DrafterConfig(**SIZES["kimi"], aux_layer_ids=[2, 30, 58])
    H, I, q, DV, T, S = 7168, 18432, 64 * 128, 32000, 2048, 7
    layer = 2 * (3 * 2 * H * q + q * H + 3 * H * I)
    anchor = S * (3 * layer + 2 * 2 * H * DV + 3 * 2 * 2 * (T / 2) * q) + 2 * 2 * 3 * H * H + 2 * H * DV
    ours = flops_per_token(cfg, T, S, lm_head_trainable=False)
    assert abs(ours["train"] / anchor - 1) < 1e-3   # differs only by the diagonal keys and (T+1)/2
    assert flops_per_token(cfg, T, S, True)["train"] - ours["train"] == S * 2 * H * DV
    assert ours["mask_extra"] == 2 * H * (163840 - DV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_diag", [0, 1, 3])
def test_fused_attention_matches_reference(dtype, n_diag):
    g = torch.Generator().manual_seed(n_diag)
    B, h, T, d = 2, 3, 17, 16

    def r():
        return torch.randn(B, h, T, d, dtype=dtype, generator=g).requires_grad_(True)

    q, ks, vs = r(), [r() for _ in range(n_diag + 1)], [r() for _ in range(n_diag + 1)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(1, 1, T, T, dtype=dtype).masked_fill(~causal, float("-inf"))

    class Cfg:
        head_dim = d

    ref = Attention.attend_core(Cfg(), q, ks, vs, bias)
    fast = ttt_attention(q, ks, vs, 1 / math.sqrt(d))
    go = torch.randn(ref.shape, dtype=dtype, generator=g)
    gr = torch.autograd.grad((ref * go).sum(), [q, *ks, *vs])
    gf = torch.autograd.grad((fast * go).sum(), [q, *ks, *vs])
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(gf, gr):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("train_head", [False, True])
def test_fused_ttt_terms_match_reference(train_head):
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=3)
    d.lm_head.weight.requires_grad_(train_head)
    batch = toy_batch(cfg, B=2, T=12)               # row 1 right-padded by 3
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    out = []
    for fused in (False, True):
        d.zero_grad(set_to_none=True)
        terms = ttt_terms(d, batch, head, 4, fused=fused, chunk=5)   # chunk < T: several chunks
        loss, stats = combine(terms, 0.8)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        out.append((float(loss.detach()), stats, grads))
    (l0, s0, g0), (l1, s1, g1) = out
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    assert s0.keys() == s1.keys() and all(abs(s0[k] - s1[k]) < 1e-5 * max(1, abs(s0[k])) for k in s0)
    assert g0.keys() == g1.keys() and ("lm_head.weight" in g0) == train_head
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-4), k


def test_fused_path_refuses_left_padding():
    cfg = toy_cfg()
    d = toy_drafter(cfg)
    batch = toy_batch(cfg, B=2, T=12)
    batch.valid[0, :2] = False
    with pytest.raises(RuntimeError):
        ttt_terms(d, batch, torch.randn(cfg.vocab_size, cfg.hidden_size), 3, fused=True)


def test_train_fused_impl_follows_reference(tmp_path):
    fs, head = make_features(tmp_path)
    hist = {}
    for impl in ("reference", "fused"):
        cfg = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=100, log_every=1,
                          impl=impl)
        hist[impl] = train(toy_drafter(seed=5), fs, head, tmp_path / impl, cfg, progress=False)["history"]
    for a, b in zip(hist["reference"], hist["fused"]):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)


def test_captured_target_argmax_needs_only_the_draft_rows_of_the_head():
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=4)
    batch = toy_batch(cfg, B=2, T=12)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    ref, _ = combine(ttt_terms(d, batch, head, 3), 0.8)
    batch.target_arg = (batch.final @ head.t()).argmax(-1)       # as a capture would store it
    rows = head[d.hot_ids]                                        # draft rows only, slot order
    fused, _ = combine(ttt_terms(d, batch, rows, 3, fused=True), 0.8)
    assert abs(float(ref.detach()) - float(fused.detach())) < 1e-5 * abs(float(ref.detach()))


@pytest.mark.parametrize("optimizer", ["torch_fused", "draftport"])
def test_clipping_inside_fused_adamw_equals_clip_grad_norm(optimizer):
    """train_step clips inside the optimizer (grad_scale; by default for torch's fused AdamW and
    draftport.training.optim's) as clip_grad_norm_ before the update would."""
    from draftport.training.optim import AdamW
    from draftport.training.loop import train_step

    cfg = toy_cfg()
    batch = toy_batch(cfg)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    out = []
    for in_opt in (False, None):   # None: train_step's default
        d = toy_drafter(cfg, seed=2)
        params = [p for p in d.parameters() if p.requires_grad]
        opt = (torch.optim.AdamW(params, lr=1e-2, fused=True) if optimizer == "torch_fused"
               else AdamW(params, lr=1e-2, compiled=False))
        tcfg = TrainConfig(ttt_steps=3, grad_clip=0.05)          # clipping active
        for _ in range(3):
            _, _, _, _, gnorm = train_step(d, batch, head, opt, params, tcfg, impl="fused",
                                           clip_in_optimizer=in_opt)
        out.append((float(gnorm), getattr(opt, "grad_scale", None), [p.detach().clone() for p in params]))
    (n0, s0, p0), (n1, s1, p1) = out
    assert s0 is None and s1 is not None and float(s1) > 1.0     # the default clipped inside
    assert n0 > 0.05 and abs(n0 - n1) < 1e-5 * n0
    for a, b in zip(p0, p1):
        assert torch.allclose(a, b, atol=1e-4)   # AdamW divides by sqrt(v): rounding grows


@pytest.mark.parametrize("accumulate", [False, True])
def test_fused_projections_match_separate_gemms(accumulate):
    """The fuse_projections lever (q/k/v and gate/up as one GEMM each, gradients as row views of
    one buffer when summed in place) computes the same loss, gradients and updates."""
    from draftport.training.loop import train_step

    cfg = toy_cfg()
    batch = toy_batch(cfg, B=2, T=12)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    out = []
    for fuse in (False, True):
        d = toy_drafter(cfg, seed=6)
        d.accumulate_wgrad, d.fuse_projections = accumulate, fuse
        params = [p for p in d.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for _ in range(3):   # several steps: the in-place sums restart at each step
            loss, *_ = train_step(d, batch, head, opt, params, TrainConfig(ttt_steps=4), impl="fused")
            losses.append(float(loss.detach()))
        out.append((losses, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None},
                    [p.detach().clone() for p in params]))
    (l0, g0, p0), (l1, g1, p1) = out
    assert l0 == pytest.approx(l1, rel=1e-5)
    assert g0.keys() == g1.keys()
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-4), k
    for a, b in zip(p0, p1):
        assert torch.allclose(a, b, atol=1e-4)   # AdamW divides by sqrt(v): rounding grows


def test_faster_peer_ratio_needs_every_peer_asked_for():
    """score(): the ratio to the faster peer takes the faster of all the peers asked for; when one
    of them was not measured (it timed out) there is no such ratio, rather than one against the
    peer that happened to finish."""
    sys.path.insert(0, str(BENCH.parent))
    from bench_train_h200 import score

    def run(peers_raw):
        ours = {f"{k}_{m}": {"real_tokens_per_s": v, "mfu": 0.7, "peak_mem_gib": 10.0}
                for k, v in (("frozen", 150.0), ("trainable", 120.0)) for m in ("computed", "stored")}
        out = {"by_length": {"2048": {"ours": ours}}, "peers_raw": peers_raw,
               "peers_requested": ["speculators", "specforge"]}
        score(out)
        return out["by_length"]["2048"]["ratios"], out["goals"]

    # speculators' records from before it ran two sets carry no "set": its default, frozen
    sp = {"config": "seq2048", "real_tokens_per_s": 100.0, "peak_mem_gib": 12.0, "impl": "speculators-0.9.0",
          "lm_head_trainable": False}
    spt = dict(sp, set="trained", real_tokens_per_s=96.0, peak_mem_gib=11.0, lm_head_trainable=True)
    sff = {"config": "seq2048", "set": "frozen", "real_tokens_per_s": 80.0, "peak_mem_gib": 20.0,
           "impl": "specforge-0.2.0", "lm_head_trainable": False}
    sft = dict(sff, set="trained", real_tokens_per_s=60.0, lm_head_trainable=True)
    trained_goal = "T2048 lm_head trainable vs the faster peer with lm_head trained, mask stored"
    r, goals = run({"speculators": [spt, sp], "specforge": [sff, sft]})
    assert r["best_peer_lm_head_frozen"] == "speculators" and r["speedup_vs_best_peer_stored"] == 1.5
    assert r["vs_specforge_lm_head_trained_stored"] == 2.0
    # lm_head trained on both sides: the faster of speculators' 96 and SpecForge's 60
    assert r["best_peer_lm_head_trained"] == "speculators" and r["lm_head_trainable_vs_best_peer_stored"] == 1.25
    assert r["lm_head_trainable_vs_best_peer_default_sets_stored"] == 1.2   # vs speculators' frozen 100
    assert {g["goal"]: g["met"] for g in goals}[trained_goal] is True
    # memory at the same set: speculators trained (11 GiB) against ours trainable (10 GiB)
    assert r["peak_mem_peer_over_ours_speculators_trained_stored"] == 1.1
    assert {g["goal"]: g["met"] for g in goals}["T2048 vs the faster peer, lm_head frozen, mask stored"] is True
    r, goals = run({"speculators": [sp], "specforge": [sff, sft]})   # its trained set not run
    assert r["best_peer_lm_head_trained"] is None and r["lm_head_trainable_vs_best_peer_stored"] is None
    assert r["missing_peers_lm_head_trained"] == ["speculators"] and r["speedup_vs_best_peer_stored"] == 1.5
    assert {g["goal"]: g["met"] for g in goals}[trained_goal] is None
    r, goals = run({"speculators": [], "specforge": [sff, sft]})   # speculators timed out
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
        return subprocess.run([sys.executable, str(BENCH), *toy, *args], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)

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
        return dict(config=config, real_tokens_per_s=tps, tokens_per_s=tps, peak_mem_gib=1.0, impl=impl,
                    lm_head_trainable=trained, trainable_params=1000, step_s_median=0.1, **kw)

    p["peers_raw"] = {
        "speculators": [rec("seq64", 100.0, "speculators-0.9.0", False, set="frozen"),
                        rec("mix", 90.0, "speculators-0.9.0", False, set="frozen"),
                        rec("seq64", 95.0, "speculators-0.9.0", True, set="trained"),
                        rec("mix", 60.0, "speculators-0.9.0", True, set="trained")],
        "specforge": [rec("seq64", 80.0, "specforge-0.2.0", True, set="trained"),
                      rec("seq64", 120.0, "specforge-0.2.0", False, set="frozen"),
                      rec("mix", 70.0, "specforge-0.2.0", True, set="trained")]}
    p["versions"].update(speculators="0.9.0", specforge="0.2.0")
    peers_file.write_text(json.dumps(p))

    r = bench("--peers-from", str(peers_file), "--iters", "1", "--warmup", "1", "--json", str(res_file))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "speculators_run.py" not in r.stdout and f"(from {peers_file})" in r.stdout   # no peer ran
    assert f"peer figures in these ratios come from {peers_file}" in r.stdout
    res = json.loads(res_file.read_text())
    pf = res["peers_from"]
    assert pf["file"] == str(peers_file.resolve()) and pf["device"] == "cpu" and pf["mode"] == "peers-only"
    assert res["versions"]["speculators"] == "0.9.0" and res["peers_raw"] == p["peers_raw"]
    ours = res["by_length"]["64"]["ours"]
    ra = res["by_length"]["64"]["ratios"]
    assert ra["best_peer_lm_head_frozen"] == "specforge" and ra["missing_peers"] == []
    assert ra["speedup_vs_best_peer_stored"] == pytest.approx(ours["frozen_stored"]["real_tokens_per_s"] / 120.0)
    assert ra["vs_specforge_lm_head_trained_stored"] == pytest.approx(ours["trainable_stored"]["real_tokens_per_s"] / 80)
    assert ra["best_peer_lm_head_trained"] == "speculators"
    assert ra["lm_head_trainable_vs_best_peer_stored"] == pytest.approx(ours["trainable_stored"]["real_tokens_per_s"] / 95)
    mr, mres = res["mix_ratios"], res["mix_results"]
    # trained on the mix: SpecForge's 70 beats speculators' 60
    assert mr["best_peer_lm_head_trained"] == "specforge"
    assert mr["speedup_vs_best_peer"] == pytest.approx(min(mres["packed_frozen_stored"]["real_tokens_per_s"] / 90.0,
                                                           mres["packed_trainable_stored"]["real_tokens_per_s"] / 70))
    assert all(g["value"] is not None for g in res["goals"] if "faster peer" in g["goal"])
    # the same ratios and goals as --rescore computes from these records
    again = tmp_path / "again.json"
    again.write_text(res_file.read_text())
    assert subprocess.run([sys.executable, str(BENCH), "--rescore", str(again)], capture_output=True,
                          timeout=120, env=env).returncode == 0
    assert json.loads(again.read_text())["goals"] == res["goals"]
    # --rescore with --peers-from: the same records of ours against another call's peers (twice as fast)
    p2 = json.loads(json.dumps(p))
    for recs in p2["peers_raw"].values():
        for r_ in recs:
            r_["real_tokens_per_s"] *= 2
    peers2 = tmp_path / "peers2.json"
    peers2.write_text(json.dumps(p2))
    r = subprocess.run([sys.executable, str(BENCH), "--rescore", str(again), "--peers-from", str(peers2)],
                       capture_output=True, text=True, timeout=120, env=env)
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
    r = subprocess.run([sys.executable, str(BENCH), "--rescore", str(again), "--peers-from", str(tmp_path / "peers3.json")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and "config differs" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert again.read_text() == before

    # refusals: one line on stderr, exit 1, before any work
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "nopeers.json").write_text(json.dumps({"config": p["config"], "mix": p["mix"]}))
    shared = dict(p, config={k: v for k, v in p["config"].items() if k != "peer_process"})
    (tmp_path / "shared.json").write_text(json.dumps(shared))   # peers run several shapes per process
    for args, why in (([str(tmp_path / "missing.json")], "no such file"), ([str(tmp_path / "bad.json")], "not JSON"),
                      ([str(tmp_path / "nopeers.json")], "no peers_raw"),
                      ([str(peers_file), "--ttt", "5"], "ttt_steps"), ([str(peers_file), "--mix-seed", "3"], "mix"),
                      ([str(peers_file), "--seqs", "32"], "seqs"), ([str(tmp_path / "shared.json")], "peer_process"),
                      ([str(peers_file), "--mix-prompt-share", "0.25"], "mix")):
        r = bench("--peers-from", *args, "--json", str(tmp_path / "x.json"))
        assert r.returncode == 1 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not (tmp_path / "x.json").exists()


def _train_steps(d, batch, head, n=3):
    """n fused train steps -> (losses, the first step's gradients, the parameters after n)."""
    from draftport.training.loop import train_step

    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], None
    for _ in range(n):   # several steps: the in-place sums restart at each step
        loss, *_ = train_step(d, batch, head, opt, params, TrainConfig(ttt_steps=4), impl="fused")
        losses.append(float(loss.detach()))
        if grads is None:
            grads = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    return losses, grads, [p.detach().clone() for p in params]


def _fp64_problem(cfg, packed: bool, seed: int):
    """A target head and a batch in fp64: two padded rows, or six samples packed into rows of 14."""
    from draftport.data.packing import pack

    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)
    if packed:
        return head, pack(make_samples(cfg, (9, 5, 12, 3, 7, 2)), row_len=14, dtype=torch.float64)[0]
    b = toy_batch(cfg, B=2, T=12)
    return head, Batch(b.aux.double(), b.final.double(), b.tokens, b.loss_mask, b.valid)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_embedding_half_once_per_unroll_matches_every_step(accumulate, packed):
    """embed_once (the embedding half of q/k/v as one table per unroll, each step a slice of it)
    gives the losses, gradients and updates of the 2H-wide GEMMs at every step (fp64), padded
    and packed (rows past a sample's end fed token 0), gradients summed in place or not."""
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=8)
    out = []
    for once in (False, True):
        d = toy_drafter(cfg, seed=6).double()
        d.accumulate_wgrad, d.embed_once = accumulate, once
        out.append(_train_steps(d, batch, head))
    (l0, g0, p0), (l1, g1, p1) = out
    assert l0 == pytest.approx(l1, rel=1e-10)
    assert g0.keys() == g1.keys() and "midlayer.input_layernorm.weight" in g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-12, rtol=1e-9), k
    for a, b in zip(p0, p1):
        assert torch.allclose(a, b, atol=1e-6)   # AdamW divides by sqrt(v): rounding grows


def test_embedding_half_once_skips_exactly_its_repeated_gemms():
    """The FLOPs saved are the embedding half's forward, input grad and weight grad at every
    step but one (the table has T-1+steps rows instead of steps x T), counted by torch's
    FlopCounterMode over forward and backward (told to count addmm_ as well: the input
    gradients of q/k/v are summed inside their GEMMs, and it counts no in-place GEMM)."""
    from torch.utils.flop_counter import FlopCounterMode

    def addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    from draftport.training import ttt

    cfg = toy_cfg()
    b = toy_batch(cfg, B=2, T=12)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    flops = {}
    default = ttt._LIVE["on"]
    try:
        ttt.set_skip_dead_rows(False)   # every row at every step: this lever's saving alone
        for once in (False, True):
            d = toy_drafter(cfg, seed=6)
            d.embed_once = once
            with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_inplace}) as fc:
                loss, _ = combine(ttt_terms(d, b, head, 4, fused=True, chunk=5), 0.8)
                loss.backward()
            flops[once] = fc.get_total_flops()
    finally:
        ttt.set_skip_dead_rows(default)
    B, T, S, H = 2, 12, 4, cfg.hidden_size
    n_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    saved = 3 * 2 * H * n_out * B * (S * T - (T - 1 + S))   # fwd, dgrad, wgrad of the half
    assert flops[False] - flops[True] == saved


def test_steps_on_live_rows_skip_exactly_the_dropped_rows_gemms(monkeypatch):
    """ttt.set_skip_dead_rows saves, at each step j >= 1, the midlayer's GEMMs (q/k/v's hidden
    half, o, gate/up, down: forward, input grad and weight grad) over the rows it dropped, and
    nothing else (the attention and the lm_head run as before), counted by FlopCounterMode as
    the embedding-half test counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from draftport.model import drafter as drafter_mod
    from draftport.training import ttt

    def addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    ran = []
    step = drafter_mod.Eagle3Drafter.step

    def record(self, tok, h, *args, **kw):
        ran.append(h.shape[0] * h.shape[1])
        return step(self, tok, h, *args, **kw)

    monkeypatch.setattr(drafter_mod.Eagle3Drafter, "step", record)
    cfg = toy_cfg()
    b = toy_batch(cfg, B=2, T=12)
    b.loss_mask[:, :3] = False   # a prompt
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    flops, rows = {}, {}
    default = ttt._LIVE["on"]
    try:
        for on in (False, True):
            ttt.set_skip_dead_rows(on)
            ran.clear()
            d = toy_drafter(cfg, seed=6)
            with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_inplace}) as fc:
                loss, _ = combine(ttt_terms(d, b, head, 4, fused=True, chunk=5), 0.8)
                loss.backward()
            flops[on], rows[on] = fc.get_total_flops(), list(ran)
    finally:
        ttt.set_skip_dead_rows(default)
    H, I = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    n_out = q + 2 * cfg.num_key_value_heads * cfg.head_dim
    per_row = 3 * 2 * (H * n_out + q * H + 3 * H * I)   # fwd, dgrad, wgrad
    dropped = sum(n0 - n1 for n0, n1 in zip(rows[False][1:], rows[True][1:]))
    assert rows[False] == [24] * 4 and dropped > 0, rows
    assert flops[False] - flops[True] == dropped * per_row


@pytest.mark.parametrize("fill", [False, True])
def test_shifted_slices_sum_their_gradients_as_autograd_would(fill):
    """kernels.shifted_slices: the slices y[:, j:j+T] (and the last row) of the embedding half's
    table, their gradients summed in one pass, give autograd's gradient of plain slicing (fp64)."""
    from draftport.model.fast import kernels

    B, T, S, n = 2, 9, 4, 5
    g = torch.Generator().manual_seed(3)
    y0 = torch.randn(B, T - 1 + S, n, generator=g, dtype=torch.float64)
    ws = [torch.randn(B, T, n, generator=g, dtype=torch.float64) for _ in range(S)]
    wf = torch.randn(B, 1, n, generator=g, dtype=torch.float64)
    grads = []
    for fused in (False, True):
        y = y0.clone().requires_grad_(True)
        parts = list(kernels.shifted_slices(y, T, S, fill)) if fused else \
            [y[:, j:j + T] for j in range(S)] + ([y[:, -1:]] if fill else [])
        assert all(torch.equal(p, y0[:, j:j + T]) for j, p in enumerate(parts[:S]))
        loss = sum((p * w).sum() for p, w in zip(parts, ws)) + ((parts[S] * wf).sum() if fill else 0)
        loss.backward()
        grads.append(y.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_compiled_shift_sum_equals_eager():
    """The compiled one-pass sum (the GPU path's) equals the eager function, in bf16 too."""
    from draftport.model.fast import kernels

    fn = torch.compile(kernels._shift_sum, dynamic=None)
    g = torch.Generator().manual_seed(4)
    for dt in (torch.float32, torch.bfloat16):
        for T in (10, 13):   # a second length: the symbolic-length graph
            gs = [torch.randn(2, T, 6, generator=g).to(dt) for _ in range(4)]
            fg = torch.randn(2, 1, 6, generator=g).to(dt)
            for f in (None, fg):
                want, got = kernels._shift_sum(gs, f), fn(gs, f)
                assert got.dtype == dt and got.shape == (2, T + 3, 6)
                assert torch.allclose(got.float(), want.float(), rtol=1e-2 if dt == torch.bfloat16 else 1e-6, atol=1e-6)


def test_merge_peers_takes_each_peer_from_the_file_that_measured_it(tmp_path):
    """--merge-peers: two calls' peer files on one machine as one --peers-from file (a peer that
    failed in the first, measured in the second); files of other work or another device refused
    with one line."""
    def peers_file(name, raw, runs, device="NVIDIA H200", seqs=(2048, 4096)):
        f = tmp_path / name
        f.write_text(json.dumps({"date": "2026-12-02", "device": device, "mode": "peers-only", "wall_s": 10.0,
                                 "config": {"hidden_size": 7168, "seqs": list(seqs), "ttt_steps": 7},
                                 "mix": {"lengths": [5, 7], "pack_len": 8192},
                                 "peers_requested": ["speculators", "specforge"], "peers_raw": raw, "peer_runs": runs}))
        return str(f)
    sf = [{"config": "seq2048", "set": "trained", "real_tokens_per_s": 9000.0}]
    sp = [{"config": "seq2048", "set": "frozen", "real_tokens_per_s": 11900.0}]
    a = peers_file("a.json", {"speculators": [], "specforge": sf},
                   {"speculators": {"status": "failed (rc 1)"}, "specforge": {"status": "done"}})
    b = peers_file("b.json", {"speculators": sp}, {"speculators": {"status": "done"}})
    sys.path.insert(0, str(BENCH.parent))
    from bench_train_h200 import main

    out = tmp_path / "m.json"
    main(["--merge-peers", a, b, "--json", str(out)])
    m = json.loads(out.read_text())
    assert m["peers_raw"] == {"speculators": sp, "specforge": sf}
    assert m["peer_runs"]["speculators"]["status"] == "done" and m["peer_runs"]["specforge"]["status"] == "done"
    assert [x["peers"] for x in m["merged_from"]] == [["specforge"], ["speculators"]] and m["wall_s"] == 20.0
    for bad, why in ((peers_file("c.json", {"speculators": sp}, {}, device="NVIDIA H100"), "measured on NVIDIA H100"),
                     (peers_file("d.json", {"speculators": sp}, {}, seqs=(2048,)), "config differs"),
                     (str(tmp_path / "none.json"), "no such file")):
        with pytest.raises(SystemExit) as e:   # the CLI prints it as one line and exits 1
            main(["--merge-peers", a, bad, "--json", str(tmp_path / "x.json")])
        assert why in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("packed", [False, True])
def test_keys_gradients_summed_across_steps_equal_autograds_sums(packed):
    """kernels.set_kv_grad_sum: the keys' and values' gradients summed in one accumulator per
    unroll (each step's attention the last reader of its own keys) give autograd's gradients
    (fp64, padded and packed rows), and a backward pass that stops before step 0 (autograd.grad
    of a later step's output) leaves nothing behind for the next one."""
    from draftport.model.fast import kernels

    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=4)
    out = []
    try:
        for on in (False, True):
            kernels.set_kv_grad_sum(on)
            d = toy_drafter(cfg, seed=5).double()
            d.zero_grad(set_to_none=True)
            terms = ttt_terms(d, batch, head, 5, fused=True, chunk=5)
            loss, _ = combine(terms, 0.8)
            # a partial pass first: the gradient of the last step's loss w.r.t. the fc output
            # stops before reaching step 0's attention's backward
            part = torch.autograd.grad(terms[-1][0], [d.midlayer.self_attn.o_proj.weight], retain_graph=True)[0]
            loss.backward()
            out.append((part, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}))
    finally:
        kernels.set_kv_grad_sum(True)
    (p0, g0), (p1, g1) = out
    assert torch.allclose(p0, p1, atol=1e-12, rtol=1e-9)
    assert g0.keys() == g1.keys() and "midlayer.self_attn.k_proj.weight" in g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-12, rtol=1e-9), k


def test_swiglu_gradient_kernel_hands_back_the_forward_product():
    """kernels._swiglu_grads_act: the down projection's weight gradient reads silu(g) * u from the
    kernel that computes dg and du; it is bitwise the product the forward computed (_swiglu), and
    dg, du are _swiglu_grads' (bf16, as on the GPU path)."""
    from draftport.model.fast import kernels

    g = torch.Generator().manual_seed(0)
    da, gg, u = (torch.randn(3, 5, 40, generator=g).to(torch.bfloat16) for _ in range(3))
    dg, du, act = kernels._swiglu_grads_act(da, gg, u)
    assert torch.equal(act, kernels._swiglu(gg, u))
    dg2, du2 = kernels._swiglu_grads(da, gg, u)
    assert torch.equal(dg, dg2) and torch.equal(du, du2)
    ref_g, ref_u = gg.double().requires_grad_(), u.double().requires_grad_()
    (torch.nn.functional.silu(ref_g) * ref_u * da.double()).sum().backward()
    assert torch.allclose(dg.double(), ref_g.grad, rtol=2e-2, atol=1e-2)
    assert torch.allclose(du.double(), ref_u.grad, rtol=2e-2, atol=1e-2)


def _fp64_terms_and_grads(cfg, batch, head, steps, train_head, accumulate):
    """One fused TTT loss and backward of a fresh fp64 toy drafter -> (loss, stats, gradients)."""
    d = toy_drafter(cfg, seed=7).double()
    d.lm_head.weight.requires_grad_(train_head)
    d.accumulate_wgrad = accumulate
    d.zero_grad(set_to_none=True)
    loss, stats = combine(ttt_terms(d, batch, head, steps, fused=True, chunk=5), 0.8)
    loss.backward()
    return float(loss), stats, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}


def _assert_same_fp64(out, train_head, stat_key):
    """The two sides of a switch: the same loss, stats (they pass through fp32) and gradients."""
    (l0, s0, g0), (l1, s1, g1) = out
    assert l0 == pytest.approx(l1, rel=1e-12) and l0 > 0
    assert s0 == pytest.approx(s1, rel=1e-6) and s0[stat_key] > 0
    assert g0.keys() == g1.keys() and ("lm_head.weight" in g0) == train_head
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-12, rtol=1e-9), k


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("train_head,accumulate", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("group_bytes", [None, 1])
def test_stacked_lm_head_gives_the_per_step_terms_and_gradients(packed, train_head, accumulate, group_bytes,
                                                                   monkeypatch):
    """ttt.set_stacked_head: the TTT steps' lm_head GEMMs and soft-CE taken stacked
    (StackedLinearSoftCE, the gradient written over the logits) give the per-step LinearSoftCE's
    losses, stats and gradients (fp64, padded and packed rows), lm_head frozen or trained, its
    gradient summed in place or returned; group_bytes=1 forces one step per group (the groups
    each path ran are counted: the switch must change the path)."""
    from draftport.training import ttt

    calls = {"stacked": [], "per_step": 0}
    stacked_apply, per_step_apply = ttt.StackedLinearSoftCE.apply, ttt.LinearSoftCE.apply

    def count_stacked(*args):
        calls["stacked"].append(len(args) - 5)   # steps in this group
        return stacked_apply(*args)

    def count_per_step(*args):
        calls["per_step"] += 1
        return per_step_apply(*args)

    monkeypatch.setattr(ttt.StackedLinearSoftCE, "apply", count_stacked)
    monkeypatch.setattr(ttt.LinearSoftCE, "apply", count_per_step)
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=9)
    out = []
    budget, default = ttt.STACK_BYTES, ttt._STACKED["on"]
    try:
        for on in (False, True):
            ttt.set_stacked_head(on)
            ttt.STACK_BYTES = group_bytes or budget
            out.append(_fp64_terms_and_grads(cfg, batch, head, 4, train_head, accumulate))
    finally:
        ttt.set_stacked_head(default)
        ttt.STACK_BYTES = budget
    assert calls == {"stacked": [1, 1, 1, 1] if group_bytes else [4], "per_step": 4}
    _assert_same_fp64(out, train_head, "n_3")


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("train_head,accumulate", [(False, False), (True, False), (True, True)])
def test_skipping_uncounted_rows_gives_every_row_s_terms_and_gradients(packed, train_head, accumulate,
                                                                        monkeypatch):
    """ttt.set_skip_uncounted: the per-step lm_head and soft-CE on the rows the loss counts only
    give the losses, stats and gradients of every row's (fp64; padded rows with a prompt, packed
    samples; lm_head frozen or trained, summed in place or returned). The path each side ran is
    counted: off, none took the counted rows; on, every step did."""
    from draftport.training import ttt

    ran = []
    counted = ttt._step_loss_counted

    def count(xn, w, t_prob, ok, idx, j, *rest):
        ran.append((j, int(idx.numel()), int(ok.sum())))
        return counted(xn, w, t_prob, ok, idx, j, *rest)

    monkeypatch.setattr(ttt, "_step_loss_counted", count)
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=11)
    if not packed:
        batch.loss_mask[:, :4] = False   # a prompt
    out = []
    default = ttt._SKIP["on"]
    try:
        for on in (False, True):
            ttt.set_skip_uncounted(on)
            out.append(_fp64_terms_and_grads(cfg, batch, head, 5, train_head, accumulate))
            if not on:
                assert ran == []
    finally:
        ttt.set_skip_uncounted(default)
    rows = batch.tokens.numel()
    assert [j for j, _, _ in ran] == list(range(5))
    for j, n_idx, n_ok in ran:
        assert n_idx == max(n_ok, 1) and n_ok <= (1 - ttt.SKIP_MIN) * rows, (j, n_idx, n_ok)
    _assert_same_fp64(out, train_head, "n_0")


def test_counted_rows_leave_dense_steps_alone_and_keep_a_row_for_empty_ones():
    """_count_rows: a step whose uncounted rows are fewer than SKIP_MIN runs every row (None);
    one with none counted runs row 0 (at weight 0); otherwise the counted rows, in order; off,
    every step runs every row."""
    from draftport.training import ttt

    full = torch.ones(2, 32, dtype=torch.bool)
    few_off = full.clone()
    few_off[0, :3] = False                               # 3 of 64 < 64 / 16
    half = full.clone()
    half[:, 16:] = False
    none = torch.zeros(2, 32, dtype=torch.bool)
    idx = ttt._count_rows([full, few_off, half, none]).rows_to_run()
    assert idx[0] is None and idx[1] is None
    assert idx[2].tolist() == list(range(16)) + list(range(32, 48))
    assert idx[3].tolist() == [0]
    default = ttt._SKIP["on"]
    try:
        ttt.set_skip_uncounted(False)
        assert ttt._count_rows([half, none]) is None
    finally:
        ttt.set_skip_uncounted(default)


def test_host_loss_share_spares_the_count_when_few_rows_are_out(monkeypatch):
    """Batch.to() reads the share of loss rows on the host; when fewer than SKIP_MIN of the rows
    are out of the loss, the fused loss neither counts the rows on the device nor waits for them
    (every row runs); with a prompt it counts and skips; a batch without the share counts."""
    from draftport.training import ttt

    cfg = toy_cfg()
    head, b = _fp64_problem(cfg, False, seed=12)
    full = b.to("cpu")
    assert full.loss_share == pytest.approx(float((b.loss_mask & b.valid).sum()) / b.loss_mask.numel())
    calls = []
    real = ttt._count_rows
    monkeypatch.setattr(ttt, "_count_rows", lambda oks: calls.append(len(oks)) or real(oks))
    d = toy_drafter(cfg, seed=7).double()
    for loss_share, counted in ((1.0, False), (0.5, True), (None, True)):
        calls.clear()
        full.loss_share = loss_share
        combine(ttt_terms(d, full, head, 3, fused=True, chunk=5), 0.8)
        assert bool(calls) == counted, loss_share
    assert b.to("cpu").host_loss_share() == b.to("cpu").loss_share


@pytest.fixture
def step_rows(monkeypatch):
    """Every Eagle3Drafter.step call's (rows it ran, the batch's (B, T) or None), in call order."""
    from draftport.model import drafter as drafter_mod

    ran = []
    step = drafter_mod.Eagle3Drafter.step

    def record(self, tok, h, *args, **kw):
        ran.append((h.shape[0] * h.shape[1], kw.get("shape")))
        return step(self, tok, h, *args, **kw)

    monkeypatch.setattr(drafter_mod.Eagle3Drafter, "step", record)
    return ran


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("train_head,accumulate", [(False, False), (True, False), (True, True)])
def test_steps_on_the_rows_later_steps_score_give_every_row_s_terms_and_gradients(packed, train_head, accumulate,
                                                                                   step_rows):
    """ttt.set_skip_dead_rows: TTT steps >= 1 running their GEMMs on the rows a later step scores
    only give the losses, stats and gradients of every row's (fp64; two padded rows with a prompt,
    or six samples packed into three rows; lm_head frozen or trained, summed in place or
    returned). The rows each step ran are recorded: off, every step every row; on, step 0 every
    row, then fewer, never more than the step before, and never fewer than the step scores."""
    from draftport.training import ttt

    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=11)
    if not packed:
        batch.loss_mask[:, :4] = False   # a prompt
    rows = batch.tokens.numel()
    out, runs = [], {}
    default = ttt._LIVE["on"]
    try:
        for on in (False, True):
            ttt.set_skip_dead_rows(on)
            step_rows.clear()
            out.append(_fp64_terms_and_grads(cfg, batch, head, 5, train_head, accumulate))
            runs[on] = [n for n, _ in step_rows]
    finally:
        ttt.set_skip_dead_rows(default)
    assert runs[False] == [rows] * 5
    on = runs[True]
    assert on[0] == rows and on[-1] < rows and on == sorted(on, reverse=True), on
    (_, stats, _) = out[1]
    for j in range(5):
        assert on[j] >= stats[f"n_{j}"] > 0, (on, stats)
    _assert_same_fp64(out, train_head, "n_0")


def test_live_rows_are_nested_prefixes_rounded_up_and_spare_dense_batches():
    """_LiveRows: rows ordered by the last step that scores them (latest first, ties in row
    order), step j's rows a prefix of step j-1's, counts rounded up to the multiple (at least one
    multiple), None where too few rows could go; _live_rows counts nothing when off, for a
    batch whose host-side share leaves fewer than SKIP_MIN of the rows out, or for one step."""
    from draftport.training import ttt

    N = 32
    oks = [torch.zeros(1, N, dtype=torch.bool) for _ in range(4)]
    oks[0][0, :] = True                   # step 0 scores every row
    oks[1][0, 4:30] = True
    oks[2][0, 8:20] = True
    oks[3][0, 10:12] = True
    oks[2][0, 1] = True                   # row 1: last scored at step 2
    live = ttt._LiveRows(oks, multiple=1)
    assert live.order.tolist() == ([10, 11] + [1, 8, 9] + list(range(12, 20))          # last scored at 3, 2
                                   + [4, 5, 6, 7] + list(range(20, 30)) + [0, 2, 3, 30, 31])   # at 1, 0
    assert live.rows(1) is not None and live.rows(1).numel() == 27      # 4..29 and row 1
    r1, r2, r3 = live.rows(1), live.rows(2), live.rows(3)
    assert torch.equal(r2, r1[:r2.numel()]) and torch.equal(r3, r2[:r3.numel()])
    assert sorted(r2.tolist()) == [1] + list(range(8, 20)) and sorted(r3.tolist()) == [10, 11]
    assert ttt._LiveRows(oks, multiple=8).rows(3).numel() == 8          # 2 rows, rounded up to 8
    assert ttt._LiveRows(oks, multiple=8).rows(1) is None               # 27 -> 32: nothing to spare
    few = [torch.ones(1, N, dtype=torch.bool), torch.ones(1, N, dtype=torch.bool)]
    few[1][0, :1] = False                                               # 1 of 32 < 32 / 16
    assert ttt._LiveRows(few, multiple=1).rows(1) is None
    assert ttt._live_rows(oks, None) is not None and ttt._live_rows(oks, 0.5) is not None
    assert ttt._live_rows(oks, 1.0) is None and ttt._live_rows(oks[:1], None) is None
    default = ttt._LIVE["on"]
    try:
        ttt.set_skip_dead_rows(False)
        assert ttt._live_rows(oks, None) is None
    finally:
        ttt.set_skip_dead_rows(default)


def test_compiled_regions_give_the_eager_regions_terms_and_gradients(step_rows):
    """compile_regions (what train() and the benchmark run on the GPU, the rope's cos/sin a
    region of its own) on the CPU: the fused TTT loss and gradients of the eager regions (fp64
    data; six samples packed, TTT 3, so token fills, the per-sample positions and the dead rows'
    reduced steps all run compiled). Inductor's fp32 cos/sin may differ from eager's in the last bits."""
    from draftport.model import drafter as drafter_mod

    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, True, seed=11)
    out = []
    try:
        # (compile_regions also compiles the process's shared kernels: the eager runs go first)
        for comp, apart in ((False, True), (False, False), (True, True)):
            drafter_mod.set_rope_apart(apart)
            d = toy_drafter(cfg, seed=7).double()
            d.accumulate_wgrad = True
            if comp:
                d.compile_regions()
            step_rows.clear()
            loss, stats = combine(ttt_terms(d, batch, head, 3, fused=True, chunk=5), 0.8)
            loss.backward()
            out.append((loss.item(), stats, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}))
    finally:
        drafter_mod.set_rope_apart(True)
    assert any(n < shape[0] * shape[1] for n, shape in step_rows)   # the compiled run's reduced steps
    # eager, cos/sin inside the rope region (set_rope_apart(False)): the same ops, the same bits
    assert out[1][0] == out[0][0] and all(torch.equal(out[0][2][k], out[1][2][k]) for k in out[0][2])
    (l0, s0, g0), (l1, s1, g1) = out[0], out[2]
    assert l0 == pytest.approx(l1, rel=1e-6) and s0 == pytest.approx(s1, rel=1e-6)
    assert g0.keys() == g1.keys() and "midlayer.self_attn.q_proj.weight" in g0
    for k in g0:   # against each gradient's largest entry (the fp32 cos/sin's rounding spreads)
        assert float((g0[k] - g1[k]).abs().max()) <= 1e-5 * float(g0[k].abs().max()), k


def test_a_reduced_step_must_be_followed_by_reduced_ones():
    """drafter.unroll refuses a `live` whose rows widen back to every row after a reduced step
    (the state no longer holds the other rows)."""
    from draftport.training import ttt

    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, False, seed=13)
    d = toy_drafter(cfg, seed=7).double()

    class Widening:
        def rows(self, j):
            return torch.arange(5) if j == 1 else None

    with pytest.raises(ValueError, match="after a reduced one"):
        d.unroll(batch.aux, batch.tokens, 3, teacher_tokens=True, valid=batch.valid, fused=True,
                 return_normed=True, live=Widening())
    assert ttt._LIVE["on"] is True   # the default


def test_train_with_prompts_follows_every_row_s_run(tmp_path, step_rows):
    """train() (fused, packed, fp32, the toy features' prompts and out-of-draft rows) with the
    dead rows skipped gives every row's losses, and its steps did skip rows (only with it on)."""
    from draftport.training import ttt
    from draftport.training.loop import TrainConfig as TC

    fs, head = make_features(tmp_path)
    hist, reduced = {}, {}
    default = ttt._LIVE["on"]
    try:
        for on in (False, True):
            ttt.set_skip_dead_rows(on)
            step_rows.clear()
            cfg = TC(steps=3, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=100, log_every=1,
                     impl="fused", packing=True)
            hist[on] = train(toy_drafter(seed=5), fs, head, tmp_path / str(on), cfg, progress=False)["history"]
            reduced[on] = sum(n < shape[0] * shape[1] for n, shape in step_rows if shape)
    finally:
        ttt.set_skip_dead_rows(default)
    assert reduced[False] == 0 and reduced[True] > 0, reduced
    for a, b in zip(hist[False], hist[True]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (a, b)
        assert a["n_0"] == b["n_0"]


def test_mix_prompts_mask_the_same_rows_in_ours_and_name_them_for_the_peers(tmp_path, monkeypatch):
    """--mix-prompt-share: each mix sample's first share of tokens is a prompt (at least the
    default 16, a quarter of a shorter sample) in our samples' loss masks, and the mix file the
    peers' runners read lists the same prompt lengths (without it, no "prompts" key: the peers'
    loss takes every row, as before)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_train_h200 as bench_mod

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
        a = bench_mod.argparse.Namespace(size="toy", ttt=7, peer_iters=1, peer_warmup=1, seqs=[], mix_passes=1,
                                         no_speculators=False, no_specforge=True, pack_len=128, spec_loss="eager",
                                         spec_attn=None, speculators_share=0.5)
        mix = {"lengths": lengths, "prompt_share": share}
        written.clear()
        bench_mod.run_peers(a, mix, False, lambda: 100.0, lambda m: None, lambda p, r: None, peers_only=True)
        assert written and written[0]["lengths"] == lengths
        assert written[0].get("prompts") == (bench_mod.mix_prompts(lengths, share) if share else None)


def test_stacked_groups_cover_the_steps_within_the_byte_budget():
    from draftport.training import ttt

    assert ttt._step_groups(7, 4096, 32000, 2) == [range(0, 7)]          # Kimi size, T 4,096: 1.8 GB
    assert ttt._step_groups(7, 8192, 32000, 2) == [range(0, 4), range(4, 7)]
    assert ttt._step_groups(3, 10 ** 9, 32000, 2) == [range(0, 1), range(1, 2), range(2, 3)]


@pytest.mark.slow
def test_compiled_softce_at_gathered_targets_equals_eager():
    """The compiled soft-CE that reads its targets through an index (the counted rows' path on
    the GPU) gives the eager kernel's loss, gradient and argmax on the gathered rows, bf16 too."""
    from draftport.training import ttt

    fn = torch.compile(ttt._softce_rows_at, dynamic=None)
    g = torch.Generator().manual_seed(6)
    for dt in (torch.float32, torch.bfloat16):
        lg = torch.randn(5, 40, generator=g).to(dt)
        t = torch.softmax(torch.randn(9, 40, generator=g), -1)
        idx = torch.tensor([7, 0, 3, 8, 2])
        w = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
        got, ref = fn(lg, t, idx, w), ttt._softce_rows(lg, t[idx], w)
        assert torch.allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(got[1].float(), ref[1].float(), rtol=1e-2 if dt == torch.bfloat16 else 1e-5, atol=1e-6)
        assert torch.equal(got[2], ref[2])


@pytest.mark.slow
def test_compiled_softce_written_over_its_logits_equals_eager():
    """The compiled soft-CE that writes its gradient over the logits (the GPU path's) gives the
    eager kernel's loss, argmax and gradient, into a slice of a larger buffer, in bf16 too."""
    from draftport.training import ttt

    fn = torch.compile(ttt._softce_rows_into, dynamic=None)
    g = torch.Generator().manual_seed(5)
    for dt in (torch.float32, torch.bfloat16):
        buf = torch.randn(3 * 7, 50, generator=g).to(dt)
        t = torch.softmax(torch.randn(7, 50, generator=g), -1)
        w = (torch.rand(7, generator=g) > 0.3).float()
        want_l, want_g, want_a = ttt._softce_rows(buf[7:14].clone(), t, w)
        before = buf.clone()
        got_l, got_a = fn(buf[7:14], t, w)
        tol = dict(rtol=1e-2, atol=1e-2) if dt == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
        assert torch.allclose(got_l, want_l, **tol) and torch.equal(got_a, want_a)
        assert torch.allclose(buf[7:14].float(), want_g.float(), **tol)
        assert torch.equal(buf[:7], before[:7]) and torch.equal(buf[14:], before[14:])


def test_profile_kinds_put_flash_varlen_under_attention():
    """The profile's breakdown by kind: FlashAttention's kernels name cutlass in their template
    arguments and were counted as GEMMs; attention is matched first."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_train_h200", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kind = bench.kernel_kind
    assert kind("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits"
                "<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>>") == "attention"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, cutlass::bfloat16_t>>") == "attention"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7") == "attention"
    assert kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kind("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>") == "gemm"
    assert kind("triton_poi_fused__to_copy_mul_silu_0") == "compiled elementwise (triton)"


def test_attention_switches_refuse_unknown_names():
    """The dense and packed attention switches take their known names only, by call or by
    environment (the environment's checked at import, one line naming the variable); the packed
    default, auto, runs segments under cudnn and varlen under flash and fa4."""
    from draftport.model.fast import kernels
    before = dict(kernels._BACKEND)
    try:
        assert before["packed"] == "auto" or os.environ.get("DRAFTPORT_PACKED_ATTENTION")
        kernels.set_packed_attention("auto")
        for dense, path in (("cudnn", "segments"), ("flash", "varlen"), ("fa4", "varlen")):
            kernels.set_attention_backend(dense)
            assert kernels.packed_attention() == path
        assert kernels.packed_attention("cudnn") == "segments"   # under a named backend
        kernels.set_packed_attention("segments")
        assert kernels.packed_attention() == "segments" == kernels.packed_attention("flash")
        kernels.set_packed_attention("varlen")
        with pytest.raises(ValueError, match="auto, varlen or segments"):
            kernels.set_packed_attention("ragged")
        with pytest.raises(ValueError, match="flash, cudnn or fa4"):
            kernels.set_attention_backend("math")
        assert kernels._BACKEND["packed"] == "varlen" and kernels.packed_attention("cudnn") == "varlen"
    finally:
        kernels._BACKEND.update(before)
    env = dict(os.environ, DRAFTPORT_PACKED_ATTENTION="ragged")
    r = subprocess.run([sys.executable, "-c", "import draftport.model.fast.kernels"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode != 0 and "DRAFTPORT_PACKED_ATTENTION='ragged': auto, varlen or segments" in r.stderr
