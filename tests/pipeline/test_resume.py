"""Nothing lost: a training phase killed with SIGKILL resumes from its last checkpoint when the same
command runs again, under Snakemake and under DVC, and ends with the weights and accept length of
an uninterrupted run (micro profile, real processes, in copies of the repository).

Plus the pieces, fast: a checkpoint of other inputs is set aside, Snakemake's lock of a dead
process is cleared and a live one's is not.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from repo import BIN
from resume_copy import EVERY, STEP, STEPS, Copy, assert_same_result, kill_after_first_checkpoint
from toys import make_features, toy_drafter

from draftport.errors import DraftportError
from draftport.pipeline import bridge, runner
from draftport.progress import Logger
from draftport.training.loop import TrainConfig, latest_checkpoint, resumable, train


@pytest.fixture(scope="module")
def base(tmp_path_factory, micro_upstream):
    """The micro profile with a longer control phase; everything upstream of it built once (for the
    session: conftest's micro_upstream, a git and DVC copy whose data steps ran under Snakemake)."""
    root = tmp_path_factory.mktemp("resume")
    c = Copy(micro_upstream).clone(root / "base")
    params = c.path / "params.yaml"
    cfg = yaml.safe_load(params.read_text())
    # the control's training values: no step upstream of it reads them
    cfg["phase1"]["train"].update(steps=STEPS, checkpoint_every=EVERY, log_every=EVERY // 2)
    params.write_text("# the micro profile, merged (test copy)\n" + yaml.safe_dump(cfg, sort_keys=False))
    c.run("git", "add", "-A")
    c.run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a longer control phase")
    # nothing upstream of the control reruns for the edit: the data steps are done
    plan = c.run(BIN / "snakemake", "-n", "vocab_new", "features_eval", "features_monitor").stdout
    assert "Nothing to be done" in plan, plan[-3000:]
    return c


@pytest.fixture(scope="module")
def copies(base, tmp_path_factory):
    """Two copies to kill in, then the uninterrupted reference run in the base."""
    root = tmp_path_factory.mktemp("killed")
    smk, dvc = base.clone(root / "smk"), base.clone(root / "dvc")
    base.run(sys.executable, f"scripts/{STEP}.py", "--logfile", f"logs/{STEP}.log")  # the rule's command
    assert base.metrics()["resumed_from_step"] == 0
    assert not (base.path / runner.CHECKPOINTS / STEP).exists()  # a finished step drops its resume state
    return {"ref": base, "smk": smk, "dvc": dvc}


@pytest.mark.slow
def test_snakemake_killed_mid_training_resumes_with_the_same_command(copies):
    c = copies["smk"]
    cmd = (BIN / "snakemake", "--cores", "1", STEP)
    killed_at = kill_after_first_checkpoint(c, cmd)
    assert list((c.path / ".snakemake" / "locks").glob("*.lock"))  # what a kill -9 leaves behind
    r = c.run(*cmd)
    assert "left by killed run" in r.stderr
    assert_same_result(c, copies["ref"], killed_at)
    assert json.loads(c.run(BIN / "dvc", "status", "--json", STEP).stdout) == {}


@pytest.mark.slow
def test_dvc_repro_killed_mid_training_resumes_with_the_same_command(copies):
    c = copies["dvc"]
    cmd = (BIN / "dvc", "repro", STEP)
    killed_at = kill_after_first_checkpoint(c, cmd)
    c.run(*cmd)
    assert_same_result(c, copies["ref"], killed_at)
    assert json.loads(c.run(BIN / "dvc", "status", "--json", STEP).stdout) == {}
    assert "Nothing to be done" in c.run(BIN / "snakemake", "-n", STEP).stdout


# ---- the pieces -----------------------------------------------------------------------------------
def test_checkpoint_of_other_inputs_is_set_aside_not_resumed(tmp_path):
    fs, head = make_features(tmp_path)
    cfg = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=2, log_every=2)
    ck = tmp_path / "ck"
    train(
        toy_drafter(seed=5),
        fs,
        head,
        tmp_path / "run",
        cfg,
        progress=False,
        stop_after=2,
        ckpt_dir=ck,
        inputs={"features": "a"},
    )
    assert [p.name for p in ck.iterdir()] == ["step_0000002"]
    again = train(
        toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, progress=False, ckpt_dir=ck, inputs={"features": "a"}
    )
    assert again["resumed_from"] == 2
    other = train(
        toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, progress=False, ckpt_dir=ck, inputs={"features": "b"}
    )
    assert other["resumed_from"] == 0 and other["steps"] == 4
    assert list(tmp_path.glob("ck.stale-*"))


def test_lock_of_a_dead_snakemake_is_cleared_a_live_ones_is_not(tmp_path):
    class Persistence:
        def __init__(self, *files):
            self._lockfile = {f"k{i}": str(f) for i, f in enumerate(files)}

    locks, owners = tmp_path / "locks", tmp_path / "owners"
    locks.mkdir()
    mine, dead = locks / "0.input.lock", locks / "1.input.lock"
    for f in (mine, dead):
        f.write_text("artifacts/phase1/metrics.json\n")
    bridge.note_lock_owner(Persistence(mine), root=str(owners))  # this live process
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rec = json.loads((owners / f"{os.getpid()}.json").read_text())
    rec.update(pid=gone.pid, locks={str(dead): bridge._lock_id(dead)})
    (owners / f"{gone.pid}.json").write_text(json.dumps(rec))
    later = locks / "2.output.lock"  # a later run's lock that a dead record must not touch
    later.write_text("x\n")
    rec2 = dict(rec, pid=gone.pid + 100000, locks={str(later): "0:0"})
    (owners / "other.json").write_text(json.dumps(rec2))
    msgs = []
    assert bridge.clear_stale_locks(root=str(owners), log=msgs.append) == 1
    assert mine.exists() and later.exists() and not dead.exists()
    assert "left by killed run" in msgs[0]


def test_non_finite_loss_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    fs, head = make_features(tmp_path)
    cfg = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=2, log_every=2)

    class Poison(Logger):  # the target's head goes bad after step 2 (logged before its checkpoint)
        def log_metrics(self, metrics, step):
            if step == 2:
                head.fill_(float("nan"))

    ck = tmp_path / "ck"
    with pytest.raises(DraftportError) as e:
        train(toy_drafter(seed=5), fs, head, tmp_path / "run", cfg, logger=Poison(), progress=False, ckpt_dir=ck)
    assert str(e.value) == (
        f"train step 4: loss is not finite (at or before this step); last good checkpoint kept in {ck}"
    )
    assert [p.name for p in ck.iterdir()] == ["step_0000002"]
    assert resumable(latest_checkpoint(ck), cfg)


