"""The port recipes of a train group: `l2sp_lambda` (the L2-SP anchor to the weights a training
starts from) and `freeze` (named parts kept at their initial weights). Off, a training is the one
it was without the keys (an older checkpoint resumes bit-exactly); on, the anchor is the gradient
of its loss term and holds the weights near w0, frozen parts stay bit-identical and get no
optimizer state, and a resume anchors to the same w0."""

import json
import typing

import pytest
import torch
from safetensors.torch import load_file
from toys import make_features, toy_batch, toy_cfg, toy_drafter, weights

from draftport.errors import DraftportError
from draftport.plan import params as schema
from draftport.training import loop
from draftport.training.loop import TrainConfig, add_l2sp_grad, train
from draftport.training.phases import train_phase
from draftport.training.ttt import combine, ttt_terms

BASE = dict(steps=8, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=4, log_every=2)


def trained(d: torch.nn.Module) -> dict:
    return {n: p.detach().clone() for n, p in d.named_parameters() if n != "embed_tokens.weight"}


def dist2(a: dict, b: dict) -> float:
    return sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a)


@pytest.fixture(scope="module")
def feats(tmp_path_factory):
    return make_features(tmp_path_factory.mktemp("recipes"))


def test_off_is_the_training_without_the_keys_and_an_older_checkpoint_resumes(feats, tmp_path):
    fs, head = feats
    plain = toy_drafter(seed=5)
    a = train(plain, fs, head, tmp_path / "plain", TrainConfig(**BASE), progress=False)
    off = toy_drafter(seed=5)
    b = train(off, fs, head, tmp_path / "off", TrainConfig(**BASE, l2sp_lambda=0.0, freeze=[]), progress=False)
    assert a["history"] == b["history"] and not any("l2sp_penalty" in r for r in b["history"])
    wa, wb = weights(plain), weights(off)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert {n for n, p in off.named_parameters() if p.requires_grad} == set(trained(off))  # all but the embedding
    # a checkpoint written before the keys existed (its config without them, no anchor) resumes
    part = tmp_path / "part" / "checkpoints"
    train(toy_drafter(seed=5), fs, head, tmp_path / "part", TrainConfig(**BASE), progress=False, stop_after=5)
    state = part / "step_0000004" / "state.json"
    s = json.loads(state.read_text())
    for key in ("l2sp_lambda", "freeze"):
        del s["config"][key]
    assert "anchor" not in s
    state.write_text(json.dumps(s) + "\n")
    res = train(toy_drafter(seed=5), fs, head, tmp_path / "part", TrainConfig(**BASE), progress=False)
    assert res["resumed_from"] == 4
    last = load_file(str(part / "step_0000008" / "model.safetensors"))  # what the resumed run ended with
    assert all(torch.equal(wa[k], last[k]) for k in wa)


def test_the_anchor_is_the_gradient_of_its_loss_term():
    """add_l2sp_grad after backward == autograd of loss + lambda * sum ||w - w0||^2."""
    cfg = toy_cfg()
    batch = toy_batch(cfg, B=2, T=12)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    d = toy_drafter(seed=2)
    params = {n: p for n, p in d.named_parameters() if p.requires_grad}
    w0 = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():  # away from the anchor, as after some steps
        for p in params.values():
            p.add_(0.01 * torch.randn_like(p))
    lam = 0.37

    def loss_of():
        loss, _ = combine(ttt_terms(d, batch, head, 2), 0.8)
        return loss

    d.zero_grad(set_to_none=True)
    (loss_of() + lam * sum((p - w0[n]).pow(2).sum() for n, p in params.items())).backward()
    want = {n: p.grad.clone() for n, p in params.items()}
    d.zero_grad(set_to_none=True)
    loss_of().backward()
    sq = add_l2sp_grad(list(params.values()), [w0[n] for n in params], lam)
    for n, p in params.items():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)
    assert abs(float(sq) - dist2(trained(d), w0)) < 1e-6 * float(sq)


def test_a_large_lambda_holds_the_weights_near_their_start(feats, tmp_path):
    fs, head = feats
    cfg = dict(BASE, steps=16, checkpoint_every=16, log_every=4)
    w0 = trained(toy_drafter(seed=5))
    free, held = toy_drafter(seed=5), toy_drafter(seed=5)
    train(free, fs, head, tmp_path / "free", TrainConfig(**cfg), progress=False)
    res = train(held, fs, head, tmp_path / "held", TrainConfig(**cfg, l2sp_lambda=10.0), progress=False)
    moved_free, moved_held = dist2(trained(free), w0) ** 0.5, dist2(trained(held), w0) ** 0.5
    assert moved_held < 0.3 * moved_free, (moved_held, moved_free)  # measured: 0.05
    rec = res["history"][-1]  # logged before the last update: the distance then, and lambda times its square
    assert 0 < rec["anchor_distance"] <= 1.5 * moved_held
    assert rec["l2sp_penalty"] == pytest.approx(10.0 * rec["anchor_distance"] ** 2, rel=1e-3)


