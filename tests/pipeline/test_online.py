"""vLLM serves an exported drafter and its accept length agrees with the offline evaluator.

The end-to-end test needs the vLLM venv (`make vllm-venv`). Without it the test is skipped,
unless DRAFTPORT_REQUIRE_VLLM is set (CI), where a missing venv is a failure.
"""

import ast
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import draftport
from draftport.data.draftmap import build_vocab
from draftport.data.features import build_features
from draftport.engines.export import validate_export
from draftport.engines.vllm.venv import default_vllm_python, runner, vllm_python
from draftport.errors import DraftportError
from draftport.evaluation import online as serve
from draftport.model.bind import new_drafter_config
from draftport.model.formats import find_target_embedding, read_tensor_np, save_safetensors, tensor_sha256
from draftport.plan.params import load
from draftport.training.loop import TrainConfig
from draftport.training.phases import train_phase

VLLM_PY = default_vllm_python()
HAVE_VLLM = VLLM_PY.exists() or bool(os.environ.get("DRAFTPORT_VLLM_PYTHON"))
REQUIRE = bool(os.environ.get("DRAFTPORT_REQUIRE_VLLM"))
ROOT = Path(__file__).resolve().parents[2]


def fake_raw(k=3, drafts=10, accepted=(6, 4, 2)):
    return {
        "k": k,
        "num_drafts": drafts,
        "num_draft_tokens": drafts * k,
        "num_accepted_tokens": sum(accepted),
        "accepted_per_pos": list(accepted),
        "num_prompts": 2,
        "output_tokens": 30,
        "load_seconds": 1.0,
        "generate_seconds": 0.5,
        "requests": [
            {"output_token_ids": [5, 6], "per_step_accepted": [1, 2, 0]},
            {"output_token_ids": [7], "per_step_accepted": [3]},
        ],
    }


def test_online_summary_reads_vllm_counters():
    s = serve.summarize_online(fake_raw())
    assert s["online_accept_length"] == pytest.approx(1 + 12 / 10)
    assert [s[f"online_accept_rate_pos_{i}"] for i in range(3)] == pytest.approx([0.6, 0.4, 0.2])
    assert s["online_cond_acc_1"] == pytest.approx(0.4 / 0.6)
    with pytest.raises(DraftportError, match="no drafts"):
        serve.summarize_online(fake_raw(drafts=0, accepted=(0, 0, 0)))


def test_online_summary_has_the_other_definitions_on_vllms_counters():
    s = serve.summarize_online(fake_raw())  # 10 drafts of 3 tokens, 12 accepted
    assert s["online_acceptance_rate"] == pytest.approx(12 / 30)  # vLLM's "Avg Draft acceptance rate"
    assert s["online_acceptance_rate"] == pytest.approx((s["online_accept_length"] - 1) / 3)
    assert s["online_simulated_acc_len"] == pytest.approx(s["online_accept_length"] - 1)
    # vLLM counts the draft tokens it scheduled: fewer than drafts x k, the rate follows them
    raw = fake_raw()
    raw["num_draft_tokens"] = 24
    assert serve.summarize_online(raw)["online_acceptance_rate"] == pytest.approx(12 / 24)


def test_agreement_check_reports_both_numbers():
    on = serve.summarize_online(fake_raw())
    off = {
        "accept_length": 2.2 - 0.04,
        "k": 3,
        "accept_rate_pos_0": 0.6,
        "accept_rate_pos_1": 0.4,
        "accept_rate_pos_2": 0.2,
    }
    assert serve.agreement_check(on, off)["difference"] == pytest.approx(0.04)
    off["accept_length"] = 2.1
    with pytest.raises(DraftportError, match=r"vLLM accept length 2\.2000 and offline 2\.1000"):
        serve.agreement_check(on, off)


def test_cycle_mismatches_points_at_the_request():
    raw = fake_raw()
    m = serve.cycle_mismatches(raw, {"per_request_cycles": [[1, 2, 0], [2]]})
    assert m["requests_differing"] == 1
    assert m["examples"][0]["request"] == 1 and m["examples"][0]["first_step"] == 0


def test_missing_vllm_venv_is_a_clear_error(tmp_path):
    with pytest.raises(DraftportError, match="make vllm-venv"):
        vllm_python(tmp_path / "nope" / "python")


