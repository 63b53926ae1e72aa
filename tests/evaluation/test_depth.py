"""Acceptance to depth (eval.k_max) and offline trees (eval.trees) on the 64-wide toy drafter:
one deep pass gives every shallower k exactly, and a tree of topk 1 is the chain."""

import json

import pytest
import torch
from toys import toy_batch, toy_cfg, toy_drafter

from draftport.errors import DraftportError
from draftport.evaluation.accept import accepted_counts, evaluate_drafter, offline_accept_length
from draftport.evaluation.trees import check_tree, tree_accepted
from tests.evaluation.test_eval_sets import save_toy_pair


def agreeing_world(seed=0, B=3, T=48, k=8):
    """A toy drafter, and a batch whose target agrees with its chain drafts in runs of random
    length (1..k+1 tokens): accepted counts of every depth occur. -> (drafter, batch, head)."""
    cfg = toy_cfg(hidden_size=128, head_dim=32)  # hidden >= vocab: an identity target head
    d = toy_drafter(cfg, seed=seed).eval()
    b = toy_batch(cfg, B=B, T=T, seed=seed + 1)
    with torch.no_grad():
        drafted = [d.hot_ids[lg.argmax(-1)] for lg in d.unroll(b.aux, b.tokens, k, teacher_tokens=False, valid=b.valid)]
    g = torch.Generator().manual_seed(seed)
    t_arg = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    for i in range(B):
        p = 0
        while p < T:
            run = int(torch.randint(0, k + 1, (1,), generator=g))
            for j in range(run):
                if p + 1 + j < T:
                    t_arg[i, p + 1 + j] = drafted[j][i, p]
            p += run + 1
    head = torch.eye(cfg.vocab_size, cfg.hidden_size)
    b.final = head[t_arg] * 10.0
    return d, b, head


def test_a_draft_does_not_depend_on_how_many_come_after_it():
    cfg = toy_cfg()
    d = toy_drafter(cfg).eval()
    b = toy_batch(cfg, B=2, T=16)
    with torch.no_grad():
        short = d.unroll(b.aux, b.tokens, 3, teacher_tokens=False, valid=b.valid)
        deep = d.unroll(b.aux, b.tokens, 8, teacher_tokens=False, valid=b.valid)
    for j in range(3):
        assert torch.equal(short[j], deep[j]), j  # bit for bit: min(accepted, k) is exact


def test_every_k_from_one_deep_pass_equals_a_run_at_that_k():
    d, b, head = agreeing_world()
    acc8, _ = accepted_counts(d, b, head, 8)
    assert set(acc8.flatten().tolist()) >= {0, 1, 2, 3, 5, 8}  # every depth is exercised
    deep = offline_accept_length(d, [(b, [1, 1, 4])], head, 3, k_max=8)
    for row in deep["by_k"]:
        alone = offline_accept_length(d, [(b, [1, 1, 4])], head, row["k"])
        per = deep["per_sample"]["by_k"][row["k"] - 1]
        assert row == {key: v for key, v in alone.items() if key != "per_sample"}, row["k"]  # difference 0
        assert per == {"k": row["k"], **alone["per_sample"]}
    # the figures at k keep their values when the pass goes deeper
    at_k = offline_accept_length(d, [(b, [1, 1, 4])], head, 3)
    deep_ps = {key: v for key, v in deep.pop("per_sample").items() if key != "by_k"}
    assert deep_ps == at_k.pop("per_sample")
    assert {key: deep[key] for key in at_k} == at_k
    taus = [row["accept_length"] for row in deep["by_k"]]
    assert taus == sorted(taus) and taus[-1] > taus[0] + 1.0  # deeper chains accept more here


@pytest.fixture
def saved(tmp_path):
    save_toy_pair(tmp_path)
    sets = [
        {"name": "chat", "share": 0.7, "start": 0, "count": 16},
        {"name": "long", "share": 0.3, "start": 16, "count": 8},
    ]
    (tmp_path / "feats" / "sets.json").write_text(json.dumps({"sets": sets}))
    return tmp_path


