"""The drift probe: the old and the new target on the same tokens (the new target's eval answers), how
far their hidden states moved, and what that costs the source drafter.

The seeds' Assumption 1 (K2's and K2.5's hidden states at the aux layers are similar, so the
source drafter's fc and midlayer still make sense of them) is a claim about representations;
Phase 0 cannot test it alone, because there the target *and* the text it verifies both change.
Here the text is held fixed:

- `capture_same_tokens`: a target (the old one) run over exactly the sequences of a feature folder
  (same ids, loss masks, aux layer ids and convention; no regeneration), written as a feature
  folder of the same format, its greedy choice from its own head;
- `drift_stats`: per aux layer and for the final state (after the final norm), over the assistant
  tokens, the mean cosine similarity, linear CKA and two relative norm figures; and the greedy
  agreement of the two targets on those positions;
- `drift_probe`: both, plus the source drafter's tau on the old target's features and on the new
  target's features of the same tokens (and one cross term; see its docstring).

Metric names (a = the reference, the old target; b = the other, the new target):
    cos_layer_<id>, cos_final            mean over tokens of cos(a_t, b_t)
    cka_layer_<id>, cka_final            linear CKA (Kornblith et al. 2019) on a token sample
    rel_norm_change_layer_<id>, _final   mean over tokens of | ||b_t|| - ||a_t|| | / ||a_t||
                                         (did the scale move? blind to rotation)
    rel_diff_norm_layer_<id>, _final     mean over tokens of ||b_t - a_t|| / ||a_t||
                                         (did the vector move? 0 only when b_t == a_t)
    greedy_agreement                     fraction of positions predicting an assistant token where
                                         the two targets' stored greedy choices agree
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from draftport.data.capture import capture_dtype, check_aux_ids, load_target, target_identity
from draftport.data.features import featurizer, on_gpu
from draftport.data.shards import FeatureSet, Sequence, collate, write_features
from draftport.data.vllm_capture import capture_features_vllm
from draftport.errors import DraftportError
from draftport.evaluation.accept import evaluate_drafter, offline_accept_length
from draftport.files import atomic_write_text
from draftport.model.bind import check_features_fit, drafter_for_target, target_head
from draftport.model.config import target_text_config
from draftport.model.device import pick as pick_device
from draftport.model.formats import load_drafter_state
from draftport.progress import progress

DEFAULT_MAX_TOKENS = 4096  # CKA's token sample: Gram matrices of 4096^2 float64 (128 MB each)
CKA_SEED = 0


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- reading a feature folder's token sequences (no hidden state is loaded) -------------------
def _shard_small(fs: FeatureSet, si: int) -> dict[str, torch.Tensor]:
    """tokens, loss_mask, offsets, response_start of one shard, read alone (safe_open)."""
    path = fs.folder / fs.index["shards"][si]["file"]
    try:
        with safe_open(str(path), framework="pt") as sf:
            return {n: sf.get_tensor(n) for n in ("tokens", "loss_mask", "offsets", "response_start")}
    except Exception as e:  # safetensors raises its own error types
        raise DraftportError(path, f"cannot read feature shard ({e})") from None


def read_sequences(fs: FeatureSet, max_samples: int | None = None) -> list[Sequence]:
    """The token sequences of a feature folder, in order, as data.write_features takes them. Their
    loss masks must be what write_features writes (True from the response start on), so that a
    rewrite keeps them exactly; a folder whose masks are not is refused."""
    n = len(fs) if max_samples is None else min(len(fs), max_samples)
    out: list[Sequence] = []
    for si in range(len(fs.index["shards"])):
        if len(out) >= n:
            break
        sh = _shard_small(fs, si)
        for li in range(int(sh["response_start"].shape[0])):
            if len(out) >= n:
                break
            a, b = int(sh["offsets"][li]), int(sh["offsets"][li + 1])
            start = int(sh["response_start"][li])
            mask = sh["loss_mask"][a:b]
            want = torch.arange(b - a) >= start
            if not torch.equal(mask.bool(), want):
                raise DraftportError(
                    fs.folder,
                    f"sample {len(out)}: its loss mask is not 'answer from the response "
                    f"start on' ({start}): a capture could not keep it exactly",
                )
            out.append(Sequence(sh["tokens"][a:b].long().tolist(), start))
    return out


def _index_field(fs: FeatureSet, key: str):
    if fs.index.get(key) is None:
        raise DraftportError(fs.folder / "index.json", f"no {key} recorded: not a feature folder draftport wrote")
    return fs.index[key]


def check_compatible(target_dir, fs: FeatureSet, *, like_target=None, sequences: list[Sequence] | None = None) -> dict:
    """The target can be run on the folder's tokens and compared with the target that wrote it:
    the same hidden size as the folder (and as `like_target`, the folder's own target, when
    given), the same vocab size as like_target (the folder's, when it records one), every token id
    in its vocab, the aux layer ids in its range, every sequence in its context. One-line errors
    naming the target folder and the feature folder. Returns the target's text config."""
    tcfg = target_text_config(target_dir)
    hidden, vocab = int(tcfg["hidden_size"]), int(tcfg["vocab_size"])
    fh = int(_index_field(fs, "hidden_size"))
    if hidden != fh:
        raise DraftportError(
            target_dir,
            f"hidden size {hidden}, but {fs.folder} holds states of hidden size {fh}: "
            "the drift probe compares two versions of one target (same hidden and vocab size)",
        )
    if like_target is not None:
        lcfg = target_text_config(like_target)
        if int(lcfg["hidden_size"]) != hidden or int(lcfg["vocab_size"]) != vocab:
            raise DraftportError(
                target_dir,
                f"hidden {hidden} / vocab {vocab}, but {like_target} (the target of "
                f"{fs.folder}) has hidden {lcfg['hidden_size']} / vocab {lcfg['vocab_size']}: "
                "the drift probe needs the same hidden and vocab size",
            )
    fv = fs.index.get("vocab_size")
    if fv is not None and int(fv) != vocab:
        raise DraftportError(
            target_dir,
            f"vocab size {vocab}, but {fs.folder} was captured with a vocab of {fv}: "
            "the drift probe needs the same vocab (the same token ids)",
        )
    aux_ids = _index_field(fs, "aux_layer_ids")
    conv = _index_field(fs, "aux_convention")
    layers = int(tcfg.get("num_hidden_layers", 0))
    try:
        check_aux_ids(aux_ids, layers, conv, target_dir)
    except DraftportError as e:
        raise DraftportError(target_dir, f"{e.problem} (the aux layers of {fs.folder})") from None
    if sequences:
        top = max(max(s.tokens) for s in sequences)
        if top >= vocab:
            raise DraftportError(target_dir, f"token id {top} in {fs.folder} is outside this target's vocab of {vocab}")
        ctx = int(tcfg.get("max_position_embeddings", 0) or 0)
        longest = max(len(s.tokens) for s in sequences)
        if ctx and longest > ctx:
            raise DraftportError(
                target_dir, f"a sequence of {longest} tokens in {fs.folder} does not fit this target's context of {ctx}"
            )
    return tcfg


# ---- 1. the old target on the new target's tokens --------------------------------------------
def _open(features) -> FeatureSet:
    """A FeatureSet as given, or opened (and its shards' sha256 checked) from a folder."""
    return features if isinstance(features, FeatureSet) else FeatureSet(features)


def capture_same_tokens(
    target_dir,
    features_dir,
    out_dir,
    *,
    batch_size: int = 16,
    dtype: str = "bfloat16",
    device: str = "cpu",
    trust_remote_code: bool = False,
    like_target=None,
    max_samples: int | None = None,
    engine: str = "transformers",
    tensor_parallel_size: int = 1,
    shard_samples: int | None = None,
) -> dict:
    """Run `target_dir` over exactly the token sequences stored in `features_dir` and write a
    feature folder of the same format to `out_dir` (evaluate_drafter reads it): the same ids, loss
    masks, response starts, sample order, aux layer ids and convention as that folder's
    index.json; the states this target computes; its greedy choice (target_arg) from its own head,
    from the full-precision forward, as draftport.data.features stores it. Nothing is regenerated.

    dtype: the storage dtype of the states (features.dtype); the forward runs as
    draftport.data.features runs it (weights in target.capture_dtype: float32 on the CPU, bfloat16 on
    a GPU, batched by length there; engine 'vllm': vLLM's extract_hidden_states over
    tensor_parallel_size GPUs). like_target: the folder's own target,
    for the vocab check (recommended: a folder does not record its vocab size). max_samples: only
    the first n samples. Returns the written index."""
    fs = _open(features_dir)
    features_dir, out_dir = fs.folder, Path(out_dir)
    if out_dir.resolve() == features_dir.resolve():
        raise DraftportError(out_dir, "the capture would overwrite the feature folder it reads")
    seqs = read_sequences(fs, max_samples)
    tcfg = check_compatible(target_dir, fs, like_target=like_target, sequences=seqs)
    aux_ids, conv = list(fs.index["aux_layer_ids"]), fs.index["aux_convention"]
    shard_samples = shard_samples or int(fs.index["shards"][0]["samples"])
    meta = _capture_meta(target_dir, fs, tcfg, aux_ids, conv)
    ntok = sum(len(s.tokens) for s in seqs)
    log(f"drift: {target_identity(target_dir)['id']} over the {len(seqs)} sequences ({ntok} tokens) of {features_dir}")

    if engine == "vllm":
        with progress(len(seqs), "capture same tokens (vLLM)", "sample") as bar:
            return capture_features_vllm(
                target_dir,
                seqs,
                out_dir,
                aux_ids=aux_ids,
                convention=conv,
                meta=meta,
                tensor_parallel_size=tensor_parallel_size,
                dtype=dtype,
                batch_size=batch_size,
                shard_samples=shard_samples,
                progress=bar.update,
            )
    if engine != "transformers":
        raise DraftportError("features.engine", f"unknown engine {engine!r} (transformers or vllm)")
    return _capture_transformers(
        target_dir, seqs, out_dir, aux_ids, conv, meta, batch_size, dtype, device, trust_remote_code, shard_samples
    )


def _capture_meta(target_dir, fs: FeatureSet, tcfg: dict, aux_ids: list, conv: str) -> dict:
    """The capture's index fields beyond the states: the folder's aux layers and convention, this
    target, where the tokens came from (the folder, and its prompts)."""
    meta = {
        "aux_layer_ids": aux_ids,
        "aux_convention": conv,
        "target": target_identity(target_dir),
        "regenerated": False,
        "tokens_from": {"features": str(fs.folder), "target": fs.index.get("target")},
        "num_target_layers": int(tcfg.get("num_hidden_layers", 0)),
        "vocab_size": int(tcfg["vocab_size"]),
    }
    for key in ("samples_file", "offset"):  # where the prompts came from: the input folder's
        if key in fs.index:
            meta[key] = fs.index[key]
    return meta


def _capture_transformers(
    target_dir, seqs, out_dir: Path, aux_ids, conv, meta, batch_size, dtype, device, trust_remote_code, shard_samples
) -> dict:
    """The target loaded in transformers over the sequences, written as a feature folder; -> its index."""
    model = load_target(
        target_dir, dtype=capture_dtype(device, dtype), device=device, trust_remote_code=trust_remote_code
    )
    featurize = featurizer(model, aux_ids, conv, device)

    with progress(len(seqs), "capture same tokens", "sample") as bar:
        return write_features(
            out_dir,
            seqs,
            featurize,
            meta=meta,
            batch_size=batch_size,
            dtype=dtype,
            shard_samples=shard_samples,
            progress=bar.update,
            by_length=on_gpu(model, device),
        )


# ---- 2. how far the states moved --------------------------------------------------------------
@torch.no_grad()
def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019) of two representations of the same n samples, x [n, d1],
    y [n, d2]: columns centered, ||X^T Y||_F^2 / (||X^T X||_F ||Y^T Y||_F), in float64. Invariant to
    orthogonal transforms and isotropic scaling of either side, 1 for x = y. Computed through the
    n x n Gram matrices when n < d (||X^T Y||_F^2 = <X X^T, Y Y^T>_F), which is the same number.
    0.0 when either side has no variance."""
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"linear_cka needs [n, d] matrices of the same n, got {list(x.shape)} and {list(y.shape)}")
    x = x.double() - x.double().mean(0, keepdim=True)
    y = y.double() - y.double().mean(0, keepdim=True)
    if x.shape[0] < max(x.shape[1], y.shape[1]):
        k, l = x @ x.T, y @ y.T
        num, den = (k * l).sum(), k.norm() * l.norm()
    else:
        num = (x.T @ y).pow(2).sum()
        den = (x.T @ x).norm() * (y.T @ y).norm()
    return float(num / den) if den > 0 else 0.0


def _assistant_tokens(fs: FeatureSet, n: int) -> int:
    """Loss-mask tokens of the first n samples (only the masks are read)."""
    total, done = 0, 0
    for si, sh in enumerate(fs.index["shards"]):
        if done >= n:
            break
        small = _shard_small(fs, si)
        take = min(int(sh["samples"]), n - done)
        total += int(small["loss_mask"][: int(small["offsets"][take])].sum())
        done += take
    return total


def _slots(fs: FeatureSet) -> list[str]:
    return [f"layer_{i}" for i in fs.index["aux_layer_ids"]] + ["final"]


def _split(sample: dict, n_aux: int, H: int) -> list[torch.Tensor]:
    aux = sample["aux"].float()
    return [aux[:, i * H : (i + 1) * H] for i in range(n_aux)] + [sample["final"].float()]


def _iter_samples(fs: FeatureSet, n: int):
    """fs.sample(i) for i < n, each shard let go once passed (FeatureSet keeps what it loaded)."""
    last = None
    for i in range(n):
        si = fs.where[i][0]
        if last is not None and si != last:
            fs.shards[last] = None
        last = si
        yield fs.sample(i)
    if last is not None:
        fs.shards[last] = None


def _check_pair(fa: FeatureSet, fb: FeatureSet, max_samples: int | None) -> int:
    for key in ("aux_layer_ids", "aux_convention", "hidden_size"):
        if fa.index.get(key) != fb.index.get(key):
            raise DraftportError(
                fb.folder,
                f"{key} {fb.index.get(key)}, but {fa.folder} holds {fa.index.get(key)}: "
                "the drift probe compares the same layers of the same tokens",
            )
    if max_samples is None and len(fa) != len(fb):
        raise DraftportError(fb.folder, f"{len(fb)} samples, but {fa.folder} holds {len(fa)}: not the same sequences")
    n = min(len(fa), len(fb)) if max_samples is None else min(len(fa), len(fb), max_samples)
    return n


@torch.no_grad()
def drift_stats(
    features_a,
    features_b,
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_samples: int | None = None,
    head_a: torch.Tensor | None = None,
    head_b: torch.Tensor | None = None,
    seed: int = CKA_SEED,
) -> dict:
    """How far the states of folder b moved from folder a's, over the same sequences (checked:
    equal token ids and loss masks, sample by sample), on the assistant tokens (loss mask) only.

    Per aux layer (slot i of the folders' aux ids, keyed by the layer id: `<stat>_layer_<id>`) and
    for the final state (`<stat>_final`): `cos` (per token, averaged), `cka` (linear CKA on a
    seeded sample of at most max_tokens assistant tokens, the same tokens for every layer; see
    linear_cka), `rel_norm_change` (| ||b|| - ||a|| | / ||a||, per token, averaged: the scale) and
    `rel_diff_norm` (||b - a|| / ||a||, per token, averaged: the vector).

    `greedy_agreement`: the fraction of the positions predicting an assistant token (p with
    loss_mask[p + 1]; the positions an evaluator checks drafts against) where the two targets'
    greedy choices agree: the stored target_arg, or, for a folder without one, the argmax of its
    final state through head_a / head_b. `next_token_match_a` / `_b`: how often each target's
    greedy choice is the next token of the sequence (for the folder that wrote the answers, ~1).
    `tokens`: assistant tokens compared; `cka_tokens`: the CKA sample; `greedy_positions`;
    `samples`. Keys are flat and the same for every run of one layout."""
    fa, fb = _open(features_a), _open(features_b)
    n = _check_pair(fa, fb, max_samples)
    slots = _slots(fa)
    n_aux, H = len(slots) - 1, int(fa.index["hidden_size"])
    total, m, pick = _cka_sample(fa, n, max_tokens, seed)
    picked: dict[str, list[list[torch.Tensor]]] = {s: [[], []] for s in slots}

    sums = {f"{stat}_{s}": 0.0 for s in slots for stat in ("cos", "rel_norm_change", "rel_diff_norm")}
    greedy = {"agree": 0, "positions": 0, "match_a": 0, "match_b": 0}
    seen = 0
    for i, (sa, sb) in enumerate(zip(_iter_samples(fa, n), _iter_samples(fb, n))):
        if not torch.equal(sa["tokens"], sb["tokens"]) or not torch.equal(sa["loss_mask"], sb["loss_mask"]):
            raise DraftportError(
                fb.folder, f"sample {i}: its tokens or loss mask differ from {fa.folder}'s: not the same sequences"
            )
        mask = sa["loss_mask"].bool()
        lo = seen
        seen += int(mask.sum())
        sel = pick[(pick >= lo) & (pick < seen)] - lo
        _add_moves(sums, picked, slots, _split(sa, n_aux, H), _split(sb, n_aux, H), mask, sel)
        _add_greedy(greedy, sa["tokens"], mask, _greedy(sa, head_a, fa), _greedy(sb, head_b, fb))
    return _drift_out(n, total, m, slots, sums, picked, greedy)


def _cka_sample(fa: FeatureSet, n: int, max_tokens: int, seed: int) -> tuple[int, int, torch.Tensor]:
    """The CKA sample: seeded positions among all assistant tokens (masks read without the states).
    -> (assistant tokens, the sample's size, its sorted positions)."""
    total = _assistant_tokens(fa, n)
    if total == 0:
        raise DraftportError(fa.folder, "no assistant tokens (loss mask) to compare")
    m = min(max_tokens, total)
    pick = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:m].sort().values
    return total, m, pick


def _add_moves(sums: dict, picked: dict, slots: list, parts_a: list, parts_b: list, mask, sel) -> None:
    """One sample's per-token cos and relative norms at its assistant tokens, summed into sums per
    slot; its tokens in the CKA sample (sel) appended to picked."""
    for s, xa, xb in zip(slots, parts_a, parts_b):
        xa, xb = xa[mask], xb[mask]
        na, nb = xa.norm(dim=-1).double(), xb.norm(dim=-1).double()
        den = na.clamp_min(1e-12)
        dot = (xa.double() * xb.double()).sum(-1)
        sums[f"cos_{s}"] += float((dot / (den * nb.clamp_min(1e-12))).sum())
        sums[f"rel_norm_change_{s}"] += float(((nb - na).abs() / den).sum())
        sums[f"rel_diff_norm_{s}"] += float(((xb.double() - xa.double()).norm(dim=-1) / den).sum())
        if sel.numel():
            picked[s][0].append(xa[sel])
            picked[s][1].append(xb[sel])


def _add_greedy(counts: dict, tokens: torch.Tensor, mask, ga: torch.Tensor, gb: torch.Tensor) -> None:
    """One sample's greedy choices compared at the positions predicting an assistant token, added to counts."""
    pred = torch.zeros_like(mask)
    pred[:-1] = mask[1:]  # position p predicts token p + 1
    nxt = tokens[1:][pred[:-1]]
    counts["agree"] += int((ga[pred] == gb[pred]).sum())
    counts["match_a"] += int((ga[pred] == nxt).sum())
    counts["match_b"] += int((gb[pred] == nxt).sum())
    counts["positions"] += int(pred.sum())


def _drift_out(n: int, total: int, m: int, slots: list, sums: dict, picked: dict, greedy: dict) -> dict:
    """drift_stats' flat result: the per-slot means and CKA, then the greedy agreement figures."""
    out: dict = {"samples": n, "tokens": total, "cka_tokens": m}
    for s in slots:
        out[f"cos_{s}"] = sums[f"cos_{s}"] / total
        out[f"cka_{s}"] = linear_cka(torch.cat(picked[s][0]), torch.cat(picked[s][1]))
        out[f"rel_norm_change_{s}"] = sums[f"rel_norm_change_{s}"] / total
        out[f"rel_diff_norm_{s}"] = sums[f"rel_diff_norm_{s}"] / total
    positions = greedy["positions"]
    out["greedy_positions"] = positions
    out["greedy_agreement"] = greedy["agree"] / positions if positions else 0.0
    out["next_token_match_a"] = greedy["match_a"] / positions if positions else 0.0
    out["next_token_match_b"] = greedy["match_b"] / positions if positions else 0.0
    return out


def _greedy(sample: dict, head: torch.Tensor | None, fs: FeatureSet) -> torch.Tensor:
    if "target_arg" in sample:
        return sample["target_arg"]
    if head is None:
        raise DraftportError(fs.folder, "the features hold no greedy choice (target_arg) and no target head was given")
    return (sample["final"].float() @ head.float().t()).argmax(-1)


# ---- 3. the probe ------------------------------------------------------------------------------
def _eval_json(path: Path, res: dict) -> None:
    res = {k: v for k, v in res.items() if k not in ("eval_seconds", "run")}  # identical runs, identical bytes
    atomic_write_text(path, json.dumps(res, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def tau_with_choices(
    drafter_dir,
    target_dir,
    features_dir,
    choices_dir,
    *,
    k: int,
    batch_size: int = 16,
    max_samples: int | None = None,
    device: str = "auto",
) -> dict:
    """evaluate_drafter's offline accept length with the drafter bound to target_dir and reading
    features_dir's states, its drafts checked against another folder's greedy choices (choices_dir:
    the same sequences, captured from another target)."""
    cfg, state = load_drafter_state(drafter_dir)
    fs, fc = _open(features_dir), _open(choices_dir)
    check_features_fit(cfg, fs, drafter_dir)
    n = _check_pair(fs, fc, max_samples)
    dev = pick_device(device, "eval.device")
    d = drafter_for_target(cfg, target_dir, state).to(dev)
    head = target_head(target_dir).to(dev)

    def batches():
        buf = []
        for i, (s, c) in enumerate(zip(_iter_samples(fs, n), _iter_samples(fc, n))):
            if not torch.equal(s["tokens"], c["tokens"]):
                raise DraftportError(fc.folder, f"sample {i}: its tokens differ from {fs.folder}'s")
            if "target_arg" not in c:
                raise DraftportError(fc.folder, "the features hold no greedy choice (target_arg)")
            buf.append({**s, "target_arg": c["target_arg"]})
            if len(buf) == batch_size:
                yield collate(buf)
                buf = []
        if buf:
            yield collate(buf)

    res = offline_accept_length(d, batches(), head, k)
    res["eval_samples"] = n
    return res


def drift_probe(
    source_drafter,
    target_old,
    target_new,
    features_new,
    out_dir,
    *,
    k: int,
    batch_size: int = 16,
    max_samples: int | None = None,
    feature_batch_size: int = 16,
    dtype: str = "bfloat16",
    device: str = "cpu",
    trust_remote_code: bool = False,
    engine: str = "transformers",
    tensor_parallel_size: int = 1,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    keep_features: bool = True,
    eval_device: str = "auto",
) -> dict:
    """The drift probe. features_new: the new target's features on its own answers to the eval
    prompts (features_eval/eval_new). Writes out_dir/features_old (the old target over the same
    tokens, capture_same_tokens; removed at the end unless keep_features) and
    out_dir/eval_{old_features,new_features,new_features_old_choices}.json (the evaluator's full
    results). Returns drift_stats(old capture, features_new) (a = old, b = new) and:

    tau_source_old_features   the source drafter bound to the old target (its embedding, its head),
                              reading the old target's states, checked against the old target's
                              greedy choices: the source at home, but on the new target's text.
    tau_source_new_features   bound to the new target, its states, its choices: Phase 0's number
                              (eval_phase0's accept_length on the same set, max_samples equal;
                              with named eval sets its pooled one, accept_length_pooled: the
                              probe's three tau pool every held-out prompt alike).
    tau_gap                   old_features - new_features. The tokens are the same, so this gap is
                              the target's own change on a fixed text: its states at the aux layers
                              drifted (what the source's fc reads), its embedding and head moved,
                              and it picks other tokens at the same context (1 - greedy_agreement
                              of the positions). It is not a change in what the target says: the
                              rest of Phase 0's gap to "source on the old target on its own answers"
                              (eval_phase0's source_on_old_accept_length, other prompts) comes from
                              the text changing (prompts and answers), not from the target's states.
    tau_source_new_features_old_choices
                              the new target's states and embedding, checked against the OLD
                              target's choices: one path through the gap, splitting it into
    tau_gap_states            old_features - that: what the drifted states (and embedding) alone
                              cost a drafter still aiming at the old target's choices, and
    tau_gap_choices           that - new_features: what the new target choosing other tokens costs.
                              (One order of an order-dependent split: the two parts sum to tau_gap.)

    k, batch_size, max_samples: as eval.* (the evaluator); feature_batch_size, dtype, device,
    engine, tensor_parallel_size: as features.* (the capture); max_tokens: CKA's token sample;
    eval_device: eval.device (where the source drafter drafts)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    old_dir = out_dir / "features_old"
    fs_new = _open(features_new)  # each FeatureSet checks every shard's sha256: open each folder once
    idx = capture_same_tokens(
        target_old,
        fs_new,
        old_dir,
        batch_size=feature_batch_size,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        like_target=target_new,
        max_samples=max_samples,
        engine=engine,
        tensor_parallel_size=tensor_parallel_size,
    )
    n = int(idx["samples"])
    fs_old = FeatureSet(old_dir)
    stats = drift_stats(fs_old, fs_new, max_tokens=max_tokens, max_samples=n)
    ev = dict(k=k, batch_size=batch_size, max_samples=n, device=eval_device)
    evals = _source_evals(source_drafter, target_old, target_new, old_dir, features_new, fs_old, fs_new, out_dir, ev)
    out = _probe_out(stats, k, *evals)
    if not keep_features:
        shutil.rmtree(old_dir)
    return out


def _source_evals(
    source_drafter, target_old, target_new, old_dir: Path, features_new, fs_old, fs_new, out_dir: Path, ev: dict
):
    """The source drafter on the old features, on the new ones, and on the new ones checked against
    the old choices, each written to out_dir/eval_<name>.json; -> the three results."""
    # sample by sample on the same tokens: the first n of each folder, pooled (not by eval set)
    ev_old = evaluate_drafter(source_drafter, target_old, old_dir, **ev, by_set=False)
    ev_new = evaluate_drafter(source_drafter, target_new, features_new, **ev, by_set=False)
    ev_cross = tau_with_choices(source_drafter, target_new, fs_new, fs_old, **ev)
    for name, res in (("old_features", ev_old), ("new_features", ev_new), ("new_features_old_choices", ev_cross)):
        _eval_json(out_dir / f"eval_{name}.json", res)
    return ev_old, ev_new, ev_cross


def _probe_out(stats: dict, k: int, ev_old: dict, ev_new: dict, ev_cross: dict) -> dict:
    """drift_probe's result: the drift stats, the three tau and the gaps between them, the
    per-position accept rates of the first two."""
    t_old, t_new, t_x = ev_old["accept_length"], ev_new["accept_length"], ev_cross["accept_length"]
    out = {
        **stats,
        "k": k,
        "tau_source_old_features": t_old,
        "tau_source_new_features": t_new,
        "tau_gap": t_old - t_new,
        "tau_source_new_features_old_choices": t_x,
        "tau_gap_states": t_old - t_x,
        "tau_gap_choices": t_x - t_new,
    }
    for i in range(k):
        out[f"accept_rate_pos_{i}_old_features"] = ev_old[f"accept_rate_pos_{i}"]
        out[f"accept_rate_pos_{i}_new_features"] = ev_new[f"accept_rate_pos_{i}"]
    return out
