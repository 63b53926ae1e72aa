"""The drift probe (draftport.evaluation.drift) on two tiny random Llama targets: a target against itself
shows no drift, a perturbed copy shows some, linear CKA behaves as Kornblith et al.'s, the capture
keeps the input folder's tokens and masks exactly, incompatible targets give one line."""

import json
import math

import numpy as np
import pytest
import torch
from tiny_targets import LLAMA_AUX, LLAMA_VOCAB, H, seed_folder, tiny_llama

from draftport.data.shards import FeatureSet
from draftport.errors import DraftportError
from draftport.evaluation.accept import evaluate_drafter
from draftport.evaluation.drift import capture_same_tokens, drift_probe, drift_stats, linear_cka
from draftport.model.config import DrafterConfig
from draftport.model.drafter import Eagle3Drafter
from draftport.model.formats import save_drafter
from draftport.model.vocab import build_maps


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift")
    new = tiny_llama(root / "target_new", seed=0)
    tiny_llama(root / "target_old", seed=0, base=new, noise=0.3)
    tiny_llama(root / "target_narrow", seed=3, hidden=32)
    tiny_llama(root / "target_vocab", seed=4, vocab=96)
    # the new target's features on "its answers" (here: fixed token sequences)
    capture_same_tokens(
        root / "target_new", seed_folder(root / "seqs"), root / "features_new", batch_size=4, dtype="float32"
    )
    return root


def test_cka_is_invariant_to_rotation_and_scale_and_near_zero_for_independent_data():
    g = torch.Generator().manual_seed(0)
    for n, d in ((300, 20), (30, 50)):  # the feature form and the Gram form
        x = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g)  # anisotropic
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)
        assert linear_cka(x, 3.7 * (x.double() @ q) + 5.0) == pytest.approx(1.0, abs=1e-9)
        y = torch.randn(n, d, generator=g)
        assert linear_cka(x, y) == pytest.approx(linear_cka(y, x), abs=1e-12)
        assert 0.0 <= linear_cka(x, y) < 1.0
    # the two forms are one number
    x, y = torch.randn(40, 30, generator=g), torch.randn(40, 30, generator=g)
    num = ((x - x.mean(0)).double().T @ (y - y.mean(0)).double()).pow(2).sum()
    xc, yc = (x - x.mean(0)).double(), (y - y.mean(0)).double()
    assert linear_cka(x, y) == pytest.approx(float(num / ((xc.T @ xc).norm() * (yc.T @ yc).norm())), rel=1e-9)
    big_x, big_y = torch.randn(4000, 8, generator=g), torch.randn(4000, 8, generator=g)
    assert linear_cka(big_x, big_y) < 0.02


def test_a_target_against_itself_shows_no_drift(world):
    again = world / "features_new_again"
    capture_same_tokens(world / "target_new", world / "features_new", again, batch_size=3, dtype="float32")
    st = drift_stats(world / "features_new", again, max_tokens=50)
    assert st["samples"] == 10 and st["tokens"] > 50 and st["cka_tokens"] == 50
    for slot in ("layer_0", "layer_1", "layer_2", "final"):
        assert st[f"cos_{slot}"] == pytest.approx(1.0, abs=1e-5)
        assert st[f"cka_{slot}"] == pytest.approx(1.0, abs=1e-5)
        assert st[f"rel_norm_change_{slot}"] == pytest.approx(0.0, abs=1e-5)
        assert st[f"rel_diff_norm_{slot}"] == pytest.approx(0.0, abs=1e-4)
    assert st["greedy_agreement"] == 1.0
    assert st["next_token_match_a"] == st["next_token_match_b"]
    assert st["greedy_positions"] == st["tokens"]  # one predicting position per assistant token


def test_a_perturbed_target_drifts_and_disagrees(world):
    old = world / "features_old"
    capture_same_tokens(
        world / "target_old",
        world / "features_new",
        old,
        batch_size=4,
        dtype="float32",
        like_target=world / "target_new",
    )
    st = drift_stats(old, world / "features_new")
    assert st["cos_layer_1"] < 0.999 and st["cos_final"] < 0.999
    assert st["rel_diff_norm_final"] > 0.01
    assert 0.0 < st["greedy_agreement"] < 1.0
    assert all(0.0 <= st[f"cka_{s}"] <= 1.0 + 1e-9 for s in ("layer_0", "layer_1", "layer_2", "final"))
    # | ||b|| - ||a|| | <= ||b - a||: the scale moves no more than the vector
    assert st["rel_norm_change_final"] <= st["rel_diff_norm_final"] + 1e-9
    # folders of other sequences (same count, same layout) are refused, naming the sample
    with pytest.raises(DraftportError, match="sample 0: .*not the same sequences"):
        drift_stats(world / "features_new", seed_folder(world / "other_seqs", n=10, seed=9))


