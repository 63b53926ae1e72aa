"""A target in a multimodal wrapper (as Kimi-K2.5 ships: config.json with a text_config, text
weights under language_model.*, a vision tower beside them) gives the same features and the
same embed/lm_head as the plain text model."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from draftport.data.capture import capture_features, load_target
from draftport.model.config import target_text_config as text_config
from draftport.model.target import read_target_tensor, read_text_tensor


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("wrapped")
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg).eval()
    plain.save_pretrained(root / "plain")
    wrapped = root / "wrapped"
    wrapped.mkdir()
    state = {"language_model." + k: v.contiguous() for k, v in plain.state_dict().items()}
    state["vision_tower.patch_embed.proj.weight"] = torch.randn(64, 3, 14, 14)  # never loaded
    state["mm_projector.proj.0.weight"] = torch.randn(64, 64)
    save_file(state, str(wrapped / "model.safetensors"))
    text = json.loads((root / "plain" / "config.json").read_text())
    (wrapped / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "model_type": "kimi_k25",
                "text_config": text,
                "vision_config": {"hidden_size": 64},
            }
        )
    )
    return root / "plain", wrapped


def test_text_config_and_tensors_through_the_wrapper(targets):
    plain, wrapped = targets
    assert text_config(wrapped)["num_hidden_layers"] == 3 == text_config(plain)["num_hidden_layers"]
    for name in ("model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"):
        assert torch.equal(read_text_tensor(wrapped, name), read_text_tensor(plain, name))
    # the drafter's frozen embedding and the target head, as bind.drafter_for_target reads them
    assert torch.equal(
        read_target_tensor(wrapped, "embed_tokens.weight"), read_target_tensor(plain, "embed_tokens.weight")
    )
    assert torch.equal(read_target_tensor(wrapped, "lm_head.weight"), read_target_tensor(plain, "lm_head.weight"))


@pytest.mark.parametrize("aux,conv", [([0, 1, 3], "vllm"), ([0, 1, 2], "sglang")])
def test_capture_through_the_wrapper_equals_the_plain_model(targets, aux, conv):
    plain, wrapped = targets
    a, b = load_target(plain), load_target(wrapped)
    assert sum(p.numel() for p in b.parameters()) == sum(p.numel() for p in a.parameters())  # no vision tower
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    aux_a, fin_a = capture_features(a, ids, mask, aux, conv)
    aux_b, fin_b = capture_features(b, ids, mask, aux, conv)
    assert aux_a.shape == (2, 11, 3 * 64)
    assert torch.equal(aux_a, aux_b) and torch.equal(fin_a, fin_b)
    assert not torch.equal(aux_a[..., :64], aux_a[..., 64:128])  # distinct layers captured
