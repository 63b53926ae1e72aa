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

from draftport.data.shards import SETS_FILE, Batch, FeatureSet, iter_batches
from draftport.errors import DraftportError
from draftport.evaluation.trees import check_tree, tree_accepted
from draftport.model.bind import check_features_fit, drafter_for_target, target_head
from draftport.model.device import describe as describe_device
from draftport.model.device import out_of_memory
from draftport.model.device import pick as pick_device
from draftport.model.drafter import Eagle3Drafter
from draftport.model.formats import load_drafter_state
from draftport.model.target import target_logits
from draftport.progress import progress


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
    k_max: int | None = None,
    trees: list | None = None,
) -> dict:
    """batches yields (Batch, response_start per sequence). Returns the summary dict, with
    `per_sample`: each sequence's accepted drafts and cycles (in order), what bootstrap CIs over
    prompts resample (draftport.evaluation.decision); with `buckets` (lower edges of the context
    buckets, first 0) also per bucket of the verify position (`bucket_accepted`, `bucket_cycles`).

    With k_max, one pass drafts k_max tokens and every k <= k_max follows from it: a greedy
    chain's draft j does not depend on how many come after it, so the chain of k accepts
    exactly min(accepted, k) at each row, and the engine's walk is rerun on those counts.
    `by_k` holds each k's figures, per_sample["by_k"] each k's per-prompt counts (bucket counts
    summed over prompts under `bucket_by_k`). trees ([steps, topk, num_draft_tokens] each):
    draftport.evaluation.trees' offline figure of each, its per-prompt counts beside it."""
    was_training = drafter.training
    drafter.eval()
    depth = max(k, k_max or k)
    ks = list(range(1, k_max + 1)) if k_max else []
    cycles: dict[int, list[int]] = {kk: [] for kk in {k, *ks}}
    all_rows: dict[int, list[int]] = {kk: [] for kk in cycles}
    per: dict[str, list] = {"accepted": [], "cycles": []}
    if buckets is not None:
        per |= {"bucket_accepted": [], "bucket_cycles": []}
    by_k_per = {kk: {"accepted": [], "cycles": []} for kk in ks}
    bucket_by_k = {kk: ([0] * len(buckets), [0] * len(buckets)) for kk in ks} if buckets is not None else None
    tree_per = [{"accepted": [], "cycles": []} for _ in trees or []]
    tree_cycles: list[list[int]] = [[] for _ in trees or []]
    dev = target_head.device
    for batch, starts in batches:
        batch = batch.to(dev)
        acc, chk = accepted_counts(drafter, batch, target_head, depth)
        lengths = batch.valid.long().sum(-1).tolist()
        tree_counts = [tree_accepted(drafter, batch, target_head, *t) for t in trees or []]
        for b, r in enumerate(starts):
            a_max, c_max = acc[b].tolist(), chk[b].tolist()
            start, end = max(r - 1, 0), lengths[b] - 1
            for kk in cycles:
                # the chain of kk drafts: draft j < kk is the same as in the deeper pass
                a = [min(x, kk) for x in a_max] if kk < depth else a_max
                c = [min(x, kk) for x in c_max] if kk < depth else c_max
                rows = cycle_rows(a, c, start, end)
                seen = [n for _, n in rows]
                cycles[kk].extend(seen)
                all_rows[kk].extend(a[p] for p in range(start, end) if c[p] > 0)
                if kk == k:
                    per["accepted"].append(sum(seen))
                    per["cycles"].append(len(seen))
                    if buckets is not None:
                        b_acc, b_cyc = bucket_counts(rows, buckets)
                        per["bucket_accepted"].append(b_acc)
                        per["bucket_cycles"].append(b_cyc)
                if kk in by_k_per:
                    by_k_per[kk]["accepted"].append(sum(seen))
                    by_k_per[kk]["cycles"].append(len(seen))
                    if bucket_by_k is not None:
                        for i, (x, y) in enumerate(zip(*bucket_counts(rows, buckets))):
                            bucket_by_k[kk][0][i] += x
                            bucket_by_k[kk][1][i] += y
            for t, (t_acc, t_chk) in enumerate(tree_counts):
                seen = walk(t_acc[b].tolist(), t_chk[b].tolist(), start, end)
                tree_cycles[t].extend(seen)
                tree_per[t]["accepted"].append(sum(seen))
                tree_per[t]["cycles"].append(len(seen))
        if progress is not None:
            progress(len(starts))
    drafter.train(was_training)
    out = {**summarize(cycles[k], all_rows[k], k), "per_sample": per}
    if ks:
        out["by_k"] = [summarize(cycles[kk], all_rows[kk], kk) for kk in ks]
        per["by_k"] = [{"k": kk, **by_k_per[kk]} for kk in ks]
        if bucket_by_k is not None:
            out["bucket_by_k"] = [{"k": kk, "accepted": bucket_by_k[kk][0], "cycles": bucket_by_k[kk][1]} for kk in ks]
    if trees:
        out["trees"] = [
            {
                "steps": s,
                "topk": tk,
                "num_draft_tokens": n,
                "accept_length": 1.0 + sum(c) / max(len(c), 1),
                "num_cycles": len(c),
                "num_accepted_tokens": sum(c),
                "offline": True,  # no engine serves EAGLE-3 trees on the CPU: never checked online
                "per_sample": tp,
            }
            for (s, tk, n), c, tp in zip(trees, tree_cycles, tree_per)
        ]
    return out


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


