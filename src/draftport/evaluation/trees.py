"""Offline accept length of SGLang-style draft trees (steps, topk, draft tokens).

SGLang drafts an EAGLE-3 tree with --speculative-num-steps S, --speculative-eagle-topk K and
--speculative-num-draft-tokens N (EAGLE-2's dynamic tree): the first step drafts K children of the
verified token; each later step drafts K children of every node of the frontier (K nodes), and
the K of those K*K with the best cumulative draft score (the product of the draft probabilities
along the path) form the next frontier. After S steps the N-1 candidates with the best cumulative
score (over every level: K, then K*K per later step) are verified with the root (the verified
token). The target accepts the longest root path whose tokens are all its greedy choices.

Here, at every row p at once (as draftport.evaluation.accept drafts chains), the drafter builds
that tree (Eagle3Drafter.draft_start / draft_next: each branch attends to the verified prefix and
its own ancestors, as SGLang's tree mask lets it) and `tree_accepted` counts the accepted path.
The score is summed log-probabilities, the order of SGLang's product. tau is walked over the
cycles an engine runs, as for chains: a cycle accepting a moves a+1 tokens on.

The figure is offline only: no engine serves EAGLE-3 trees on the CPU (vLLM serves chains only
since tree attention was removed; SGLang serves trees on GPUs).
"""

from __future__ import annotations

import torch

from draftport.data.shards import Batch
from draftport.errors import DraftportError
from draftport.model.drafter import Eagle3Drafter
from draftport.model.target import target_logits


def tree_candidates(steps: int, topk: int) -> int:
    """Nodes a tree of `steps` and `topk` scores (its root excluded): K, then K*K per later step."""
    return topk + (steps - 1) * topk * topk


def check_tree(tree, where: str = "eval.trees") -> tuple[int, int, int]:
    """(steps, topk, num_draft_tokens) of one tree, checked the way SGLang sets them up."""
    if not (isinstance(tree, (list, tuple)) and len(tree) == 3 and all(isinstance(x, int) for x in tree)):
        raise DraftportError(where, f"a tree is [steps, topk, num_draft_tokens] (integers), got {tree!r}")
    steps, topk, n = tree
    if steps < 1 or topk < 1:
        raise DraftportError(where, f"{list(tree)}: steps and topk must be >= 1")
    most = 1 + tree_candidates(steps, topk)
    if not 2 <= n <= most:
        raise DraftportError(
            where, f"{list(tree)}: num_draft_tokens must lie in [2, {most}] (the root + the nodes the tree drafts)"
        )
    return steps, topk, n


@torch.no_grad()
def tree_accepted(drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor, steps: int, topk: int, n: int):
    """[B, T] accepted drafts of the tree drafted from row p (its longest root path of the
    target's greedy choices among the n-1 best-scored nodes), and [B, T] the depth that could be
    checked (steps, fewer near the end of a sequence)."""
    hot = drafter.hot_ids
    t_arg = batch.target_arg if batch.target_arg is not None else target_logits(batch.final, target_head).argmax(-1)
    B, T = batch.tokens.shape
    dev = t_arg.device
    length = batch.valid.long().sum(-1)
    rows = torch.arange(T, device=dev)[None]

    def greedy(j):  # the target's choice that draft depth j+1 must match, and whether it exists
        q = rows + 1 + j
        return torch.gather(t_arg, 1, q.clamp(max=T - 1).expand(B, T)), q <= (length[:, None] - 2)

    state, logits = drafter.draft_start(batch.aux, batch.tokens, valid=batch.valid)
    lp = torch.log_softmax(logits.float(), -1)
    top = logits.topk(topk, -1).indices  # [B, T, K]: chosen on the logits, as the chain's argmax
    score = torch.gather(lp, -1, top)
    tok = hot[top]
    want, inside = greedy(0)
    match = (tok == want[..., None]) & inside[..., None]
    scores, depths, matches = [score], [1] * topk, [match]
    parent = torch.zeros(topk, B, T, dtype=torch.long, device=dev)  # the start state has one branch
    for j in range(1, steps):
        # expand each frontier node (branch n of the next state) by its topk children
        state, logits = drafter.draft_next(state, parent, tok.permute(2, 0, 1))
        lp = torch.log_softmax(logits.float(), -1)
        top = logits.topk(topk, -1).indices  # [K, B, T, K]
        child = score.permute(2, 0, 1)[..., None] + torch.gather(lp, -1, top)
        # parent-major, child-minor: SGLang's order of the K*K expanded nodes
        child = child.permute(1, 2, 0, 3).flatten(2)  # [B, T, K*K]
        ctok = hot[top].permute(1, 2, 0, 3).flatten(2)
        want, inside = greedy(j)
        cmatch = match.repeat_interleave(topk, -1) & (ctok == want[..., None]) & inside[..., None]
        scores.append(child)
        depths += [j + 1] * (topk * topk)
        matches.append(cmatch)
        keep = child.topk(topk, -1).indices  # the next frontier: best cumulative score
        score, tok, match = (torch.gather(x, -1, keep) for x in (child, ctok, cmatch))
        parent = (keep // topk).permute(2, 0, 1)  # the frontier branch each one continues
    all_scores = torch.cat(scores, -1)
    all_match = torch.cat(matches, -1)
    depth = torch.tensor(depths, device=dev)
    chosen = torch.zeros_like(all_match).scatter_(-1, all_scores.topk(n - 1, -1).indices, True)
    hit = all_match & chosen
    # a depth counts when its matching node is verified and so is every shallower one
    per_depth = torch.stack([hit[..., depth == d].any(-1) for d in range(1, steps + 1)], -1)
    accepted = per_depth.long().cumprod(-1).sum(-1)
    checkable = (length[:, None] - 2 - rows).clamp(min=0, max=steps)
    return accepted, checkable