@pytest.mark.parametrize(
    "impl, freeze",
    [("reference", ["fc", "input_norms"]), ("fused", ["attention", "mlp", "post_attention_norm", "final_norm"])],
)
def test_frozen_parts_stay_bit_identical_and_get_no_optimizer_state(feats, tmp_path, impl, freeze):
    fs, head = feats
    d = toy_drafter(seed=5)
    start = trained(d)
    train(
        d, fs, head, tmp_path / "run", TrainConfig(**BASE, impl=impl, freeze=freeze, l2sp_lambda=0.01), progress=False
    )
    frozen = {n for part in freeze for n in TrainConfig.FREEZE_PARTS[part]}
    after = trained(d)
    for n in start:
        assert torch.equal(after[n], start[n]) == (n in frozen), n
    moments = load_file(str(tmp_path / "run" / "checkpoints" / "step_0000008" / "optimizer.safetensors"))
    with_state = {k.rsplit(".", 1)[0] for k in moments if k.endswith(".exp_avg")}
    assert with_state == set(start) - frozen


def test_the_parts_name_every_trained_weight_but_lm_head():
    names = [n for ns in TrainConfig.FREEZE_PARTS.values() for n in ns]
    d = toy_drafter()
    assert sorted(names + ["lm_head.weight"]) == sorted(n for n, p in d.named_parameters() if p.requires_grad)
    (literal,) = typing.get_args(TrainConfig.model_fields["freeze"].annotation)  # list[Literal[...]]
    assert list(TrainConfig.FREEZE_PARTS) == list(typing.get_args(literal))


def test_resume_with_the_anchor_is_bit_exact_and_needs_the_same_start(feats, tmp_path):
    fs, head = feats
    cfg = TrainConfig(**BASE, l2sp_lambda=0.5, freeze=["fc"])
    full = toy_drafter(seed=5)
    train(full, fs, head, tmp_path / "full", cfg, progress=False)
    train(toy_drafter(seed=5), fs, head, tmp_path / "part", cfg, progress=False, stop_after=6)  # killed at 6; ckpt at 4
    # a new process: the init built again (the anchor), the trained weights from the checkpoint
    res = train(again := toy_drafter(seed=5), fs, head, tmp_path / "part", cfg, progress=False)
    assert res["resumed_from"] == 4 and res["steps"] == 8
    a, b = weights(full), weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # handed another start, the checkpoint would anchor elsewhere: set aside, trained anew
    other = train(toy_drafter(seed=6), fs, head, tmp_path / "part", cfg, progress=False)
    assert other["resumed_from"] == 0 and list(tmp_path.glob("part/checkpoints.stale-*"))


def test_refused_with_one_line_naming_the_key(tmp_path):
    with pytest.raises(DraftportError) as e:  # before any file is read
        train_phase(
            tmp_path,
            features_dir=tmp_path,
            target_dir=tmp_path,
            vocab_path=tmp_path,
            init="scratch",
            train_cfg=TrainConfig(l2sp_lambda=1e-4),
        )
    assert str(e.value).startswith("train.l2sp_lambda: 0.0001: ") and "\n" not in str(e.value)
    parts = "fc, input_norms, attention, post_attention_norm, mlp, final_norm"
    for kw, msg in [
        ({"freeze": ["fcc"]}, f'phase1.train.freeze: unknown part "fcc"; parts: {parts}'),
        (
            {"freeze": ["lm_head"]},
            f"phase1.train.freeze: lm_head: set train_lm_head: false to freeze it; parts: {parts}",
        ),
        ({"freeze": "fc"}, f'phase1.train.freeze: expected a list of part names ({parts}), got "fc"'),
        ({"freeze": ["fc", "fc"]}, 'phase1.train.freeze: "fc" twice'),
        (
            {"freeze": list(TrainConfig.FREEZE_PARTS), "train_lm_head": False},
            "phase1.train.freeze: every part frozen and train_lm_head false: nothing left to train",
        ),
        ({"l2sp_lambda": -1e-4}, "phase1.train.l2sp_lambda: must be >= 0, got -0.0001"),
        ({"l2sp_lambda": float("inf")}, "phase1.train.l2sp_lambda: expected a finite number, got inf"),
    ]:
        with pytest.raises(schema.ParamsError) as e:
            TrainConfig.from_dict({"steps": 3, **kw}, "phase1.train")
        assert str(e.value) == msg
    # plain fields: a recipe is a train group with keys changed
    c = TrainConfig(**{**TrainConfig(steps=3).model_dump(), "l2sp_lambda": 1e-4, "freeze": ["fc"]})
    assert (c.l2sp_lambda, c.freeze) == (1e-4, ["fc"])
    assert loop.TrainConfig is schema.TrainConfig
