"""Hidden states through vLLM (`extract_hidden_states`), for targets that do not fit one device.

runners/features_vllm.py runs in the vLLM venv (as evaluation.online runs runners/online_vllm.py):
vLLM shards the target over `tensor_parallel_size` GPUs, prefills every sequence once and writes
the residual stream entering each requested layer. Here those files become the same shards
data.write_features writes for the transformers path, so nothing downstream knows which engine
produced them.

Layer ids. vLLM reads id k as the state entering layer k (draftport's "vllm" convention);
SGLang-trained drafters (convention "sglang") read the state leaving layer k, so they ask vLLM
for k + 1. The final state is asked as id L (leaving the last layer, before the final norm)
and normed here with the target's own final-norm weight (RMSNorm, rms_norm_eps of the config),
which is what the target's lm_head sees.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftport.data.capture import check_aux_ids
from draftport.data.shards import Sequence, write_features
from draftport.engines.vllm.venv import run_runner, vllm_python
from draftport.errors import DraftportError
from draftport.model.config import target_text_config
from draftport.model.target import read_text_tensor


def vllm_layer_ids(aux_ids, convention: str, num_layers: int) -> list[int]:
    """The ids to ask vLLM for: the aux states in vLLM's reading, then L for the final state."""
    check_aux_ids(aux_ids, num_layers, convention, "features.aux_layer_ids")
    shift = 1 if convention == "sglang" else 0
    return [int(i) + shift for i in aux_ids] + [num_layers]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def run_extraction(
    target_dir,
    sequences: list[list[int]],
    out_dir,
    layer_ids: list[int],
    *,
    tensor_parallel_size: int = 1,
    dtype: str = "float32",
    max_model_len: int | None = None,
    max_num_seqs: int = 8,
    vllm_python_path=None,
    timeout: float | None = None,
    log_path=None,
) -> dict:
    """Run runners/features_vllm.py; returns its result.json (one file per sequence, in order)."""
    py = vllm_python(vllm_python_path)  # before anything is written
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sequences.json").write_text(json.dumps({"token_ids": sequences}))
    args = [
        "--target",
        target_dir,
        "--sequences",
        out_dir / "sequences.json",
        "--layer-ids",
        ",".join(map(str, layer_ids)),
        "--out-dir",
        out_dir,
        "--tensor-parallel-size",
        tensor_parallel_size,
        "--dtype",
        dtype,
        "--max-num-seqs",
        max_num_seqs,
    ]
    if max_model_len:
        args += ["--max-model-len", max_model_len]
    res_path = out_dir / "result.json"
    wall = run_runner(
        "features_vllm.py",
        args,
        log_path or out_dir / "vllm.log",
        res_path,
        where=target_dir,
        what="vLLM hidden-state extraction",
        vllm_python_path=py,
        timeout=timeout,
    )
    res = json.loads(res_path.read_text())
    if len(res["files"]) != len(sequences):
        raise DraftportError(res_path, f"{len(res['files'])} files for {len(sequences)} sequences")
    res["wall_seconds"] = wall
    return res


def capture_features_vllm(
    target_dir,
    seqs: list[Sequence],
    out_dir,
    *,
    aux_ids,
    convention: str,
    meta: dict,
    tensor_parallel_size: int = 1,
    dtype: str = "bfloat16",
    engine_dtype: str | None = None,
    batch_size: int = 16,
    shard_samples: int = 256,
    vllm_python_path=None,
    work_dir=None,
    progress=None,
) -> dict:
    """Feature shards (data.write_features' format) of `seqs`, captured by vLLM."""
    tcfg = target_text_config(target_dir)
    L = int(tcfg["num_hidden_layers"])
    ids = vllm_layer_ids(aux_ids, convention, L)
    # vLLM keeps one copy of a repeated id (an aux id L is also the final state): ask each once,
    # in increasing order, and pick every slot by position
    asked = sorted(set(ids))
    slots = [asked.index(i) for i in ids]
    norm_w = read_text_tensor(target_dir, "model.norm.weight")
    head = read_text_tensor(target_dir, "lm_head.weight", tied_to="model.embed_tokens.weight").float()
    eps = float(tcfg.get("rms_norm_eps", 1e-6))
    engine_dtype = engine_dtype or ("float32" if dtype == "float32" else "bfloat16")
    work = Path(tempfile.mkdtemp(prefix=".vllm-features.", dir=work_dir or Path(out_dir).parent))
    try:
        res = run_extraction(
            target_dir,
            [s.tokens for s in seqs],
            work,
            asked,
            tensor_parallel_size=tensor_parallel_size,
            dtype=engine_dtype,
            max_model_len=int(tcfg.get("max_position_embeddings", 0)) or None,
            vllm_python_path=vllm_python_path,
        )
        files = iter(res["files"])

        def featurize(batch: list[Sequence]):
            T = max(len(s.tokens) for s in batch)
            H = int(tcfg["hidden_size"])
            aux = torch.zeros(len(batch), T, len(aux_ids) * H)
            final = torch.zeros(len(batch), T, H)
            for i, s in enumerate(batch):
                f = next(files)
                hs = load_file(f["path"])["hidden_states"]  # [T, n_ids, H]
                if hs.shape[0] != len(s.tokens):
                    raise DraftportError(f["path"], f"{hs.shape[0]} states for a {len(s.tokens)}-token sequence")
                aux[i, : len(s.tokens)] = hs[:, slots[:-1]].reshape(len(s.tokens), -1).float()
                final[i, : len(s.tokens)] = rms_norm(hs[:, slots[-1]], norm_w, eps)
                os.unlink(f["path"])  # the raw copy goes as its shard is built (disk)
            t_arg = (final @ head.t()).argmax(-1)
            return aux, final, t_arg

        meta = {
            **meta,
            "engine": "vllm",
            "vllm_layer_ids": asked,
            "vllm_version": res.get("vllm_version"),
            "tensor_parallel_size": tensor_parallel_size,
        }
        return write_features(
            out_dir,
            seqs,
            featurize,
            meta=meta,
            batch_size=batch_size,
            dtype=dtype,
            shard_samples=shard_samples,
            progress=progress,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