def test_an_evaluation_to_depth_keeps_every_figure_at_k(saved):
    args = (saved / "drafter", saved / "target", saved / "feats")
    kw = dict(k=2, batch_size=8, buckets=[0, 6, 12])
    plain = evaluate_drafter(*args, **kw)
    deep = evaluate_drafter(*args, **kw, k_max=4, trees=[[2, 2, 4]])
    for res in (plain, deep):
        res.pop("eval_seconds"), res.pop("run")
    new = {"by_k", "trees"}
    assert set(deep) - set(plain) == new
    strip = {"per_sample", "by_set", "by_bucket"}  # compared below, their new keys left out
    kept = json.dumps({key: v for key, v in deep.items() if key not in new | strip})
    assert kept == json.dumps({key: v for key, v in plain.items() if key not in strip})  # bytes, not approximately
    ps = {key: v for key, v in deep["per_sample"].items() if key != "by_k"}
    assert ps == plain["per_sample"]
    for name in ("chat", "long"):
        figs = {key: v for key, v in deep["by_set"][name].items() if key not in new}
        assert figs == plain["by_set"][name]
    for b_deep, b_plain in zip(deep["by_bucket"], plain["by_bucket"]):
        assert {key: v for key, v in b_deep.items() if key != "by_k"} == b_plain
        assert b_deep["by_k"][1]["num_cycles"] == b_plain["num_cycles"]
    # each k's row at eval.k is the headline, under the same (traffic-weighted) definition
    at2 = deep["by_k"][1]
    assert (at2["accept_length"], at2["accept_length_pooled"]) == (deep["accept_length"], deep["accept_length_pooled"])
    assert deep["by_set"]["chat"]["by_k"][1]["accept_length"] == deep["by_set"]["chat"]["accept_length"]
    assert [r["k"] for r in deep["by_k"]] == [1, 2, 3, 4]
    tree = deep["trees"][0]
    assert (tree["steps"], tree["topk"], tree["num_draft_tokens"], tree["offline"]) == (2, 2, 4, True)
    assert sum(tree["per_sample"]["cycles"]) == tree["num_cycles"]
    assert deep["by_set"]["long"]["trees"][0]["num_cycles"] == sum(tree["per_sample"]["cycles"][16:])


def test_bad_depths_and_trees_are_refused_by_their_key(saved):
    args = (saved / "drafter", saved / "target", saved / "feats")
    with pytest.raises(DraftportError, match=r"^eval\.k_max: 2 is below eval\.k \(3\)"):
        evaluate_drafter(*args, k=3, k_max=2)
    with pytest.raises(DraftportError, match=r"^eval\.trees: \[3, 1, 5\]: num_draft_tokens must lie in \[2, 4\]"):
        check_tree([3, 1, 5])
    with pytest.raises(DraftportError, match=r"^eval\.trees: a tree is \[steps, topk, num_draft_tokens\]"):
        check_tree([3, 1])


def test_a_tree_of_topk_one_is_the_chain():
    d, b, head = agreeing_world(seed=2)
    for steps in (1, 3, 6):
        chain = accepted_counts(d, b, head, steps)
        tree = tree_accepted(d, b, head, steps, 1, steps + 1)
        assert torch.equal(tree[0], chain[0]) and torch.equal(tree[1], chain[1]), steps
    deep = offline_accept_length(d, [(b, [1, 1, 4])], head, 3, k_max=6, trees=[[6, 1, 7], [3, 1, 4]])
    assert [t["accept_length"] for t in deep["trees"]] == [deep["by_k"][5]["accept_length"], deep["accept_length"]]


