"""features.storage online / hybrid on the micro world: the feature steps store the answers only,
each training step captures the states through the bounded spool, and the drafter equals the one
trained on a disk capture of the same samples (allclose: the capture batches samples in reading
order, the disk in input order); a resume from a checkpoint (its data position) gives the
uninterrupted run's weights bit for bit; hybrid keeps the first epoch for the later ones. Then
the pipeline: Phase 1 and Phase 2 under Snakemake with storage online, and a kill -9 of an online
training step resumed by the same command (real processes, in copies of the repository)."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from repo import micro_copy
from resume_copy import EVERY, STEP, STEPS, Copy, assert_same_result, kill_after_first_checkpoint
from safetensors.torch import load_file

from draftport.data.draftmap import build_vocab
from draftport.data.features import build_features
from draftport.data.shards import FeatureSet, SequenceSet, open_set
from draftport.errors import DraftportError
from draftport.model.bind import new_drafter_config
from draftport.model.config import target_text_config
from draftport.plan.params import TrainConfig
from draftport.training import phases
from draftport.training.phases import train_phase

KW = dict(
    n_samples=24,
    aux_layer_ids=[0, 1, 2],
    convention="vllm",
    max_new_tokens=16,
    dtype="float32",
    batch_size=4,
    shard_samples=8,
)
SPOOL = {"gb": 0.0005}  # 500 KB: about two shards of 8 samples, the producer waits on the trainer


@pytest.fixture(scope="module")
def micro(tmp_path_factory, micro_world):
    """The micro world's new target, its answers to 24 prompts stored each way, the draft map."""
    root = tmp_path_factory.mktemp("online-storage")
    (root / "w").symlink_to(micro_world, target_is_directory=True)  # the session's, read only
    target, prompts = root / "w" / "target_new", root / "w" / "corpus" / "new.jsonl"
    for mode in ("disk", "online", "hybrid"):
        build_features(target, prompts, root / mode, storage=mode, **KW)
    tc = target_text_config(target)
    build_vocab(root / "disk", root / "vocab.safetensors", draft_vocab_size=100, vocab_size=tc["vocab_size"])
    arch = new_drafter_config(
        {"num_attention_heads": 2, "intermediate_size": 128},
        vocab_size=tc["vocab_size"],
        hidden_size=tc["hidden_size"],
        aux_layer_ids=[0, 1, 2],
        convention="vllm",
        draft_vocab_size=100,
        max_positions=512,
    )
    return {"root": root, "target": target, "arch": arch}


def run(micro, mode, name, cfg, **kw):
    out = micro["root"] / name
    rep = train_phase(
        out,
        features_dir=micro["root"] / mode,
        target_dir=micro["target"],
        vocab_path=micro["root"] / "vocab.safetensors",
        init="scratch",
        arch=micro["arch"],
        train_cfg=cfg,
        progress=False,
        spool=SPOOL,
        **kw,
    )
    return rep, load_file(str(out / "drafter" / "model.safetensors"))


def cfg(steps):
    return TrainConfig(steps=steps, batch_size=4, lr=3e-3, warmup_steps=1, log_every=2, checkpoint_every=3)


def max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_sequences_folder_holds_the_answers_without_states(micro):
    r = micro["root"]
    on = json.loads((r / "online" / "index.json").read_text())
    assert sorted(p.name for p in (r / "online").iterdir()) == ["index.json", "sequences.safetensors"]
    assert on["storage"] == "online" and on["shards"] == [] and on["capture"]["dtype"] == "float32"
    disk, seqs = FeatureSet(r / "disk"), open_set(r / "online")
    assert isinstance(seqs, SequenceSet) and len(seqs) == len(disk) == 24
    for i in (0, 7, 23):  # the same answers: the states are all that is left out
        a, b = disk.sample(i), seqs.sample(i)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert a["response_start"] == b["response_start"]
    assert (r / "online" / "sequences.safetensors").stat().st_size < 0.02 * sum(
        p.stat().st_size for p in (r / "disk").iterdir()
    )
    # the draft map reads tokens only: the same bytes from either folder
    tc = target_text_config(micro["target"])
    build_vocab(r / "online", r / "vocab_online.safetensors", draft_vocab_size=100, vocab_size=tc["vocab_size"])
    assert (r / "vocab_online.safetensors").read_bytes() == (r / "vocab.safetensors").read_bytes()
    with pytest.raises(DraftportError, match="holds sequences without their states .features.storage online."):
        FeatureSet(r / "online")


