"""Checkpoint formats: header parsing, validation, save/load round trips (flat and speculators)."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as load_np
from safetensors.torch import load_file, save_file
from toys import toy_cfg, toy_state

from draftport.data.shards import Sequence, write_features
from draftport.errors import DraftportError
from draftport.model.config import parse_config, read_config
from draftport.model.drafter import Eagle3Drafter
from draftport.model.fixtures import frequency_maps, kimi_k2_config, small_config, write_header_only_drafter
from draftport.model.formats import (
    check_keys,
    check_shapes,
    inspect_drafter,
    inspect_report,
    load_drafter_state,
    read_header,
    read_tensor_np,
    save_drafter,
    save_safetensors,
)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # for the process that writes


def raw_safetensors(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


# ---- headers ---------------------------------------------------------------------------------


def test_header_of_sparse_k2_drafter_reads_without_touching_data(tmp_path):
    cfg = kimi_k2_config()
    d2t, t2d = frequency_maps(cfg)
    folder = write_header_only_drafter(tmp_path / "k2", cfg, d2t, t2d, with_embed=True)
    f = folder / "model.safetensors"
    st = f.stat()
    assert st.st_size > 4.7e9  # full length ...
    assert st.st_blocks * 512 < 50e6  # ... but the big tensors are holes
    table, meta = read_header(f)
    assert meta == {"format": "pt"}
    assert table["fc.weight"].shape == (7168, 21504) and table["fc.weight"].dtype == "BF16"
    assert table["embed_tokens.weight"].shape == (163840, 7168)
    np.testing.assert_array_equal(read_tensor_np(table["d2t"]), d2t)
    np.testing.assert_array_equal(read_tensor_np(table["t2d"]), t2d)


def test_header_rejects_lies_truncation_and_garbage(tmp_path):
    f = tmp_path / "a.safetensors"
    raw_safetensors(f, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}}, b"\0" * 32)
    with pytest.raises(DraftportError, match="needs 16 bytes, offsets give 32"):
        read_header(f)
    raw_safetensors(f, {"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    with pytest.raises(DraftportError, match="truncated"):
        read_header(f)
    raw_safetensors(
        f,
        {
            "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    )
    with pytest.raises(DraftportError, match="overlap"):
        read_header(f)
    raw_safetensors(f, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 12)
    with pytest.raises(DraftportError, match="holds 12"):
        read_header(f)
    raw_safetensors(f, {"x": {"dtype": "F32", "shape": [2], "data_offsets": ["0", 8]}}, b"\0" * 8)
    with pytest.raises(DraftportError, match="bad data_offsets"):
        read_header(f)
    raw_safetensors(f, {"x": {"dtype": "F32", "shape": [2**62, 2**62], "data_offsets": [0, 0]}}, b"")
    with pytest.raises(DraftportError, match="header lies"):
        read_header(f)  # no int64 wrap-around makes a huge shape look small
    f.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(DraftportError, match="not a safetensors file"):
        read_header(f)
    f.write_bytes(b"\x05")
    with pytest.raises(DraftportError, match="truncated"):
        read_header(f)


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    (tmp_path / "config.json").write_text(json.dumps(toy_cfg().to_flat_dict()))
    with pytest.raises(DraftportError, match="pickle") as e:
        inspect_drafter(tmp_path)
    assert e.value.where.endswith("pytorch_model.bin")
    with pytest.raises(DraftportError, match="pickle"):
        inspect_drafter(tmp_path / "pytorch_model.bin")
    with pytest.raises(DraftportError, match="pickle"):
        read_header(tmp_path / "pytorch_model.bin")


# ---- config ----------------------------------------------------------------------------------


def test_config_head_dim_comes_from_config_not_hidden_over_heads():
    cfg = parse_config(kimi_k2_config().to_flat_dict())
    assert cfg.head_dim == 128 and cfg.hidden_size // cfg.num_attention_heads == 112


def test_config_rejects_missing_and_malformed_fields():
    raw = small_config().to_flat_dict()
    with pytest.raises(DraftportError, match="missing hidden_size"):
        parse_config({k: v for k, v in raw.items() if k != "hidden_size"})
    with pytest.raises(DraftportError, match="head_dim must be a positive integer"):
        parse_config({**raw, "head_dim": "128"})
    with pytest.raises(DraftportError, match="rope_theta must be a number"):
        parse_config({**raw, "rope_theta": "1e6"})
    with pytest.raises(DraftportError, match="not a multiple"):
        parse_config({**raw, "num_key_value_heads": 3})
    with pytest.raises(DraftportError, match="3 aux layer ids"):
        parse_config({**raw, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}})


def test_check_shapes_names_heads_times_head_dim(tmp_path):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    folder = write_header_only_drafter(
        tmp_path / "d", cfg, d2t, t2d, shapes={"midlayer.self_attn.q_proj.weight": (4 * 16, 128)}
    )
    with pytest.raises(DraftportError, match=r"q_proj.*\[128, 128\].*num_attention_heads 4 x head_dim 32") as e:
        check_shapes(inspect_drafter(folder))
    assert e.value.where.endswith("model.safetensors")


# ---- save / load -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["flat", "speculators"])
def test_save_load_round_trip(tmp_path, fmt):
    cfg, state = toy_state(toy_cfg(aux_convention="vllm", rope_scaling={"rope_type": "linear", "factor": 2.0}))
    out = save_drafter(tmp_path / "drafter", cfg, state, fmt=fmt)
    names = set(read_header(out / "model.safetensors")[0])
    if fmt == "speculators":
        assert "layers.0.self_attn.q_proj.weight" in names and not any(n.startswith("midlayer.") for n in names)
        raw = json.loads((out / "config.json").read_text())
        assert raw["transformer_layer_config"]["hidden_size"] == 64
    else:
        assert "midlayer.self_attn.q_proj.weight" in names
    cfg2, state2 = load_drafter_state(out)
    assert set(state2) == set(state)
    for k in state:
        torch.testing.assert_close(state2[k], state[k].cpu(), rtol=0, atol=0)
    skip = {"architectures", "format"}
    assert {k: v for k, v in cfg2.summary().items() if k not in skip} == {
        k: v for k, v in cfg.summary().items() if k not in skip
    }
    assert cfg2.format == fmt
    # the loaded state drives a drafter exactly like the saved one
    d = Eagle3Drafter(cfg2)
    d.load_flat_state(state2)


def test_save_refuses_incomplete_state_and_leaves_nothing(tmp_path):
    cfg, state = toy_state()
    state.pop("lm_head.weight")
    with pytest.raises(DraftportError, match="without lm_head.weight"):
        save_drafter(tmp_path / "out", cfg, state)
    assert list(tmp_path.iterdir()) == []


def test_load_lists_missing_and_unexpected_keys(tmp_path):
    cfg, state = toy_state()
    folder = save_drafter(tmp_path / "d", cfg, state)
    bad = {k: v for k, v in state.items() if k not in ("norm.weight", "midlayer.hidden_norm.weight")}
    bad["midlayer.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    bad["extra_head.weight"] = torch.zeros(2, 2)
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(DraftportError) as e:
        load_drafter_state(folder)
    msg = e.value.problem
    assert "missing midlayer.hidden_norm.weight, norm.weight" in msg
    assert "unexpected extra_head.weight, midlayer.self_attn.rotary_emb.inv_freq" in msg


def test_load_validates_the_vocab_map(tmp_path):
    cfg, state = toy_state()
    state["d2t"] = state["d2t"].clone()
    state["d2t"][-1] = 10_000  # points past the vocab of 100
    folder = save_drafter(tmp_path / "d", cfg, state)
    with pytest.raises(DraftportError, match="outside the vocab of 100"):
        load_drafter_state(folder)


def test_speculators_checkpoint_loads_with_its_own_defaults(tmp_path):
    """`layers.0.*` names, nested transformer_layer_config, norm_before_residual absent -> False
    (speculators 0.9.0's Eagle3SpeculatorConfig default, as the flat format's)."""
    cfg, state = toy_state()
    folder = tmp_path / "spec"
    folder.mkdir()
    tensors = {(k.replace("midlayer.", "layers.0.", 1)): v.contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Eagle3Speculator"],
                "speculators_model_type": "eagle3",
                "draft_vocab_size": 40,
                "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
                "transformer_layer_config": {
                    "model_type": "llama",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "head_dim": 16,
                    "vocab_size": 100,
                    "max_position_embeddings": 256,
                    "rms_norm_eps": 1e-6,
                },
                "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "org/target"}},
            }
        )
    )
    cfg2, state2 = load_drafter_state(folder)
    assert cfg2.format == "speculators"
    assert cfg2.norm_before_residual is False  # speculators 0.9.0: Field(default=False)
    assert cfg2.aux_layer_ids == [1, 2, 3] and cfg2.head_dim == 16 and cfg2.draft_vocab_size == 40
    assert cfg2.extra["verifier"] == "org/target"
    assert "midlayer.self_attn.q_proj.weight" in state2 and not any(k.startswith("layers.") for k in state2)
    flat_raw = dict(cfg.to_flat_dict())
    flat_raw.pop("norm_before_residual")
    assert parse_config(flat_raw).norm_before_residual is False


def test_flat_and_speculators_headers_normalize_to_the_same_names(tmp_path):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    a = inspect_drafter(write_header_only_drafter(tmp_path / "a", cfg, d2t, t2d, fmt="flat"))
    b = inspect_drafter(write_header_only_drafter(tmp_path / "b", cfg, d2t, t2d, fmt="speculators"))
    assert set(a.tensors) == set(b.tensors)
    assert (a.format, b.format) == ("flat", "speculators")
    check_keys(b)
    check_shapes(b)
    assert read_config(tmp_path / "b")[0].target_hidden_size is None  # written, equal to H: normalized


def test_inspect_report_lists_problems_instead_of_failing(tmp_path):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    folder = write_header_only_drafter(tmp_path / "d", cfg, d2t, t2d, drop=["norm.weight"])
    rep = inspect_report(folder)
    assert any("missing norm.weight" in p for p in rep["problems"])
    assert rep["config"]["hidden_size"] == 64
    assert {t["name"] for t in rep["tensors"]} >= {"fc.weight", "d2t", "t2d"}


# ---- deterministic safetensors writer --------------------------------------------------------

WRITE_IN_A_PROCESS = """
import sys, torch
from draftport.model.formats import save_drafter, save_safetensors
from draftport.model.drafter import Eagle3Drafter
sys.path.insert(0, sys.argv[2])
from toys import toy_state
g = torch.Generator().manual_seed(0)
tensors = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).bfloat16(),
           "ids": torch.arange(7), "mask": torch.arange(6) % 2 == 0}
