"""Offline accept length, drafted exactly as a serving engine drafts.

For every row p the drafter proposes k tokens greedily: step 0 from the target's aux features at
p and the verified token p+1, later steps from its own pre-norm state and its own previous draft,
attending to the step-0 keys of the verified prefix (what the engine's drafter KV cache holds).
Draft j (0-based) is compared with the target's greedy choice at position p+1+j; `accepted[p]`
is the length of the agreeing prefix.

tau is measured the way SGLang and vLLM count it, over the cycles an engine actually runs:
after the prompt, the first cycle drafts from the last prompt position; a cycle that accepts a
drafts moves a+1 tokens on. tau = 1 + mean accepted over those cycles (the bonus token counts).
The mean over *every* response position is reported too (`accept_length_all_positions`).

Three definitions of "how much is accepted", all from the same counts (`summarize`):
  - accept_length (tau)   1 + accepted / cycles: the bonus token counted (vLLM's "Mean
                          acceptance length", SGLang's accept length);
  - simulated_acc_len     a0 + a0*a1 + a0*a1*a2 + ... over the conditional rates cond_acc_i, no
                          bonus token (SpecForge's eval metric); on these counts it is tau - 1;
  - acceptance_rate       accepted / draft tokens proposed (vLLM's "Avg Draft acceptance rate",
                          as a fraction); with k drafts every cycle it is (tau - 1) / k.
"""

from __future__ import annotations

import bisect
import itertools
import json
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from draftport.model.drafter import Eagle3Drafter
from draftport.errors import DraftportError
from draftport.data.shards import SETS_FILE, Batch, FeatureSet, iter_batches
from draftport.model.bind import check_features_fit, drafter_for_target, target_head
from draftport.model.device import describe as describe_device, out_of_memory
from draftport.model.device import pick as pick_device
from draftport.model.formats import load_drafter_state
from draftport.progress import progress
from draftport.model.target import target_logits


@torch.no_grad()
def accepted_counts(drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, k: int):
    """[B, T] number of accepted drafts when drafting from row p, and [B, T] count of drafts
    that could be checked (k, fewer near the end of a sequence)."""
    hot = drafter.hot_ids
    # the target's greedy choice: as captured (full precision) when the features hold it
    t_arg = batch.target_arg if batch.target_arg is not None else target_logits(batch.final, target_head).argmax(-1)
    logits = drafter.unroll(batch.aux, batch.tokens, k, teacher_tokens=False, valid=batch.valid)
    B, T = batch.tokens.shape
    length = batch.valid.long().sum(-1)  # sequences are right-padded
    rows = torch.arange(T, device=t_arg.device)[None]
    alive = torch.ones(B, T, dtype=torch.bool, device=t_arg.device)
    accepted = torch.zeros(B, T, dtype=torch.long, device=t_arg.device)
    checkable = torch.zeros(B, T, dtype=torch.long, device=t_arg.device)
    for j, lg in enumerate(logits):
        q = rows + 1 + j  # the target position whose argmax draft j must match
        inside = q <= (length[:, None] - 2)  # its prediction (token q+1) exists in the sequence
        tq = torch.gather(t_arg, 1, q.clamp(max=T - 1).expand(B, T))
        match = (hot[lg.argmax(-1)] == tq) & inside
        alive = alive & match
        accepted += alive.long()
        checkable += inside.long()
    return accepted, checkable


def cycle_rows(accepted: list[int], checkable: list[int], start: int, end: int) -> list[tuple[int, int]]:
    """(row, accepted) of each cycle an engine runs from `start` to `end` (exclusive): each cycle
    jumps a+1 tokens; the row is the verify position the cycle drafts from."""
    p, seen = start, []
    while p < end and checkable[p] > 0:
        a = accepted[p]
        seen.append((p, a))
        p += a + 1
    return seen


def walk(accepted: list[int], checkable: list[int], start: int, end: int) -> list[int]:
    """The accepted count of each cycle an engine runs from `start` to `end` (exclusive)."""
    return [a for _, a in cycle_rows(accepted, checkable, start, end)]


def bucket_of(row: int, edges: list[int]) -> int:
    """The context bucket of a verify position: the last lower edge at or below it."""
    return bisect.bisect_right(edges, row) - 1


def bucket_counts(rows: list[tuple[int, int]], edges: list[int]) -> tuple[list[int], list[int]]:
    """Accepted drafts and cycles per context bucket of one sequence's cycles."""
    acc, cyc = [0] * len(edges), [0] * len(edges)
    for row, a in rows:
        b = bucket_of(row, edges)
        acc[b] += a
        cyc[b] += 1
    return acc, cyc


