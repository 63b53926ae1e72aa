"""Accept length measured by a serving engine (vLLM), and the offline figure on the same prompts.

`measure` serves the target with an exported drafter through vLLM's EAGLE-3 speculative
decoding (greedy) and reads tau from vLLM's own counters: tau = 1 + accepted / drafts, with
the per-position accepted counts. vLLM lives in its own venv (`make vllm-venv`, see
draftport.engines.vllm.venv); runners/online_vllm.py runs there as a subprocess, so the main
environment never imports it.

`offline_same_prompts` replays exactly the sequences vLLM produced (same prompt tokens, vLLM's
greedy outputs) through the target in transformers and the offline evaluator. Two engine facts
decide the last cycle of every request (read in vLLM 0.32's scheduler, checked on the counters):
  - a request stops once it has its N output tokens; every verify step before that counts one
    draft of k tokens: cycles run while the verified prefix is shorter than prompt + N;
  - the accepted count of a step is taken before the stop truncates the output, so drafts that
    run past EOS or max_tokens still count when the target (fed the drafts) agrees with them.
The features are therefore captured on each sequence extended by k greedy tokens of the target
(what vLLM's verifier sees past the end), and the walk stops at the served length. The plain
evaluator (which cannot see past the end) is reported next to it: the difference is the size
of that end effect.

`agreement_check` fails when the two tau differ by more than the tolerance: a difference means
a bug (aux-layer convention, masks, RoPE positions, d2t handling), not noise: both run greedy
on identical tokens. `for_vllm` renumbers an SGLang-numbered drafter's aux ids for vLLM and
drops or replaces a drafter's own embed_tokens (params online.embed_tokens);
`run_step` is the pipeline's online step (also `python -m draftport.evaluation.online`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftport.data.capture import capture_features, load_target, regenerate
from draftport.data.shards import Batch, Sequence
from draftport.engines.export import EMBED_CHOICES, validate_export
from draftport.engines.vllm.venv import run_in_vllm_venv, runner, vllm_python
from draftport.errors import DraftportError
from draftport.evaluation.accept import acceptance_rate, accepted_counts, simulated_acc_len, summarize, walk
from draftport.files import load_json
from draftport.model.bind import drafter_for_target, target_head
from draftport.model.config import target_text_config
from draftport.model.formats import (
    atomic_dir,
    atomic_write_text,
    copy_tensors_safetensors,
    find_target_embedding,
    load_drafter_state,
    read_header,
    tensor_sha256,
    to_flat_name,
)


def log(msg: str) -> None:
    print(msg, flush=True)


# ---- prompts ---------------------------------------------------------------------------------
def encode_prompts(target_dir, prompts_path, n_prompts: int | None, *, offset: int = 0) -> list[list[int]]:
    """Held-out chat prompts rendered through the target's chat template (generation prompt on):
    the same token ids go to vLLM and to the offline evaluator."""
    # lazy (registry): the publish step runs this module without data.features
    from draftport.data.features import encode_prompt, load_tokenizer, read_samples

    tok = load_tokenizer(target_dir)
    return [encode_prompt(tok, s["user"]) for s in read_samples(prompts_path, n_prompts, offset)]


def _target_context(target_dir) -> int:
    return int(target_text_config(target_dir).get("max_position_embeddings", 2048))


# ---- vLLM ---------------------------------------------------------------------------------------
def run_vllm(
    target_dir,
    drafter_dir,
    prompt_ids: list[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    vllm_python_path=None,
    work_dir=None,
    max_num_seqs: int = 8,
    dtype: str = "float32",
    script=None,
    timeout: float | None = 3600,
    log_path=None,
    tensor_parallel_size: int = 1,
) -> dict:
    """Run runners/online_vllm.py in the vLLM venv; return its result (counters + outputs)."""
    py = vllm_python(vllm_python_path)
    script = Path(script) if script else runner("online_vllm.py")
    if not script.is_file():
        raise DraftportError(script, "the vLLM runner script is missing")
    ctx = _target_context(target_dir)
    longest = max(len(p) for p in prompt_ids)
    if longest + max_new_tokens + k > ctx:
        raise DraftportError(
            target_dir,
            f"prompt of {longest} tokens + {max_new_tokens} new + {k} drafts exceeds the target's context of {ctx}",
        )
    with tempfile.TemporaryDirectory(prefix="draftport-vllm-", dir=work_dir) as tmp:
        tmp = Path(tmp)
        (tmp / "prompts.json").write_text(json.dumps({"prompt_token_ids": prompt_ids}))
        out = tmp / "result.json"
        cmd = [
            str(py),
            str(script),
            "--target",
            str(target_dir),
            "--drafter",
            str(drafter_dir),
            "--prompts",
            str(tmp / "prompts.json"),
            "--out",
            str(out),
            "--k",
            str(k),
            "--max-tokens",
            str(max_new_tokens),
            "--max-num-seqs",
            str(max_num_seqs),
            "--dtype",
            dtype,
            "--max-model-len",
            str(ctx),
            "--tensor-parallel-size",
            str(tensor_parallel_size),
        ]
        wall = run_in_vllm_venv(
            cmd, log_path or tmp / "vllm.log", out, where=drafter_dir, what="vLLM run", timeout=timeout
        )
        res = json.loads(out.read_text())
    res["wall_seconds"] = wall
    return res


def summarize_online(raw: dict) -> dict:
    """The engine's counters as metrics, named like the offline ones with an `online_` prefix."""
    k, drafts = raw["k"], raw["num_drafts"]
    if drafts <= 0:
        raise DraftportError("vllm", "vLLM counted no drafts: speculative decoding did not run")
    out = {
        "online_accept_length": 1.0 + raw["num_accepted_tokens"] / drafts,
        "online_num_drafts": drafts,
        "online_num_draft_tokens": raw["num_draft_tokens"],
        "online_num_accepted_tokens": raw["num_accepted_tokens"],
        "online_k": k,
        "online_num_prompts": raw["num_prompts"],
        "online_output_tokens": raw["output_tokens"],
        "online_seconds": raw.get("wall_seconds", raw["load_seconds"] + raw["generate_seconds"]),
        "online_load_seconds": raw["load_seconds"],
        "online_generate_seconds": raw["generate_seconds"],
        "vllm_version": raw.get("vllm_version"),
        "vllm_device": raw.get("device"),
    }
    prev = 1.0
    for i, a in enumerate(raw["accepted_per_pos"]):
        rate = a / drafts
        out[f"online_accept_rate_pos_{i}"] = rate
        out[f"online_cond_acc_{i}"] = rate / prev if prev > 0 else 0.0
        prev = rate
    # SpecForge's and vLLM's log's definitions on vLLM's own counters (draftport.evaluation.accept)

    out["online_simulated_acc_len"] = simulated_acc_len(
        out[f"online_cond_acc_{i}"] for i in range(len(raw["accepted_per_pos"]))
    )
    out["online_acceptance_rate"] = acceptance_rate(raw["num_accepted_tokens"], raw["num_draft_tokens"])
    return out


