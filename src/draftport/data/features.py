"""A target's training data: its own greedy answers to chat prompts (through its chat template)
and its hidden states at the drafter's aux layers, captured into feature shards (draftport.data.shards).

The same calls serve the embedded world and a real target; weights through safetensors only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from draftport.data.capture import (
    capture_dtype,
    capture_features,
    compile_layers,
    load_target,
    padded_length,
    regenerate,
    remote_code_refused,
    target_identity,
    uncompile_layers,
)
from draftport.data.shards import Sequence, bytes_per_token, capture_meta, to_device, write_features, write_sequences
from draftport.errors import DraftportError
from draftport.model.config import target_text_config
from draftport.progress import progress


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- tokenization through the target's chat template ------------------------------------------
def load_tokenizer(target_dir, trust_remote_code: bool = False):
    """The target's tokenizer; its own code runs only when the params trust its repo."""
    with remote_code_refused(target_dir):
        return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=trust_remote_code)


def _ids(x):
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)
    return list(x["input_ids"]) if hasattr(x, "keys") else list(x)


def encode_prompt(tok, user: str) -> list[int]:
    return _ids(tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True, add_generation_prompt=True))


def encode_chat(tok, user: str, assistant: str) -> tuple[list[int], int]:
    prompt = encode_prompt(tok, user)
    full = _ids(
        tok.apply_chat_template(
            [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], tokenize=True
        )
    )
    if full[: len(prompt)] != prompt:
        raise DraftportError("chat_template", "the template renders the prompt differently with and without the answer")
    return full, len(prompt)


def read_samples(path: str | Path, n: int | None = None, offset: int = 0) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DraftportError(path, "no such samples file")
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                raise DraftportError(f"{path}:{lineno}", "not a JSON line") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("user"), str):
                raise DraftportError(f"{path}:{lineno}", "each sample needs a string 'user' field")
            out.append(rec)
    out = out[offset:]
    if n is not None:
        out = out[:n]
    if not out:
        raise DraftportError(path, f"no samples (after offset {offset})")
    return out


# ---- features -----------------------------------------------------------------------------------
def _read_prompts(target_dir, samples_path, n_samples, offset, regenerate_responses, max_len, dtype, trust_remote_code):
    """The samples and their prompts, checked to fit the context; with the target's tokenizer, text
    config, context, hidden size and stored bytes per token."""
    samples = read_samples(samples_path, n_samples, offset)
    if not regenerate_responses:
        bad = next((i for i, x in enumerate(samples) if not isinstance(x.get("assistant"), str)), None)
        if bad is not None:  # the line number counts non-blank lines of the file
            raise DraftportError(
                f"{samples_path}:{offset + bad + 1}",
                "no string 'assistant' field: the dataset's own answer is needed when the answers are not regenerated",
            )
    tok = load_tokenizer(target_dir, trust_remote_code)
    tcfg = target_text_config(target_dir)
    ctx = max_len or int(tcfg.get("max_position_embeddings", 4096))
    hidden = int(tcfg["hidden_size"])
    per_tok = bytes_per_token(hidden, dtype)
    prompts = [encode_prompt(tok, s["user"]) for s in samples]
    too_long = [i for i, p in enumerate(prompts) if len(p) >= ctx]
    if too_long:
        raise DraftportError(
            f"{samples_path}:{offset + too_long[0] + 1}",
            f"prompt of {len(prompts[too_long[0]])} tokens does not fit the target's context of {ctx}",
        )
    return samples, tok, tcfg, ctx, hidden, per_tok, prompts


def _capture_need(storage, spool_gb, est_tokens, n_samples, per_tok, hidden, dtype, aux_layer_ids) -> dict:
    """The projected bytes, logged; -> what check_storage must find free (data.storage.storage_need)."""
    # lazy (registry): drift and online_* run this module without data.storage
    from draftport.data.storage import SPOOL_GB, storage_need

    log(
        f"features: {n_samples} samples, ~{est_tokens} tokens x {per_tok} B/token "
        f"= ~{est_tokens * per_tok / 1e6:.1f} MB projected"
        + ("" if storage == "disk" else f" (storage {storage}: captured in training)")
    )
    need = storage_need(
        storage,
        tokens=est_tokens,
        hidden_size=hidden,
        dtype=dtype,
        n_aux=len(aux_layer_ids),
        spool_gb=SPOOL_GB if spool_gb is None else spool_gb,
    )
    if storage != "disk" and spool_gb is None:  # the answers only: the spool is checked where training makes it
        return {
            "mode": "online",
            "need_bytes": need["ids_bytes"],
            "formula": f"{est_tokens:,} tokens x {need['ids_bytes'] // max(est_tokens, 1)} B (ids + mask); "
            f"the spool{' and the cache' if storage == 'hybrid' else ''}: checked by the training step",
        }
    return need


