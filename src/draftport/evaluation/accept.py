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

import time
from collections.abc import Iterable

import torch

from draftport.model.drafter import Eagle3Drafter
from draftport.data.shards import Batch, FeatureSet, iter_batches
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


def walk(accepted: list[int], checkable: list[int], start: int, end: int) -> list[int]:
    """Rows an engine visits from `start` to `end` (exclusive): each cycle jumps a+1 tokens."""
    p, seen = start, []
    while p < end and checkable[p] > 0:
        a = accepted[p]
        seen.append(a)
        p += a + 1
    return seen


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
    drafter: Eagle3Drafter, batches: Iterable[tuple[Batch, list[int]]], target_head: torch.Tensor, k: int, progress=None
) -> dict:
    """batches yields (Batch, response_start per sequence). Returns the summary dict, with
    `per_sample`: each sequence's accepted drafts and cycles (in order), what bootstrap CIs over
    prompts resample (draftport.evaluation.decision)."""
    was_training = drafter.training
    drafter.eval()
    cycles: list[int] = []
    all_rows: list[int] = []
    per_acc: list[int] = []
    per_cyc: list[int] = []
    dev = target_head.device
    for batch, starts in batches:
        acc, chk = accepted_counts(drafter, batch.to(dev), target_head, k)
        lengths = batch.valid.long().sum(-1).tolist()
        for b, r in enumerate(starts):
            a, c = acc[b].tolist(), chk[b].tolist()
            end = lengths[b] - 1
            seen = walk(a, c, max(r - 1, 0), end)
            cycles.extend(seen)
            per_acc.append(sum(seen))
            per_cyc.append(len(seen))
            all_rows.extend(a[p] for p in range(max(r - 1, 0), end) if c[p] > 0)
        if progress is not None:
            progress(len(starts))
    drafter.train(was_training)
    return {**summarize(cycles, all_rows, k), "per_sample": {"accepted": per_acc, "cycles": per_cyc}}


def held_out_monitor(fs, target_head: torch.Tensor, *, k: int, batch_size: int = 32):
    """train()'s monitor: the drafter's tau on a fixed held-out feature set (collated once, on the
    target head's device), drafted as evaluate_drafter drafts."""
    dev = target_head.device
    batches = [(b.to(dev), starts) for b, starts in iter_batches(fs, list(range(len(fs))), batch_size)]

    def tau(drafter: Eagle3Drafter) -> float:
        return offline_accept_length(drafter, batches, target_head, k)["accept_length"]

    return tau


def evaluate_drafter(
    drafter_dir,
    target_dir,
    features_dir,
    *,
    k: int,
    batch_size: int = 16,
    max_samples: int | None = None,
    device: str = "auto",
) -> dict:
    """Offline accept length of a saved drafter on held-out features of a target, drafted on
    `device` (eval.device: draftport.model.device's rule). `run` in the result says where it ran
    and at what rate (tokens evaluated per second); the caller keeps it out of artifacts."""
    dev = pick_device(device, "eval.device")
    cfg, state = load_drafter_state(drafter_dir)
    fs = FeatureSet(features_dir)
    check_features_fit(cfg, fs, drafter_dir)
    d = drafter_for_target(cfg, target_dir, state).to(dev)
    head = target_head(target_dir).to(dev)
    ids = list(range(len(fs) if max_samples is None else min(len(fs), max_samples)))
    tokens = 0

    def batches():
        nonlocal tokens
        for batch, starts in iter_batches(fs, ids, batch_size):
            tokens += int(batch.valid.sum())  # real tokens, on the host before the batch moves
            yield batch, starts

    t0 = time.time()
    with progress(len(ids), "evaluate", "sample") as bar, out_of_memory("evaluation", "eval.batch_size"):
        res = offline_accept_length(d, batches(), head, k, progress=bar.update)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    res["eval_seconds"] = time.time() - t0
    res["eval_samples"] = len(ids)
    res["run"] = {
        **describe_device(dev),
        "tokens": tokens,
        "tokens_per_s": tokens / res["eval_seconds"] if res["eval_seconds"] > 0 else None,
    }
    return res
