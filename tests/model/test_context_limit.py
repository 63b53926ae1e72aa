"""How far a drafter's positions reach, as an engine derives its max length from config.json, and
Phase 0's comparison with the new target's serving length."""

import json

import pytest

from draftport.errors import DraftportError
from draftport.model.config import context_limit, served_positions


@pytest.mark.parametrize(
    "mpe, scaling, want",
    [
        (2048, None, 2048),
        (2048, {"rope_type": "default"}, 2048),
        (2048, {"rope_type": "linear", "factor": 4.0}, 8192),
        (2048, {"type": "dynamic", "factor": 2}, 4096),
        (131072, {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}, 131072),
        (8192, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 8192),
        (None, None, None),
    ],
)
def test_served_positions(mpe, scaling, want):
    assert served_positions(mpe, scaling) == want


def _drafter(path, mpe, scaling=None):
    path.mkdir()
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "draft_vocab_size": 100,
        "max_position_embeddings": mpe,
        "rope_scaling": scaling,
    }
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _target(path, mpe):
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"hidden_size": 64, "vocab_size": 512, "max_position_embeddings": mpe})
    )
    return path


def test_a_source_that_stops_below_the_serving_length_is_limited(tmp_path):
    target = _target(tmp_path / "t", 32768)
    short = context_limit(_drafter(tmp_path / "short", 4096), target)
    assert short == {
        "source_max_position_embeddings": 4096,
        "source_rope_scaling": None,
        "source_limit": 4096,
        "serving_length": 32768,
        "limited": True,
    }
    scaled = context_limit(_drafter(tmp_path / "scaled", 4096, {"rope_type": "linear", "factor": 8.0}), target)
    assert scaled["source_limit"] == 32768 and scaled["limited"] is False


def test_a_folder_without_config_is_named(tmp_path):
    with pytest.raises(DraftportError, match="config.json"):
        context_limit(tmp_path, _target(tmp_path / "t", 512))
