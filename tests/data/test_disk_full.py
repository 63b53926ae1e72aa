"""A full disk while writing features or a training checkpoint: one-line error naming the path and
the cause, the previous good checkpoint intact, no half-written file under a trusted name.

The full disk is real: a small tmpfs mounted for the test (root), or else a per-file size limit
(RLIMIT_FSIZE, EFBIG) set in the process that writes. The writes run in a subprocess either way.
"""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from toys import make_features, toy_drafter

from draftport.data.shards import FeatureSet, Sequence, write_features
from draftport.errors import DraftportError
from draftport.training.loop import TrainConfig, latest_checkpoint, resumable, train

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ROOT / "tests" / "helpers"  # what the worker (this file, in its own process) imports


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.fixture
def small_place(tmp_path):
    """-> (mode, mount(folder, kib)): 'tmpfs' where mounting works, else 'rlimit'."""
    mounted = []

    def mount(folder: Path, kib: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if mode == "tmpfs":
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(folder)], check=True)
            mounted.append(folder)

    probe = tmp_path / "probe"
    probe.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(probe)], capture_output=True)
    mode = "tmpfs" if r.returncode == 0 else "rlimit"
    if mode == "tmpfs" and os.environ.get("DRAFTPORT_TEST_DISK") == "rlimit":  # try the fallback here
        subprocess.run(["umount", str(probe)], check=True)
        mode = "rlimit"
        yield mode, mount
        return
    if mode == "tmpfs":
        subprocess.run(["umount", str(probe)], check=True)
    yield mode, mount
    for f in mounted:
        subprocess.run(["umount", "-l", str(f)], check=False)


def worker(what: str, mode: str, folder: str, limit: int, extra: str) -> None:
    """The write that runs out of space, in its own process; prints the outcome as JSON."""
    if mode == "rlimit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    torch.set_num_threads(1)
    try:
        if what == "features":
            features(Path(folder))
        else:
            fs = FeatureSet(extra)
            head = load_file(str(Path(extra) / "head.safetensors"))["head"]
            train(
                toy_drafter(seed=5),
                fs,
                head,
                Path(folder) / "run",
                ckpt_cfg(),
                progress=False,
                ckpt_dir=Path(folder) / "ck",
            )
        print(json.dumps({"ok": True}))
    except DraftportError as e:
        print(json.dumps({"error": str(e)}))


def features(out: Path, n: int = 24):
    g = torch.Generator().manual_seed(0)
    seqs = [Sequence(torch.randint(0, 100, (16,), generator=g).tolist(), 3) for _ in range(n)]

    def featurize(batch):
        return torch.randn(len(batch), 16, 3 * 64, generator=g), torch.randn(len(batch), 16, 64, generator=g)

    return write_features(out, seqs, featurize, meta={"aux_layer_ids": [1, 2, 3]}, shard_samples=8, dtype="float32")


def ckpt_cfg():
    return TrainConfig(
        steps=4, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=2, log_every=2, keep_checkpoints=2
    )


def run_worker(what, mode, folder, limit=0, extra=""):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{HELPERS}"}
    r = subprocess.run(
        [sys.executable, __file__, what, mode, str(folder), str(limit), str(extra)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_features_on_a_full_disk(tmp_path, small_place):
    mode, mount = small_place
    features(tmp_path / "full_size")
    need = dir_bytes(tmp_path / "full_size")
    shard = max(p.stat().st_size for p in (tmp_path / "full_size").glob("shard_*"))
    place = tmp_path / "small"
    mount(place, need // 2 // 1024)
    out = place / "feats"
    res = run_worker("features", mode, out, limit=shard // 2)
    err = res["error"]
    assert "\n" not in err and err.startswith(f"{out}: disk full (")
    assert ("no space left on device" if mode == "tmpfs" else "file size limit exceeded") in err
    assert not out.exists()  # nothing under the trusted name
    assert [p.name for p in place.iterdir() if p.name != "lost+found"] == []  # no temp folder left


def test_checkpoint_on_a_full_disk_keeps_the_last_good_one(tmp_path, small_place):
    mode, mount = small_place

    _, head = make_features(tmp_path)
    feats = tmp_path / "feats"
    save_file({"head": head}, str(feats / "head.safetensors"))
    # the size of one checkpoint, written where space is plenty
    assert run_worker("checkpoint", "none", tmp_path / "sizing", extra=feats) == {"ok": True}
    one = dir_bytes(tmp_path / "sizing" / "ck" / "step_0000002")
    place = tmp_path / "small"
    mount(place, int(one * 1.5) // 1024)  # room for one checkpoint, not two
    limit = 0
    if mode == "rlimit":  # a per-file limit: step 2 is written without it, the resumed run has it
        shutil.copytree(tmp_path / "sizing" / "ck" / "step_0000002", place / "ck" / "step_0000002")
        limit = max(p.stat().st_size for p in (place / "ck" / "step_0000002").iterdir()) // 2
    res = run_worker("checkpoint", mode, place, limit=limit, extra=feats)
    err = res["error"]
    ck = place / "ck"
    assert "\n" not in err and err.startswith(f"{ck / 'step_0000004'}: disk full (")
    assert f"the last good one is kept: {ck / 'step_0000002'}" in err
    assert [p.name for p in ck.iterdir()] == ["step_0000002"]  # no half-written step_0000004
    good = latest_checkpoint(ck)
    assert good == ck / "step_0000002" and resumable(good, ckpt_cfg())
    assert dir_bytes(good) == one


if __name__ == "__main__":
    worker(*sys.argv[1:6])