def _set_taus(accepted: list[int], cycles: list[int], sets: list[dict]) -> dict[str, tuple]:
    """Per set: (accept length pooled over its prompts or None, cycles) of per-prompt counts."""
    out = {}
    for x in sets:
        span = slice(x["start"], x["start"] + x["count"])
        acc, cyc = sum(accepted[span]), sum(cycles[span])
        out[x["name"]] = (1.0 + acc / cyc if cyc else None, cyc)
    return out


def _weighted(taus: dict[str, tuple], sets: list[dict]) -> float:
    """The traffic-weighted accept length of the sets measured (their shares renormalized)."""
    share = {x["name"]: float(x["share"]) for x in sets}
    measured = [(share[n], t) for n, (t, _) in taus.items() if t is not None]
    return sum(w * t for w, t in measured) / sum(w for w, _ in measured)


def set_figures(res: dict, sets: list[dict]) -> dict:
    """Per set its accept length (pooled over its prompts); more than one set: the headline
    accept_length is the traffic-weighted one (shares), the pooled one kept beside it. The same
    for each k of `by_k` and each tree of `trees` (their entries and each set's `by_k`, `trees`)."""
    per = res["per_sample"]
    taus = _set_taus(per["accepted"], per["cycles"], sets)
    by_set = {
        x["name"]: {
            "accept_length": taus[x["name"]][0],
            "num_cycles": taus[x["name"]][1],
            "n_prompts": x["count"],
            "share": x["share"],
        }
        for x in sets
    }
    out = {"sets": sets, "by_set": by_set}
    if len(sets) > 1:
        out["accept_length_pooled"] = res["accept_length"]
        out["accept_length"] = _weighted(taus, sets)
    # each depth and each tree: per set, and the headline under the same definition as above
    for key, rows, per_rows, name in (
        ("by_k", res.get("by_k", []), per.get("by_k", []), ("k",)),
        ("trees", res.get("trees", []), [t["per_sample"] for t in res.get("trees", [])], TREE_KEYS),
    ):
        for row, ps in zip(rows, per_rows):
            t = _set_taus(ps["accepted"], ps["cycles"], sets)
            for n, (tau, cyc) in t.items():
                by_set[n].setdefault(key, []).append(
                    {**{f: row[f] for f in name}, "accept_length": tau, "num_cycles": cyc}
                )
            if len(sets) > 1:
                row["accept_length_pooled"] = row["accept_length"]
                row["accept_length"] = _weighted(t, sets)
    return out


TREE_KEYS = ("steps", "topk", "num_draft_tokens")


def bucket_figures(res: dict, edges: list[int]) -> list[dict]:
    """Per context bucket of the verify position: its accept length (None: no cycle reached it),
    and each k's (`by_k`, from the counts summed over prompts) when the evaluation went deeper."""
    per = res["per_sample"]
    out = []
    for b, lo in enumerate(edges):
        acc = sum(row[b] for row in per["bucket_accepted"])
        cyc = sum(row[b] for row in per["bucket_cycles"])
        hi = edges[b + 1] if b + 1 < len(edges) else None
        out.append({"lo": lo, "hi": hi, "accept_length": 1.0 + acc / cyc if cyc else None, "num_cycles": cyc})
        if "bucket_by_k" in res:
            out[-1]["by_k"] = [
                {
                    "k": x["k"],
                    "accept_length": 1.0 + x["accepted"][b] / x["cycles"][b] if x["cycles"][b] else None,
                    "num_cycles": x["cycles"][b],
                }
                for x in res["bucket_by_k"]
            ]
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
    k_max: int | None = None,
    trees: list | None = None,
) -> dict:
    """Offline accept length of a saved drafter on held-out features of a target, drafted on
    `device` (eval.device: draftport.model.device's rule), per named eval set (sets.json beside the
    features; eval.max_samples: the first of each set) and, with `buckets`, per context bucket.
    `run` in the result says where it ran and at what rate (tokens evaluated per second); the
    caller keeps it out of artifacts. by_set false: the folder as one set, its first max_samples
    (what a probe pairing it sample by sample with another folder needs). k_max (eval.k_max):
    every k up to it from the same pass (`by_k`); trees (eval.trees): each tree's offline figure."""
    if k_max is not None and k_max < k:
        raise DraftportError("eval.k_max", f"{k_max} is below eval.k ({k}): the deeper pass must cover k")
    for t in trees or []:
        check_tree(t)
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
        res = offline_accept_length(
            d, batches(), head, k, progress=bar.update, buckets=buckets, k_max=k_max, trees=trees
        )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    res["eval_seconds"] = time.time() - t0
    res["eval_samples"] = len(ids)
    res |= set_figures(res, sets)
    if buckets is not None:
        res["context_buckets"] = list(buckets)
        res["by_bucket"] = bucket_figures(res, buckets)
    res.pop("bucket_by_k", None)  # in by_bucket's by_k now
    res["run"] = {
        **describe_device(dev),
        "tokens": tokens,
        "tokens_per_s": tokens / res["eval_seconds"] if res["eval_seconds"] > 0 else None,
    }
    return res