def _capture_model(target_dir, engine, regenerate_responses, regenerate_via, dtype, device, trust_remote_code):
    """The target loaded here when it captures the states or writes the answers, else None."""
    need_model = engine == "transformers" or (regenerate_responses and regenerate_via == "local")
    return (
        load_target(target_dir, dtype=capture_dtype(device, dtype), device=device, trust_remote_code=trust_remote_code)
        if need_model
        else None
    )


def _regenerated_sequences(model, prompts, ctx, max_new_tokens, eos, pad, batch_size, via, base_url, served_model):
    """Each prompt + the target's own greedy answer (the model here, or via 'openai' the served one),
    cut to the context."""
    budget = [min(max_new_tokens, ctx - len(p)) for p in prompts]
    with progress(len(prompts), "regenerate", "sample") as bar:
        if via == "openai":
            # lazy (registry): only features.engine openai runs engines.openai; the training rows do not list it
            from draftport.engines.openai import regenerate_openai

            resp = regenerate_openai(
                base_url, served_model, prompts, max_new_tokens=max(budget), eos_id=eos, progress=bar.update
            )
        else:
            resp = regenerate(
                model,
                prompts,
                max_new_tokens=max(budget),
                eos_id=eos,
                pad_id=pad,
                batch_size=batch_size,
                progress=bar.update,
            )
    return [Sequence(p + r[:b], len(p)) for p, r, b in zip(prompts, resp, budget)]


def _dataset_sequences(tok, samples, ctx) -> list[Sequence]:
    """Each sample's chat with the dataset's own answer, cut to the context."""
    seqs = []
    for s in samples:
        ids, start = encode_chat(tok, s["user"], s["assistant"])
        seqs.append(Sequence(ids[:ctx], start))
    return seqs


def _seconds_since(t0: float) -> float:
    # wall seconds of the answers and of the capture (the decision's hours; never in index.json)
    return round(time.perf_counter() - t0, 3)


def _features_meta(target_dir, samples_path, offset, aux_layer_ids, convention, regenerate_responses, tcfg) -> dict:
    """What index.json records of the capture's inputs."""
    return {
        "aux_layer_ids": list(aux_layer_ids),
        "aux_convention": convention,
        "target": target_identity(target_dir),
        "regenerated": regenerate_responses,
        "samples_file": str(samples_path),
        "offset": offset,
        "num_target_layers": int(tcfg.get("num_hidden_layers", 0)),
    }


def _capture_settings(storage, engine, dtype, device, batch_size, tensor_parallel_size, shard_samples, hidden, compile):
    """The capture settings, as a sequences folder records them (index['capture'], capture_writer)."""
    return {
        "storage": storage,
        "engine": engine,
        "dtype": dtype,
        "device": device,
        "batch_size": batch_size,
        "tensor_parallel_size": tensor_parallel_size,
        "shard_samples": shard_samples,
        "hidden_size": hidden,
        "compile": bool(compile),
    }


def _write_answers_only(out_dir, seqs, meta, capture) -> dict:
    """storage online / hybrid: the answers alone, the states left to the training step."""
    index = write_sequences(out_dir, seqs, meta=meta, capture=capture)
    log(
        f"features: wrote {index['samples']} sequences, {index['tokens']} tokens to {out_dir} "
        f"(storage {capture['storage']}: the training step captures their states)"
    )
    return index