def test_a_corrupt_sequences_file_is_refused(micro, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(micro["root"] / "online", bad)
    f = bad / "sequences.safetensors"
    b = bytearray(f.read_bytes())
    b[-3] ^= 0xFF
    f.write_bytes(bytes(b))
    with pytest.raises(DraftportError, match="sequences file is corrupted"):
        open_set(bad)


def test_online_and_hybrid_train_the_disk_drafter(micro):
    """2.3 epochs of 24 samples: online recomputes every epoch through a 500 KB spool, hybrid
    captures the first into its cache and reads the others from it; both end where the disk
    capture's run ends, their spool and cache gone."""
    c = cfg(14)
    rd, wd = run(micro, "disk", "r_disk", c)
    ro, wo = run(micro, "online", "r_online", c)
    rh, wh = run(micro, "hybrid", "r_hybrid", c)
    assert max_diff(wd, wo) < 1e-5 and max_diff(wd, wh) < 1e-5 and max_diff(wo, wh) < 1e-5
    assert max_diff(wd, wo) > 0  # other batch-mates, another rounding: the capture did run in training
    assert abs(ro["final"]["loss"] - rd["final"]["loss"]) < 1e-4
    for name in ("r_online", "r_hybrid"):
        assert not list((micro["root"] / name).glob("checkpoints.spool*")), "spool or cache left behind"


def test_online_with_fp8_states_trains_the_fp8_disk_drafter(micro):
    r, target = micro["root"], micro["target"]
    prompts = r / "w" / "corpus" / "new.jsonl"
    for mode in ("disk", "online"):
        build_features(target, prompts, r / f"fp8_{mode}", storage=mode, **{**KW, "dtype": "fp8_e4m3"})
    assert json.loads((r / "fp8_online" / "index.json").read_text())["capture"]["dtype"] == "fp8_e4m3"
    c = cfg(6)
    _, wd = run(micro, "fp8_disk", "r_fp8_disk", c)
    _, wo = run(micro, "fp8_online", "r_fp8_online", c)
    _, w32 = run(micro, "disk", "r_f32_disk", c)
    assert max_diff(wd, wo) < 1e-5
    assert max_diff(wd, w32) > 10 * max_diff(wd, wo)  # fp8 states did reach the online run


def test_resume_restarts_the_capture_at_the_checkpoints_data_position(micro, monkeypatch):
    c = cfg(14)
    for mode in ("online", "hybrid"):
        _, ref = run(micro, mode, f"ref_{mode}", c)
        name = f"resumed_{mode}"
        orig = phases.train
        monkeypatch.setattr(phases, "train", lambda *a, **k: orig(*a, **{**k, "stop_after": 9}))  # into epoch 2
        run(micro, mode, name, c)
        monkeypatch.setattr(phases, "train", orig)
        state = json.loads((micro["root"] / name / "checkpoints" / "step_0000009" / "state.json").read_text())
        assert state["data_position"] == 9 * 4
        rep, w = run(micro, mode, name, c)
        assert rep["resumed_from_step"] == 9
        assert max_diff(w, ref) == 0, mode


def test_a_checkpoint_at_another_data_position_is_refused(micro, monkeypatch):
    c = cfg(6)
    orig = phases.train
    monkeypatch.setattr(phases, "train", lambda *a, **k: orig(*a, **{**k, "stop_after": 3}))
    run(micro, "online", "moved", c)
    monkeypatch.setattr(phases, "train", orig)
    st = micro["root"] / "moved" / "checkpoints" / "step_0000003" / "state.json"
    st.write_text(json.dumps({**json.loads(st.read_text()), "data_position": 5}))
    with pytest.raises(DraftportError, match="records data position 5, but step 3 x batch 4 reads from 12"):
        run(micro, "online", "moved", c)


def test_a_spool_below_one_shard_is_refused_before_training(micro):
    with pytest.raises(DraftportError, match=r"features.spool_gb: .* is less than one shard"):
        train_phase(
            micro["root"] / "tiny",
            features_dir=micro["root"] / "online",
            target_dir=micro["target"],
            vocab_path=micro["root"] / "vocab.safetensors",
            init="scratch",
            arch=micro["arch"],
            train_cfg=cfg(2),
            progress=False,
            spool={"gb": 1e-6},
        )
    assert not (micro["root"] / "tiny" / "drafter").exists()


# ---- the pipeline -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def online_copy(tmp_path_factory):
    """The micro profile with storage online and a longer control phase (a kill lands between
    its checkpoints), everything upstream of the control built once."""
    path = tmp_path_factory.mktemp("online-pipeline") / "base"

    def edit(c):
        c["features"].update(storage="online", spool_gb=0.05)
        c["phase1"]["train"].update(steps=STEPS, checkpoint_every=EVERY, log_every=EVERY // 2)

    micro_copy(path, edit)
    c = Copy(path)
    c.env["DRAFTPORT_STRICT_MODULES"] = "1"  # a step importing a module its registry row lacks fails
    c.run("git", "init", "-q")
    c.run(
        Path(sys.executable).parent / "snakemake",
        "--cores",
        "2",
        "features_new",
        "features_eval",
        "features_monitor",
        "vocab_new",
    )
    return c


@pytest.mark.slow
def test_online_pipeline_phase1_and_phase2_and_a_killed_training_step(online_copy, tmp_path):
    c = online_copy
    killed = c.clone(tmp_path / "killed")
    killed.env["DRAFTPORT_STRICT_MODULES"] = "1"
    smk = Path(sys.executable).parent / "snakemake"
    cmd = (smk, "--cores", "1", STEP)  # one intra-op thread, as the killed copy's (threads change rounding)
    c.run(*cmd)
    c.run(smk, "--cores", "2", "eval_phase2", "eval_phase1_scratch", "eval_curves")  # + the learning curves
    art = c.path / "artifacts"
    assert json.loads((art / "features_new" / "train" / "index.json").read_text())["storage"] == "online"
    assert not list((art / "features_new" / "train").glob("shard_*"))  # no states on disk
    m = json.loads((art / "features_new" / "metrics.json").read_text())["train"]
    assert m["storage"] == "online" and m["stored_mb"] < 0.05 * m["mb"]
    for ph in ("phase1_scratch", "phase1", "phase2"):
        tau = json.loads((art / f"eval_{ph}" / "metrics.json").read_text())["accept_length"]
        assert 1.0 <= tau <= 4.0, (ph, tau)
    log = (c.path / "logs" / "train_phase2.log").read_text()
    assert "storage (online): need" in log and "spool min(0.05 GB" in log
    assert not list((c.path / "artifacts").rglob("*.spool")), "a spool was left behind"
    points = json.loads((art / "train_curves" / "points.json").read_text())["points"]
    assert len(points) >= 8  # every point (a chain of Phase 1's + Phase 2's answers, its first n) online
    assert (c.path / "logs" / "train_curves.log").read_text().count("storage (online): need") == len(points)

    at = kill_after_first_checkpoint(killed, cmd)
    killed.run(*cmd)
    assert_same_result(killed, c, at)  # bit for bit the uninterrupted online run's weights
