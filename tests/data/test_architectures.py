"""The world's target architectures (params world.model.arch): Llama, DeepSeek-V3 (Kimi-K2's MLA +
MoE) and Qwen3, each a tiny target built by the world's own code (draftport.world.targets), run
through what the pipeline does with a target: capture (both aux conventions, against
transformers' own output_hidden_states), greedy regeneration, binding a drafter."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftport.data.capture import capture_features, decoder_parts, load_target, regenerate
from draftport.errors import DraftportError
from draftport.model.bind import drafter_for_target, new_drafter_config, target_head, target_sizes
from draftport.model.config import target_text_config
from draftport.plan import params
from draftport.world.language import generate_corpus
from draftport.world.targets import target_config, train_target
from draftport.world.tokenizer import END, PAD, load_world_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("llama", "deepseek_v3", "qwen3")
LAYERS = 3
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
}
CLASSES = {"llama": "LlamaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TRAIN = dict(lr=0.003, batch_size=4, seq_len=32, warmup=1, threads=1, progress=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    corpus = generate_corpus("old", 40, 0)
    return train_tokenizer(out / "tokenizer", corpus, vocab_size=300, model_max_length=256), corpus


@pytest.fixture(scope="module", params=ARCHS)
def target(request, tokenizer, tmp_path_factory):
    """(arch, folder) of a target trained 3 steps by the world's train_target."""
    tok_dir, corpus = tokenizer
    out = tmp_path_factory.mktemp(request.param) / "target"
    train_target(out, tok_dir, corpus, config={"arch": request.param, **SHAPE}, steps=3, **TRAIN)
    return request.param, out