def _capture_vllm(capture_features_vllm, target_dir, seqs, out_dir, meta, capture) -> dict:
    """engine vllm: the states from vLLM's extract_hidden_states (it loads the target itself), at
    the aux layers meta records; -> the index. capture_features_vllm: build_features imports it
    (lazily) before it lets its own model go."""
    with progress(len(seqs), "capture (vLLM)", "sample") as bar:
        index = capture_features_vllm(
            target_dir,
            seqs,
            out_dir,
            aux_ids=meta["aux_layer_ids"],
            convention=meta["aux_convention"],
            meta=meta,
            tensor_parallel_size=capture["tensor_parallel_size"],
            dtype=capture["dtype"],
            batch_size=capture["batch_size"],
            shard_samples=capture["shard_samples"],
            progress=bar.update,
        )
    log(
        f"features: wrote {index['samples']} samples, {index['tokens']} tokens, "
        f"{index['tokens'] * index['bytes_per_token'] / 1e6:.1f} MB to {out_dir} (vLLM)"
    )
    return index


def _capture_here(model, seqs, out_dir, meta, capture, pad) -> dict:
    """engine transformers: the states from the target loaded in this process, at the aux layers
    meta records; -> the index."""
    device = capture["device"]
    aux, conv = meta["aux_layer_ids"], meta["aux_convention"]
    featurize = featurizer(model, aux, conv, device, pad, compile=capture["compile"], log=log)

    with progress(len(seqs), "capture", "sample") as bar:
        index = write_features(
            out_dir,
            seqs,
            featurize,
            meta=meta,
            batch_size=capture["batch_size"],
            dtype=capture["dtype"],
            shard_samples=capture["shard_samples"],
            progress=bar.update,
            by_length=on_gpu(model, device),
        )
    log(
        f"features: wrote {index['samples']} samples, {index['tokens']} tokens, "
        f"{index['tokens'] * index['bytes_per_token'] / 1e6:.1f} MB to {out_dir}"
    )
    return index


def build_features(
    target_dir,
    samples_path,
    out_dir,
    *,
    n_samples: int,
    aux_layer_ids: list[int],
    convention: str = "vllm",
    regenerate_responses: bool = True,
    offset: int = 0,
    max_new_tokens: int = 128,
    max_len: int | None = None,
    batch_size: int = 16,
    dtype: str = "bfloat16",
    device: str = "cpu",
    shard_samples: int = 256,
    engine: str = "transformers",
    tensor_parallel_size: int = 1,
    regenerate_via: str = "local",
    base_url: str | None = None,
    served_model: str | None = None,
    trust_remote_code: bool = False,
    storage: str = "disk",
    spool_gb: float | None = None,
    compile: bool = False,
) -> dict:
    """Capture the target's aux + final states over chat samples, responses regenerated by the
    target itself (greedy) so the data is what the target will verify.

    engine 'transformers': the target in this process (device 'auto': spread over the GPUs);
    'vllm': vLLM's extract_hidden_states, tensor_parallel_size GPUs (draftport.data.vllm_capture).
    regenerate_via 'local': the answers from the model loaded here; 'openai': from the target
    served at base_url (draftport.engines.openai). The storage estimate is checked before either.
    dtype: the storage dtype of the states (fp8_e4m3: half of bf16's bytes, see draftport.data.shards);
    the target runs in target.capture_dtype(device, dtype): bfloat16 on a GPU, float32 on the CPU.
    On a GPU each shard's samples are batched by length (featurizer: the shards keep the input
    order).

    storage 'online' / 'hybrid': the answers only (data.write_sequences), with the capture
    settings recorded for the training step that captures the states itself (draftport.training.spool).
    The storage check covers every mode: disk the states; online / hybrid the token ids, plus the
    spool bound when spool_gb is given (the training step checks its spool where it makes it)."""
    # lazy (registry): drift and online_* run this module without data.storage
    from draftport.data.storage import check_storage

    samples, tok, tcfg, ctx, hidden, per_tok, prompts = _read_prompts(
        target_dir, samples_path, n_samples, offset, regenerate_responses, max_len, dtype, trust_remote_code
    )
    est_tokens = sum(len(p) for p in prompts) + len(prompts) * (max_new_tokens if regenerate_responses else 64)
    need = _capture_need(storage, spool_gb, est_tokens, len(samples), per_tok, hidden, dtype, aux_layer_ids)
    check_storage(Path(out_dir).parent, need, log)  # before loading any weights
    model = _capture_model(target_dir, engine, regenerate_responses, regenerate_via, dtype, device, trust_remote_code)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    t0 = time.perf_counter()
    if regenerate_responses:
        seqs = _regenerated_sequences(
            model, prompts, ctx, max_new_tokens, eos, pad, batch_size, regenerate_via, base_url, served_model
        )
    else:
        seqs = _dataset_sequences(tok, samples, ctx)
    seconds = {"regenerate": _seconds_since(t0) if regenerate_responses else 0.0}
    t0 = time.perf_counter()
    meta = _features_meta(target_dir, samples_path, offset, aux_layer_ids, convention, regenerate_responses, tcfg)
    capture = _capture_settings(
        storage, engine, dtype, device, batch_size, tensor_parallel_size, shard_samples, hidden, compile
    )
    if storage != "disk":
        del model
        return {**_write_answers_only(out_dir, seqs, meta, capture), "seconds": {**seconds, "capture": 0.0}}
    if engine == "vllm":
        # lazy (registry): only features.engine vllm runs this; world's and online_*'s rows do not list it
        from draftport.data.vllm_capture import capture_features_vllm

        del model
        index = _capture_vllm(capture_features_vllm, target_dir, seqs, out_dir, meta, capture)
    else:
        index = _capture_here(model, seqs, out_dir, meta, capture, pad)
    return {**index, "seconds": {**seconds, "capture": _seconds_since(t0)}}