def measure(
    target_dir,
    drafter_dir,
    prompts_path,
    n_prompts: int,
    k: int,
    max_new_tokens: int,
    vllm_python_path=None,
    *,
    offset: int = 0,
    max_num_seqs: int = 8,
    dtype: str = "float32",
    validate: bool = True,
    raw_out=None,
    log_path=None,
    return_raw: bool = False,
    tensor_parallel_size: int = 1,
):
    """Online accept length of an exported drafter served by vLLM next to target_dir.

    Validates the export first (see draftport.engines.export). Returns the `online_*` metrics (with
    `online_seconds`, the whole vLLM run); vLLM's raw result (prompt and output tokens,
    per-request cycles) is written to raw_out when given (for `offline_same_prompts`), and
    returned as a second value with return_raw.
    """
    if validate:
        validate_export(drafter_dir, target_dir)
    prompts = encode_prompts(target_dir, prompts_path, n_prompts, offset=offset)
    ctx = _target_context(target_dir)
    too_long = [i for i, ids in enumerate(prompts) if len(ids) + max_new_tokens + k > ctx]
    if too_long:  # named by its line, before vLLM is even looked for
        i = too_long[0]
        raise DraftportError(
            f"{prompts_path}:{offset + i + 1}",
            f"prompt of {len(prompts[i])} tokens + {max_new_tokens} "
            f"new + {k} drafts exceeds the target's context of {ctx}",
        )
    raw = run_vllm(
        target_dir,
        drafter_dir,
        prompts,
        k=k,
        max_new_tokens=max_new_tokens,
        vllm_python_path=vllm_python_path,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        log_path=log_path,
        tensor_parallel_size=tensor_parallel_size,
    )
    raw["prompt_token_ids"] = prompts
    if raw_out is not None:
        atomic_write_text(raw_out, json.dumps(raw) + "\n")
    res = summarize_online(raw)
    return (res, raw) if return_raw else res