def test_a_tree_keeping_every_node_of_two_steps_accepts_at_least_the_chain():
    d, b, head = agreeing_world(seed=3)
    chain, _ = accepted_counts(d, b, head, 2)
    for topk in (2, 4):
        tree, _ = tree_accepted(d, b, head, 2, topk, 1 + topk + topk * topk)
        assert (tree >= chain).all(), topk
        assert (tree > chain).any() or topk == 2  # the target's second choices exist among 4


def test_branches_draft_as_the_chain_would_along_their_own_tokens():
    """draft_next's branch n at row p == unroll teacher-forced along that branch's tokens at row p
    (row p attends to rows <= p only, so the tokens after p+1 are the branch's)."""
    cfg = toy_cfg()
    d = toy_drafter(cfg).eval()
    b = toy_batch(cfg, B=2, T=14)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        state, _ = d.draft_start(b.aux, b.tokens, valid=b.valid)
        fed1 = torch.randint(0, cfg.vocab_size, (3, 2, 14), generator=g)
        state, _ = d.draft_next(state, torch.zeros(3, 2, 14, dtype=torch.long), fed1)
        parent = torch.randint(0, 3, (2, 2, 14), generator=g)
        fed2 = torch.randint(0, cfg.vocab_size, (2, 2, 14), generator=g)
        _, logits = d.draft_next(state, parent, fed2)
        for n, bi, p in ((0, 0, 3), (1, 1, 6), (1, 0, 9)):
            path = [int(fed1[parent[n, bi, p], bi, p]), int(fed2[n, bi, p])]
            tokens = b.tokens.clone()
            tokens[bi, p + 2 : p + 4] = torch.tensor(path)
            ref = d.unroll(b.aux, tokens, 3, teacher_tokens=True, valid=b.valid)[2][bi, p]
            torch.testing.assert_close(logits[n, bi, p], ref)


def test_one_online_replay_to_depth_gives_each_k_of_a_replay_at_that_k(tmp_path):
    """The vLLM check's offline side (online._replay on a real tiny Llama target): one replay
    drafting 5 deep gives the engine-exact cycles of a replay at every k <= 5, so vLLM served at
    two k is compared with one replay."""
    from tiny_targets import LLAMA_AUX, LLAMA_VOCAB, tiny_llama

    from draftport.data.shards import Sequence
    from draftport.evaluation import online

    model = tiny_llama(tmp_path / "target")
    with torch.no_grad():  # the target's greedy choice: token 0 or 1 by the sign of one direction
        model.lm_head.weight.zero_()
        model.lm_head.weight[0] = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    cfg = toy_cfg(vocab_size=LLAMA_VOCAB, aux_layer_ids=LLAMA_AUX)
    d = toy_drafter(cfg).eval()
    d.set_embedding(model.model.embed_tokens.weight.detach())
    d.set_vocab_maps(
        torch.zeros(cfg.draft_vocab_size, dtype=torch.long), torch.arange(LLAMA_VOCAB) < cfg.draft_vocab_size
    )
    with torch.no_grad():
        d.lm_head.weight.zero_()  # always drafts slot 0 = token 0: accepted while the target says 0
    head = model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(4)
    # random answers (the target's own greedy ones fall into a loop): its choices vary along them
    seqs = [Sequence(torch.randint(2, LLAMA_VOCAB, (n,), generator=g).tolist(), 4) for n in (20, 31, 26)]

    def replay(depth, ks):
        ext = online._past_the_ends(model, seqs, depth, 0, 8)
        return online._replay(model, d, head, LLAMA_AUX, seqs, ext, depth, ks, 0, 8, "cpu")

    deep = replay(5, [1, 2, 3, 4, 5])
    assert {a for c in deep[5]["per_request"] for a in c} >= {0, 1, 2}  # runs of every length occur
    for k in (1, 2, 3, 4):
        alone = replay(k, [k])[k]
        assert deep[k]["per_request"] == alone["per_request"] and deep[k]["plain"] == alone["plain"], k
