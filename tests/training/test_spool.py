"""Online features (draftport.training.spool): a drafter trained on the spool equals one trained on a disk
capture of the same samples, the spool never holds more than its bound, a resume yields the
uninterrupted run's samples, and bad input or a failing capture gives one error."""

import pytest
import torch
from tiny_targets import LLAMA_AUX, LLAMA_VOCAB, H, tiny_llama
from toys import toy_cfg, toy_drafter, weights

from draftport.data.features import featurizer
from draftport.data.shards import FeatureSet, Sequence, write_features
from draftport.errors import DraftportError
from draftport.training.loop import TrainConfig, batch_ids, train
from draftport.training.spool import MARKER, SpoolFeatures, _files_bytes, consumption_order

META = {"aux_layer_ids": LLAMA_AUX, "aux_convention": "vllm"}
BIG = 10**9


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A 2-layer random Llama in float32 on the CPU and its featurizer."""
    m = tiny_llama(tmp_path_factory.mktemp("spool") / "target", seed=0)
    return m, featurizer(m, LLAMA_AUX, "vllm", "cpu", pad=0)


def sequences(n=12, seed=0, lengths=(10, 20)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(lengths[0], lengths[1], (1,), generator=g)) if lengths[1] > lengths[0] else lengths[0]
        out.append(Sequence(torch.randint(0, LLAMA_VOCAB, (T,), generator=g).tolist(), 3))
    return out


def spool(tmp, seqs, featurize, order, **kw):
    args = dict(
        order=order,
        spool_dir=tmp / "spool",
        spool_bytes=BIG,
        shard_samples=4,
        batch_size=1,
        hidden_size=H,
        meta=META,
        dtype="float32",
    )
    args.update(kw)
    return SpoolFeatures(seqs, featurize, **args)


def test_consumption_order_is_trains_batches():
    order = consumption_order(10, 5, 4, seed=3)
    assert order == [i for s in range(5) for i in batch_ids(s, 10, 4, 3)] and len(order) == 20
    assert consumption_order(10, 5, 4, seed=3, start_step=2) == order[8:]


def test_a_drafter_trained_online_equals_one_trained_on_disk(tmp_path, target):
    model, featurize = target
    head = model.lm_head.weight.detach().float()
    seqs = sequences(12)
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=6, log_every=2)
    write_features(tmp_path / "disk", seqs, featurize, meta=META, shard_samples=4, batch_size=1, dtype="float32")
    disk = toy_drafter(toy_cfg(vocab_size=LLAMA_VOCAB), seed=5)
    init = weights(disk)
    train(disk, FeatureSet(tmp_path / "disk"), head, tmp_path / "run_disk", cfg, progress=False)

    order = consumption_order(len(seqs), cfg.steps, cfg.batch_size, cfg.seed)
    online = toy_drafter(toy_cfg(vocab_size=LLAMA_VOCAB), seed=5)
    with spool(tmp_path, seqs, featurize, order) as sp:
        assert len(sp) == len(seqs)
        train(online, sp, head, tmp_path / "run_online", cfg, progress=False)
        assert sp.position == len(order)
    assert not (tmp_path / "spool").exists()
    a, b = weights(disk), weights(online)
    assert any(not torch.equal(init[k], a[k]) for k in a)  # training moved the weights
    for k in a:
        assert torch.allclose(a[k], b[k]), k


def test_the_spool_never_holds_more_than_its_bound(tmp_path, target):
    model, featurize = target
    head = model.lm_head.weight.detach().float()
    seqs = sequences(12, lengths=(16, 16))  # equal shards
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=6, log_every=2)
    order = consumption_order(len(seqs), cfg.steps, cfg.batch_size, cfg.seed)  # 24 positions, 6 shards of 4
    with spool(tmp_path, seqs, featurize, order[:4]) as probe:
        one = probe.projected(0)
    bound = int(2.5 * one)
    seen, calls = [], []

    def watched(batch):  # runs in the producer's thread, while a shard is being written
        calls.append(len(batch))
        seen.append(_files_bytes(tmp_path / "spool"))
        return featurize(batch)

    with spool(tmp_path, seqs, watched, order, spool_bytes=bound) as sp:
        with sp._cond:  # two shards fit, a third does not: the producer waits for the trainer
            assert sp._cond.wait_for(lambda: len(sp._ready) == 2 or sp._error is not None, timeout=60)
            assert sp._error is None and sum(calls) == 8
        train(toy_drafter(toy_cfg(vocab_size=LLAMA_VOCAB), seed=1), sp, head, tmp_path / "run", cfg, progress=False)
        assert sum(calls) == len(order)
        assert 2 * one >= sp.max_bytes_seen > one and sp.max_bytes_seen <= bound
        assert max(seen) <= bound
        assert [p.name for p in (tmp_path / "spool").iterdir()] == [MARKER]  # every shard deleted once read
    assert not (tmp_path / "spool").exists()


def test_a_resumed_spool_yields_the_uninterrupted_runs_samples(tmp_path, target):
    _, featurize = target
    seqs = sequences(12)
    order = consumption_order(len(seqs), 4, 4, seed=0)  # 16 positions
    kw = dict(shard_samples=4, batch_size=2)
    with spool(tmp_path, seqs, featurize, order, **kw) as sp:
        full = [sp.sample(i) for i in order]
    K = 6  # mid-shard, at a batch boundary of its shard
    with spool(tmp_path, seqs, featurize, order, **kw) as sp:
        for i in order[:K]:
            sp.sample(i)
        assert sp.position == K
    assert not (tmp_path / "spool").exists()
    # a killed run leaves its spool behind: the next one clears it
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / MARKER).touch()
    (tmp_path / "spool" / "shard_99999").mkdir()
    featurized = []

    def counted(batch):
        featurized.extend(batch)
        return featurize(batch)

    with spool(tmp_path, seqs, counted, order, start=K, **kw) as sp:
        assert sp.position == K
        assert not (tmp_path / "spool" / "shard_99999").exists()
        rest = [sp.sample(i) for i in order[K:]]
        assert sp.position == len(order)
    assert featurized == [seqs[i] for i in order[K:]]  # the producer restarted at K, not at its shard's start
    assert len(rest) == len(order) - K
    for a, b in zip(full[K:], rest):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


def test_a_failing_capture_is_raised_in_the_trainer(tmp_path, target):
    _, featurize = target
    seqs = sequences(12)
    order = consumption_order(len(seqs), 4, 4, seed=0)
    n = []

    def failing(batch):
        n.append(1)
        if len(n) == 6:  # the second shard's second batch
            raise RuntimeError("the target ran out of memory on batch 6")
        return featurize(batch)

    sp = spool(tmp_path, seqs, failing, order)
    with pytest.raises(RuntimeError, match="the target ran out of memory on batch 6"):
        for i in order:
            sp.sample(i)
    assert sp.position <= 4  # only the first shard was ever complete
    sp.close()
    assert not (tmp_path / "spool").exists()


def test_reading_out_of_order_is_refused(tmp_path, target):
    _, featurize = target
    seqs = sequences(12)
    order = consumption_order(len(seqs), 2, 4, seed=0)
    assert order[0] != order[1]
    with spool(tmp_path, seqs, featurize, order) as sp:
        with pytest.raises(DraftportError, match="at data position 0.*out of order"):
            sp.sample(order[1])
        sp.sample(order[0])  # the right one still reads
        assert sp.position == 1


def test_a_bound_below_one_shard_is_refused(tmp_path, target):
    _, featurize = target
    seqs = sequences(12)
    order = consumption_order(len(seqs), 2, 4, seed=0)
    with pytest.raises(DraftportError, match="spool_gb.*less than one shard") as e:
        spool(tmp_path, seqs, featurize, order, spool_bytes=1000)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "spool").exists()
    (tmp_path / "spool").mkdir()
    (tmp_path / "spool" / "mine.txt").write_text("not a spool")
    with pytest.raises(DraftportError, match="not a spool"):
        spool(tmp_path, seqs, featurize, order)
    assert (tmp_path / "spool" / "mine.txt").read_text() == "not a spool"
    with pytest.raises(DraftportError, match="sample id 12 is not one of the 12"):
        spool(tmp_path / "x", seqs, featurize, order + [12])