def test_a_finished_curve_point_s_record_replaces_its_checkpoints(tmp_path, monkeypatch):
    """A curve point (or budget seed) that finished writes its result beside the step's
    checkpoints and removes its own (a real-shape point's weights and moments filled a 64 GB GPU
    node by the sixth point); a killed step that runs again reads the record instead of training
    the point, and a record of another job (other steps) is not taken."""
    from draftport.pipeline.steps import curve_steps
    from draftport.training import phases

    ckpt = tmp_path / "checkpoints" / "train_curves" / "source_n8_s0"
    pt = {"name": "source_n8_s0", "arm": "source", "init": "source", "n_samples": 8, "seed": 0}
    kw = {"features_dir": [str(tmp_path / "feats")], "n_samples": 8, "init": "source", "ckpt_dir": ckpt}
    job = {"i": 1, "of": 1, "point": pt, "kw": kw, "train": {"steps": 4}, "out": str(tmp_path / "p"), "parent": None}
    trained = []

    def fake_train_phase(out, logger=None, progress=True, **kw):  # the checkpoint a training leaves
        trained.append(kw["train_cfg"].steps)
        (kw["ckpt_dir"] / "step_0000004").mkdir(parents=True)
        return {"train_steps": 4, "stopped_early": False, "curve": [[4, 1.0]], "final": {"loss": 1.0}, "run": {}}

    monkeypatch.setattr(phases, "train_phase", fake_train_phase)
    res = curve_steps._train_point(job)
    assert trained == [4] and not ckpt.exists() and res["train_steps"] == 4
    assert json.loads(curve_steps.done_path(job).read_text())["result"] == res
    assert curve_steps._train_point(job) == res and trained == [4]  # read, not trained again
    other = {**job, "train": {"steps": 5}}
    assert curve_steps.finished(other) is None
    curve_steps._train_point(other)
    assert trained == [4, 5]


@pytest.mark.slow
def test_torchrun_training_rule_two_ranks_match_one_process(copies, tmp_path):
    """resources.<rule>.torchrun: Snakemake launches the step under torchrun (gloo on the CPU);
    both ranks train, rank 0 alone writes, and the result is the one-process run's up to the
    order of float sums (DDP averages the two half-batch gradients)."""
    ref = copies["ref"]
    c = ref.clone(tmp_path / "torchrun")
    shutil.rmtree(c.path / "artifacts" / STEP)
    cfg = yaml.safe_load((c.path / "params.yaml").read_text())
    cfg.setdefault("resources", {})[STEP] = {"gpu": 2, "torchrun": True}
    (c.path / "params.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    plan = c.run(BIN / "snakemake", "-n", "-p", STEP).stdout
    assert f"torchrun --standalone --nproc_per_node 2 scripts/{STEP}.py --input features=" in plan
    c.run(BIN / "snakemake", STEP, "--cores", "2", "--resources", "gpu=2")  # target first: --resources takes several
    m, r = c.metrics(), ref.metrics()
    assert m["train_processes"] == 2 and r["train_processes"] == 1
    assert m["train_steps"] == r["train_steps"] == STEPS
    assert m["final_loss"] == pytest.approx(r["final_loss"], rel=1e-3)
    a, b = c.weights(), ref.weights()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-4), k
    assert not list((c.path / "artifacts").glob(f".{STEP}*"))  # no rank left a folder behind
