"""A training step of the plan on the GPU, three ways, compared with each other: run through once,
killed with SIGKILL after its first checkpoint and run again (the resume), and launched by
torchrun as one process (the one-GPU DDP path a cluster profile takes).

Each run is the step's own command from the project's runner (draftport.pipeline.local, --force
STEP), so what is timed and compared is what the pipeline runs. The step's inputs are made first
by the same runner when they are missing. Prints a table and writes one JSON: per run its wall
seconds, the step it resumed from, its final loss, and which tensors of its drafter are equal, bit
for bit, to the uninterrupted run's (and the largest difference of the others). Asserts nothing.

    python benchmarks/bench_gpu_resume.py --configfile configs/gpu.yaml --step train_phase2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftport.files import atomic_write_text  # noqa: E402
from draftport.pipeline import runner  # noqa: E402
from draftport.plan import registry  # noqa: E402


def local_cmd(step: str, files: list[str], force: bool) -> list[str]:
    cmd = [sys.executable, "-m", "draftport.pipeline.local", step, "--no-tracking"]
    cmd += [a for f in files for a in ("--configfile", f)]
    return cmd + (["--force", step] if force else [])


def checkpoints(step: str) -> list[Path]:
    folder = ROOT / runner.CHECKPOINTS / step
    return sorted(p for p in folder.glob("step_*") if (p / "state.json").is_file())


def weights(step: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ROOT / "artifacts" / step / "drafter" / "model.safetensors"))


def metrics(step: str) -> dict:
    return json.loads((ROOT / registry.done(step)).read_text())


def run(step: str, files: list[str], env: dict) -> float:
    t0 = time.time()
    subprocess.run(local_cmd(step, files, force=True), cwd=ROOT, env=env, check=True)
    return round(time.time() - t0, 1)


def run_killed(step: str, files: list[str], env: dict, timeout_s: float = 900) -> dict:
    """The step's command in its own session, SIGKILLed (the whole group) once a checkpoint is on
    disk, then run again to the end."""
    shutil.rmtree(ROOT / runner.CHECKPOINTS / step, ignore_errors=True)
    (ROOT / registry.done(step)).unlink(missing_ok=True)
    t0 = time.time()
    p = subprocess.Popen(local_cmd(step, files, force=True), cwd=ROOT, env=env, start_new_session=True)
    while not checkpoints(step):
        if p.poll() is not None or time.time() - t0 > timeout_s:
            raise SystemExit(f"{step}: ended or timed out before its first checkpoint (rc {p.poll()})")
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    killed = {"killed_after_s": round(time.time() - t0, 1), "last_checkpoint": checkpoints(step)[-1].name}
    if (ROOT / registry.done(step)).exists():
        killed["note"] = "the step finished before the kill landed: lengthen it"
    killed["rerun_s"] = run(step, files, env)
    return killed


def compare(ref: dict, other: dict) -> dict:
    equal = [k for k in ref if k in other and ref[k].shape == other[k].shape and bool((ref[k] == other[k]).all())]
    diff = {
        k: float((ref[k].float() - other[k].float()).abs().max())
        for k in ref
        if k not in equal and k in other and ref[k].shape == other[k].shape
    }
    return {"tensors": len(ref), "bit_identical": len(equal), "max_abs_diff": diff}


def record(step: str, ref_w: dict | None) -> tuple[dict, dict]:
    m = metrics(step)
    w = weights(step)
    out = {k: m.get(k) for k in ("final_loss", "train_steps", "resumed_from_step")}
    if ref_w is not None:
        out["vs_uninterrupted"] = compare(ref_w, w)
    return out, w


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configfile", action="append", default=None, help="profile(s) (default configs/gpu.yaml)")
    ap.add_argument("--step", default="train_phase2", help="a training step of the plan")
    ap.add_argument("--no-torchrun", action="store_true", help="skip the one-process torchrun run")
    ap.add_argument("--json", default=None, help="where the result goes (default: printed only)")
    a = ap.parse_args(argv)
    files = a.configfile or ["configs/gpu.yaml"]
    env = {**os.environ, "DRAFTPORT_TRACKING": "off", "PYTHONPATH": str(ROOT / "src")}
    res: dict = {"step": a.step, "profile": files}
    # the step's inputs (the world, the captures, ...), by the runner, kept when done
    t0 = time.time()
    subprocess.run(local_cmd(a.step, files, force=False), cwd=ROOT, env=env, check=True)
    res["inputs_s"] = round(time.time() - t0, 1)
    res["uninterrupted"] = {"seconds": run(a.step, files, env)}
    rec, ref_w = record(a.step, None)
    res["uninterrupted"].update(rec)
    res["killed"] = run_killed(a.step, files, env)
    res["killed"].update(record(a.step, ref_w)[0])
    if not a.no_torchrun:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=ROOT, delete=False) as fh:
            fh.write(f"resources:\n  {a.step}: {{torchrun: true, gpu: 1}}\n")
        try:
            res["torchrun"] = {"seconds": run(a.step, [*files, fh.name], env)}
            res["torchrun"].update(record(a.step, ref_w)[0])
        finally:
            os.unlink(fh.name)
    for name in ("uninterrupted", "killed", "torchrun"):
        r = res.get(name)
        if r:
            cmp = r.get("vs_uninterrupted") or {}
            same = f"{cmp['bit_identical']}/{cmp['tensors']} tensors bit-identical" if cmp else "reference"
            print(f"{name:<14} loss {r.get('final_loss')}  resumed from {r.get('resumed_from_step')}  {same}")
    if a.json:
        atomic_write_text(Path(a.json), json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
