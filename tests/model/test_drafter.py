"""The EAGLE-3 module, the TTT loss and the offline evaluator on a 64-wide toy."""

import pytest
import torch
from toys import toy_batch, toy_cfg, toy_drafter

from draftport.evaluation.accept import offline_accept_length, walk
from draftport.model.drafter import Eagle3Drafter
from draftport.training.ttt import ttt_loss


def test_shapes_match_flat_layout():
    cfg = toy_cfg(hidden_size=64, num_attention_heads=4, head_dim=32)  # head_dim != H / heads
    d = toy_drafter(cfg)
    sd = d.export_state()
    assert sd["fc.weight"].shape == (64, 192)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (4 * 32, 128)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert sd["midlayer.self_attn.o_proj.weight"].shape == (64, 128)
    assert sd["lm_head.weight"].shape == (40, 64)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert "embed_tokens.weight" not in sd
    assert "midlayer.hidden_norm.weight" in sd


def test_embed_is_frozen_and_never_exported_random():
    cfg = toy_cfg()
    d = Eagle3Drafter(cfg)
    assert not d.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="random embeddings"):
        d.export_state(include_embed=True)


def test_step_j_row_p_only_sees_verified_prefix():
    """Changing features after row p must not change any step's logits at row p (causality)."""
    cfg = toy_cfg()
    d = toy_drafter(cfg)
    b = toy_batch(cfg, B=1, T=10)
    out1 = d.unroll(b.aux, b.tokens, 3, teacher_tokens=True)
    aux2 = b.aux.clone()
    aux2[:, 6:] += 5.0
    tok2 = b.tokens.clone()
    tok2[:, 9:] = (tok2[:, 9:] + 1) % cfg.vocab_size
    out2 = d.unroll(aux2, tok2, 3, teacher_tokens=True)
    for j in range(3):
        # row p at step j consumes tokens up to p+1+j and features up to p
        last_ok = min(5, 9 - 1 - j - 1)
        torch.testing.assert_close(out1[j][:, : last_ok + 1], out2[j][:, : last_ok + 1])
        assert not torch.allclose(out1[j][:, 6:], out2[j][:, 6:])


def test_unrolled_step_equals_incremental_engine_drafting():
    """Step j of the batched unroll at row p == drafting token by token with a growing KV cache."""
    cfg = toy_cfg()
    d = toy_drafter(cfg)
    b = toy_batch(cfg, B=1, T=9)
    k = 3
    batched = d.unroll(b.aux, b.tokens, k, teacher_tokens=False)
    p = 5
    # engine: step-0 prefill over rows 0..p only, then draft with own states/tokens
    h0 = d.fc(b.aux[:, : p + 1])
    T = p + 1
    bias = torch.zeros(1, 1, T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    ck, cv = [], []
    pos = torch.arange(T)[None]
    h, lg = d.step(b.tokens[:, 1 : p + 2], h0, pos, ck, cv, bias)
    torch.testing.assert_close(lg[:, p], batched[0][:, p])
    K0, V0 = ck[0], cv[0]
    hp, tok = h[:, p : p + 1], d.hot_ids[lg[:, p : p + 1].argmax(-1)]
    own_k, own_v = [], []
    for j in range(1, k):
        # one query row at position p + j attending prefix keys 0..p (step 0) and its own chain
        ck2, cv2 = [K0] + own_k, [V0] + own_v
        bias1 = torch.zeros(1, 1, 1, T)
        h2, lg2 = d.step(tok, hp, torch.tensor([[p + j]]), ck2, cv2, bias1)
        own_k, own_v = ck2[1:], cv2[1:]
        torch.testing.assert_close(lg2[:, 0], batched[j][:, p], rtol=1e-4, atol=1e-5)
        hp, tok = h2, d.hot_ids[lg2.argmax(-1)]


def test_ttt_loss_backprop_and_stats():
    cfg = toy_cfg()
    d = toy_drafter(cfg)
    b = toy_batch(cfg)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    loss, stats = ttt_loss(d, b, head, steps=3, gamma=0.8)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert d.fc.weight.grad is not None and d.fc.weight.grad.abs().sum() > 0
    assert d.embed_tokens.weight.grad is None
    assert set(stats) >= {"loss_0", "acc_2", "n_1"}
    # later steps see fewer rows (shift past the end)
    assert stats["n_0"] > stats["n_2"] > 0


def test_ttt_loss_drops_when_fitting_one_batch():
    cfg = toy_cfg()
    d = toy_drafter(cfg)
    b = toy_batch(cfg)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(60):
        loss, stats = ttt_loss(d, b, head, steps=2, gamma=0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = first if first is not None else float(loss.detach())
    assert float(loss.detach()) < 0.5 * first


def test_walk_counts_cycles_like_an_engine():
    # accepted at each row; a cycle at p accepting a moves to p + a + 1
    acc = [2, 0, 0, 1, 0, 3, 0, 0, 0]
    chk = [3] * 9
    assert walk(acc, chk, 0, 9) == [2, 1, 3]  # rows 0, 3, 5, then 9 ends


def test_offline_perfect_drafter_hits_k_plus_one():
    """When the target's greedy choice always equals the draft, tau = k + 1 (minus the tail)."""
    cfg = toy_cfg(hidden_size=128, head_dim=32)  # hidden >= vocab: an identity target head
    d = toy_drafter(cfg)
    T, k = 40, 3
    b = toy_batch(cfg, B=1, T=T)
    logits = d.unroll(b.aux, b.tokens, k, teacher_tokens=False)
    drafted = [d.hot_ids[lg.argmax(-1)][0] for lg in logits]  # drafted[j][p] aims at pos p+1+j
    # the engine walk from row 0 visits rows 0, 4, 8, ... when everything is accepted
    t_arg = torch.zeros(T, dtype=torch.long)
    for p in range(0, T, k + 1):
        for j in range(k):
            if p + 1 + j < T:
                t_arg[p + 1 + j] = drafted[j][p]
    head = torch.eye(cfg.vocab_size, cfg.hidden_size)
    b.final = head[t_arg][None] * 10.0
    res = offline_accept_length(d, [(b, [1])], head, k)
    # rows 0..32 accept k each; the last cycle (row 36) can check only 2 drafts before the end
    assert res["num_cycles"] == 10
    assert res["num_accepted_tokens"] == 9 * k + 2
    assert res["accept_rate_pos_0"] == 1.0
    # a target that never agrees gives tau = 1
    b.final = head[(t_arg + 1) % cfg.vocab_size][None] * 10.0
    worst = offline_accept_length(d, [(b, [1])], head, k)
    assert worst["accept_length"] <= 1.2
