"""Wall time and disk of a profile's phases: the data (the target's answers, its hidden states) and
the trainings, per storage mode, from measured throughputs and stated assumptions.

Training (per rule, from a measured one-GPU throughput; bench_throughput says which figure):
    tokens  = steps x global batch x tokens per sample
    seconds = tokens / (one-GPU tok/s x GPUs x scaling efficiency)
The one-GPU figure is read from a benchmark result (benchmarks/results/*.json of
benchmarks/bench_train_h200.py): its rate with lm_head trained when the phase trains it
(draftport's default; Phase 1's vocab remap needs it), else frozen; on packed rows when the
phase's train.packing is true, else padded (bench_throughput).

Data (per feature step; docs/estimate.md has the formulas and the kimi table):
    regenerate: samples x answer tokens / the serving deployment's output tok/s: --serve-tok-s, else
                the measured features.serve_tok_s, else derived (`serve_rate`): decode is memory-bound,
                tok/s = instances x C / max(bytes a step reads / (TP x HBM x utilisation),
                FLOPs of a step / (TP x peak x fraction)), a step reading the weights its C tokens touch
                (a MoE: the routed experts C tokens reach) and their KV caches
    capture:    samples x tokens per sample x FLOPs/token / (peak x GPUs x fraction of roofline)
    FLOPs/token = 2 x active params without the input embedding (lm_head included: the capture
                  runs it for the greedy choice; MoE: the experts a token is routed to + shared)
                + attention 2 x layers x heads x (qk head dim + v head dim) x tokens per sample / 2
The fraction of roofline is measured (a capture benchmark, benchmarks/results/*-h200-capture.json)
or stated (--capture-efficiency, else CAPTURE_STATED); every figure says which.

Storage modes: `disk` (every state on disk at features.dtype; bf16 and fp8_e4m3 are both shown),
`online` (the target recomputes the states for every pass of every training; only a bounded spool
is on disk), `hybrid` (online, the first epoch cached when the disk holds it). `storage_need` and
`check_storage` are the check a capture or an online training runs before any weights load.
Every input is printed next to the result so the arithmetic can be redone by hand.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console, Group

# the estimate's storage terms, read through it (draftport estimate's tests and callers)
from draftport.data.storage import (  # noqa: F401
    DISK_MARGIN,
    MODES,
    SPOOL_GB,
    TOKEN_BYTES,
    _positive,
    bytes_per_token,
    check_storage,
    storage_need,
)
from draftport.errors import DraftportError
from draftport.evaluation.budget import schedule
from draftport.model.config import target_text_config
from draftport.outputs.render import estimate_renderables
from draftport.plan.cluster import rule_resources
from draftport.plan.curves import budget_steps, points
from draftport.plan.params import resolved_eval_sets
from draftport.profile.rates import _packaged, capture_bench, newest_capture_bench

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/draftport/profile/estimate.py)
# the default: the training figures of the profile's own drafter shape (draftport.profile.rates:
# measured, interpolated or nearest); this file (Kimi-K2's drafter) when a caller reads one file
DEFAULT_BENCH = ROOT / "benchmarks" / "results" / "2026-12-03-h200-train-kimi.json"
RESULTS = ROOT / "benchmarks" / "results"
PHASES = (("phase1_scratch", "phase1"), ("phase1", "phase1"), ("phase2", "phase2"))

PEAK_TFLOPS = 790.0  # H200 dense bf16, the roofline of the training and capture benchmarks
# Stated until a capture benchmark file lands (CAPTURE_STATED_SOURCE: where the figure comes from);
# no capture-only figure was quoted, so online is billed at capture + write's fraction (conservative).
CAPTURE_STATED = {"capture_write": 0.42, "capture": 0.42}
CAPTURE_STATED_SOURCE = (
    "H200 2026-12-01, 32B dense bf16 random weights, B x T 16 x 2048: capture+write "
    "42% of roofline (forward alone 65%), quoted, no result file"
)
# The adaptive data budget (data.budget adaptive) on the embedded world stopped after this many rounds
# of x2 from Phase 1's n, its curve flattened (benchmarks/results/2026-12-04-embedded-adaptive.md): the
# estimate bills a real pair's rounds as if its curve had that shape.
EMBEDDED_STOP_ROUND = 3

# ---- the regeneration's serving rate: every assumption of `serve_rate`, in one place ---------------
# per GPU: HBM bandwidth and memory (NVIDIA's datasheets: H100 SXM 3.35 TB/s, 80 GB; H200 4.8 TB/s,
# 141 GB); both are the same GH100 compute die, so PEAK_TFLOPS (the measured H200 roofline) serves both
GPUS = {"H100": {"hbm_bytes_s": 3.35e12, "memory_bytes": 80e9}, "H200": {"hbm_bytes_s": 4.8e12, "memory_bytes": 141e9}}
SERVE_GPU = "H200"  # the estimate's device throughout (its benchmarks ran on H200; no params key names one)
SERVE_CONCURRENCY = 64  # requests in flight per serving instance: the published figure's; a batch job can run
# more (more tokens per weight read), so the rate is on the low side
SERVE_HBM_UTIL = 0.43  # the fraction of HBM bandwidth a decode step gets end to end (prefills, TP all-reduces,
# scheduling included): fitted to SERVE_REFERENCE's 64-concurrent point, checked on its
# 16 and 32 (tests/profile/test_estimate.py); dense kernels do better: low side for dense
SERVE_COMPUTE_FRACTION = 0.5  # of PEAK_TFLOPS in decode's skinny matmuls (assumed): binds only when the bytes are few
KV_CACHE_BYTES = 2  # bytes per cached element: bf16, SGLang's and vLLM's default (kv_cache_dtype auto)
# bytes per parameter read per decode step, by the target's weight format (weight_format): decoder layers,
# routed experts, lm_head. The input embedding is not read at decode (C rows of it only).
WEIGHT_BYTES = {
    "bf16": {"layers": 2.0, "experts": 2.0, "lm_head": 2.0},  # no quantization_config: served as published
    "fp8": {"layers": 1.0, "experts": 1.0, "lm_head": 2.0},  # DeepSeek-V3/R1, Kimi-K2: fp8 blocks (scales ~0)
    # compressed-tensors 4-bit, a bf16 scale per 32 weights (Kimi-K2-Thinking, K2.5): a MoE's routed experts only
    "int4_experts": {"layers": 2.0, "experts": 0.5 + 2 / 32, "lm_head": 2.0},
    "int4": {"layers": 0.5 + 2 / 32, "experts": 0.5 + 2 / 32, "lm_head": 2.0},  # a dense model's 4-bit layers
}
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
INT4_EXPERTS = {
    "quant_method": "compressed-tensors",  # abridged: its config_groups' weights (Kimi-K2.5's release)
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "group_size": 32, "type": "int", "symmetric": True},
        }
    },
}
# The one published figure the rate is checked against: DeepSeek-R1-0528 FP8 (the DeepSeek-V3 shape
# Kimi-K2 shares) on 8 x H200, SGLang v0.5.7 TP8, 1K in / 1K out, output tok/s per GPU by concurrency
# (SemiAnalysisAI/InferenceX#870, 2026-03-05)
SERVE_REFERENCE = {
    "source": "DeepSeek-R1 FP8 on 8 x H200, SGLang TP8, 1K/1K (SemiAnalysisAI/InferenceX#870)",
    "gpu": "H200",
    "gpus": 8,
    "tp": 8,
    "input": 1024,
    "output": 1024,
    "tok_s_per_gpu": {8: 74.6, 16: 111.9, 32: 151.1, 64: 223.6},
}
DEEPSEEK_R1_TEXT = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "tie_word_embeddings": False,
    "quantization_config": FP8_BLOCKS,
}

# The text decoder of the targets the real profile names, as published in their config.json
# (Kimi-K2.5: the `text_config` of its multimodal wrapper; the DeepseekV3 shape of Kimi-K2).
# A folder at targets.new, or --target-config, takes precedence.
KIMI_K2_TEXT = {
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "tie_word_embeddings": False,
}
# with the weight format each repo publishes (K2.5: int4 routed experts; K2-Instruct: fp8 blocks)
KNOWN_TARGETS = {
    "moonshotai/Kimi-K2.5": {**KIMI_K2_TEXT, "quantization_config": INT4_EXPERTS},
    "moonshotai/Kimi-K2-Instruct": {**KIMI_K2_TEXT, "quantization_config": FP8_BLOCKS},
}


def train_seconds(
    *, steps: int, batch_size: int, tokens_per_sample: int, tok_s_per_gpu: float, gpus: int, efficiency: float
) -> float:
    if min(steps, batch_size, tokens_per_sample, gpus) < 1 or tok_s_per_gpu <= 0 or not 0 < efficiency <= 1:
        raise DraftportError(
            "estimate", "steps, batch, tokens per sample, GPUs must be >= 1; throughput > 0; efficiency in (0, 1]"
        )
    return steps * batch_size * tokens_per_sample / (tok_s_per_gpu * gpus * efficiency)


def step_samples(tr: dict, tokens_per_sample: int, gpus: int) -> float:
    """A training's samples a step: batch_size, or with train.tokens_per_step (a packed row of that
    many tokens a process, one process a GPU) what a greedy cut fits on average: the budget less
    half a sample, the tail the next sample does not fit."""
    budget = int(tr.get("tokens_per_step") or 0)
    if not budget:
        return int(tr["batch_size"])
    fill = max(tokens_per_sample, budget - tokens_per_sample / 2)
    return gpus * fill / tokens_per_sample


def _read_json(path: Path, missing: str):
    """A JSON file's content; one-line errors for a missing file or invalid JSON."""
    if not path.is_file():
        raise DraftportError(path, missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DraftportError(path, f"not JSON ({e.msg}, line {e.lineno})") from None


def bench_throughput(path=DEFAULT_BENCH, cfg: dict | None = None) -> dict:
    """The one-GPU training rates of a bench_train_h200 result. With a profile (cfg) and the
    default path: those of the profile's own drafter shape (train_rates.for_profile: measured,
    interpolated or nearest, said in `rate` and `shape_source`); a path given: that file's.
    A result with a length mix gives its real-token rates for the two row layouts
    train.packing picks from: packed (`packed_real_tokens_per_s`, lm_head trained;
    `..._lm_head_frozen`) and padded (`padded_real_tokens_per_s`; frozen:
    `mix_results.padded_frozen_stored`), the greedy choice stored as the pipeline stores it.
    An older one gives its full-row rates for both
    (`tokens_per_s_lm_head_trainable`, `tokens_per_s_mask_precomputed`)."""
    if cfg is not None and path is DEFAULT_BENCH:  # not given (the CLI passes this very object)
        from draftport.profile.rates import for_profile  # lazy: estimate's other callers pass a file

        return for_profile(cfg)
    path = Path(path)
    d = _read_json(path, "no such benchmark result")
    try:
        out = {
            "device": d["device"],
            "date": d["date"],
            "seq": d["config"]["seq"],
            "ttt_steps": d["config"]["ttt_steps"],
            "hidden_size": d["config"]["hidden_size"],
        }
        if d.get("packed_real_tokens_per_s"):
            mix = d.get("mix") or {}
            out.update(
                lm_head_trainable=float(d["packed_real_tokens_per_s"]),
                lm_head_frozen=float(d["packed_real_tokens_per_s_lm_head_frozen"]),
                padded_lm_head_trainable=float(d["padded_real_tokens_per_s"]),
                padded_lm_head_frozen=float(d["mix_results"]["padded_frozen_stored"]["real_tokens_per_s"]),
                rate=f"real tokens of a length mix ({mix.get('n', '?')} samples, mean "
                f"{mix.get('mean', '?')}, max {mix.get('max', '?')} tokens), packed rows or "
                f"padded groups of {mix.get('pad_batch', '?')} as train.packing says",
            )
        else:
            out.update(
                lm_head_trainable=float(d["tokens_per_s_lm_head_trainable"]),
                lm_head_frozen=float(d["tokens_per_s_mask_precomputed"]),
                rate="full rows",
            )
            out.update(padded_lm_head_trainable=out["lm_head_trainable"], padded_lm_head_frozen=out["lm_head_frozen"])
        return out
    except (KeyError, TypeError) as e:
        raise DraftportError(path, f"benchmark result lacks {e}") from None


# ---- the target's shape: active parameters and capture FLOPs ------------------------------------
def _read_text_config(path: Path) -> dict:
    """The text decoder's config; a multimodal wrapper's quantization_config carried into it (the
    weights' format sets the serving rate)."""
    path = Path(path)
    if path.is_dir():
        tc, cfg = target_text_config(path), _read_json(path / "config.json", "not a model folder (no config.json)")
    else:
        cfg = _read_json(path, "no such target config (a model folder or its config.json)")
        if not isinstance(cfg, dict):
            raise DraftportError(path, "config is not a JSON object")
        tc = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg else cfg
    if tc is not cfg and isinstance(cfg.get("quantization_config"), dict) and "quantization_config" not in tc:
        tc = {**tc, "quantization_config": cfg["quantization_config"]}
    return tc


def target_config(cfg: dict, path=None) -> tuple[dict, str]:
    """(the new target's text decoder config, where it came from): --target-config, the folder at
    targets.new, or the published shape of a known hub id."""
    if path is not None:
        return _read_text_config(path), str(path)
    new = cfg["targets"]["new"]
    local = Path(new)  # relative paths in params are the project's, where the plan runs (the cwd)
    if (local / "config.json").is_file():
        return _read_text_config(local), f"{new}/config.json"
    if new in KNOWN_TARGETS:
        return dict(KNOWN_TARGETS[new]), "built in: its published config.json"
    w = cfg.get("world") or {}
    if w.get("build") and str(new).startswith("artifacts/world/"):
        return {**w["model"], "vocab_size": w["vocab_size"]}, "world.model (the embedded target, not built here)"
    raise DraftportError(
        "targets.new", f"{new}: no config.json here and no built-in shape; pass --target-config (its config.json)"
    )


def target_shape(tc: dict, where: str = "target config") -> dict:
    """Parameter counts of a text decoder config (Llama-like dense; DeepseekV3/Kimi MLA + MoE;
    Mixtral-like MoE), per token (active) and in all. Matmul weights only (norms do no matmul)."""
    try:
        h, n_layers, heads = int(tc["hidden_size"]), int(tc["num_hidden_layers"]), int(tc["num_attention_heads"])
        vocab, inter = int(tc["vocab_size"]), int(tc["intermediate_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise DraftportError(where, f"config lacks {e}") from None
    if tc.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V3, Kimi-K2)
        nope, rope, v = int(tc["qk_nope_head_dim"]), int(tc["qk_rope_head_dim"]), int(tc["v_head_dim"])
        qr, kvr = tc.get("q_lora_rank"), int(tc["kv_lora_rank"])
        q = h * int(qr) + int(qr) * heads * (nope + rope) if qr else h * heads * (nope + rope)
        attn = q + h * (kvr + rope) + kvr * heads * (nope + v) + heads * v * h
        qk_dim, v_dim = nope + rope, v
        kv_cached = kvr + rope  # MLA caches the latent and the rope key per layer
    else:
        hd = int(tc.get("head_dim") or h // heads)
        kv = int(tc.get("num_key_value_heads") or heads)
        attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
        qk_dim = v_dim = hd
        kv_cached = 2 * kv * hd
    experts = tc.get("n_routed_experts") or tc.get("num_local_experts") or tc.get("num_experts") or 0
    if experts:
        odd = [k for k in ("shared_expert_intermediate_size", "mlp_only_layers") if tc.get(k)] + [
            k for k in ("moe_layer_freq", "decoder_sparse_step") if int(tc.get(k, 1)) != 1
        ]
        if odd:  # counted wrong rather than refused would be worse
            raise DraftportError(where, f"MoE layout not supported by the estimate ({', '.join(odd)})")
        top_k, shared = int(tc["num_experts_per_tok"]), int(tc.get("n_shared_experts") or 0)
        expert = 3 * h * int(tc.get("moe_intermediate_size") or inter)
        dense_layers = int(tc.get("first_k_dense_replace", 0))
        router = h * int(experts)
        moe_layers = n_layers - dense_layers
        mlp_active = dense_layers * 3 * h * inter + moe_layers * ((top_k + shared) * expert + router)
        mlp_total = dense_layers * 3 * h * inter + moe_layers * ((int(experts) + shared) * expert + router)
        moe = {
            "experts": int(experts),
            "top_k": top_k,
            "shared": shared,
            "dense_layers": dense_layers,
            "expert_params": expert,
            "router_params": router,
        }
    else:
        mlp_active = mlp_total = n_layers * 3 * h * inter
        moe = None
    embed = lm_head = vocab * h
    active_no_embed = n_layers * attn + mlp_active + lm_head
    return {
        "layers": n_layers,
        "hidden_size": h,
        "heads": heads,
        "qk_head_dim": qk_dim,
        "v_head_dim": v_dim,
        "vocab_size": vocab,
        "moe": moe,
        "attention_per_layer": attn,
        "dense_mlp_params": 3 * h * inter,
        "kv_cache_per_token": n_layers * kv_cached,
        "lm_head_params": lm_head,
        "active_params": active_no_embed + embed,
        "active_params_no_embed": active_no_embed,
        "total_params": n_layers * attn + mlp_total + lm_head + embed,
    }


def capture_flops_per_token(shape: dict, tokens_per_sample: int) -> dict:
    """2 x active params without the input embedding + causal attention over tokens_per_sample
    (2 x layers x heads x (qk + v head dim) x T / 2; = 4 x layers x hidden x T / 2 for attention
    whose heads x head_dim is the hidden size)."""
    matmul = 2 * shape["active_params_no_embed"]
    attention = (
        2 * shape["layers"] * shape["heads"] * (shape["qk_head_dim"] + shape["v_head_dim"]) * (tokens_per_sample / 2)
    )
    return {"matmul": matmul, "attention": attention, "total": matmul + attention}


# ---- the capture's fraction of roofline: measured or stated ---------------------------------------
def capture_efficiency(bench=None, stated: float | None = None) -> dict:
    """stated (given) > the benchmark file given > the newest *-h200-capture.json > CAPTURE_STATED."""
    if stated is not None:
        _positive("--capture-efficiency", stated, at_most=1)
        return {"source": "stated", "note": "--capture-efficiency", "capture_write": stated, "capture": stated}
    path = bench if bench is not None else newest_capture_bench()
    if path is not None:
        return capture_bench(path)
    if bench is None and not RESULTS.is_dir():  # an installed draftport: the packaged table's
        cap = _packaged().get("capture")
        if cap is not None:
            return cap
    return {"source": "stated", "note": CAPTURE_STATED_SOURCE, **CAPTURE_STATED}


# ---- the regeneration's serving rate: measured, or derived from the target and the GPUs -----------
def weight_format(tc: dict, moe: bool) -> tuple[str, str]:
    """(the WEIGHT_BYTES key, why) from the config's quantization_config."""
    q = tc.get("quantization_config")
    if not isinstance(q, dict) or not q:
        return "bf16", "no quantization_config: bf16 weights"
    method = str(q.get("quant_method") or "?").lower()
    if method == "fp8":
        return "fp8", "quantization_config fp8"
    groups = q.get("config_groups") if isinstance(q.get("config_groups"), dict) else {}
    bits = {(g.get("weights") or {}).get("num_bits") for g in groups.values() if isinstance(g, dict)}
    if method == "compressed-tensors" and bits == {8}:
        return "fp8", "quantization_config compressed-tensors, 8-bit"
    if method == "compressed-tensors" and bits == {4}:
        return (
            ("int4_experts", "quantization_config compressed-tensors, 4-bit routed experts")
            if moe
            else ("int4", "quantization_config compressed-tensors, 4-bit")
        )
    return "bf16", f"quantization_config {method} not modelled: bf16 bytes assumed (an upper bound on the bytes)"


def decode_step(
    tc: dict, *, tp: int, requests: int, tokens: int, context: float, gpu: str, util: float, where: str
) -> dict:
    """One decode step of a `tp`-GPU instance: `requests` in flight, `tokens` each (1 plain; k + 1
    when a verify checks k draft tokens) at a mean context of `context`. It reads the weights its
    tokens touch (a MoE: the distinct routed experts of tokens x top-k uniform draws) and every
    request's KV cache once, at `util` of the HBM bandwidth; its matmuls at SERVE_COMPUTE_FRACTION
    of PEAK_TFLOPS bound it from below. -> {seconds, the bytes, ...}."""
    shape = target_shape(tc, where)
    moe = shape["moe"]
    fmt, fmt_why = weight_format(tc, moe is not None)
    wb = WEIGHT_BYTES[fmt]
    L = shape["layers"]
    layers = L * shape["attention_per_layer"]
    n_tok = requests * tokens
    if moe:
        n_moe, E, k = L - moe["dense_layers"], moe["experts"], moe["top_k"]
        touched = E * (1 - (1 - k / E) ** n_tok)  # expected distinct experts of n_tok x top-k uniform draws
        experts_read, experts_all = n_moe * touched * moe["expert_params"], n_moe * E * moe["expert_params"]
        layers += moe["dense_layers"] * shape["dense_mlp_params"] + n_moe * (
            moe["shared"] * moe["expert_params"] + moe["router_params"]
        )
    else:
        touched, experts_read, experts_all = None, 0, 0
        layers += L * shape["dense_mlp_params"]
    rest = layers * wb["layers"] + shape["lm_head_params"] * wb["lm_head"]
    weight_bytes = rest + experts_read * wb["experts"]
    # all of them, the input embedding (bf16) too: whether an instance's GPUs hold them and the KV caches
    total_bytes = rest + experts_all * wb["experts"] + shape["vocab_size"] * shape["hidden_size"] * 2
    kv_bytes = requests * context * shape["kv_cache_per_token"] * KV_CACHE_BYTES
    hbm = GPUS[gpu]["hbm_bytes_s"]
    memory_s = (weight_bytes + kv_bytes) / (tp * hbm * util)
    flops = n_tok * (
        2 * shape["active_params_no_embed"]
        + 2 * L * shape["heads"] * (shape["qk_head_dim"] + shape["v_head_dim"]) * context
    )
    compute_s = flops / (tp * PEAK_TFLOPS * 1e12 * SERVE_COMPUTE_FRACTION)
    return {
        "seconds": max(memory_s, compute_s),
        "bound": "memory" if memory_s >= compute_s else "compute",
        "moe": moe,  # its shape, None for a dense target
        "touched": touched,
        "format": fmt,
        "format_why": fmt_why,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "total_bytes": total_bytes,
        "hbm": hbm,
    }


def serving_steps(
    tc: dict,
    *,
    tp: int,
    batch_sizes: list[int],
    k_max: int,
    context: float,
    draft_bytes: float,
    gpu: str = SERVE_GPU,
    util: float = SERVE_HBM_UTIL,
    where: str = "target config",
) -> dict[int, dict[int, float]]:
    """The engine's step in ms by batch size and draft tokens k (k 0: the target alone), derived as
    serve_rate derives decode: a verify of k + 1 tokens a request, plus k draft steps that each read
    the drafter's `draft_bytes` over the instance's GPUs (their own compute is small)."""
    if gpu not in GPUS:
        raise DraftportError("gpu", f"{gpu!r}: expected one of {', '.join(GPUS)}")
    draft_s = draft_bytes / (tp * GPUS[gpu]["hbm_bytes_s"] * util)
    out = {}
    for b in batch_sizes:
        out[b] = {
            k: 1000.0
            * (
                decode_step(tc, tp=tp, requests=b, tokens=k + 1, context=context, gpu=gpu, util=util, where=where)[
                    "seconds"
                ]
                + k * draft_s
            )
            for k in range(k_max + 1)
        }
    return out


def serve_rate(
    tc: dict,
    *,
    gpus: int,
    tp: int,
    context: float,
    gpu: str = SERVE_GPU,
    concurrency: int = SERVE_CONCURRENCY,
    util: float = SERVE_HBM_UTIL,
    where: str = "target config",
) -> dict:
    """Output tok/s of `gpus` GPUs serving the target: gpus // tp instances (data parallel) of `tp`
    GPUs each (tensor parallel), `concurrency` requests in flight per instance at a mean context of
    `context` tokens. A decode step emits one token per request and reads the weights its tokens
    touch (a MoE: the distinct routed experts `concurrency` tokens of top-k reach, routing taken as
    uniform) and their KV caches, at `util` of the HBM bandwidth; its matmuls at
    SERVE_COMPUTE_FRACTION of PEAK_TFLOPS bound it from below."""
    if gpu not in GPUS:
        raise DraftportError("gpu", f"{gpu!r}: expected one of {', '.join(GPUS)}")
    for name, v in (("gpus", gpus), ("tp", tp), ("concurrency", concurrency), ("context", context)):
        _positive(name, v)
    _positive("util", util, at_most=1)
    tp = min(int(tp), int(gpus))  # fewer GPUs than the TP size: one instance over all of them
    instances = int(gpus) // tp
    st = decode_step(tc, tp=tp, requests=concurrency, tokens=1, context=context, gpu=gpu, util=util, where=where)
    step, moe, touched, fmt, fmt_why = st["seconds"], st["moe"], st["touched"], st["format"], st["format_why"]
    weight_bytes, kv_bytes, total_bytes, hbm = st["weight_bytes"], st["kv_bytes"], st["total_bytes"], st["hbm"]
    per_instance = concurrency / step
    return {
        "tok_s": per_instance * instances,
        "tok_s_per_gpu": per_instance / tp,
        "gpu": gpu,
        "gpus": int(gpus),
        "tp": tp,
        "instances": instances,
        "concurrency": concurrency,
        "context": context,
        "util": util,
        "hbm_bytes_s": hbm,
        "format": fmt,
        "format_why": fmt_why,
        "moe": moe is not None,
        "experts_read": touched,
        "experts": moe["experts"] if moe else None,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "step_s": step,
        "bound": st["bound"],
        "weights_total_bytes": total_bytes,
        "memory_bytes": GPUS[gpu]["memory_bytes"],
        "fits": total_bytes + kv_bytes <= tp * GPUS[gpu]["memory_bytes"],
    }


def reference_check(concurrency: int = 64) -> dict:
    """serve_rate's figure for SERVE_REFERENCE's deployment at one of its published concurrencies."""
    r = SERVE_REFERENCE
    got = serve_rate(
        DEEPSEEK_R1_TEXT,
        gpus=r["gpus"],
        tp=r["tp"],
        gpu=r["gpu"],
        concurrency=concurrency,
        context=r["input"] + r["output"] / 2,
        where="DEEPSEEK_R1_TEXT",
    )
    return {
        "concurrency": concurrency,
        "model": got["tok_s_per_gpu"],
        "published": r["tok_s_per_gpu"][concurrency],
        "source": r["source"],
    }


def serving(cfg: dict, tc: dict, *, gpus: int, context: float, given: float | None, where: str) -> dict:
    """The regeneration's output tok/s: --serve-tok-s > the profile's measured features.serve_tok_s >
    derived (serve_rate) for the feature step's GPUs as instances of features.tensor_parallel_size."""
    if given is not None:
        _positive("--serve-tok-s", given)
        return {"tok_s": float(given), "source": "--serve-tok-s"}
    measured = (cfg.get("features") or {}).get("serve_tok_s")
    if measured is not None:
        _positive("features.serve_tok_s", measured)
        return {"tok_s": float(measured), "source": "features.serve_tok_s"}
    tp = int((cfg.get("features") or {}).get("tensor_parallel_size") or 1)
    got = serve_rate(tc, gpus=gpus, tp=tp, context=context, where=where)
    ref = reference_check()
    return {**got, "source": "derived", "calibration": ref}


# ---- the estimate -------------------------------------------------------------------------------
def _gpus(cfg: dict, step: str, override: int | None) -> int:
    res = cfg["resources"]
    return override or max(1, int({**res["default"], **(res.get(step) or {})}["gpu"]))


def _adaptive(cfg: dict, data: list[dict], b: dict, tps: int, gpus: int | None, efficiency: float) -> dict:
    """What data.budget adaptive would cost and save if the pair's curve flattened where the embedded
    world's did (EMBEDDED_STOP_ROUND rounds of x data.factor): Phase 2's regeneration and capture of
    the samples past the stop saved; every round's trainings (data.seeds x the curves' budget rule,
    round 0 at Phase 1's n included) added. Phase 2's own training is the same either way."""
    d, c = cfg.get("data") or {}, cfg["curves"]
    n1, n2 = int(cfg["phase1"]["n_samples"]), int(cfg["phase2"]["n_samples"])
    factor, seeds = float(d.get("factor", 2.0)), len(d.get("seeds", [0, 1, 2]))
    full = schedule(n1, factor, n2)
    ns = full[: EMBEDDED_STOP_ROUND + 1]
    tr = c["train"]
    rate = b[
        ("" if tr.get("packing") else "padded_")
        + ("lm_head_trainable" if tr.get("train_lm_head", True) else "lm_head_frozen")
    ]
    steps = seeds * sum(budget_steps(n, c) for n in ns)
    # the rounds' trainings: under torchrun over the step's GPUs (resources.budget.torchrun), else
    # in the step's own process on one of them
    held = _gpus(cfg, "budget", gpus)
    on = held if rule_resources(cfg, "budget")["torchrun"] else 1
    train_h = (
        train_seconds(
            steps=steps,
            batch_size=int(tr["batch_size"]),
            tokens_per_sample=tps,
            tok_s_per_gpu=rate,
            gpus=on,
            efficiency=efficiency,
        )
        / 3600
    )
    p2 = next(r for r in data if r["step"] == "features_phase2")
    per_sample = (p2["regenerate_hours"] + p2["capture_hours"]) / max(1, p2["samples"])
    saved = (n2 - ns[-1]) * per_sample
    return {
        "stop_round": EMBEDDED_STOP_ROUND,
        "factor": factor,
        "rounds_n": ns,
        "n_samples": ns[-1],
        "instead_of": n2,
        "seeds": seeds,
        "rounds_steps": steps,
        "data_hours_saved": saved,
        "rounds_train_hours": train_h,
        "gpus_held": held,
        "gpus_training": on,
        "net_hours_saved": saved - train_h,
        "cap_first": ns[-1] >= n2,
        "profile_mode": d.get("budget", "fixed"),
    }


def _estimate_inputs(
    cfg: dict,
    b: dict,
    tokens_per_sample: int | None,
    gpus: int | None,
    efficiency: float,
    answer_tokens: int | None,
    spool_gb: float | None,
    peak_tflops: float,
) -> tuple:
    """The options checked: -> (tokens per sample, answer tokens, spool GB, where the spool came from, storage)."""
    tps = tokens_per_sample if tokens_per_sample is not None else b["seq"]
    _positive("--tokens-per-sample", tps)
    _positive("--peak-tflops", peak_tflops)
    _positive("--efficiency", efficiency, at_most=1)
    if gpus is not None:
        _positive("--gpus", gpus)
    f = cfg["features"]
    answer = answer_tokens if answer_tokens is not None else min(int(f["max_new_tokens"]), tps)
    _positive("--answer-tokens", answer)
    if answer > tps:
        raise DraftportError("--answer-tokens", f"{answer} exceeds the {tps} tokens per sample")
    # features.storage / features.spool_gb: read when the profile has them (params may not yet)
    spool_from = "--spool-gb" if spool_gb is not None else "features.spool_gb" if "spool_gb" in f else "default"
    spool = spool_gb if spool_gb is not None else f.get("spool_gb", SPOOL_GB)
    _positive("--spool-gb" if spool_gb is not None else "features.spool_gb", spool)
    storage = f.get("storage", "disk")
    if storage not in MODES:
        raise DraftportError("features.storage", f"{storage!r}: expected one of {', '.join(MODES)}")
    return tps, answer, spool, spool_from, storage


def _train_rate(b: dict, tr: dict) -> tuple[bool, bool, float]:
    """A training's lm_head (trainable?), rows (packed?) and the benchmark's one-GPU rate for that pair."""
    trainable = tr.get("train_lm_head", True)
    packed = bool(tr.get("packing", False))
    rate = b[("" if packed else "padded_") + ("lm_head_trainable" if trainable else "lm_head_frozen")]
    return trainable, packed, rate


def _training_rows(cfg: dict, b: dict, tps: int, gpus: int | None, efficiency: float) -> list[dict]:
    """One row per training rule (the curves' last, when on): its tokens, the rate used and its hours."""
    rows = []
    for rule, group in PHASES:
        tr = cfg[group]["train"]
        n_gpu = _gpus(cfg, f"train_{rule}", gpus)  # the training step's resources (draftport.plan.registry)
        trainable, packed, rate = _train_rate(b, tr)
        steps, batch = int(tr["steps"]), step_samples(tr, tps, n_gpu)
        sec = train_seconds(
            steps=steps, batch_size=batch, tokens_per_sample=tps, tok_s_per_gpu=rate, gpus=n_gpu, efficiency=efficiency
        )
        n = cfg[group]["n_samples"]
        rows.append(
            {
                "rule": rule,
                "phase": group,
                "steps": steps,
                "batch_size": batch if isinstance(batch, int) else round(batch, 1),
                "samples": n,
                "epochs": round(steps * batch / n, 2),
                "tokens": int(steps * batch * tps),
                "lm_head": "trainable" if trainable else "frozen",
                "rows": "packed" if packed else "padded",
                "tok_s_per_gpu": round(rate),
                "gpus": n_gpu,
                "seconds": sec,
                "hours": sec / 3600,
            }
        )
    curves = _curves_row(cfg, b, tps, gpus, efficiency)
    if curves is not None:
        rows.append(curves)
    return rows


def _curves_row(cfg: dict, b: dict, tps: int, gpus: int | None, efficiency: float) -> dict | None:
    """The learning curves' row (None when they are off): every point a training under the budget rule."""
    c = cfg.get("curves") or {}
    if not c.get("enabled"):
        return None
    tr = c["train"]
    n_gpu = _gpus(cfg, "train_curves", gpus)
    trainable, packed, rate = _train_rate(b, tr)
    pts = points(c)
    steps = sum(budget_steps(pt["n_samples"], c) for pt in pts)
    batch = int(tr["batch_size"])
    sec = train_seconds(
        steps=steps, batch_size=batch, tokens_per_sample=tps, tok_s_per_gpu=rate, gpus=n_gpu, efficiency=efficiency
    )
    return {
        "rule": "curves",
        "phase": "curves",
        "steps": steps,
        "batch_size": batch,
        "samples": sum(pt["n_samples"] for pt in pts),
        "points": len(pts),
        "epochs": float(c["epochs"]),
        "tokens": steps * batch * tps,
        "lm_head": "trainable" if trainable else "frozen",
        "rows": "packed" if packed else "padded",
        "tok_s_per_gpu": round(rate),
        "gpus": n_gpu,
        "seconds": sec,
        "hours": sec / 3600,
    }


def _target_side(
    cfg: dict,
    target_config_path,
    tps: int,
    answer: int,
    gpus: int | None,
    serve_tok_s: float | None,
    capture_bench_path,
    capture_eff: float | None,
) -> tuple:
    """The target's shape, the answers' serving rate and the capture's inputs:
    -> (shape_from, shape, serve, n_aux, flops per token, capture efficiency)."""
    tc, shape_from = target_config(cfg, target_config_path)
    shape = target_shape(tc, shape_from)
    # the answers decode after their prompt: a step's mean context is the prompt + half the answer
    serve = serving(
        cfg, tc, gpus=_gpus(cfg, "features_new", gpus), context=tps - answer / 2, given=serve_tok_s, where=shape_from
    )
    n_aux = len(cfg["features"]["aux_layer_ids"])
    flops = capture_flops_per_token(shape, tps)
    eff = capture_efficiency(capture_bench_path, capture_eff)
    return shape_from, shape, serve, n_aux, flops, eff


def _data_rows(
    cfg: dict, n1: int, n2: int, tps: int, answer: int, serve_tok_s: float, gpus: int | None, capture_s
) -> tuple[list[dict], int, int]:
    """The feature steps (Phase 1's training data, the held-out sets, Phase 2's new samples, the
    dataset's answers): their regeneration and capture hours. -> (rows, eval samples, monitor samples)."""
    c, t = cfg.get("curves") or {}, cfg["targets"]
    # the held-out prompts each target answers: every set's n (one set of features.eval_samples by default)
    per_target = sum(int(s["n"]) for s in resolved_eval_sets(cfg))
    n_eval = per_target * (2 if t.get("old") and t.get("prompts_eval_old") else 1)
    n_mon = (
        int(cfg["monitor"]["n_samples"])
        if any(cfg[g]["train"].get("eval_every", 0) > 0 for g in ("phase1", "phase2"))
        else 0
    )
    data_steps = [
        ("features_new", "phase1", n1),
        ("features_eval+monitor", "phase1", n_eval + n_mon),
        ("features_phase2", "phase2", n2 - n1),
    ]
    # the regenerate-or-not arm's data: the dataset's own answers, a prefill each (nothing regenerated)
    dataset_n = max(c["arms_n_samples"]) if c.get("enabled") and c.get("answers") and c.get("arms_n_samples") else 0
    if dataset_n:
        data_steps.append(("features_dataset", "curves", dataset_n))
    data = []
    for step, phase, n in data_steps:
        n_gpu = _gpus(cfg, "features_eval" if step.startswith("features_eval") else step, gpus)
        cap = capture_s(n * tps, n_gpu, "capture_write")
        regen = 0 if step == "features_dataset" else n * answer
        data.append(
            {
                "step": step,
                "phase": phase,
                "samples": n,
                "answer_tokens": regen,
                "regenerate_hours": regen / serve_tok_s / 3600,
                "capture_tokens": n * tps,
                "gpus": n_gpu,
                "capture_hours": cap / 3600,
            }
        )
    return data, n_eval, n_mon


def _mode_rows(
    cfg: dict,
    rows: list[dict],
    data: list[dict],
    tps: int,
    hidden: int,
    n_aux: int,
    dtypes: list[str],
    spool: float,
    storage: str,
    capture_s,
    online_gpus: int,
) -> list[dict]:
    """Per phase and storage mode: hours = regenerate + capture (+ online's recompute) + train, and the
    disk at the phase's end (Phase 2 trains on Phase 1's samples too: both folders stay)."""
    f = cfg["features"]
    n1, n2 = int(cfg["phase1"]["n_samples"]), int(cfg["phase2"]["n_samples"])
    held = data[1]["samples"]
    phases = []
    for phase, samples_on_disk in (("phase1", n1 + held), ("phase2", n2 + held)):
        dr = [r for r in data if r["phase"] == phase]
        tr = [r for r in rows if r["phase"] == phase]
        regen = sum(r["regenerate_hours"] for r in dr)
        cap = sum(r["capture_hours"] for r in dr)
        train_h = sum(r["hours"] for r in tr)
        for d in dtypes:
            need = storage_need("disk", tokens=samples_on_disk * tps, hidden_size=hidden, dtype=d, n_aux=n_aux)
            phases.append(
                {
                    "phase": phase,
                    "mode": "disk",
                    "dtype": d,
                    "regenerate_hours": regen,
                    "capture_hours": cap,
                    "train_hours": train_h,
                    "total_hours": regen + cap + train_h,
                    "disk_bytes": need["need_bytes"],
                    "profile": storage == "disk" and d == f["dtype"],
                }
            )
        # online: the held-out sets are captured once and stored (every evaluation reads them); the
        # training samples are recomputed for every pass of every training (= its training tokens)
        held_cap = sum(r["capture_hours"] for r in dr if r["step"].startswith("features_eval"))
        recompute_tokens = sum(r["tokens"] for r in tr)
        recompute = capture_s(recompute_tokens, online_gpus, "capture") / 3600
        train_samples = n1 if phase == "phase1" else n2
        need = storage_need(
            "online", tokens=train_samples * tps, hidden_size=hidden, dtype=f["dtype"], n_aux=n_aux, spool_gb=spool
        )
        held_bytes = storage_need("disk", tokens=held * tps, hidden_size=hidden, dtype=f["dtype"], n_aux=n_aux)
        phases.append(
            {
                "phase": phase,
                "mode": "online",
                "dtype": f["dtype"],
                "regenerate_hours": regen,
                "capture_hours": held_cap + recompute,
                "recompute_tokens": recompute_tokens,
                "train_hours": train_h,
                "total_hours": regen + held_cap + recompute + train_h,
                "spool_bytes": need["spool_bytes"],
                "ids_bytes": need["ids_bytes"],
                "held_out_bytes": held_bytes["need_bytes"],
                "disk_bytes": need["need_bytes"] + held_bytes["need_bytes"],
                "profile": storage in ("online", "hybrid"),
            }
        )
    return phases


def _bench_summary(b: dict, bench) -> dict:
    """The training benchmark the rates came from, as the report names it."""
    return {
        **{k: b[k] for k in ("device", "date", "seq", "ttt_steps", "rate")},
        "shape_source": b.get("shape_source", "given file"),
        "drafter": b.get("drafter"),
        "files": b.get("files", [str(bench)]),
    }


def _hour_totals(rows: list[dict], data: list[dict]) -> dict:
    """The report's per-phase training hours, the curves' data hours and the regeneration R7 may save."""
    return {
        "phase1_hours": sum(r["hours"] for r in rows if r["rule"] in ("phase1_scratch", "phase1")),
        "phase2_hours": sum(r["hours"] for r in rows if r["rule"] == "phase2"),
        "curves_hours": sum(r["hours"] for r in rows if r["rule"] == "curves"),
        "curves_data_hours": sum(r["capture_hours"] for r in data if r["phase"] == "curves"),
        # what R7 saves when it says the dataset's answers do: Phase 1's and Phase 2's regeneration
        "regenerate_hours": {
            ph: sum(r["regenerate_hours"] for r in data if r["phase"] == ph and r["step"] != "features_eval+monitor")
            for ph in ("phase1", "phase2")
        },
    }


def estimate(
    cfg: dict,
    *,
    tokens_per_sample: int | None = None,
    gpus: int | None = None,
    efficiency: float = 0.9,
    bench=DEFAULT_BENCH,
    capture_bench_path=None,
    capture_eff: float | None = None,
    serve_tok_s: float | None = None,
    answer_tokens: int | None = None,
    target_config_path=None,
    spool_gb: float | None = None,
    peak_tflops: float = PEAK_TFLOPS,
) -> dict:
    """Per training rule: tokens, throughput used, hours. Per feature step: the answers'
    regeneration and the capture. Per phase and storage mode: hours (data + training) and disk."""
    b = bench_throughput(bench, cfg)
    tps, answer, spool, spool_from, storage = _estimate_inputs(
        cfg, b, tokens_per_sample, gpus, efficiency, answer_tokens, spool_gb, peak_tflops
    )
    f = cfg["features"]
    rows = _training_rows(cfg, b, tps, gpus, efficiency)
    shape_from, shape, serve, n_aux, flops, eff = _target_side(
        cfg, target_config_path, tps, answer, gpus, serve_tok_s, capture_bench_path, capture_eff
    )
    hidden = shape["hidden_size"]
    peak = peak_tflops * 1e12

    def capture_s(tokens: int, n_gpu: int, kind: str) -> float:
        return tokens * flops["total"] / (peak * n_gpu * eff[kind])

    n1, n2 = int(cfg["phase1"]["n_samples"]), int(cfg["phase2"]["n_samples"])
    data, n_eval, n_mon = _data_rows(cfg, n1, n2, tps, answer, serve["tok_s"], gpus, capture_s)
    adaptive = _adaptive(cfg, data, b, tps, gpus, efficiency)
    per_tok = {d: bytes_per_token(hidden, d, n_aux) for d in dict.fromkeys(["bfloat16", "fp8_e4m3", f["dtype"]])}
    online_gpus = _gpus(cfg, "features_new", gpus)
    phases = _mode_rows(cfg, rows, data, tps, hidden, n_aux, list(per_tok), spool, storage, capture_s, online_gpus)
    return {
        "bench": _bench_summary(b, bench),
        "tokens_per_sample": tps,
        "efficiency": efficiency,
        "rows": rows,
        **_hour_totals(rows, data),
        "adaptive": adaptive,
        "bytes_per_token": per_tok[f["dtype"]][0],
        "hidden_size": hidden,
        "target": {"id": cfg["targets"]["new"], "config": shape_from, **shape},
        "flops_per_token": flops,
        "peak_tflops": peak_tflops,
        "capture_efficiency": eff,
        "capture_tok_s": {k: peak * online_gpus * eff[k] / flops["total"] for k in ("capture_write", "capture")},
        "serve_tok_s": serve["tok_s"],
        "serve_source": serve["source"],
        "serve": serve,
        "answer_tokens": answer,
        "samples": {"phase1": n1, "phase2": n2},
        "held_out": {"eval": n_eval, "monitor": n_mon},
        "storage_mode": storage,
        "spool_gb": spool,
        "spool_from": spool_from,
        "n_aux": n_aux,
        "per_token_bytes": {d: {"bytes": v[0], "how": v[1]} for d, v in per_tok.items()},
        "data": data,
        "phases": phases,
    }


def render(rep: dict) -> str:
    """The tables `draftport estimate` prints (render.estimate_renderables), as plain text."""
    buf = io.StringIO()
    Console(file=buf, width=150, color_system=None, highlight=False).print(Group(*estimate_renderables(rep)))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
