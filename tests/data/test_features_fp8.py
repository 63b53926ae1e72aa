"""Feature storage in fp8_e4m3 (float8 states with a float32 scale per token and state) and the
capture's writer (rows written in place by a thread, batches sorted by length): fp8 rounds within
e4m3's bound and halves the bytes, its scales are checked on load, a drafter trains on it as on
bf16; the writer's files are the former writer's byte for byte, whatever the batching; the
capture stops at the final norm and takes its greedy choice from float32 logits in chunks."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_targets import LLAMA_AUX, seed_folder, tiny_llama
from toys import toy_cfg, toy_drafter

from draftport.data.capture import capture_dtype, capture_features, load_target
from draftport.data.features import greedy_choice, greedy_head
from draftport.data.shards import FeatureSet, Sequence, bytes_per_token, dequantize_fp8, quantize_fp8, write_features
from draftport.errors import DraftportError
from draftport.evaluation.drift import capture_same_tokens
from draftport.model.formats import save_safetensors
from draftport.training.loop import TrainConfig, train

E4M3_REL = 2.0**-4  # half an ulp of 3 mantissa bits, relative to the value
E4M3_SUB = 2.0**-10  # half the subnormal spacing (2^-9), relative to the group's scale


def sequences(n, seed=0, lo=5, hi=40, vocab=100):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(
            Sequence(torch.randint(0, vocab, (T,), generator=g).tolist(), int(torch.randint(1, 4, (1,), generator=g)))
        )
    return out


def token_featurizer(H, seed=0, layer_scale=(0.01, 1.0, 30.0), vocab=100, calls=None):
    """States that are a fixed function of (token id, position): the same whatever the batch they
    come in, so folders written with other batchings must be equal byte for byte. The three aux
    layers differ in magnitude by 3000x (as a target's embedding and deep layers do), and one
    channel of the last is an outlier. The padding is filled with garbage (NaN): never stored."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, 3, H, generator=g) * torch.tensor(layer_scale)[:, None]
    table[:, 2, 0] *= 20
    pos = torch.randn(256, 3, H, generator=g) * 0.1
    mix = torch.randn(3 * H, H, generator=g) / (3 * H) ** 0.5
    head = torch.randn(vocab, H, generator=g)

    def featurize(batch):
        if calls is not None:
            calls.append([len(s.tokens) for s in batch])
        T = max(len(s.tokens) for s in batch)
        aux = torch.full((len(batch), T, 3 * H), float("nan"))
        for i, s in enumerate(batch):
            n = len(s.tokens)
            aux[i, :n] = (table[torch.tensor(s.tokens)] * (1 + pos[:n])).reshape(n, 3 * H)
        final = torch.tanh(torch.nan_to_num(aux) @ mix) * 3
        final[torch.isnan(aux[..., 0])] = float("nan")
        arg = (final @ head.t()).argmax(-1)
        return aux, final, arg

    return featurize, head


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def old_writer(out_dir: Path, sequences, featurize, meta, shard_samples, batch_size, dtype):
    """The writer as it was before the in-place writer (per-sample copies, torch.cat, one
    save_safetensors per shard, then its sha256): the reference for the bytes."""
    td = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    out_dir.mkdir(parents=True)
    shards, total = [], 0
    for s0 in range(0, len(sequences), shard_samples):
        chunk = sequences[s0 : s0 + shard_samples]
        parts = {"aux": [], "final": [], "tokens": [], "loss_mask": [], "target_arg": []}
        for b0 in range(0, len(chunk), batch_size):
            bseq = chunk[b0 : b0 + batch_size]
            aux, final, arg = featurize(bseq)
            for i, sq in enumerate(bseq):
                n = len(sq.tokens)
                parts["target_arg"].append(arg[i, :n].to(torch.int32))
                parts["aux"].append(aux[i, :n].to(td))
                parts["final"].append(final[i, :n].to(td))
                parts["tokens"].append(torch.tensor(sq.tokens, dtype=torch.int32))
                m = torch.zeros(n, dtype=torch.bool)
                m[sq.response_start :] = True
                parts["loss_mask"].append(m)
        lens = torch.tensor([len(sq.tokens) for sq in chunk], dtype=torch.int64)
        tensors = {k: torch.cat(v) for k, v in parts.items()}
        tensors["offsets"] = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        tensors["response_start"] = torch.tensor([sq.response_start for sq in chunk], dtype=torch.int64)
        name = f"shard_{len(shards):05d}.safetensors"
        save_safetensors(tensors, out_dir / name)
        shards.append(
            {
                "file": name,
                "samples": len(chunk),
                "tokens": int(lens.sum()),
                "sha256": hashlib.sha256((out_dir / name).read_bytes()).hexdigest(),
            }
        )
        total += int(lens.sum())
    hidden = tensors["final"].shape[1]
    index = dict(meta)
    index.update(
        samples=len(sequences),
        tokens=total,
        dtype=dtype,
        hidden_size=hidden,
        bytes_per_token=bytes_per_token(hidden, dtype),
        shards=shards,
    )
    (out_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")


META = {"aux_layer_ids": [1, 2, 3], "aux_convention": "vllm"}


# ---- the writer --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,window", [("bfloat16", 5), ("bfloat16", None), ("float32", 8)])
def test_writer_bytes_equal_the_former_writers_in_any_batching(tmp_path, dtype, window):
    seqs = sequences(23)
    featurize, _ = token_featurizer(16)
    old_writer(tmp_path / "old", seqs, featurize, META, 5, 2, dtype)
    calls = []
    featurize_logged, _ = token_featurizer(16, calls=calls)
    write_features(tmp_path / "input", seqs, featurize, meta=META, shard_samples=5, batch_size=2, dtype=dtype)
    write_features(
        tmp_path / "sorted",
        seqs,
        featurize_logged,
        meta=META,
        shard_samples=5,
        batch_size=2,
        dtype=dtype,
        by_length=True,
        sort_window=window,
        writers=2,
    )
    ref = folder_bytes(tmp_path / "old")
    assert len(ref) == 6  # 5 shards + index.json
    assert folder_bytes(tmp_path / "input") == ref
    assert folder_bytes(tmp_path / "sorted") == ref
    # the sorted run did batch by length: longest first within windows of whole shards (5: each
    # shard; 8 -> 10: two shards; default max(5, 16 x 2) -> 35: all), batches across shards
    lens = [len(s.tokens) for s in seqs]
    w = {5: 5, 8: 10, None: 35}[window]
    want = []
    for w0 in range(0, 23, w):
        group = sorted(lens[w0 : w0 + w], reverse=True)
        want += [group[b : b + 2] for b in range(0, len(group), 2)]
    assert calls == want and want != [lens[s0 : s0 + 5][b : b + 2] for s0 in range(0, 23, 5) for b in range(0, 5, 2)]


def test_writer_errors_reach_the_caller_and_leave_nothing(tmp_path):
    seqs = sequences(12)
    featurize, _ = token_featurizer(16)
    state = {"n": 0}

    def narrowing(batch):  # the 4th batch returns a narrower final state than the shard's first
        state["n"] += 1
        aux, final, arg = featurize(batch)
        return (aux, final[..., :8], arg) if state["n"] == 4 else (aux, final, arg)

    out = tmp_path / "feats"
    with pytest.raises(DraftportError, match="featurize"):
        write_features(out, seqs, narrowing, meta=META, shard_samples=6, batch_size=2)
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no temp folder either

    def failing(batch):
        state["n"] += 1
        if state["n"] > 6:
            raise RuntimeError("device lost")
        return featurize(batch)

    with pytest.raises(RuntimeError, match="device lost"):
        write_features(out, seqs, failing, meta=META, shard_samples=4, batch_size=2)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DraftportError, match="features.dtype"):
        write_features(out, seqs, featurize, meta=META, dtype="fp8")


# ---- fp8: rounding, bytes, checks ----------------------------------------------------------------
def test_fp8_round_trip_within_e4m3_bound_per_token_and_layer():
    g = torch.Generator().manual_seed(0)
    H = 512
    # per token magnitudes over 6 decades, three layers 3000x apart, a heavy-tailed channel, zeros
    x = torch.randn(300, 3, H, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    x *= 10 ** torch.empty(300, 1, 1).uniform_(-3, 3, generator=g)
    x[:, 2, 5] *= 50
    x[7] = 0
    x = x.reshape(300, 3 * H)
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (300, 3)
    assert scale.dtype == torch.float32 and bool((scale > 0).all())
    y = dequantize_fp8(q, scale)
    err = (y - x).abs()
    s = scale.repeat_interleave(H, dim=1)
    assert bool((err <= E4M3_REL * x.abs() + E4M3_SUB * s + 1e-6 * x.abs()).all())
    rows = x.reshape(300 * 3, H)
    rel = (y.reshape(-1, H) - rows).norm(dim=1) / rows.norm(dim=1).clamp_min(1e-30)
    assert float(rel.max()) <= E4M3_REL and float(rel[rows.norm(dim=1) > 0].mean()) > 2**-7  # really rounded
    assert torch.equal(y[7], torch.zeros(3 * H))
    # one scale for the whole row would lose the small layer: its values fall under e4m3's range
    q1, s1 = quantize_fp8(x, 1)
    small = (dequantize_fp8(q1, s1) - x)[:, :H].norm() / x[:, :H].norm()
    assert float(small) > 4 * float(rel.reshape(300, 3)[:, 0].max())


def test_fp8_folder_halves_the_bytes_reads_back_and_keeps_the_full_precision_choice(tmp_path):
    H = 256
    seqs = sequences(30, hi=60)
    featurize, head = token_featurizer(H)
    ib = write_features(tmp_path / "bf16", seqs, featurize, meta=META, shard_samples=8, batch_size=3)
    i8 = write_features(
        tmp_path / "fp8", seqs, featurize, meta=META, shard_samples=8, batch_size=3, dtype="fp8_e4m3", by_length=True
    )
    assert i8["dtype"] == "fp8_e4m3" and i8["bytes_per_token"] == 4 * H + 4 * 4 + 5 == bytes_per_token(H, "fp8_e4m3")
    assert ib["bytes_per_token"] == 4 * H * 2 + 5
    disk = {k: sum(p.stat().st_size for p in (tmp_path / k).glob("shard_*")) for k in ("bf16", "fp8")}
    ratio = disk["fp8"] / disk["bf16"]
    # what each stores per token beyond the states: target_arg (4 B) and the tokens' and masks' 5
    assert ratio == pytest.approx((i8["bytes_per_token"] + 4) / (ib["bytes_per_token"] + 4), rel=0.01)
    assert 0.5 <= ratio < 0.52
    fb, f8 = FeatureSet(tmp_path / "bf16"), FeatureSet(tmp_path / "fp8")  # sha256 of every shard checked
    for i in range(len(seqs)):
        a, b = fb.sample(i), f8.sample(i)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["response_start"] == b["response_start"]
        assert b["aux"].dtype == torch.float32 and b["aux"].shape == a["aux"].shape
        ref_aux, ref_fin, ref_arg = (t[0] for t in featurize([seqs[i]]))
        for got, ref, k in ((b["aux"], ref_aux, 3), (b["final"], ref_fin, 1)):
            rows = ref.reshape(len(ref), k, H)
            rel = (got.reshape(len(ref), k, H) - rows).norm(dim=-1) / rows.norm(dim=-1)
            assert float(rel.max()) <= E4M3_REL
        # the greedy choice is the full-precision one, not the dequantized state's
        assert torch.equal(b["target_arg"], ref_arg) and torch.equal(a["target_arg"], ref_arg)
    agree = [
        bool(torch.equal((f8.sample(i)["final"] @ head.t()).argmax(-1), f8.sample(i)["target_arg"]))
        for i in range(len(seqs))
    ]
    assert not all(agree)  # e4m3's rounding does flip choices: the stored one matters


def rewrite_shard(folder: Path, si: int, edit) -> Path:
    """Change one shard's tensors and record its new sha256: a folder that passes the hash check."""
    idx = json.loads((folder / "index.json").read_text())
    path = folder / idx["shards"][si]["file"]
    t = load_file(str(path))
    edit(t)
    save_safetensors(t, path)
    idx["shards"][si]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (folder / "index.json").write_text(json.dumps(idx))
    return path


def test_fp8_scales_and_hashes_are_checked(tmp_path):
    seqs = sequences(10)
    featurize, _ = token_featurizer(16)
    out = tmp_path / "fp8"
    write_features(out, seqs, featurize, meta=META, shard_samples=5, batch_size=2, dtype="fp8_e4m3")
    shard = out / "shard_00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 3] ^= 0x40
    shard.write_bytes(raw)
    with pytest.raises(DraftportError, match="sha256 differs"):
        FeatureSet(out)

    def fresh():
        write_features(out, seqs, featurize, meta=META, shard_samples=5, batch_size=2, dtype="fp8_e4m3")

    cases = [
        (lambda t: t["final_scale"].__setitem__(3, float("nan")), "final_scale holds 1 non-finite or non-positive"),
        (lambda t: t["aux_scale"].__setitem__((0, 2), 0.0), "aux_scale holds 1 non-finite or non-positive"),
        (
            lambda t: t.update(aux_scale=t["aux_scale"][:, :2].contiguous()),
            r"aux_scale is torch.float32 \[\d+, 2\], expected",
        ),
        (lambda t: t.update(final_scale=t["final_scale"][1:].contiguous()), "final_scale is torch.float32"),
        (lambda t: t.pop("aux_scale"), "without aux_scale"),
        (lambda t: t.update(final=t["final"].float().bfloat16()), "final is stored as torch.bfloat16"),
    ]
    for edit, msg in cases:
        fresh()
        path = rewrite_shard(out, 1, edit)
        fs = FeatureSet(out)
        fs.sample(0)  # shard 0 is sound
        with pytest.raises(DraftportError, match=msg) as e:
            fs.sample(7)
        assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)
    # a bf16 folder whose shard holds fp8 states (scales beside them, ignored): refused
    write_features(tmp_path / "bf", seqs, featurize, meta=META, shard_samples=5, batch_size=2)

    def to_fp8(t):
        t["aux"], t["aux_scale"] = quantize_fp8(t["aux"].float(), 3)

    rewrite_shard(tmp_path / "bf", 0, to_fp8)
    with pytest.raises(DraftportError, match="aux is stored as float8_e4m3fn but index.json says bfloat16"):
        FeatureSet(tmp_path / "bf").sample(0)


# ---- a drafter trains on fp8 features as on bf16 ones -----------------------------------------------
def test_a_drafter_trains_on_fp8_features_as_on_bf16(tmp_path):
    cfg = toy_cfg()
    H = cfg.hidden_size
    seqs = sequences(24, lo=10, hi=20, vocab=cfg.vocab_size)
    featurize, head = token_featurizer(H, layer_scale=(0.05, 1.0, 8.0), vocab=cfg.vocab_size)
    result = {}
    for dtype in ("bfloat16", "fp8_e4m3"):
        write_features(tmp_path / dtype, seqs, featurize, meta=META, shard_samples=10, batch_size=4, dtype=dtype)
        tc = TrainConfig(steps=30, batch_size=4, lr=3e-3, warmup_steps=5, checkpoint_every=30, log_every=5)
        out = train(toy_drafter(), FeatureSet(tmp_path / dtype), head, tmp_path / f"run_{dtype}", tc, progress=False)
        result[dtype] = [h["loss"] for h in out["history"]]
    for h in result.values():
        assert h[-1] < 0.8 * h[0]
    a, b = result["bfloat16"][-1], result["fp8_e4m3"][-1]
    assert abs(a - b) / a < 0.05, result
    assert result["bfloat16"] != result["fp8_e4m3"]  # the inputs did differ


# ---- a real target: capture in fp8 --------------------------------------------------------------
def test_capture_of_a_real_target_in_fp8(tmp_path):
    tiny_llama(tmp_path / "target")
    seed_folder(tmp_path / "seqs", n=9)
    ref = capture_same_tokens(tmp_path / "target", tmp_path / "seqs", tmp_path / "f32", batch_size=4, dtype="float32")
    got = capture_same_tokens(tmp_path / "target", tmp_path / "seqs", tmp_path / "f8", batch_size=4, dtype="fp8_e4m3")
    assert got["dtype"] == "fp8_e4m3" and got["aux_layer_ids"] == LLAMA_AUX and got["tokens"] == ref["tokens"]
    fa, fb = FeatureSet(tmp_path / "f32"), FeatureSet(tmp_path / "f8")
    for i in range(len(fa)):
        a, b = fa.sample(i), fb.sample(i)
        assert torch.equal(a["target_arg"], b["target_arg"])  # from the float32 forward, before rounding
        for k, n in (("aux", 3), ("final", 1)):
            x, y = a[k].reshape(-1, n, 64), b[k].reshape(-1, n, 64)
            rel = (y - x).norm(dim=-1) / x.norm(dim=-1)
            assert float(rel.max()) <= E4M3_REL


# ---- the capture: target dtype, stop at the final norm, the greedy choice ----------------------
def test_capture_dtype_is_bf16_on_a_gpu_float32_on_the_cpu():
    assert capture_dtype("cpu") == torch.float32 and capture_dtype("cpu", "fp8_e4m3") == torch.float32
    assert capture_dtype("cuda") == torch.bfloat16 and capture_dtype("cuda:1", "fp8_e4m3") == torch.bfloat16
    assert capture_dtype("cuda", "float32") == torch.float32  # float32 features: a float32 forward
    assert capture_dtype("auto") == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)


def test_capture_stops_at_the_final_norm_and_chunks_the_greedy_choice(tmp_path):
    tiny_llama(tmp_path / "t")
    model = load_target(tmp_path / "t")
    calls = []
    model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, 13:] = 0
    aux, final = capture_features(model, ids, mask, [0, 1, 2])
    assert calls == []  # no logits computed
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(calls) == 1
    assert torch.equal(aux[..., :64], out.hidden_states[0]) and torch.equal(aux[..., 64:128], out.hidden_states[1])
    head = greedy_head(model)
    ref = out.logits.float().argmax(-1)
    assert torch.equal(greedy_choice(final, head), ref)
    assert torch.equal(greedy_choice(final, head, budget=4 * 128 * 7), ref)  # 7 rows at a time, a ragged last