def _batch(n=3, seed=0):
    """Right-padded token ids of different lengths and their mask."""
    g = torch.Generator().manual_seed(seed)
    lens = [17, 11, 6][:n]
    ids = torch.zeros(n, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n_tok in enumerate(lens):
        ids[i, :n_tok] = torch.randint(5, 300, (n_tok,), generator=g)
        mask[i, :n_tok] = 1
    return ids, mask


def test_the_target_is_transformers_own_class(target):
    arch, folder = target
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == [CLASSES[arch]] and "auto_map" not in cfg
    assert cfg["num_hidden_layers"] == LAYERS and cfg["hidden_size"] == 64 and not cfg["tie_word_embeddings"]
    model = load_target(folder)
    assert type(model).__name__ == CLASSES[arch]
    layers, _, _ = decoder_parts(model)
    assert len(layers) == LAYERS
    if arch == "deepseek_v3":  # MLA everywhere, a dense first layer, then MoE
        kinds = [type(layer.mlp).__name__ for layer in layers]
        assert kinds == ["DeepseekV3MLP"] + ["DeepseekV3MoE"] * (LAYERS - 1)
        assert cfg["q_lora_rank"] == 32 and cfg["kv_lora_rank"] == 16 and cfg["qk_rope_head_dim"] == 16
        assert cfg["n_routed_experts"] == 4 and cfg["num_experts_per_tok"] == 2 and cfg["n_group"] == 1
        # the routing transformers computes, in the keys DeepSeek-V3's and Kimi-K2's configs (and vLLM) use
        assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")


@pytest.mark.parametrize("convention,aux_ids,shift", [("vllm", [0, 2, 3], 0), ("sglang", [0, 1, 2], 1)])
def test_capture_is_transformers_hidden_states(target, convention, aux_ids, shift):
    """vllm: id k = hidden_states[k] (entering layer k); sglang: hidden_states[k + 1] (leaving layer
    k). transformers' last entry, hidden_states[L], is after the final norm: the capture's state
    leaving the last layer is before it (as the engines collect it), the norm makes it that entry.
    The final state through lm_head gives the model's logits. Right-padded, with the mask."""
    _, folder = target
    model = load_target(folder)
    _, norm, _ = decoder_parts(model)
    ids, mask = _batch()
    aux, final = capture_features(model, ids, mask, aux_ids, convention)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == LAYERS + 1 and aux.shape == (3, ids.shape[1], 3 * 64)
    valid = mask.bool()
    for slot, k in enumerate(aux_ids):
        mine = aux[..., slot * 64 : (slot + 1) * 64]
        if k + shift == LAYERS:
            with torch.no_grad():
                mine = norm(mine)
        torch.testing.assert_close(mine[valid], out.hidden_states[k + shift][valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(final[valid], out.hidden_states[LAYERS][valid], rtol=0, atol=1e-5)
    logits = final @ model.get_output_embeddings().weight.T
    torch.testing.assert_close(logits[valid], out.logits[valid], rtol=0, atol=1e-4)


def test_regeneration_is_greedy_generate(target):
    """regenerate (left-padded batches) answers each prompt as its own greedy generate does."""
    _, folder = target
    model = load_target(folder)
    tok = load_world_tokenizer(folder)
    eos, pad = tok.token_to_id(END), tok.token_to_id(PAD)
    ids, mask = _batch()
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    got = regenerate(model, prompts, max_new_tokens=8, eos_id=eos, pad_id=pad, batch_size=3)
    for prompt, answer in zip(prompts, got):
        with torch.no_grad():
            one = model.generate(
                input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=eos, pad_token_id=pad
            )[0, len(prompt) :].tolist()
        if eos in one:
            one = one[: one.index(eos) + 1]
        assert answer == one


def test_a_drafter_binds_to_the_target(target):
    """The drafter (a Llama-style EAGLE-3 layer) takes hidden, vocab and context from the target
    and nothing else (not DeepSeek-V3's head sizes nor its RoPE), its embedding and head too."""
    arch, folder = target
    sizes = target_sizes(folder)
    assert sizes == {"hidden_size": 64, "vocab_size": 300, "max_positions": 256}
    cfg = new_drafter_config(
        {"num_attention_heads": 2}, **sizes, aux_layer_ids=[0, 1, 2], convention="vllm", draft_vocab_size=40
    )
    assert (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (32, 10000.0, None)
    d = drafter_for_target(cfg, folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert torch.equal(d.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(target_head(folder), model.get_output_embeddings().weight)
    assert target_text_config(folder)["model_type"] == arch


def test_the_drafter_config_ignores_the_targets_other_keys(tmp_path):
    """A DeepSeek-V3 config's head_dim (= qk_rope_head_dim) and rope keys are the target's own."""
    cfg = target_config({"arch": "deepseek_v3", **SHAPE}, vocab_size=300)
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 16
    assert target_sizes(tmp_path) == {"hidden_size": 64, "vocab_size": 300, "max_positions": 256}


def test_world_model_params_per_arch():
    """arch and the DeepSeek-V3 keys stay out of the Llama world's dump; they are refused for
    another arch; a bad combination is named before any training."""
    assert "arch" not in params.WorldModel().model_dump()
    assert params.WorldModel(arch="llama").model_dump() == params.WorldModel().model_dump()
    assert params.WorldModel(arch="qwen3").model_dump()["arch"] == "qwen3"
    with pytest.raises(
        params.ParamsError,
        match=r"^world\.model\.n_group: a deepseek_v3 key, but world\.model\.arch "
        r"is qwen3",
    ):
        params.validate({"model": {"arch": "qwen3", "n_group": 2}}, params.WorldParams, "world.", cross=False)
    for model in (
        params.load(ROOT / f"configs/micro-{a}.yaml", base=ROOT / "params.yaml")["world"]["model"]
        for a in ("deepseek", "qwen3")
    ):
        assert model["arch"] in ("deepseek_v3", "qwen3")
    with pytest.raises(DraftportError, match=r"world\.model\.num_key_value_heads"):
        target_config({"arch": "deepseek_v3", **SHAPE, "num_key_value_heads": 1})
    with pytest.raises(DraftportError, match=r"world\.model\.n_group"):
        target_config({"arch": "deepseek_v3", **SHAPE, "n_group": 3})
    with pytest.raises(DraftportError, match=r"world\.model\.topk_group"):
        target_config({"arch": "deepseek_v3", **SHAPE, "n_routed_experts": 8, "n_group": 2, "topk_group": 3})


def test_deepseek_v3_training_is_deterministic(tokenizer, tmp_path):
    """MoE routing (top-k, index_add) under deterministic algorithms: the same seed, the same bytes,
    scratch and continued."""
    tok_dir, corpus = tokenizer
    digests = []
    for run in range(2):
        a, b = tmp_path / f"a{run}", tmp_path / f"b{run}"
        train_target(a, tok_dir, corpus, config={"arch": "deepseek_v3", **SHAPE}, steps=3, **TRAIN)
        train_target(b, tok_dir, corpus, init_from=a, steps=2, seed=1, **TRAIN)
        digests.append([hashlib.sha256((f / "model.safetensors").read_bytes()).hexdigest() for f in (a, b)])
    assert digests[0] == digests[1]


@pytest.mark.parametrize("name,arch", [("micro-deepseek", "deepseek_v3"), ("micro-qwen3", "qwen3")])
def test_the_arch_profiles_are_the_micro_profile(name, arch):
    """configs/micro-<arch>.yaml: configs/micro.yaml but for the profile name and world.model."""
    micro = params.read_yaml(ROOT / "configs/micro.yaml")
    mine = params.read_yaml(ROOT / f"configs/{name}.yaml")
    assert mine["profile"] == name and mine["world"]["model"]["arch"] == arch
    for cfg in (micro, mine):
        cfg.pop("profile"), cfg["world"].pop("model")
    assert mine == micro
    world = params.load(ROOT / f"configs/{name}.yaml", base=ROOT / "params.yaml")["world"]
    target_config(world["model"], vocab_size=world["vocab_size"])  # a shape the world's code builds
