"""A step's samples and batch (draftport.training.batches): the token budget's cut, its fixed
shape and its refusals, the next batch made on a host thread, and a resumed run drawing what the
uninterrupted one drew."""

import pytest
import torch
from helpers.toys import make_features, toy_drafter, weights

from draftport.errors import DraftportError
from draftport.training.batches import StepBatches, TokenBudget
from draftport.training.loop import TrainConfig, train


def test_token_budget_cuts_the_seeded_order_into_parts_that_fit():
    lengths = [5, 9, 3, 7, 11, 2, 8, 6, 4, 10]
    tb = TokenBudget(lengths, budget=16, seed=3, world=2)
    stream = []
    for step in range(12):
        for rank in range(2):
            ids = tb.ids(step, rank)
            assert ids and sum(lengths[i] for i in ids) <= 16
            stream += ids
    # the parts are consecutive pieces of the seeded epochs: every epoch covers every sample once
    n = len(lengths)
    for e in range(len(stream) // n):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
    # a fresh plan asked at a later step (a resume) draws the same part, and counts what came before
    again = TokenBudget(lengths, budget=16, seed=3, world=2)
    assert again.ids(7, 1) == tb.ids(7, 1)
    assert again.consumed(7) == sum(len(tb.ids(s, r)) for s in range(7) for r in range(2))


def test_token_budget_refuses_a_sample_longer_than_it_and_needs_packing(tmp_path):
    with pytest.raises(DraftportError, match=r"train\.tokens_per_step: 8 is smaller than sample 1 \(9 tokens\)"):
        TokenBudget([5, 9, 3], budget=8, seed=0, world=1)
    fs, _ = make_features(tmp_path)
    with pytest.raises(DraftportError, match=r"train\.tokens_per_step: 64 needs train\.packing: true"):
        StepBatches(fs, TrainConfig(tokens_per_step=64), 0, 1, torch.device("cpu"))


def test_a_token_budget_gives_every_step_one_shape_and_the_lengths_its_shards_hold(tmp_path):
    fs, _ = make_features(tmp_path)
    cfg = TrainConfig(packing=True, tokens_per_step=48)
    src = StepBatches(fs, cfg, 0, 1, torch.device("cpu"))
    for step in range(6):
        lengths, batch = src.get(step)
        assert batch.tokens.shape == (1, 48)  # one row of exactly the budget
        assert int(batch.valid.sum()) == sum(lengths) <= 48
        assert lengths == [fs.length(i) for i in src.ids(step)]
    assert [fs.length(i) for i in range(len(fs))] == [int(fs.sample(i)["tokens"].shape[0]) for i in range(len(fs))]


def test_the_next_batch_made_on_a_host_thread_is_the_batch_made_in_line(tmp_path):
    fs, _ = make_features(tmp_path)
    cfg = TrainConfig(packing=True, batch_size=4)
    inline = StepBatches(fs, cfg, 0, 1, torch.device("cpu"), ahead=False)
    ahead = StepBatches(fs, cfg, 0, 1, torch.device("cpu"), ahead=True)
    for step in (0, 1, 2, 5, 6):  # in order, then a jump (a resume): the thread's batch is not used
        (la, a), (lb, b) = inline.get(step), ahead.get(step)
        assert la == lb and a.cu_seqlens == b.cu_seqlens
        assert torch.equal(a.aux, b.aux) and torch.equal(a.tokens, b.tokens)
    ahead.close()


def test_a_token_budget_training_resumes_to_the_uninterrupted_drafter(tmp_path):
    fs, head = make_features(tmp_path)
    cfg = TrainConfig(
        steps=6, lr=3e-3, warmup_steps=1, checkpoint_every=3, log_every=1, packing=True, tokens_per_step=40
    )
    whole = toy_drafter(seed=5)
    res = train(whole, fs, head, tmp_path / "whole", cfg, progress=False)
    assert res["run"]["steps"] == 6 and res["run"]["compiles"] == 0  # the reference impl compiles nothing
    part = toy_drafter(seed=5)
    train(part, fs, head, tmp_path / "part", cfg, progress=False, stop_after=3)
    again = toy_drafter(seed=5)
    res = train(again, fs, head, tmp_path / "part", cfg, progress=False)
    assert res["resumed_from"] == 3
    for k, v in weights(whole).items():
        assert torch.equal(v, weights(again)[k]), k
