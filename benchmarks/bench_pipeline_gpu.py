"""The whole plan on one GPU, timed, next to the training benchmark at the same shape, in one call.

1. Runs the plan (`all`) of a profile (default configs/gpu.yaml) in this checkout: through Snakemake
   when it is installed (`snakemake all --cores N --resources gpu=1`), else through the project's own
   runner in the step table's order (draftport.pipeline.local; --no-tracking when MLflow is missing).
2. Reads what each step recorded (logs/<step>.json: seconds, where it ran, the trainings' real tok/s
   and MFU, the evaluations' tok/s; artifacts/<step>/metrics.json: the captures' tokens).
3. Runs benchmarks/bench_train_h200.py at the drafter's shape, the trainings' TTT steps and the
   packed row length the pipeline's Phase 2 trained on (lm_head trained, the greedy choice stored:
   what the pipeline does), no peers: the bench's rate of the same step function train() calls.
4. Writes one JSON (default benchmarks/results/<date>-<gpu>-pipeline.json): each step's wall time
   and device, the product's training tok/s and MFU beside the bench's, the captures' tok/s against
   the prefill roofline, and the decision. Prints the figures; asserts nothing.

    python benchmarks/bench_pipeline_gpu.py [--configfile configs/gpu.yaml] [--cores 16] [--no-bench]

On a machine without a GPU, with a profile whose devices are cpu (tests/pipeline/test_gpu_profile.py
layers a toy one on configs/gpu.yaml), it runs the same way: that checks the orchestration, it
measures nothing a GPU would.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from draftport.files import atomic_write_text  # noqa: E402
from draftport.plan import (
    params,  # noqa: E402
    registry,  # noqa: E402
)

TRAIN_STEPS = ("train_phase1_scratch", "train_phase1", "train_phase2")
CAPTURE_STEPS = ("features_new", "features_eval", "features_monitor", "features_phase2")


def run_plan(a, cfg_files: list[str], log) -> dict:
    """The plan's `all`, by Snakemake or the project's runner. -> {runner, seconds, rc}."""
    smk = shutil.which("snakemake")
    runner = a.runner if a.runner != "auto" else ("snakemake" if smk else "local")
    tracking = importlib.util.find_spec("mlflow") is not None and not a.no_tracking
    if runner == "snakemake":
        # the target first: --resources takes every word after it
        cmd = [
            smk or "snakemake",
            "all",
            *sum((["--configfile", f] for f in cfg_files), []),
            "--cores",
            str(a.cores),
            "--resources",
            "gpu=1",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "draftport.pipeline.local",
            "all",
            *sum((["--configfile", f] for f in cfg_files), []),
        ]
        if not tracking:
            cmd.append("--no-tracking")
    log(f"plan: {' '.join(cmd)}")
    env = {**os.environ, **({} if tracking else {"DRAFTPORT_TRACKING": "off"})}
    t0 = time.time()
    # its own session: past --plan-timeout-s the runner and the step it runs are stopped together,
    # and what the steps recorded so far is still written out
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=a.plan_timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
        log(f"plan: stopped after {a.plan_timeout_s:.0f} s")
    return {
        "runner": runner,
        "command": " ".join(cmd),
        "tracking": tracking,
        "seconds": round(time.time() - t0, 1),
        "rc": rc,
    }


def read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def steps_record(cfg: dict) -> dict:
    """Per step: its wall seconds and what it recorded of where it ran (logs/<step>.json)."""
    out = {}
    for row in registry.active(cfg):
        rec = read_json(ROOT / "logs" / f"{row.name}.json")
        if rec is None:
            out[row.name] = {"ran": False}
            continue
        timing = rec.get("timing") or {}
        devices = sorted({r["device"] for r in _runs(timing)}) or params_device(cfg, row.name)
        out[row.name] = {"ran": True, "seconds": rec.get("seconds"), "devices": devices, "timing": timing}
    return out


def params_device(cfg: dict, step: str) -> list[str]:
    """A step that records no device of its own: the one its params give (the world's targets, a
    capture's target); [] for the steps that compute with no model (fetch, compare, the decision)."""
    if step == "world":
        return [cfg["world"]["device"]]
    if step.startswith("features_") or step == "budget":
        return [cfg["features"]["device"]]
    return []


def _runs(timing: dict) -> list[dict]:
    """Every device record in a step's timing (trainings, evaluations, curve points)."""
    found = []
    for v in timing.values():
        if isinstance(v, dict) and "device" in v and "processes" in v:
            found.append(v)
        elif isinstance(v, dict):
            found.extend(_runs(v))
    return found


def training_rates(steps: dict) -> dict:
    return {
        s: steps[s]["timing"]["train"]
        for s in TRAIN_STEPS
        if steps.get(s, {}).get("ran") and isinstance(steps[s]["timing"].get("train"), dict)
    }


def capture_rates(cfg: dict, steps: dict, peak_tflops: float) -> dict:
    """Each capture's stored tokens per second of capture, against the prefill roofline at its
    mean sample length (draftport.profile.estimate's FLOP count of a capture)."""
    from draftport.profile import estimate

    try:
        shape = estimate.target_shape(estimate.target_config(cfg)[0])
    except Exception as e:  # a result without the roofline beats no result
        shape, why = None, str(e)
    out = {}
    for s in CAPTURE_STEPS:
        if not steps.get(s, {}).get("ran"):
            continue
        m = read_json(ROOT / "artifacts" / s / "metrics.json") or {}
        for name, t in steps[s]["timing"].items():
            if not isinstance(t, dict) or "capture" not in t or not t.get("samples"):
                continue
            tokens = (m.get(name) or {}).get("tokens")  # metrics.json: per folder the step wrote
            rec = {
                "samples": t["samples"],
                "capture_s": t["capture"],
                "regenerate_s": t.get("regenerate"),
                "tokens": tokens,
            }
            if tokens and t["capture"]:
                rec["tok_s"] = tokens / t["capture"]
                if shape is not None:
                    fpt = estimate.capture_flops_per_token(shape, tokens / t["samples"])["total"]
                    rec["roofline_tok_s"] = peak_tflops * 1e12 / fpt
                    rec["of_roofline"] = rec["tok_s"] / rec["roofline_tok_s"]
                else:
                    rec["roofline"] = f"not computed: {why}"
            out[f"{s}/{name}"] = rec
    return out


def packed_row_tokens(cfg: dict) -> int:
    """Tokens of a packed row of Phase 2's training: its batch of samples at their mean length."""
    m = (read_json(ROOT / "artifacts" / "features_phase2" / "metrics.json") or {}).get("train") or {}
    mean = (m.get("tokens") or 0) / max(1, m.get("samples") or 1)
    return max(64, int(round(cfg["phase2"]["train"]["batch_size"] * (mean or 256) / 64)) * 64)


def drafter_shape_arg() -> str | None:
    """The trained drafter's shape in the bench's --shape order, from Phase 2's drafter."""
    c = read_json(ROOT / "artifacts" / "train_phase2" / "drafter" / "config.json")
    if c is None:
        return None
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return ",".join(
        str(v)
        for v in (
            c["hidden_size"],
            c["intermediate_size"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            hd,
            c["draft_vocab_size"],
            c["vocab_size"],
        )
    )


def run_bench(a, cfg: dict, out_dir: Path, log) -> dict | None:
    shape = drafter_shape_arg()
    if shape is None:
        return {"skipped": "no Phase 2 drafter to take the shape from"}
    T = packed_row_tokens(cfg)
    tr = cfg["phase2"]["train"]
    path = out_dir / "bench_train.json"
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "bench_train_h200.py"),
        "--shape",
        shape,
        "--seqs",
        str(T),
        "--ttt",
        str(tr["ttt_steps"]),
        "--lm-head",
        "trainable",
        "--no-peers",
        "--no-levers",
        "--mix",
        "0",
        "--attn-backend",
        tr.get("fast", {}).get("attention", "flash"),
        "--json",
        str(path),
        "--budget-s",
        str(a.bench_s),
    ]
    log(f"bench: {' '.join(cmd)}")
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    res = read_json(path) if path.is_file() else None
    row = None
    if res:
        row = ((res.get("by_length") or {}).get(str(T)) or {}).get("ours", {}).get("trainable_stored")
    return {
        "command": " ".join(cmd),
        "rc": rc,
        "seconds": round(time.time() - t0, 1),
        "seq": T,
        "shape": shape,
        "real_tokens_per_s": (row or {}).get("real_tokens_per_s"),
        "mfu": (row or {}).get("mfu"),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configfile",
        action="append",
        default=None,
        help="profile(s) layered on params.yaml (default configs/gpu.yaml)",
    )
    ap.add_argument("--cores", type=int, default=16)
    ap.add_argument("--runner", choices=("auto", "snakemake", "local"), default="auto")
    ap.add_argument("--no-tracking", action="store_true", help="no MLflow runs (also when mlflow is missing)")
    ap.add_argument("--no-bench", action="store_true", help="skip the training benchmark at the same shape")
    ap.add_argument("--bench-s", type=float, default=150.0, help="the benchmark's wall budget")
    ap.add_argument("--plan-timeout-s", type=float, default=None, help="stop the plan after this long (partial result)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="the roofline's bf16 rate (as the benches)")
    ap.add_argument("--json", default=None, help="the result (default benchmarks/results/<date>-<gpu>-pipeline.json)")
    a = ap.parse_args(argv)
    files = a.configfile or ["configs/gpu.yaml"]
    cfg = params.load(*files)
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    tag = "cpu" if gpu is None else ("h200" if "H200" in gpu else "h100" if "H100" in gpu else "gpu")
    out_path = Path(a.json or ROOT / "benchmarks" / "results" / f"{datetime.date.today()}-{tag}-pipeline.json")
    work = Path(os.environ.get("OUT") or out_path.parent)
    work.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(msg, flush=True)

    plan = run_plan(a, files, log)
    steps = steps_record(cfg)
    res = {
        "date": str(datetime.date.today()),
        "gpu": gpu,
        "profile": files,
        "plan": plan,
        "steps": {k: {kk: vv for kk, vv in v.items() if kk != "timing"} for k, v in steps.items()},
        "training": training_rates(steps),
        "capture": capture_rates(cfg, steps, a.peak_tflops),
        "decision": (read_json(ROOT / "artifacts" / "decision" / "decision.json") or {}).get("recommendation"),
    }
    if not a.no_bench and steps.get("train_phase2", {}).get("ran"):  # also when the plan stopped after Phase 2
        res["bench"] = run_bench(a, cfg, work, log)
        p2 = res["training"].get("train_phase2") or {}
        ours = p2.get("steady_tokens_per_s") or p2.get("tokens_per_s")  # past the warm-up, as the bench times
        if res["bench"].get("real_tokens_per_s") and ours:
            res["product_vs_bench"] = ours / res["bench"]["real_tokens_per_s"]
    atomic_write_text(out_path, json.dumps(res, indent=2, default=str) + "\n")
    log(f"plan: {plan['runner']}, rc {plan['rc']}, {plan['seconds']:.0f} s")
    for s, v in res["steps"].items():
        if v["ran"]:
            log(f"  {s:<22} {v.get('seconds') or 0:8.1f} s  {','.join(v.get('devices') or []) or '-'}")
    for s, r in res["training"].items():
        log(
            f"  {s:<22} {r.get('tokens_per_s') or 0:10.0f} real tok/s ({r.get('steady_tokens_per_s') or 0:.0f} past "
            f"the warm-up of {r.get('warmup_s')} s; start {r.get('start_s')} s; {r.get('compiles')} compiles, the "
            f"last at step {r.get('last_compile_step')})  MFU {r.get('mfu')}"
        )
    if "product_vs_bench" in res:
        log(f"  product / bench (Phase 2's step at {res['bench']['seq']} tokens): {res['product_vs_bench']:.3f}")
    log(f"wrote {out_path}")
    return res


if __name__ == "__main__":
    main()