def simulated_acc_len(cond_rates: Iterable[float]) -> float:
    """SpecForge's accept length: a0 + a0*a1 + a0*a1*a2 + ..., the expected number of accepted
    drafts (no bonus token) when draft i is accepted with probability a_i once the earlier ones
    were. SpecForge (specforge/eval/evaluator.py, Evaluator._simulated_acc_len, logged as
    `eval/simulated_acc_len`, its default best-checkpoint metric) applies this running product
    to its eval-set-wide per-position TTT accuracies (correct / denom summed over the eval set,
    then the product). Here a_i are the conditional acceptance rates of the cycles an engine
    runs (cond_acc_i), so the product telescopes to accept_rate_pos_i and the sum is tau - 1."""
    cumulative, total = 1.0, 0.0
    for a in cond_rates:
        cumulative *= a
        total += cumulative
    return total


def acceptance_rate(num_accepted_tokens: int, num_draft_tokens: int) -> float:
    """vLLM's "Avg Draft acceptance rate" (vllm/v1/spec_decode/metrics.py, SpecDecodingLogging.log,
    vLLM 0.32), as a fraction instead of a percentage: the counter num_accepted_tokens over the
    counter num_draft_tokens (draft tokens proposed and scheduled for verification), not over
    num_drafts. 0.0 when nothing was drafted (vLLM prints nan)."""
    return num_accepted_tokens / num_draft_tokens if num_draft_tokens > 0 else 0.0


def summarize(cycles: list[int], all_rows: list[int], k: int) -> dict:
    """The figures of a set of cycles (each an accepted count) and of every response row."""
    n = max(len(cycles), 1)
    out = {
        "accept_length": 1.0 + sum(cycles) / n,
        "num_cycles": len(cycles),
        "num_draft_tokens": len(cycles) * k,
        "num_accepted_tokens": sum(cycles),
        "accept_length_all_positions": 1.0 + (sum(all_rows) / max(len(all_rows), 1)),
        "k": k,
    }
    prev = 1.0
    for i in range(1, k + 1):
        rate = sum(1 for a in cycles if a >= i) / n
        out[f"accept_rate_pos_{i - 1}"] = rate
        out[f"cond_acc_{i - 1}"] = rate / prev if prev > 0 else 0.0
        prev = rate
    # the same counts under the other tools' definitions (no second pass)
    out["simulated_acc_len"] = simulated_acc_len(out[f"cond_acc_{i}"] for i in range(k))
    out["acceptance_rate"] = acceptance_rate(out["num_accepted_tokens"], out["num_draft_tokens"])
    return out


def offline_accept_length(
    drafter: Eagle3Drafter,
    batches: Iterable[tuple[Batch, list[int]]],
    target_head: torch.Tensor,
    k: int,
    progress=None,
    buckets: list[int] | None = None,
) -> dict:
    """batches yields (Batch, response_start per sequence). Returns the summary dict, with
    `per_sample`: each sequence's accepted drafts and cycles (in order), what bootstrap CIs over
    prompts resample (draftport.evaluation.decision); with `buckets` (lower edges of the context
    buckets, first 0) also per bucket of the verify position (`bucket_accepted`, `bucket_cycles`)."""
    was_training = drafter.training
    drafter.eval()
    cycles: list[int] = []
    all_rows: list[int] = []
    per: dict[str, list] = {"accepted": [], "cycles": []}
    if buckets is not None:
        per |= {"bucket_accepted": [], "bucket_cycles": []}
    dev = target_head.device
    for batch, starts in batches:
        acc, chk = accepted_counts(drafter, batch.to(dev), target_head, k)
        lengths = batch.valid.long().sum(-1).tolist()
        for b, r in enumerate(starts):
            a, c = acc[b].tolist(), chk[b].tolist()
            end = lengths[b] - 1
            rows = cycle_rows(a, c, max(r - 1, 0), end)
            seen = [n for _, n in rows]
            cycles.extend(seen)
            per["accepted"].append(sum(seen))
            per["cycles"].append(len(seen))
            if buckets is not None:
                b_acc, b_cyc = bucket_counts(rows, buckets)
                per["bucket_accepted"].append(b_acc)
                per["bucket_cycles"].append(b_cyc)
            all_rows.extend(a[p] for p in range(max(r - 1, 0), end) if c[p] > 0)
        if progress is not None:
            progress(len(starts))
    drafter.train(was_training)
    return {**summarize(cycles, all_rows, k), "per_sample": per}


def held_out_monitor(fs, target_head: torch.Tensor, *, k: int, batch_size: int = 32):
    """train()'s monitor: the drafter's tau on a fixed held-out feature set (collated once, on the
    target head's device), drafted as evaluate_drafter drafts."""
    dev = target_head.device
    batches = [(b.to(dev), starts) for b, starts in iter_batches(fs, list(range(len(fs))), batch_size)]

    def tau(drafter: Eagle3Drafter) -> float:
        return offline_accept_length(drafter, batches, target_head, k)["accept_length"]

    return tau


DEFAULT_SET = "heldout"  # the one set of a plan without targets.eval_sets