meta = {f"key_{i}": f"value {i}" for i in range(12)}
save_safetensors(tensors, sys.argv[1] + "/raw.safetensors", metadata=meta)
cfg, state = toy_state()
save_drafter(sys.argv[1] + "/drafter", cfg, state, metadata={"source": "org/a", "commit": "abc", "step": "7"})
"""


def test_identical_writes_in_two_processes_give_identical_bytes(tmp_path):
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        subprocess.run(
            [sys.executable, "-c", WRITE_IN_A_PROCESS, str(out), str(HELPERS)],
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=300,
        )
        outs.append(out)
    for rel in ("raw.safetensors", "drafter/model.safetensors", "drafter/config.json"):
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel
    with safe_open(str(outs[0] / "raw.safetensors"), framework="pt") as f:
        assert f.metadata() == {f"key_{i}": f"value {i}" for i in range(12)}
    raw = (outs[0] / "raw.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    assert (8 + n) % 8 == 0  # the data section starts 8-byte aligned
    assert list(json.loads(raw[8 : 8 + n])["__metadata__"]) == sorted(f"key_{i}" for i in range(12))


def test_save_safetensors_round_trips_every_dtype_and_matches_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(4, 3, generator=g),
        "bf16": torch.randn(2, 5, generator=g).bfloat16(),
        "i64": torch.arange(-3, 9).reshape(3, 4),
        "bool": torch.rand(7, generator=g) > 0.5,
        "f16": torch.randn(3, generator=g).half(),
        "i32": torch.arange(5, dtype=torch.int32),
        "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "strided": torch.randn(4, 6, generator=g)[:, ::2],
    }
    save_safetensors(tensors, tmp_path / "a.safetensors")
    back = load_file(str(tmp_path / "a.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert (
            torch.equal(back[k].view(torch.uint8), v.contiguous().view(torch.uint8))
            if v.dtype == torch.float8_e4m3fn
            else torch.equal(back[k], v)
        ), k
    # with at most one metadata key, safetensors' own writer gives the very same bytes
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "b.safetensors"), metadata={"format": "pt"}
    )
    save_safetensors(tensors, tmp_path / "c.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "b.safetensors").read_bytes() == (tmp_path / "c.safetensors").read_bytes()
    # numpy arrays, a big-endian one included; read_header reads what it wrote
    arrays = {
        "d2t": np.arange(5, dtype=">i8"),
        "t2d": np.array([True, False, True]),
        "counts": np.arange(6, dtype=np.int64).reshape(2, 3).T,
    }
    save_safetensors(arrays, tmp_path / "v.safetensors")
    got = load_np(str(tmp_path / "v.safetensors"))
    for k, v in arrays.items():
        np.testing.assert_array_equal(got[k], v)
    table, meta = read_header(tmp_path / "v.safetensors")
    assert meta == {} and table["counts"].shape == (3, 2)
    np.testing.assert_array_equal(read_tensor_np(table["d2t"]), np.arange(5))
    with pytest.raises(TypeError, match="metadata"):
        save_safetensors(arrays, tmp_path / "w.safetensors", metadata={"step": 7})
    assert not (tmp_path / "w.safetensors").exists()


def test_feature_shards_and_save_drafter_write_the_same_bytes_twice(tmp_path):
    def featurize(batch):
        g = torch.Generator().manual_seed(len(batch[0].tokens))
        T = max(len(s.tokens) for s in batch)
        return (
            torch.randn(len(batch), T, 12, generator=g),
            torch.randn(len(batch), T, 4, generator=g),
            torch.randint(0, 50, (len(batch), T), generator=g),
        )

    seqs = [Sequence(list(range(5 + i)), 2) for i in range(6)]
    for name in ("a", "b"):
        write_features(
            tmp_path / name, seqs, featurize, meta={"aux_layer_ids": [1, 2, 3]}, shard_samples=4, batch_size=2
        )
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["index.json", "shard_00000.safetensors", "shard_00001.safetensors"]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    cfg, state = toy_state()
    for name in ("d1", "d2"):
        save_drafter(tmp_path / name, cfg, state, metadata={"z": "1", "a": "2", "m": "3"})
    for f in ("model.safetensors", "config.json"):
        assert (tmp_path / "d1" / f).read_bytes() == (tmp_path / "d2" / f).read_bytes(), f