def test_the_vllm_venv_is_found_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("DRAFTPORT_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # the pipeline runs at the repository root, not the package's
    assert default_vllm_python() == tmp_path / ".venv-vllm" / "bin" / "python"
    monkeypatch.setenv("DRAFTPORT_VLLM_PYTHON", str(tmp_path / "py"))
    assert default_vllm_python() == tmp_path / "py"


def test_the_in_venv_scripts_ship_inside_the_package():
    """Found next to the package (so a wheel carries them), importing nothing of draftport (the
    vLLM venv does not have it)."""
    for name in ("online_vllm.py", "features_vllm.py"):
        path = runner(name)
        assert path.is_relative_to(Path(draftport.__file__).parent)
        tree = ast.parse(path.read_text())
        mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "draftport" not in mods and not any(n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom))
        assert mods <= {
            "argparse",
            "functools",
            "json",
            "os",
            "sys",
            "time",
            "__future__",
            "vllm",
            "torch",
            "safetensors",
        }, mods
    with pytest.raises(DraftportError, match="runner script is missing"):
        runner("nope.py")


# ---- end to end on the micro world ----------------------------------------------------------
@pytest.fixture(scope="module")
def micro(tmp_path_factory, micro_world):
    if not HAVE_VLLM:
        if REQUIRE:
            pytest.fail(f"DRAFTPORT_REQUIRE_VLLM is set but {VLLM_PY} is missing: run `make vllm-venv`")
        pytest.skip(f"no vLLM venv at {VLLM_PY} (run `make vllm-venv`; DRAFTPORT_REQUIRE_VLLM=1 makes this a failure)")

    root = tmp_path_factory.mktemp("online")
    p = load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")["world"]  # the micro profile's world
    # vLLM's CPU attention kernels exist for head sizes >= 32 only: the preset has 32.
    assert p["model"]["head_dim"] >= 32
    (root / "w").symlink_to(micro_world, target_is_directory=True)  # the session's micro world, read only
    target = root / "w" / "target_new"
    tcfg = json.loads((target / "config.json").read_text())
    L = tcfg["num_hidden_layers"]
    aux = [0, L // 2, L]  # distinct and increasing, as vLLM needs
    build_features(
        target,
        root / "w/corpus/new.jsonl",
        root / "feat",
        n_samples=64,
        aux_layer_ids=aux,
        max_new_tokens=48,
        dtype="float32",
        batch_size=32,
    )
    dv = tcfg["vocab_size"] // 4
    build_vocab(root / "feat", root / "vocab.safetensors", draft_vocab_size=dv, vocab_size=tcfg["vocab_size"])
    cfg = new_drafter_config(
        {
            "num_attention_heads": tcfg["num_attention_heads"],
            "num_key_value_heads": tcfg["num_key_value_heads"],
            "head_dim": tcfg["head_dim"],
            "intermediate_size": 2 * tcfg["hidden_size"],
        },
        vocab_size=tcfg["vocab_size"],
        hidden_size=tcfg["hidden_size"],
        aux_layer_ids=aux,
        convention="vllm",
        draft_vocab_size=dv,
        max_positions=tcfg["max_position_embeddings"],
    )
    train_phase(
        root / "train",
        features_dir=root / "feat",
        target_dir=target,
        vocab_path=root / "vocab.safetensors",
        init="scratch",
        arch=cfg,
        train_cfg=TrainConfig(steps=40, batch_size=8, lr=3e-3, warmup_steps=3, ttt_steps=3),
        progress=False,
    )
    return {
        "root": root,
        "target": target,
        "drafter": root / "train" / "drafter",
        "prompts": root / "w/corpus/heldout_new.jsonl",
    }


@pytest.mark.slow
def test_vllm_accept_length_agrees_with_offline(micro):
    k = 3
    on, raw = serve.measure(
        micro["target"],
        micro["drafter"],
        micro["prompts"],
        16,
        k,
        32,
        raw_out=micro["root"] / "online_raw.json",
        log_path=micro["root"] / "vllm.log",
        max_num_seqs=8,
        return_raw=True,
    )
    assert on["online_num_drafts"] > 0 and raw["num_prompts"] == 16
    assert len(raw["requests"]) == 16 and all(r["output_token_ids"] for r in raw["requests"])
    off = serve.offline_same_prompts(
        micro["drafter"], micro["target"], k=k, online_raw=micro["root"] / "online_raw.json"
    )
    res = serve.agreement_check(on, off, tol=0.05)
    assert abs(res["difference"]) <= 0.05
    for i in range(k):
        assert abs(on[f"online_accept_rate_pos_{i}"] - off[f"accept_rate_pos_{i}"]) <= 0.05
    # greedy on identical tokens: the cycles themselves line up, request by request
    mism = serve.cycle_mismatches(raw, off)
    assert mism["requests_differing"] <= 1, mism
    assert off["num_cycles"] == pytest.approx(on["online_num_drafts"], abs=3)
    # per named eval set (ranges of the requests): the same agreement, set by set
    by_set = serve.per_set(raw, off, [{"name": "a", "start": 0, "count": 6}, {"name": "b", "start": 6, "count": 10}])
    assert [row["requests"] for row in by_set.values()] == [6, 10]
    for row in by_set.values():
        assert abs(row["difference"]) <= 0.05, by_set
    serve.set_agreement_check(by_set, tol=0.05)


@pytest.mark.slow
def test_vllm_agrees_at_two_k_with_one_offline_replay_to_depth(micro):
    """vLLM served at k = 1 and k = 5 against ONE offline replay drafting 5 deep (its by_k: every
    shallower k from the same pass, as the offline evaluator's eval.k_max): both agree."""
    served = {}
    for k in (1, 5):
        served[k] = serve.measure(
            micro["target"],
            micro["drafter"],
            micro["prompts"],
            16,
            k,
            32,
            log_path=micro["root"] / f"vllm_k{k}.log",
            max_num_seqs=8,
            return_raw=True,
        )
    (on1, raw1), (on5, raw5) = served[1], served[5]
    # greedy decoding whatever k: the same sequences, so one replay serves both
    assert [r["output_token_ids"] for r in raw1["requests"]] == [r["output_token_ids"] for r in raw5["requests"]]
    off = serve.offline_same_prompts(micro["drafter"], micro["target"], k=5, k_max=5, online_raw=raw5)
    for k, on, raw in ((1, on1, raw1), (5, on5, raw5)):
        at = off["by_k"][k - 1]
        res = serve.agreement_check(on, at, tol=0.05)
        assert abs(res["difference"]) <= 0.05, (k, res)
        for i in range(k):
            assert abs(on[f"online_accept_rate_pos_{i}"] - at[f"accept_rate_pos_{i}"]) <= 0.05, (k, i)
        mism = serve.cycle_mismatches(raw, {"per_request_cycles": at["per_request_cycles"]})
        assert mism["requests_differing"] <= 1, (k, mism)


@pytest.mark.slow
def test_embed_tokens_drop_and_target_serve_the_same(micro):
    """A drafter that carries the OLD target's embedding (what vLLM would serve as is, while SGLang
    embeds with the target's) is exported both ways of online.embed_tokens: dropped (vLLM takes
    the target's) or replaced by the new target's bytes. Same embedding either way: vLLM drafts
    the same tokens, so tau and every request's cycles are identical."""
    root, k = micro["root"], 3
    foreign = root / "foreign_embed"
    shutil.copytree(micro["drafter"], foreign)
    sd = load_file(str(foreign / "model.safetensors"))
    old = find_target_embedding(root / "w" / "target_old")
    sd["embed_tokens.weight"] = torch.from_numpy(read_tensor_np(old).copy())
    save_safetensors(sd, foreign / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(DraftportError, match="embed_tokens differs from the target's"):
        validate_export(foreign, micro["target"])  # never served as is
    exports = {
        "drop": serve.for_vllm(foreign, root / "export_drop", "vllm", "drop")[0],
        "target": serve.for_vllm(foreign, root / "export_target", "vllm", "target", target_dir=micro["target"])[0],
    }
    new = find_target_embedding(micro["target"])
    assert tensor_sha256(find_target_embedding(exports["target"])) == tensor_sha256(new) != tensor_sha256(old)
    runs = {}
    for mode, d in exports.items():
        runs[mode] = serve.measure(
            micro["target"],
            d,
            micro["prompts"],
            8,
            k,
            24,
            max_num_seqs=8,
            log_path=root / f"vllm_{mode}.log",
            return_raw=True,
        )
    (on_d, raw_d), (on_t, raw_t) = runs["drop"], runs["target"]
    print(f"vLLM tau: drop {on_d['online_accept_length']:.4f}, target {on_t['online_accept_length']:.4f}")
    assert on_d["online_num_drafts"] > 0
    assert on_d["online_accept_length"] == on_t["online_accept_length"]
    assert [r["per_step_accepted"] for r in raw_d["requests"]] == [r["per_step_accepted"] for r in raw_t["requests"]]
    assert [r["output_token_ids"] for r in raw_d["requests"]] == [r["output_token_ids"] for r in raw_t["requests"]]
    # what vLLM 0.32 says it did (llm_base_proposer._maybe_share_embeddings): shared both times
    logs = {mode: (root / f"vllm_{mode}.log").read_text() for mode in exports}
    assert "without its own embed_tokens in the checkpoint. Sharing target model embedding" in logs["drop"]
    assert "embed_tokens identical to the target model. Sharing target model embedding" in logs["target"]
    # the foreign drafter served as is (validation skipped): vLLM keeps the old target's embedding
    on_f = serve.measure(
        micro["target"],
        foreign,
        micro["prompts"],
        8,
        k,
        24,
        max_num_seqs=8,
        validate=False,
        log_path=root / "vllm_foreign.log",
    )
    print(f"vLLM tau with the old target's embedding served as is: {on_f['online_accept_length']:.4f}")
    assert (
        "distinct embed_tokens weights. Keeping separate embedding weights" in (root / "vllm_foreign.log").read_text()
    )