def test_capture_keeps_the_tokens_masks_and_layout_of_its_input(world):
    src, out = FeatureSet(world / "features_new"), world / "features_keep"
    idx = capture_same_tokens(world / "target_old", world / "features_new", out, batch_size=4, dtype="bfloat16")
    got = FeatureSet(out)
    assert len(got) == len(src) and idx["tokens"] == src.index["tokens"]
    assert idx["aux_layer_ids"] == LLAMA_AUX and idx["aux_convention"] == "vllm" and idx["regenerated"] is False
    assert idx["hidden_size"] == H and idx["vocab_size"] == LLAMA_VOCAB
    for i in range(len(src)):
        a, b = src.sample(i), got.sample(i)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["response_start"] == b["response_start"] and b["aux"].shape == (len(a["tokens"]), 3 * H)
        assert b["aux"].dtype == torch.bfloat16 and "target_arg" in b
    # identical runs write identical bytes; max_samples keeps a prefix
    again = capture_same_tokens(
        world / "target_old", world / "features_new", world / "features_keep2", batch_size=4, dtype="bfloat16"
    )
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in idx["shards"]]
    part = capture_same_tokens(
        world / "target_old",
        world / "features_new",
        world / "features_part",
        batch_size=4,
        dtype="float32",
        max_samples=3,
    )
    assert part["samples"] == 3


@pytest.mark.parametrize(
    "target,like,what", [("target_narrow", None, "hidden size 32"), ("target_vocab", "target_new", "vocab 96")]
)
def test_incompatible_targets_give_one_line(world, target, like, what):
    with pytest.raises(DraftportError) as e:
        capture_same_tokens(
            world / target, world / "features_new", world / "never", batch_size=4, like_target=like and world / like
        )
    msg = str(e.value)
    assert "\n" not in msg and what in msg and str(world / target) in msg and str(world / "features_new") in msg
    assert not (world / "never").exists()


def test_drift_probe_reports_tau_on_both_sides(world, tmp_path):
    cfg = DrafterConfig(
        hidden_size=H,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=LLAMA_VOCAB,
        draft_vocab_size=40,
        aux_layer_ids=LLAMA_AUX,
        max_position_embeddings=128,
        aux_convention="vllm",
    )
    torch.manual_seed(0)
    d = Eagle3Drafter(cfg, embed_weight=torch.randn(LLAMA_VOCAB, H))
    d.set_vocab_maps(*build_maps(np.random.default_rng(0).integers(0, 1000, LLAMA_VOCAB), 40))
    save_drafter(tmp_path / "source", cfg, d.export_state())
    res = drift_probe(
        tmp_path / "source",
        world / "target_old",
        world / "target_new",
        world / "features_new",
        tmp_path / "probe",
        k=2,
        batch_size=4,
        feature_batch_size=4,
        dtype="float32",
        max_tokens=64,
        keep_features=False,
    )
    direct = evaluate_drafter(tmp_path / "source", world / "target_new", world / "features_new", k=2, batch_size=4)
    assert res["tau_source_new_features"] == direct["accept_length"]  # Phase 0's number
    assert res["tau_gap"] == pytest.approx(res["tau_gap_states"] + res["tau_gap_choices"], abs=1e-12)
    assert res["tau_gap"] == res["tau_source_old_features"] - res["tau_source_new_features"]
    for key in (
        "cos_layer_0",
        "cka_final",
        "rel_diff_norm_layer_2",
        "greedy_agreement",
        "tokens",
        "accept_rate_pos_1_old_features",
    ):
        assert key in res and not math.isnan(res[key])
    assert not (tmp_path / "probe" / "features_old").exists()
    for name in ("old_features", "new_features", "new_features_old_choices"):
        ev = json.loads((tmp_path / "probe" / f"eval_{name}.json").read_text())
        assert ev["eval_samples"] == 10 and "eval_seconds" not in ev