def capture_writer(target_dir, index: dict, trust_remote_code: bool = False):
    """The writer a training step's spool calls, writer(folder, sequences): those sequences'
    feature folder, captured as build_features would have captured them (the settings a
    sequences folder records in index['capture']: engine, storage dtype, batch size, device,
    tensor parallel size). engine transformers: the target loaded here once, in the capture
    dtype; vllm: one extraction run per spool shard (draftport.data.vllm_capture)."""
    cap = index["capture"]
    aux, conv, dtype, bs = list(index["aux_layer_ids"]), index["aux_convention"], cap["dtype"], int(cap["batch_size"])
    meta = capture_meta(index)
    if cap["engine"] == "vllm":
        # lazy (registry): only features.engine vllm runs this; world's and online_*'s rows do not list it
        from draftport.data.vllm_capture import capture_features_vllm

        def write_vllm(folder, seqs):
            capture_features_vllm(
                target_dir,
                seqs,
                folder,
                aux_ids=aux,
                convention=conv,
                meta=meta,
                tensor_parallel_size=int(cap["tensor_parallel_size"]),
                dtype=dtype,
                batch_size=bs,
                shard_samples=len(seqs),
            )

        return write_vllm
    tok = load_tokenizer(target_dir, trust_remote_code)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    device = cap["device"]
    model = load_target(
        target_dir, dtype=capture_dtype(device, dtype), device=device, trust_remote_code=trust_remote_code
    )
    featurize = featurizer(model, aux, conv, device, pad, compile=bool(cap.get("compile")))
    by_length = on_gpu(model, device)

    def write(folder, seqs):
        write_features(
            folder,
            seqs,
            featurize,
            meta=meta,
            shard_samples=len(seqs),
            batch_size=bs,
            dtype=dtype,
            writers=1,
            by_length=by_length,
        )

    return write


def capture_device(model, device) -> torch.device:
    """Where the featurizer's inputs go: `device`, or for 'auto' wherever the weights are."""
    return torch.device(device) if device != "auto" else next(model.parameters()).device


def on_gpu(model, device) -> bool:
    return capture_device(model, device).type == "cuda"


COMPILE_PAD = 128  # features.compile: batch lengths padded to a multiple of this (bounded recompiles)


