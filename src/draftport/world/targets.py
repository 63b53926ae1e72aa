"""The world's two targets: small decoders trained on the corpora (target_old "K2" from scratch,
target_new "K2.5" continued from it), their content revision, and how the pair measures (each
one's loss / top-1 on assistant tokens, and how often their argmaxes agree).

Their architecture is params world.model.arch: transformers' own LlamaForCausalLM (the embedded
world), DeepseekV3ForCausalLM (Kimi-K2's: MLA attention, MoE layers) or Qwen3ForCausalLM.

Training packs the chat samples into windows (nanoGPT style) and is deterministic: a seeded
torch.Generator and deterministic algorithms on a fixed number of threads.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.utils import logging as hf_logging

from draftport.errors import DraftportError
from draftport.plan.params import WorldModel
from draftport.progress import progress as progress_bar  # train_target's `progress` flag shadows the name
from draftport.world.tokenizer import BOS, END, PAD, TOKENIZER_FILES, encode_world_chat, load_world_tokenizer


def _file_hash(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def target_revision(folder: str | Path) -> str:
    """Content hash of the weights and config: changes iff the target changes."""
    folder = Path(folder)
    return _file_hash([folder / "config.json", folder / "model.safetensors"])


ARCH_CONFIGS = {"llama": LlamaConfig, "deepseek_v3": DeepseekV3Config, "qwen3": Qwen3Config}


def _deepseek_v3_keys(m: dict) -> dict:
    """The MLA and MoE keys of a deepseek_v3 world.model, the ones left out derived from the
    sizes (WorldModel's field docs); one-line errors name the key."""
    h, hd, inter = m["hidden_size"], m["head_dim"], m["intermediate_size"]
    out = {k: m.get(k) for k in WorldModel.DEEPSEEK_KEYS}
    derived = {
        "q_lora_rank": max(1, h // 2),
        "kv_lora_rank": max(1, h // 4),
        "qk_nope_head_dim": hd,
        "qk_rope_head_dim": max(2, hd // 4 * 2),
        "v_head_dim": hd,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    }
    out = {k: derived[k] if out[k] is None and k in derived else out[k] for k in out}
    if out["moe_intermediate_size"] is None:  # a multiple of 8, as the check below wants
        out["moe_intermediate_size"] = max(8, inter // (out["num_experts_per_tok"] + out["n_shared_experts"]) // 8 * 8)
    where = "world.model."
    for key, v in (("moe_intermediate_size", out["moe_intermediate_size"]), ("hidden_size", h)):
        if v % 8:  # transformers' experts run torch._grouped_mm, whose operands need 16-byte strides
            raise DraftportError(
                where + key,
                f"{v}: deepseek_v3's experts need a multiple of 8 (transformers "
                "runs them as grouped matmuls, whose rows must be 16-byte aligned)",
            )
    if m["num_key_value_heads"] != m["num_attention_heads"]:
        raise DraftportError(
            where + "num_key_value_heads",
            f"{m['num_key_value_heads']}: MLA (deepseek_v3) has "
            f"one key/value head per attention head, set it to num_attention_heads "
            f"({m['num_attention_heads']})",
        )
    if out["qk_rope_head_dim"] % 2:
        raise DraftportError(where + "qk_rope_head_dim", f"{out['qk_rope_head_dim']}: must be even (RoPE pairs)")
    n, groups = out["n_routed_experts"], out["n_group"]
    if n % groups or n // groups < 2:
        # the router scores a group by its two best experts (DeepSeek-V3's noaux_tc)
        raise DraftportError(
            where + "n_group", f"{groups}: must divide n_routed_experts ({n}) into groups of at least 2 experts"
        )
    if out["topk_group"] > groups:
        raise DraftportError(where + "topk_group", f"{out['topk_group']}: more than n_group ({groups})")
    if out["num_experts_per_tok"] > out["topk_group"] * (n // groups):
        raise DraftportError(
            where + "num_experts_per_tok",
            f"{out['num_experts_per_tok']}: more than the "
            f"{out['topk_group'] * (n // groups)} experts of topk_group groups",
        )
    return out


def target_config(model: dict | None = None, **special) -> PretrainedConfig:
    """The transformers config of a world target from a params world.model group (None: the
    embedded world's, WorldModel's defaults); `special` adds vocab_size and the token ids.
    Untied head, as Kimi's: the drafter takes embed_tokens and lm_head separately."""
    m = {**WorldModel().model_dump(), "tie_word_embeddings": False, "rms_norm_eps": 1e-5, **(model or {})}
    arch = m.pop("arch", "llama")
    base = {k: v for k, v in m.items() if k not in WorldModel.DEEPSEEK_KEYS}
    if arch == "deepseek_v3":
        base.pop("head_dim")  # MLA's head sizes are its own (qk_nope / qk_rope / v_head_dim)
        # what transformers' DeepseekV3 routing computes (sigmoid scores, bias-corrected group top-k),
        # named as DeepSeek-V3's and Kimi-K2's own config.json name it: vLLM reads these two keys and,
        # without them, routes by softmax and builds no e_score_correction_bias
        return DeepseekV3Config(
            **base, **_deepseek_v3_keys(m), topk_method="noaux_tc", scoring_func="sigmoid", **special
        )
    return ARCH_CONFIGS[arch](**base, **special)


def _chunks(xs: list, n: int) -> list[list]:
    size = max(1, math.ceil(len(xs) / n))
    return [xs[i : i + size] for i in range(0, len(xs), size)]


class _Deterministic:
    """Deterministic torch on a fixed thread count, without transformers' own progress bars
    (they would interleave with ours in the Snakemake log); restores the caller's settings."""

    def __init__(self, threads: int | None, cuda: bool = False):
        self.threads, self.cuda = threads, cuda

    def __enter__(self):
        self.prev = (
            torch.get_num_threads(),
            torch.are_deterministic_algorithms_enabled(),
            hf_logging.is_progress_bar_enabled(),
        )
        if self.threads:
            torch.set_num_threads(self.threads)
        if self.cuda:  # cuBLAS is deterministic only with a fixed workspace (set before its first call)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # CUDA: the ops without a deterministic kernel (MoE scatters) warn instead of failing
        torch.use_deterministic_algorithms(True, warn_only=self.cuda)
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        torch.set_num_threads(self.prev[0])
        torch.use_deterministic_algorithms(self.prev[1])
        if self.prev[2]:
            hf_logging.enable_progress_bar()


def _token_stream(tok, samples: list[dict], seq_len: int, name: str) -> torch.Tensor:
    """One long stream of <|bos|>…<|end|> chats; windows are drawn at random offsets."""
    stream = []
    for s in samples:
        stream += encode_world_chat(tok, s)[0]
    data = torch.tensor(stream, dtype=torch.long)
    if len(data) <= seq_len + 1:
        raise ValueError(f"{name}: corpus has {len(data)} tokens, fewer than seq_len {seq_len}")
    return data


def _initial_model(tok, init_from: str | Path | None, config: dict | None, vocab_size: int | None):
    """The saved target to continue (init_from), or a fresh one from target_config."""
    if init_from is not None:
        model = AutoModelForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        if model.config.vocab_size < tok.get_vocab_size():
            raise ValueError(f"{init_from}: vocab {model.config.vocab_size} < tokenizer {tok.get_vocab_size()}")
        return model
    vocab = max(tok.get_vocab_size(), vocab_size or 0)
    cfg = target_config(
        config,
        vocab_size=vocab,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(END),
        pad_token_id=tok.token_to_id(PAD),
    )
    return AutoModelForCausalLM.from_config(cfg)


def _lr_at(step: int, *, lr: float, warmup: int, steps: int) -> float:
    """Linear warmup, cosine down to 10%."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _train_steps(
    model, data: torch.Tensor, *, steps, lr, batch_size, seq_len, warmup, seed, name, progress, device
) -> list[float]:
    """The training loop on random windows of the stream; the loss of every step."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    with progress_bar(steps, name, "step", enabled=progress, leave=False) as bar:
        for step in range(steps):
            ix = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
            batch = torch.stack([data[i : i + seq_len + 1] for i in ix.tolist()]).to(device)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, lr=lr, warmup=warmup, steps=steps)
            # CUDA: bf16 autocast (a GPU world's targets are 1B-scale; the CPU stays float32)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device != "cpu"):
                logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
    return losses


def _parent_of(init_from: str | Path | None) -> dict | None:
    """Name and revision of the target continued from (its draftport_target.json), None if fresh."""
    if init_from is None:
        return None
    parent_meta = Path(init_from) / "draftport_target.json"
    parent = json.loads(parent_meta.read_text()) if parent_meta.exists() else {"path": str(init_from)}
    return {k: parent.get(k) for k in ("name", "revision")}


def _target_summary(
    out_dir: Path,
    model,
    losses: list[float],
    *,
    name,
    trained_on,
    steps,
    seed,
    parent,
    lr,
    batch_size,
    seq_len,
    warmup,
    t0,
) -> dict:
    """The summary train_target returns: the run's settings, its revision, loss and size."""
    tail = losses[-max(1, steps // 10) :]  # last 10% of steps: less noisy than the last batch
    return {
        "name": name,
        "revision": target_revision(out_dir),
        "trained_on": trained_on,
        "steps": steps,
        "seed": seed,
        "init_from": parent,
        "lr": lr,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "warmup": warmup,
        "tokens_seen": steps * batch_size * seq_len,
        "final_loss": round(sum(tail) / len(tail), 4),
        "seconds": round(time.time() - t0, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        # mean loss of each tenth of the run: enough to see whether it had converged
        "loss_curve": [round(sum(c) / len(c), 3) for c in _chunks(losses, 10)],
    }


def _record_target(out_dir: Path, meta: dict, progress: bool) -> None:
    """Write draftport_target.json (without the time) and print the one-line summary."""
    # the file without the time: identical runs write identical bytes
    (out_dir / "draftport_target.json").write_text(
        json.dumps({k: v for k, v in meta.items() if k != "seconds"}, indent=2) + "\n"
    )
    if progress:
        print(
            f"{meta['name']}: loss {meta['final_loss']:.3f} | {meta['steps']} steps | "
            f"{meta['tokens_seen'] / 1e3:.0f}k tokens | {meta['seconds']:.1f} s | "
            f"{meta['num_parameters'] / 1e6:.2f}M params | rev {meta['revision']}"
        )


def train_target(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    samples: list[dict],
    *,
    init_from: str | Path | None = None,
    config: dict | None = None,
    steps: int,
    lr: float,
    batch_size: int,
    seq_len: int,
    warmup: int,
    seed: int = 0,
    name: str = "target",
    trained_on: str = "",
    threads: int | None = None,
    progress: bool = True,
    device: str = "cpu",
    vocab_size: int | None = None,
) -> dict:
    """Train a small causal LM (target_config: Llama, DeepSeek-V3 or Qwen3) on packed chat samples;
    save an HF model folder.

    Loss is on all tokens, not only the assistant's: the windows are packed (nanoGPT style, no
    padding, cheapest on CPU), user turns are the same language so they are free signal for the
    small budget, and the prompt still conditions the answer either way. `init_from` continues a
    saved target (K2.5 = K2 + more training on the new data); `config` is then ignored (left
    out: the embedded world's model, draftport.plan.params.WorldModel). steps .. warmup: a params
    world.target_old / target_new group. device: "cpu" or "cuda" (the world's device rule);
    vocab_size: the model's vocabulary, at least the tokenizer's (more: rows no text uses).
    Returns the summary also written to draftport_target.json.
    """
    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    hp = {"steps": steps, "lr": lr, "batch_size": batch_size, "seq_len": seq_len, "warmup": warmup}
    t0 = time.time()
    with _Deterministic(threads, cuda=device != "cpu"):
        torch.manual_seed(seed)
        tok = load_world_tokenizer(tokenizer_dir)
        data = _token_stream(tok, samples, seq_len, name)
        model = _initial_model(tok, init_from, config, vocab_size)
        losses = _train_steps(model, data, seed=seed, name=name, progress=progress, device=device, **hp)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.to("cpu").save_pretrained(out_dir)
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, out_dir / f)

    parent = _parent_of(init_from)
    meta = _target_summary(
        out_dir, model, losses, name=name, trained_on=trained_on, seed=seed, parent=parent, t0=t0, **hp
    )
    _record_target(out_dir, meta, progress)
    return meta


# ──────────────────────────────────────────────────────────────────────────────────────────────
# 4. Measuring the pair: how predictable each target is and how far B moved from A
# ──────────────────────────────────────────────────────────────────────────────────────────────


def _assistant_predictions(model, tok, samples: list[dict], batch_size: int = 32, device: str = "cpu"):
    """Per sample: (logits at positions predicting assistant tokens, those tokens)."""
    pad = tok.token_to_id(PAD)
    out = []
    for b in range(0, len(samples), batch_size):
        enc = [encode_world_chat(tok, s) for s in samples[b : b + batch_size]]
        width = max(len(ids) for ids, _ in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, (x, _) in enumerate(enc):
            ids[i, : len(x)] = torch.tensor(x)
            mask[i, : len(x)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.cpu()
        for i, (x, start) in enumerate(enc):
            # position p predicts token p+1: the assistant tokens x[start:] come from p = start-1 ..
            out.append((logits[i, start - 1 : len(x) - 1].float(), ids[i, start : len(x)]))
    return out


def measure_targets(
    target_a: str | Path,
    target_b: str | Path,
    heldout: dict[str, list[dict]],
    threads: int | None = None,
    device: str = "cpu",
) -> dict:
    """Loss / top-1 of A and B on each held-out set, and A-B greedy agreement, assistant tokens only.

    Agreement is the fraction of assistant positions where argmax A == argmax B: roughly the
    acceptance a perfect imitation of A would get against B, i.e. how far the port has to move.
    """
    res: dict[str, float] = {}
    with _Deterministic(threads, cuda=device != "cpu"):
        models = {
            "A": AutoModelForCausalLM.from_pretrained(target_a, dtype=torch.float32).to(device).eval(),
            "B": AutoModelForCausalLM.from_pretrained(target_b, dtype=torch.float32).to(device).eval(),
        }
        tok = load_world_tokenizer(target_a)
        for kind, samples in heldout.items():
            preds = {k: _assistant_predictions(m, tok, samples, device=device) for k, m in models.items()}
            for k in models:
                logits = torch.cat([lg for lg, _ in preds[k]])
                tgt = torch.cat([t for _, t in preds[k]])
                res[f"loss_{k}_{kind}"] = round(torch.nn.functional.cross_entropy(logits, tgt).item(), 4)
                res[f"top1_{k}_{kind}"] = round((logits.argmax(-1) == tgt).float().mean().item(), 4)
            agree = torch.cat(
                [(a.argmax(-1) == b.argmax(-1)).float() for (a, _), (b, _) in zip(preds["A"], preds["B"])]
            )
            res[f"agree_AB_{kind}"] = round(agree.mean().item(), 4)
            res[f"assistant_tokens_{kind}"] = int(agree.numel())
    return res
