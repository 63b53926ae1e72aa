"""benchmarks/side_by_side.py: ours and the peers at one shape in one call, at once on two GPUs
(here, with no CUDA device, both on the CPU: the orchestration, not a measurement), then ours
scored against the peers' file. The peers' packages are not installed here: their runs fail fast
and leave no records, so the ratios are n/a; what is checked is the pair of runs and the files."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "side_by_side.py"


def side(*args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )


def test_both_runs_at_once_then_ours_is_scored_against_the_peers_file(tmp_path):
    out = tmp_path / "res"
    args = [
        "--shape",
        "toy",
        "--mix",
        "4",
        "--iters",
        "1",
        "--warmup",
        "1",
        "--dir",
        str(out),
        "--suffix=-t",
        "--ours=--lm-head frozen",
    ]
    r = side(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [ours_f] = out.glob("*-h200-train-toy-t.json")
    [peers_f] = out.glob("*-h200-peers-toy-t.json")
    assert len(list(out.glob("*.log"))) == 2 and not list(out.glob("*.tmp"))
    ours, peers = json.loads(ours_f.read_text()), json.loads(peers_f.read_text())
    assert peers["mode"] == "peers-only" and "[ours]" not in peers_f.with_suffix(".log").read_text()
    # the ours-only arguments reached ours alone; the shared ones both
    assert set(ours["by_length"]["64"]["ours"]) == {"frozen_computed", "frozen_stored"}
    assert ours["config"]["seqs"] == peers["config"]["seqs"] == [64] and peers["mix"]["n"] == 4
    assert ours["peers_from"]["file"] == str(peers_f.resolve()) and "rescored" in ours
    assert ours["pairing"]["ours"]["gpu"] == ours["pairing"]["peers"]["gpu"] == "cpu"
    assert "no CUDA device: both run on the CPU" in r.stdout and "[goal] T64 vs the faster peer" in r.stdout
    # a second round under the same names would overwrite the first: refused, nothing run
    before = ours_f.read_text()
    r = side(*args, cwd=tmp_path)
    assert r.returncode == 1 and "exists" in r.stderr and "--suffix" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and ours_f.read_text() == before


def test_bad_arguments_are_one_line_errors(tmp_path):
    for args, why in (
        (["--shape", "toy", "--gpus", "0"], "two different CUDA indices"),
        (["--shape", "toy", "--gpus", "1,1"], "two different CUDA indices"),
        (["--shape", "1,2"], "--shape 1,2"),
        (["--shape", "toy", "--budget-s", "0"], "must be positive"),
    ):
        r = side(*args, "--dry-run", "--dir", str(tmp_path), cwd=tmp_path)
        assert r.returncode == 2 and why in r.stderr.strip().splitlines()[-1], (args, r.stderr)
        assert not list(tmp_path.iterdir())


def test_stopping_a_run_stops_the_processes_it_started():
    """Past its budget a run is killed with its whole session: a peers-only bench's runner
    subprocesses must not keep the GPU after it."""
    import side_by_side

    pr = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child = int(pr.stdout.readline())
    side_by_side.stop(pr)
    assert pr.wait(timeout=10) != 0
    for _ in range(100):  # gone, or a zombie left for init to reap
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the run's child {child} outlived it")
    side_by_side.stop(pr)  # a second stop of a finished run is a no-op
