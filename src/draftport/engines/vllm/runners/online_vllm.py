"""Serve a target with an EAGLE-3 drafter through vLLM and report vLLM's own acceptance counters.

Runs INSIDE the vLLM venv (.venv-vllm), never in the project's: it imports only vllm and the
standard library. draftport.evaluation.online.measure() calls it as a subprocess:

    .venv-vllm/bin/python src/draftport/engines/vllm/runners/online_vllm.py --target T --drafter D \
        --prompts prompts.json --k 3 --max-tokens 128 --out result.json

prompts.json: {"prompt_token_ids": [[...], ...]} already rendered through the target's chat
template by draftport (so vLLM and the offline evaluator see exactly the same tokens).
result.json: vLLM's spec-decode counters (the Prometheus metrics `vllm:spec_decode_*`, the
difference over the generate call), the greedy outputs (token ids, finish reason) and, per
request, the accepted-draft count of every verify step (per_request_spec_decode_metrics
"detailed"), which lets a disagreement be traced to one prompt and one cycle.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm, k: int) -> dict:
    """Sum vLLM's spec-decode counters over engines; per-position counts by label."""
    out = {v: 0 for v in COUNTERS.values()}
    per_pos = [0] * k
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] += int(getattr(m, "value", 0))
        elif m.name == PER_POS:
            # A Vector metric in recent vLLM (one value per position); labelled counters in older.
            values = getattr(m, "values", None)
            if values is not None:
                for i, v in enumerate(values[:k]):
                    per_pos[i] += int(v)
            else:
                pos = int((getattr(m, "labels", None) or {}).get("position", 0))
                if pos < k:
                    per_pos[pos] += int(getattr(m, "value", 0))
    out["accepted_per_pos"] = per_pos
    return out


def _parse_args() -> argparse.Namespace:
    """The command line (the module docstring shows a call)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--k", type=int, required=True, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="default: 0.85 on a GPU, 0.2 of the memory on the CPU engine",
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def _engine_args(args: argparse.Namespace) -> dict:
    """The LLM's settings for the target and its EAGLE-3 drafter, eager and with spec-decode stats."""
    return dict(
        model=args.target,
        tokenizer=args.target,
        speculative_config={"method": "eagle3", "model": args.drafter, "num_speculative_tokens": args.k},
        dtype=args.dtype,
        enforce_eager=True,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        disable_log_stats=False,
        per_request_spec_decode_metrics="detailed",
        enable_prefix_caching=False,
    )


def _counter_delta(before: dict, after: dict) -> dict:
    """The counters' growth over the generate call."""
    counters = {k: after[k] - before[k] for k in COUNTERS.values()}
    counters["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"])]
    return counters


def _requests(outs) -> list[dict]:
    """Per request: the greedy output and the accepted / drafted count of every verify step."""
    requests = []
    for o in outs:
        c = o.outputs[0]
        sd = c.spec_decode_metrics
        requests.append(
            {
                "output_token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "per_step_accepted": list(sd.per_step_accepted) if sd is not None else None,
                "per_step_drafted": list(sd.per_step_drafted) if sd is not None else None,
            }
        )
    return requests


def _record(args, prompts, counters, outs, t_load, t_gen, *, vllm_version, torch_version, device) -> None:
    """Write result.json (through a temporary file: no half-written result) and print the summary."""
    requests = _requests(outs)
    result = {
        **counters,
        "k": args.k,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "output_tokens": sum(len(r["output_token_ids"]) for r in requests),
        "load_seconds": t_load,
        "generate_seconds": t_gen,
        "vllm_version": vllm_version,
        "torch_version": torch_version,
        "device": device,
        "requests": requests,
    }
    with open(args.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(args.out + ".tmp", args.out)
    print(
        f"vllm: {len(prompts)} prompts, {counters['num_drafts']} drafts, "
        f"{counters['num_accepted_tokens']} accepted, load {t_load:.1f}s, generate {t_gen:.1f}s",
        flush=True,
    )


def main() -> int:
    args = _parse_args()

    # CPU engine: a small KV cache (GiB) unless the caller set one.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.time()
    # lazy: runs in the vLLM venv; loads after the VLLM_* defaults, inside load_seconds
    import torch

    kw = {}
    if not torch.cuda.is_available() and args.tensor_parallel_size == 1:
        # the CPU engine in this one process: a separate engine core and worker would each import vLLM again
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kw["distributed_executor_backend"] = "uni"
    # lazy: after VLLM_ENABLE_V1_MULTIPROCESSING is decided (vLLM reads it when it loads)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(args.prompts).read())["prompt_token_ids"]
    if args.gpu_memory_utilization is None:
        args.gpu_memory_utilization = 0.85 if torch.cuda.is_available() else 0.2
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    llm = LLM(**_engine_args(args), **kw)
    t_load = time.time() - t0
    before = read_counters(llm, args.k)
    # Greedy, stop at the target's EOS as the offline regeneration does; no detokenization needed.
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False, seed=args.seed)
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
    t_gen = time.time() - t1
    counters = _counter_delta(before, read_counters(llm, args.k))
    _record(
        args,
        prompts,
        counters,
        outs,
        t_load,
        t_gen,
        vllm_version=vllm.__version__,
        torch_version=torch.__version__,
        device="cuda" if torch.cuda.is_available() else "cpu",
    )
    return 0


if __name__ == "__main__":  # vLLM's CPU engine starts worker processes: the guard is required
    sys.exit(main())