def read_sets(features_dir, n: int) -> list[dict]:
    """The named eval sets of a feature folder ({name, share, start, count}: contiguous ranges of its
    n samples, in order), or one set of them all."""
    path = Path(features_dir) / SETS_FILE
    if not path.is_file():
        return [{"name": DEFAULT_SET, "share": 1.0, "start": 0, "count": n}]
    try:
        sets = json.loads(path.read_text())["sets"]
        spans = [(int(x["start"]), int(x["count"])) for x in sets]
    except (ValueError, KeyError, TypeError) as e:
        raise DraftportError(path, f"not a sets file ({{sets: [{{name, share, start, count}}]}}): {e}") from None
    if [a for a, _ in spans] != list(itertools.accumulate([0] + [c for _, c in spans[:-1]])) or sum(
        c for _, c in spans
    ) != n:
        raise DraftportError(path, f"its sets {spans} do not tile the folder's {n} samples in order")
    return sets


def evaluated_sets(sets: list[dict], max_samples: int | None) -> tuple[list[int], list[dict]]:
    """The samples evaluated (eval.max_samples: the first of each set) and the sets over them."""
    ids, out = [], []
    for x in sets:
        take = x["count"] if max_samples is None else min(x["count"], max_samples)
        out.append({"name": x["name"], "share": float(x["share"]), "start": len(ids), "count": take})
        ids.extend(range(x["start"], x["start"] + take))
    return ids, out


def set_figures(res: dict, sets: list[dict]) -> dict:
    """Per set its accept length (pooled over its prompts); more than one set: the headline
    accept_length is the traffic-weighted one (shares), the pooled one kept beside it."""
    per = res["per_sample"]
    by_set = {}
    for x in sets:
        span = slice(x["start"], x["start"] + x["count"])
        acc, cyc = sum(per["accepted"][span]), sum(per["cycles"][span])
        by_set[x["name"]] = {
            "accept_length": 1.0 + acc / cyc if cyc else None,
            "num_cycles": cyc,
            "n_prompts": x["count"],
            "share": x["share"],
        }
    out = {"sets": sets, "by_set": by_set}
    if len(sets) > 1:
        measured = [v for v in by_set.values() if v["accept_length"] is not None]
        out["accept_length_pooled"] = res["accept_length"]
        out["accept_length"] = sum(v["share"] * v["accept_length"] for v in measured) / sum(
            v["share"] for v in measured
        )
    return out


def bucket_figures(res: dict, edges: list[int]) -> list[dict]:
    """Per context bucket of the verify position: its accept length (None: no cycle reached it)."""
    per = res["per_sample"]
    out = []
    for b, lo in enumerate(edges):
        acc = sum(row[b] for row in per["bucket_accepted"])
        cyc = sum(row[b] for row in per["bucket_cycles"])
        hi = edges[b + 1] if b + 1 < len(edges) else None
        out.append({"lo": lo, "hi": hi, "accept_length": 1.0 + acc / cyc if cyc else None, "num_cycles": cyc})
    return out


def evaluate_drafter(
    drafter_dir,
    target_dir,
    features_dir,
    *,
    k: int,
    batch_size: int = 16,
    max_samples: int | None = None,
    device: str = "auto",
    buckets: list[int] | None = None,
    by_set: bool = True,
) -> dict:
    """Offline accept length of a saved drafter on held-out features of a target, drafted on
    `device` (eval.device: draftport.model.device's rule), per named eval set (sets.json beside the
    features; eval.max_samples: the first of each set) and, with `buckets`, per context bucket.
    `run` in the result says where it ran and at what rate (tokens evaluated per second); the
    caller keeps it out of artifacts. by_set false: the folder as one set, its first max_samples
    (what a probe pairing it sample by sample with another folder needs)."""
    dev = pick_device(device, "eval.device")
    cfg, state = load_drafter_state(drafter_dir)
    fs = FeatureSet(features_dir)
    check_features_fit(cfg, fs, drafter_dir)
    d = drafter_for_target(cfg, target_dir, state).to(dev)
    head = target_head(target_dir).to(dev)
    whole = [{"name": DEFAULT_SET, "share": 1.0, "start": 0, "count": len(fs)}]
    ids, sets = evaluated_sets(read_sets(features_dir, len(fs)) if by_set else whole, max_samples)
    tokens = 0

    def batches():
        nonlocal tokens
        for batch, starts in iter_batches(fs, ids, batch_size):
            tokens += int(batch.valid.sum())  # real tokens, on the host before the batch moves
            yield batch, starts

    t0 = time.time()
    with progress(len(ids), "evaluate", "sample") as bar, out_of_memory("evaluation", "eval.batch_size"):
        res = offline_accept_length(d, batches(), head, k, progress=bar.update, buckets=buckets)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    res["eval_seconds"] = time.time() - t0
    res["eval_samples"] = len(ids)
    res |= set_figures(res, sets)
    if buckets is not None:
        res["context_buckets"] = list(buckets)
        res["by_bucket"] = bucket_figures(res, buckets)
    res["run"] = {
        **describe_device(dev),
        "tokens": tokens,
        "tokens_per_s": tokens / res["eval_seconds"] if res["eval_seconds"] > 0 else None,
    }
    return res