# ---- the offline evaluator on the same sequences --------------------------------------------
def _extend_greedy(model, seqs: list[list[int]], n: int, pad: int, batch_size: int = 16) -> list[list[int]]:
    """Each sequence + n greedy tokens of the target, EOS or not (vLLM's verifier keeps scoring
    drafts past the end of a request). Batched, left padded; n is small (k - 2), so n full
    forwards per batch cost little and avoid the cache API, which moves between transformers
    versions."""
    dev = next(model.parameters()).device
    out: list[list[int]] = [list(x) for x in seqs]
    for s0 in range(0, len(out), batch_size):
        chunk = out[s0 : s0 + batch_size]
        for _ in range(n):
            L = max(len(x) for x in chunk)
            ids = torch.full((len(chunk), L), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for i, x in enumerate(chunk):
                ids[i, L - len(x) :] = torch.tensor(x)
                mask[i, L - len(x) :] = 1
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            with torch.no_grad():
                logits = model(
                    input_ids=ids.to(dev),
                    attention_mask=mask.to(dev),
                    position_ids=pos.to(dev),
                    use_cache=False,
                    logits_to_keep=1,
                ).logits[:, -1]
            for x, t in zip(chunk, logits.argmax(-1).tolist()):
                x.append(int(t))
    return out


def offline_same_prompts(
    drafter_dir,
    target_dir,
    *,
    k: int,
    prompt_ids: list[list[int]] | None = None,
    responses: list[list[int]] | None = None,
    online_raw: dict | str | None = None,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    device: str = "cpu",
    k_max: int | None = None,
) -> dict:
    """Offline accept length on exactly the sequences vLLM served.

    Give `online_raw` (the dict or the raw JSON file `measure` wrote), or prompt_ids and the
    responses vLLM generated; with prompt_ids alone the transformers target regenerates the
    responses greedily (the same tokens as vLLM's unless the two disagree on a near-tie).
    Returns `accept_length` (engine-exact end of each request), per-position rates, the plain
    evaluator's figure on the same sequences (`accept_length_plain`), per-request cycles and
    the wall time. k_max: one replay drafts that deep and `by_k` holds the same figures at every
    k up to it (min(accepted, k) per row, as draftport.evaluation.accept's by_k): what vLLM
    served at another k is compared with it without a second replay.
    """
    # lazy (registry): the publish step runs this module without data.features
    from draftport.data.features import load_tokenizer

    prompt_ids, responses = _served(online_raw, prompt_ids, responses)
    if not prompt_ids:
        raise DraftportError(drafter_dir, "no prompts to evaluate")
    t0 = time.time()
    cfg, drafter, head = _vllm_drafter(drafter_dir, target_dir, device)
    model = load_target(target_dir, device=device)
    tok = load_tokenizer(target_dir)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    if responses is None:
        responses = regenerate(
            model, prompt_ids, max_new_tokens=max_new_tokens, eos_id=eos, pad_id=pad, batch_size=batch_size
        )
    seqs = [Sequence(list(p) + list(r), len(p)) for p, r in zip(prompt_ids, responses)]
    t_load = time.time() - t0
    t1 = time.time()
    depth = max(k, k_max or k)
    # past the ends as far as the deepest chain's verifier scores; a shallower chain's drafts
    # only reach its own (shorter) extension, whose greedy tokens are the same
    extended = _past_the_ends(model, seqs, depth, pad, batch_size)
    t_ext = time.time() - t1
    ks = sorted({k, *range(1, (k_max or 0) + 1)})
    runs = _replay(model, drafter, head, cfg.aux_layer_ids, seqs, extended, depth, ks, pad, batch_size, device)
    run = runs[k]
    res = summarize(run["exact"], run["rows"], k)
    plain = summarize(run["plain"], run["rows"], k)
    res["accept_length_plain"] = plain["accept_length"]
    res["num_cycles_plain"] = plain["num_cycles"]
    res["num_prompts"] = len(seqs)
    res["output_tokens"] = sum(len(s.tokens) - s.response_start for s in seqs)
    res["offline_seconds"] = time.time() - t0
    res["offline_load_seconds"] = t_load  # imports, target + drafter (+ regeneration)
    res["offline_extend_seconds"] = t_ext  # k greedy tokens past each end
    res["offline_feature_seconds"] = run["feature_seconds"]  # the target's aux/final states
    res["offline_eval_seconds"] = run["eval_seconds"]  # the drafter: the offline evaluator proper
    res["per_request_cycles"] = run["per_request"]
    if k_max:
        res["by_k"] = [
            {**summarize(runs[kk]["exact"], runs[kk]["rows"], kk), "per_request_cycles": runs[kk]["per_request"]}
            for kk in range(1, k_max + 1)
        ]
    return res


def _served(online_raw: dict | str | None, prompt_ids, responses) -> tuple:
    """(prompt ids, responses): those of vLLM's raw result (the dict or measure's JSON file) when
    given, else as given."""
    if online_raw is None:
        return prompt_ids, responses
    if not isinstance(online_raw, dict):
        online_raw = json.loads(Path(online_raw).read_text())
    return online_raw["prompt_token_ids"], [r["output_token_ids"] for r in online_raw["requests"]]


def _vllm_drafter(drafter_dir, target_dir, device: str) -> tuple:
    """(config, drafter bound to the target, the target's head) on device; a drafter trained under
    another aux convention than vLLM's is refused."""
    cfg, state = load_drafter_state(drafter_dir)
    if cfg.aux_convention and cfg.aux_convention != "vllm":
        raise DraftportError(
            drafter_dir, f"drafter trained under the {cfg.aux_convention} aux convention; vLLM reads vllm's"
        )
    drafter = drafter_for_target(cfg, target_dir, state).to(device).eval()
    head = target_head(target_dir).to(device)
    return cfg, drafter, head


def _past_the_ends(model, seqs: list[Sequence], k: int, pad: int, batch_size: int) -> list[list[int]]:
    """Each sequence's tokens extended past its end as far as vLLM's verifier scores drafts."""
    # The last verify step of a request starts at most 3 tokens before its end and checks k
    # drafts: the target's choices up to position L-3+k are needed, so the sequence grows by
    # k-2 greedy tokens plus one placeholder (which only makes position L-3+k "inside" for
    # accepted_counts; nothing reads its value).
    extended = _extend_greedy(model, [s.tokens for s in seqs], max(k - 2, 0), pad, batch_size)
    if k >= 2:
        extended = [x + [pad] for x in extended]
    return extended


def _replay(
    model, drafter, head, aux_layer_ids, seqs, extended, k: int, ks: list[int], pad: int, batch_size: int, device
) -> dict:
    """The drafter over the target's features of the extended sequences, batch by batch, drafting
    k deep: for each chain length in ks, each request's engine-exact cycles, the plain
    evaluator's, the rows, and the time of each part."""
    t_feat = t_eval = 0.0
    out = {kk: {"exact": [], "plain": [], "rows": [], "per_request": []} for kk in ks}
    for b0 in range(0, len(seqs), batch_size):
        chunk, ext = seqs[b0 : b0 + batch_size], extended[b0 : b0 + batch_size]
        ids, mask = _right_padded(ext, pad)
        t1 = time.time()
        aux, final = capture_features(model, ids.to(device), mask.to(device), aux_layer_ids, "vllm")
        t_feat += time.time() - t1
        valid = mask.bool().to(device)
        ext_batch = Batch(aux.float(), final.float(), ids.to(device), valid, valid)
        t1 = time.time()
        acc_e, chk_e = accepted_counts(drafter, ext_batch, head, k)
        t_eval += time.time() - t1
        for i, s in enumerate(chunk):
            a, c = acc_e[i].tolist(), chk_e[i].tolist()
            for kk, o in out.items():
                # the chain of kk drafts accepts min(accepted, kk): its drafts are the deep pass's first kk
                ak, ck = ([min(x, kk) for x in a], [min(x, kk) for x in c]) if kk < k else (a, c)
                cyc, plain_cyc, rows = _request_cycles(ak, ck, s, kk)
                o["exact"].extend(cyc)
                o["per_request"].append(cyc)
                o["plain"].extend(plain_cyc)
                o["rows"].extend(rows)
    for o in out.values():
        o |= {"feature_seconds": t_feat, "eval_seconds": t_eval}
    return out


def _right_padded(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of token lists right-padded to the longest."""
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    return ids, mask


def _request_cycles(a: list[int], c: list[int], s: Sequence, k: int) -> tuple[list[int], list[int], list[int]]:
    """One served request's cycles as the engine ran them, its cycles under the plain evaluator on
    the served sequence alone, and that evaluator's accepted count of every response row."""
    r, L = s.response_start, len(s.tokens)
    exact = walk(a, c, r - 1, L - 2)  # a verify step while fewer than N outputs are verified
    # The plain evaluator on the served sequence alone: row p is causal, so only its
    # checkable drafts shrink (those whose target position lies inside the sequence).
    cp = [max(0, min(k, L - 2 - p)) for p in range(len(a))]
    ap = [min(x, y) for x, y in zip(a, cp)]
    return exact, walk(ap, cp, r - 1, L - 1), [ap[p] for p in range(r - 1, L - 1) if cp[p] > 0]


# ---- agreement ----------------------------------------------------------------------------------
def agreement_check(online: dict, offline: dict, tol: float = 0.05) -> dict:
    """Raise DraftportError (both numbers in the message) when |tau_online - tau_offline| > tol."""
    on, off = float(online["online_accept_length"]), float(offline["accept_length"])
    diff = on - off
    k = int(online.get("online_k", offline.get("k", 0)))
    pos = {i: (online.get(f"online_accept_rate_pos_{i}"), offline.get(f"accept_rate_pos_{i}")) for i in range(k)}
    detail = ", ".join(
        f"pos {i}: vLLM {a:.3f} / offline {b:.3f}" for i, (a, b) in pos.items() if a is not None and b is not None
    )
    if abs(diff) > tol:
        raise DraftportError(
            "online",
            f"vLLM accept length {on:.4f} and offline {off:.4f} differ by {diff:+.4f} "
            f"(> {tol}): a bug in aux layers, masks, RoPE positions or d2t handling ({detail})",
        )
    return {"online_accept_length": on, "offline_accept_length": off, "difference": diff, "tolerance": tol}


def cycle_mismatches(online_raw: dict, offline: dict, limit: int = 5) -> dict:
    """Requests whose per-step accepted counts differ between vLLM and the offline walk."""
    bad = []
    reqs = online_raw.get("requests", [])
    for i, (r, cyc) in enumerate(zip(reqs, offline.get("per_request_cycles", []))):
        on = r.get("per_step_accepted")
        if on is not None and list(on) != list(cyc):
            first = next((j for j, (x, y) in enumerate(zip(on, cyc)) if x != y), min(len(on), len(cyc)))
            bad.append(
                {
                    "request": i,
                    "first_step": first,
                    "vllm": on[first : first + 6],
                    "offline": cyc[first : first + 6],
                    "vllm_steps": len(on),
                    "offline_steps": len(cyc),
                }
            )
    return {"requests_differing": len(bad), "requests": len(reqs), "examples": bad[:limit]}


def per_set(online_raw: dict, offline: dict, sets: list[dict]) -> dict:
    """Each named eval set's accept length, vLLM's (its requests' per-step accepted counts) next to
    the offline replay's on the same requests; sets: {name, start, count} ranges of the requests."""
    reqs, off = online_raw.get("requests", []), offline.get("per_request_cycles", [])
    out = {}
    for x in sets:
        span = slice(x["start"], x["start"] + x["count"])
        on_steps = [r.get("per_step_accepted") for r in reqs[span]]
        on = _steps_tau(on_steps) if on_steps and all(c is not None for c in on_steps) else None
        offv = _steps_tau(off[span])
        diff = on - offv if on is not None and offv is not None else None
        out[x["name"]] = {"vllm": on, "offline": offv, "difference": diff, "requests": x["count"]}
    return out


def _steps_tau(per_request: list) -> float | None:
    """1 + accepted / cycles over requests' per-cycle accepted counts (None: not one cycle)."""
    n = sum(len(c) for c in per_request)
    return 1.0 + sum(sum(c) for c in per_request) / n if n else None


def side_by_side(online: dict, offline: dict) -> list[dict]:
    """Rows for a report: tau and each position's acceptance rate, vLLM next to offline."""
    k = int(online.get("online_k", offline.get("k", 0)))
    rows = [
        {"metric": "accept length (tau)", "vllm": online["online_accept_length"], "offline": offline["accept_length"]}
    ]
    for i in range(k):
        rows.append(
            {
                "metric": f"accept rate pos {i}",
                "vllm": online[f"online_accept_rate_pos_{i}"],
                "offline": offline[f"accept_rate_pos_{i}"],
            }
        )
    rows.append({"metric": "drafts (cycles)", "vllm": online["online_num_drafts"], "offline": offline["num_cycles"]})
    rows.append({"metric": "seconds", "vllm": online["online_seconds"], "offline": offline["offline_seconds"]})
    return rows


# ---- the pipeline's step ----------------------------------------------------------------------
def for_vllm(
    drafter_dir, out_dir, convention: str | None, embed_tokens: str = "drop", target_dir=None
) -> tuple[Path, str]:
    """The drafter as vLLM must be given it, and what was done.

    Aux ids: vLLM's aux id k is the state entering decoder layer k; SGLang's (the capture
    SpecForge trains with) is the state leaving layer k, the one entering layer k + 1. A drafter
    trained under SGLang's numbering is served by vLLM with every id + 1: the same states, vLLM's
    numbers. `convention`: the drafter's, when its config.json does not record one (draftport
    writes `draftport_aux_convention`; published drafters usually do not).

    embed_tokens (params online.embed_tokens): vLLM 0.32 embeds with the drafter checkpoint's own
    embed_tokens when it has one (unless it is torch.equal to the target's), SGLang always with the
    target's. So a drafter carrying another embedding (the old target's) is never served as is:
      "drop"    the export carries no embed_tokens: vLLM takes the target's, as SGLang does;
      "target"  the export carries the target's (target_dir) embed_tokens, bit for bit (its
                dtype, shape and bytes), copied by byte range.
    Both serve the same embedding; "target" makes the export self-contained.

    Nothing to change: the drafter folder itself is returned. Otherwise out_dir gets a copy:
    config.json rewritten when renumbered, the safetensors file holding embed_tokens rewritten
    (tensors copied bit for bit, torch-free), every other file hard-linked (copied across devices).
    """
    if embed_tokens not in EMBED_CHOICES:
        raise DraftportError("online.embed_tokens", f"must be one of {', '.join(EMBED_CHOICES)}, got {embed_tokens!r}")
    if embed_tokens == "target" and target_dir is None:
        raise DraftportError(drafter_dir, "online.embed_tokens target: the export needs the target folder")
    drafter_dir = Path(drafter_dir)
    cpath = drafter_dir / "config.json"
    raw = load_json(cpath, "no config.json in the drafter folder")
    done: list[str] = []

    conv = raw.get("draftport_aux_convention") or convention
    new_config = _renumbered(raw, conv, cpath, done)

    files = sorted(drafter_dir.glob("*.safetensors"))
    if not files:
        raise DraftportError(drafter_dir, "no *.safetensors weights in the drafter folder")
    tables = {f: read_header(f) for f in files}  # {file: ({stored name: TensorInfo}, metadata)}
    rewrite, index_patch = _embed_plan(tables, files, drafter_dir, embed_tokens, target_dir, done)
    if new_config is None and not rewrite:
        return drafter_dir, f"served as is ({conv or 'unrecorded'} aux-layer numbering; {done[-1]})"
    out_dir = Path(out_dir)
    _write_export(out_dir, drafter_dir, rewrite, tables, new_config, index_patch)
    return out_dir, "; ".join(done)


def _renumbered(raw: dict, conv: str | None, cpath: Path, done: list[str]) -> dict | None:
    """The config with its aux ids in vLLM's numbering (+1) when the drafter used SGLang's; None: as is."""
    if conv != "sglang":
        return None
    holder = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else raw
    ids = holder.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids:
        raise DraftportError(cpath, "no eagle_aux_hidden_state_layer_ids to renumber for vLLM")
    holder["eagle_aux_hidden_state_layer_ids"] = [int(i) + 1 for i in ids]
    raw["draftport_aux_convention"] = "vllm"
    done.append(f"aux ids {ids} (SGLang numbering) served to vLLM as {[int(i) + 1 for i in ids]}")
    return raw


def _embed_plan(
    tables: dict, files: list[Path], drafter_dir: Path, embed_tokens: str, target_dir, done: list[str]
) -> tuple[dict, dict]:
    """(file -> the tensors it will hold, weight-map changes) for online.embed_tokens: embed_tokens
    dropped, or the target's, bit for bit."""
    holders = [(f, n) for f, (t, _) in tables.items() for n in t if to_flat_name(n) == "embed_tokens.weight"]
    rewrite: dict[Path, dict] = {}  # file -> the tensors it will hold
    index_patch: dict[str, str | None] = {}
    if embed_tokens == "drop":
        for f, n in holders:
            rewrite.setdefault(f, dict(tables[f][0])).pop(n)
            index_patch[n] = None
        done.append(
            "embed_tokens dropped (vLLM embeds with the target's, as SGLang does)"
            if holders
            else "no embed_tokens: vLLM and SGLang embed with the target's"
        )
        return rewrite, index_patch
    theirs = find_target_embedding(target_dir)
    keep = False
    if len(holders) == 1 and holders[0][1] == "embed_tokens.weight":
        mine = tables[holders[0][0]][0][holders[0][1]]
        keep = (tuple(mine.shape), mine.dtype) == (tuple(theirs.shape), theirs.dtype) and tensor_sha256(
            mine
        ) == tensor_sha256(theirs)
    if keep:
        done.append("embed_tokens kept: it is the target's, bit for bit")
        return rewrite, index_patch
    for f, n in holders:
        rewrite.setdefault(f, dict(tables[f][0])).pop(n)
        index_patch[n] = None
    home = (
        holders[0][0]
        if holders
        else (drafter_dir / "model.safetensors" if drafter_dir / "model.safetensors" in tables else files[0])
    )
    rewrite.setdefault(home, dict(tables[home][0]))["embed_tokens.weight"] = theirs
    index_patch["embed_tokens.weight"] = home.name
    done.append(
        f"embed_tokens {'replaced by' if holders else 'set to'} the target's "
        f"({theirs.file.parent.name}/{theirs.file.name}: {theirs.name}, {theirs.dtype}), bit for bit"
    )
    return rewrite, index_patch


def _write_export(
    out_dir: Path, drafter_dir: Path, rewrite: dict, tables: dict, new_config: dict | None, index_patch: dict
) -> None:
    """The export folder, atomically: rewritten safetensors files (tensors copied bit for bit), the
    renumbered config, the patched weight map, every other file hard-linked (copied across devices)."""
    index_name = "model.safetensors.index.json"
    with atomic_dir(out_dir) as tmp:
        for f in drafter_dir.iterdir():
            if not f.is_file():
                continue
            if f in rewrite:
                copy_tensors_safetensors(rewrite[f], tmp / f.name, metadata=tables[f][1] or {"format": "pt"})
            elif f.name == "config.json" and new_config is not None:
                (tmp / f.name).write_text(json.dumps(new_config, indent=2) + "\n")
            elif f.name == index_name and index_patch:
                index = load_json(f, "missing")
                wmap = index.setdefault("weight_map", {})
                for n, where in index_patch.items():
                    if where is None:
                        wmap.pop(n, None)
                    else:
                        wmap[n] = where
                (tmp / f.name).write_text(json.dumps(index, indent=2) + "\n")
            else:
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)


def run_step(
    target_dir,
    drafter_dir,
    prompts_path,
    out_dir,
    *,
    n_prompts: int,
    k: int,
    max_new_tokens: int,
    tol: float = 0.05,
    vllm_python_path=None,
    max_num_seqs: int = 8,
    offset: int = 0,
    dtype: str = "float32",
    tensor_parallel_size: int = 1,
    check: bool = True,
    log_path=None,
    embed_tokens: str | None = None,
    sets: list[dict] | None = None,
) -> dict:
    """The pipeline's online step: validate the export, serve it through vLLM, replay the same
    sequences offline, compare. Writes under out_dir: vllm.log, online_raw.json (vLLM's tokens
    and per-request cycles), online.json (both sides, per position, cycle mismatches, times).
    Returns flat metrics for metrics.json / MLflow: online_accept_length,
    online_accept_rate_pos_{i}, offline_same_prompts_accept_length (+ _rate_pos_{i}),
    online_offline_difference, online_seconds, offline_same_prompts_seconds, online_time_ratio.
    Raises DraftportError (after writing the files) when the two tau differ by more than tol.
    embed_tokens: what for_vllm made the export carry (online.embed_tokens: "drop" / "target"),
    checked by validate_export; None accepts either. sets: named eval sets ({name, start, count}
    ranges of the prompts): each one's vLLM and offline figure too, checked against tol alike.
    """
    out_dir = Path(out_dir)
    # out_dir is created by the first file written into it (vLLM's log): bad input leaves nothing
    export = validate_export(drafter_dir, target_dir, embed_tokens=embed_tokens)
    on, raw = measure(
        target_dir,
        drafter_dir,
        prompts_path,
        n_prompts,
        k,
        max_new_tokens,
        vllm_python_path,
        offset=offset,
        max_num_seqs=max_num_seqs,
        dtype=dtype,
        validate=False,
        tensor_parallel_size=tensor_parallel_size,
        raw_out=out_dir / "online_raw.json",
        log_path=log_path or out_dir / "vllm.log",
        return_raw=True,
    )
    off = offline_same_prompts(drafter_dir, target_dir, k=k, online_raw=raw)
    mism = cycle_mismatches(raw, off)
    metrics = _online_metrics(on, off, mism, k, tol)
    by_set = per_set(raw, off, sets) if sets else None
    metrics |= set_metrics(by_set or {})
    report = {
        "metrics": metrics,
        **({"sets": by_set} if by_set else {}),
        "export": export,
        "rows": side_by_side(on, off),
        "cycle_mismatches": mism,
        "offline": {key: v for key, v in off.items() if key != "per_request_cycles"},
        "settings": {
            "n_prompts": n_prompts,
            "k": k,
            "max_new_tokens": max_new_tokens,
            "offset": offset,
            "prompts": str(prompts_path),
            "target": str(target_dir),
            "drafter": str(drafter_dir),
        },
    }
    atomic_write_text(out_dir / "online.json", json.dumps(report, indent=2) + "\n")
    if check:
        agreement_check(on, off, tol)
        set_agreement_check(by_set or {}, tol)
    return metrics


def set_metrics(by_set: dict) -> dict:
    """Each eval set's vLLM and offline figures as flat metrics (<metric>/<set>)."""
    out = {}
    for name, row in by_set.items():
        for side, key in (("vllm", "online_accept_length"), ("offline", "offline_same_prompts_accept_length")):
            if row[side] is not None:
                out[f"{key}/{name}"] = row[side]
    return out


def set_agreement_check(by_set: dict, tol: float) -> None:
    """Raise DraftportError naming the first eval set whose vLLM and offline figures differ by more than tol."""
    for name, row in by_set.items():
        if row["difference"] is not None and abs(row["difference"]) > tol:
            raise DraftportError(
                "online",
                f"eval set {name}: vLLM accept length {row['vllm']:.4f} and offline {row['offline']:.4f} differ "
                f"by {row['difference']:+.4f} (> {tol}) on its {row['requests']} requests",
            )


def _online_metrics(on: dict, off: dict, mism: dict, k: int, tol: float) -> dict:
    """run_step's flat metrics: vLLM's, the offline replay's, their difference and time ratios."""
    metrics = dict(on)
    metrics["offline_same_prompts_accept_length"] = off["accept_length"]
    metrics["offline_same_prompts_accept_length_plain"] = off["accept_length_plain"]
    for i in range(k):
        metrics[f"offline_same_prompts_accept_rate_pos_{i}"] = off[f"accept_rate_pos_{i}"]
    metrics["offline_same_prompts_num_cycles"] = off["num_cycles"]
    metrics["offline_same_prompts_seconds"] = off["offline_seconds"]
    metrics["offline_same_prompts_eval_seconds"] = off["offline_eval_seconds"]
    metrics["online_offline_difference"] = on["online_accept_length"] - off["accept_length"]
    # vLLM's whole run against the replay from scratch (target load, features, drafter), and
    # against the offline evaluator proper (the drafter over captured features)
    metrics["online_time_ratio"] = on["online_seconds"] / max(off["offline_seconds"], 1e-9)
    metrics["online_time_ratio_eval"] = on["online_seconds"] / max(off["offline_eval_seconds"], 1e-9)
    metrics["online_requests_with_differing_cycles"] = mism["requests_differing"]
    metrics["online_tolerance"] = tol
    return metrics


def main(argv=None) -> int:
    """python -m draftport.evaluation.online TARGET DRAFTER PROMPTS OUT_DIR --n 100 --k 3 --max-new-tokens 128"""
    ap = argparse.ArgumentParser(description="vLLM vs offline accept length on the same prompts")
    ap.add_argument("target")
    ap.add_argument("drafter")
    ap.add_argument("prompts")
    ap.add_argument("out_dir")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--tol", type=float, default=0.05)
    a = ap.parse_args(argv)
    try:
        m = run_step(
            a.target,
            a.drafter,
            a.prompts,
            a.out_dir,
            n_prompts=a.n,
            k=a.k,
            max_new_tokens=a.max_new_tokens,
            tol=a.tol,
            max_num_seqs=a.max_num_seqs,
            offset=a.offset,
            check=False,
        )
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    rep = json.loads((Path(a.out_dir) / "online.json").read_text())
    for row in rep["rows"]:
        log(f"{row['metric']:>22}: vLLM {row['vllm']:.4f}  offline {row['offline']:.4f}")
    log(
        f"plain evaluator on the same sequences: {m['offline_same_prompts_accept_length_plain']:.4f}; "
        f"requests with differing cycles: {m['online_requests_with_differing_cycles']}/{a.n}; "
        f"time: vLLM {m['online_seconds']:.1f}s (generate {m['online_generate_seconds']:.1f}s), offline replay "
        f"{m['offline_same_prompts_seconds']:.1f}s (evaluator {m['offline_same_prompts_eval_seconds']:.1f}s): "
        f"{m['online_time_ratio']:.1f}x / {m['online_time_ratio_eval']:.1f}x"
    )
    try:
        agreement_check({**m, "online_k": a.k}, {"accept_length": m["offline_same_prompts_accept_length"]}, a.tol)
    except DraftportError as e:
        log(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
