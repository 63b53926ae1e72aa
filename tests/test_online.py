"""vLLM serves an exported drafter and its accept length agrees with the offline evaluator.

The end-to-end test needs the vLLM venv (`make vllm-venv`). Without it the test is skipped,
unless DRAFTPORT_REQUIRE_VLLM is set (CI), where a missing venv is a failure.
"""

import copy
import json
import os

import pytest

from draftport import online
from draftport.errors import DraftportError

VLLM_PY = online.DEFAULT_VLLM_PYTHON
HAVE_VLLM = VLLM_PY.exists() or bool(os.environ.get("DRAFTPORT_VLLM_PYTHON"))
REQUIRE = bool(os.environ.get("DRAFTPORT_REQUIRE_VLLM"))


def fake_raw(k=3, drafts=10, accepted=(6, 4, 2)):
    return {"k": k, "num_drafts": drafts, "num_draft_tokens": drafts * k,
            "num_accepted_tokens": sum(accepted), "accepted_per_pos": list(accepted),
            "num_prompts": 2, "output_tokens": 30, "load_seconds": 1.0, "generate_seconds": 0.5,
            "requests": [{"output_token_ids": [5, 6], "per_step_accepted": [1, 2, 0]},
                         {"output_token_ids": [7], "per_step_accepted": [3]}]}


def test_online_summary_reads_vllm_counters():
    s = online.summarize_online(fake_raw())
    assert s["online_accept_length"] == pytest.approx(1 + 12 / 10)
    assert [s[f"online_accept_rate_pos_{i}"] for i in range(3)] == pytest.approx([0.6, 0.4, 0.2])
    assert s["online_cond_acc_1"] == pytest.approx(0.4 / 0.6)
    with pytest.raises(DraftportError, match="no drafts"):
        online.summarize_online(fake_raw(drafts=0, accepted=(0, 0, 0)))


def test_agreement_check_reports_both_numbers():
    on = online.summarize_online(fake_raw())
    off = {"accept_length": 2.2 - 0.04, "k": 3, "accept_rate_pos_0": 0.6, "accept_rate_pos_1": 0.4,
           "accept_rate_pos_2": 0.2}
    assert online.agreement_check(on, off)["difference"] == pytest.approx(0.04)
    off["accept_length"] = 2.1
    with pytest.raises(DraftportError, match=r"vLLM accept length 2\.2000 and offline 2\.1000"):
        online.agreement_check(on, off)


def test_cycle_mismatches_points_at_the_request():
    raw = fake_raw()
    m = online.cycle_mismatches(raw, {"per_request_cycles": [[1, 2, 0], [2]]})
    assert m["requests_differing"] == 1
    assert m["examples"][0]["request"] == 1 and m["examples"][0]["first_step"] == 0


def test_missing_vllm_venv_is_a_clear_error(tmp_path):
    with pytest.raises(DraftportError, match="make vllm-venv"):
        online.vllm_python(tmp_path / "nope" / "python")


# ---- end to end on the micro world ----------------------------------------------------------
@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    if not HAVE_VLLM:
        if REQUIRE:
            pytest.fail(f"DRAFTPORT_REQUIRE_VLLM is set but {VLLM_PY} is missing: run `make vllm-venv`")
        pytest.skip(f"no vLLM venv at {VLLM_PY} (run `make vllm-venv`; DRAFTPORT_REQUIRE_VLLM=1 makes this a failure)")
    from draftport import plan, world
    from draftport.train import TrainConfig

    root = tmp_path_factory.mktemp("online")
    p = copy.deepcopy(world.WORLD_PRESETS["micro"])
    # vLLM's CPU attention kernels exist for head sizes >= 32 only: the preset has 32.
    assert p["model"]["head_dim"] >= 32
    world.build_world_base(root / "w", p, progress=False)
    target = root / "w" / "target_new"
    tcfg = json.loads((target / "config.json").read_text())
    L = tcfg["num_hidden_layers"]
    aux = [0, L // 2, L]  # distinct and increasing, as vLLM needs
    plan.build_features(target, root / "w/corpus/new.jsonl", root / "feat", n_samples=64, aux_layer_ids=aux,
                        max_new_tokens=48, dtype="float32", batch_size=32)
    dv = tcfg["vocab_size"] // 4
    plan.build_vocab(root / "feat", root / "vocab.safetensors", draft_vocab_size=dv, vocab_size=tcfg["vocab_size"])
    cfg = plan.new_drafter_config(
        {"num_attention_heads": tcfg["num_attention_heads"], "num_key_value_heads": tcfg["num_key_value_heads"],
         "head_dim": tcfg["head_dim"], "intermediate_size": 2 * tcfg["hidden_size"]},
        vocab_size=tcfg["vocab_size"], hidden_size=tcfg["hidden_size"], aux_layer_ids=aux, convention="vllm",
        draft_vocab_size=dv, max_positions=tcfg["max_position_embeddings"])
    plan.train_phase(root / "train", features_dir=root / "feat", target_dir=target,
                     vocab_path=root / "vocab.safetensors", init="scratch", arch=cfg,
                     train_cfg=TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=3, ttt_steps=3),
                     progress=False)
    return {"root": root, "target": target, "drafter": root / "train" / "drafter",
            "prompts": root / "w/corpus/heldout_new.jsonl"}


@pytest.mark.slow
def test_vllm_accept_length_agrees_with_offline(micro):
    k = 3
    on, raw = online.measure(micro["target"], micro["drafter"], micro["prompts"], 16, k, 32,
                             raw_out=micro["root"] / "online_raw.json", log_path=micro["root"] / "vllm.log",
                             max_num_seqs=8, return_raw=True)
    assert on["online_num_drafts"] > 0 and raw["num_prompts"] == 16
    assert len(raw["requests"]) == 16 and all(r["output_token_ids"] for r in raw["requests"])
    off = online.offline_same_prompts(micro["drafter"], micro["target"], k=k,
                                      online_raw=micro["root"] / "online_raw.json")
    res = online.agreement_check(on, off, tol=0.05)
    assert abs(res["difference"]) <= 0.05
    for i in range(k):
        assert abs(on[f"online_accept_rate_pos_{i}"] - off[f"accept_rate_pos_{i}"]) <= 0.05
    # greedy on identical tokens: the cycles themselves line up, request by request
    mism = online.cycle_mismatches(raw, off)
    assert mism["requests_differing"] <= 1, mism
    assert off["num_cycles"] == pytest.approx(on["online_num_drafts"], abs=3)