def featurizer(model, aux_layer_ids, convention: str, device: str, pad: int = 0, compile: bool = False, log=print):
    """The batch function write_features calls: a batch of token sequences (right-padded with
    pad, never attended) through the target -> its aux and final states and its greedy choice
    from its own head, over float32 logits (greedy_choice). device 'auto': wherever the model's
    weights are.

    On the CPU every batch runs as it always has (padding masked), which keeps the embedded
    world's features bit for bit. On a GPU the forward gets no attention mask: causal attention
    alone never lets a token see the padding to its right, and without a mask the fused (flash)
    attention kernel runs: the unmasked batch's states are bit for bit those of each sequence run
    alone, the masked batch's (another attention kernel) are not (benchmarks/bench_capture_h200.py
    checks both on an H200; results/*-h200-capture*.json).

    compile (features.compile, a GPU only; the CPU path never compiles): each decoder layer's
    forward through torch.compile (data.capture.compile_layers) and each batch right-padded to a
    multiple of COMPILE_PAD tokens (never attended: causal; dropped when the rows are packed), so
    a capture compiles once per (batch size, padded length); what it gains on an H200:
    benchmarks/results/*-h200-capture-compile-*.json. A compile that fails (at whichever batch)
    falls back to the eager layers, said in one line."""
    head = greedy_head(model)
    dev = capture_device(model, device)
    gpu = dev.type == "cuda"
    compiled = [bool(compile and gpu)]
    if compiled[0]:
        compile_layers(model)
    ctx = int(getattr(model.config, "max_position_embeddings", 0) or 0)

    def forward(ids):
        if not compiled[0]:
            return capture_features(model, to_device(ids, dev), None, aux_layer_ids, convention)
        try:
            return capture_features(model, to_device(ids, dev), None, aux_layer_ids, convention)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 (torch.compile's own errors: the eager layers serve)
            uncompile_layers(model)
            compiled[0] = False
            log(f"features: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); capturing eager")
            return capture_features(model, to_device(ids, dev), None, aux_layer_ids, convention)

    def featurize(batch: list[Sequence]):
        T = max(len(s.tokens) for s in batch)
        if compiled[0]:
            T = padded_length(T, COMPILE_PAD, ctx or T)
        ids = torch.full((len(batch), T), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
            mask[i, : len(s.tokens)] = 1
        if gpu:  # no mask; the ids from pinned memory, so the host never waits for the last batch
            aux, final = forward(ids)
        else:
            aux, final = capture_features(model, ids.to(dev), mask.to(dev), aux_layer_ids, convention)
        return aux, final, greedy_choice(final, head)

    return featurize


def greedy_head(model) -> torch.Tensor:
    """The target head as greedy_choice uses it: float32 (a float32 target's, or a copy), or the
    bfloat16/float16 weights themselves on a GPU that multiplies them into float32 (torch.mm's
    out_dtype). On an H200 (bench_capture_h200's checks, 12.7K positions of random-weight 8B and
    32B shapes) its choice equals the float32 head's at every position; bf16 logits (the
    model's own lm_head output) would differ at 2.5% of them (near ties rounded together)."""
    w = model.get_output_embeddings().weight.detach()
    if w.dtype == torch.float32 or w.device.type != "cuda":
        return w.float()
    try:
        x = torch.zeros(2, w.shape[1], dtype=w.dtype, device=w.device)
        torch.mm(x, w[:2].t(), out_dtype=torch.float32)
        return w
    except (TypeError, RuntimeError):  # a torch without it: float32 on tensor float32 cores (see _logits)
        return w.float()


@torch.no_grad()
def greedy_choice(final: torch.Tensor, head: torch.Tensor, budget: int = 1 << 30) -> torch.Tensor:
    """argmax over the full vocab of final [..., H] @ head.T in float32, `budget` bytes of logits
    at a time ([B, T, vocab] at once would be 16 GB at B x T = 16 x 2048 and a 128K vocab)."""
    x = final.reshape(-1, final.shape[-1])
    rows = max(1, budget // (4 * head.shape[0]))
    if rows >= x.shape[0]:
        return _logits(x, head).argmax(-1).reshape(final.shape[:-1])
    out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    for r in range(0, x.shape[0], rows):
        out[r : r + rows] = _logits(x[r : r + rows], head).argmax(-1)
    return out.reshape(final.shape[:-1])


def _logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """float32 logits. A bf16/fp16 state times a bf16/fp16 head: each product is exact in float32,
    so float32 accumulation and output (out_dtype) give the float32 head's logits on the same state
    up to summation order, at the tensor cores' bf16 rate. A float32 head (a CPU or float32 target;
    or a torch without out_dtype) multiplies the state in float32 -- on a GPU as tensor float32
    when the state is bf16/fp16, whose values tf32 holds exactly."""
    if head.dtype != torch.float32:
        return torch.mm(x.to(head.dtype), head.t(), out_dtype=torch.float32)
    if x.dtype == torch.float32 or x.device.type != "cuda":
        return x.float() @ head.t()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return x.float() @ head.t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
