"""Ours and the peers at one shape in one device call, side by side on two GPUs of one host.

    python benchmarks/side_by_side.py --shape llama70b --ours="--attn-backend cudnn --no-levers"

A pair of calls (--peers-only, then --peers-from) needs two calls of ~500 s and ~330 s at H 8192,
and a machine taken back between them leaves the pair on two machines. Here both run at once:
bench_train_h200.py --peers-only on one GPU and bench_train_h200.py --no-peers on the other, each
on its own half of the host's CPU cores (the peers compile while ours times its steps), then
--rescore scores ours against the peers' records. Both files record the step's GEMMs timed alone
on their own GPU (gemm_ceiling), and the goals name the ratio of the two GPUs' times: the
evidence that the two GPUs run the same work at the same rate.

Files: <dir>/<date>-h200-{peers,train}-<shape><suffix>.{json,log}; an existing one is refused.
Arguments this script does not know go to both runs (lengths, TTT steps, the mix: the work both
must do alike); --ours="..." holds the ones for ours alone. With no CUDA device both run on the
CPU (a check of the orchestration, not a measurement); with one GPU it refuses, as two runs on one
GPU would disturb each other's times.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE / "bench_train_h200.py"
sys.path.insert(0, str(HERE))
from bench_train_h200 import parse_shape, rescore, shape_name, write_results  # noqa: E402


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape", required=True, help="as bench_train_h200.py --shape (a name or H,I,heads,kv,head_dim,Vd,V)"
    )
    ap.add_argument("--gpus", default="0,1", help="ours' GPU, then the peers' (CUDA indices)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="each run's budget; both are stopped 30 s past it")
    ap.add_argument("--dir", default=str(HERE / "results"), help="where the four files go")
    ap.add_argument("--suffix", default="", help="after the shape in the file names (--suffix=-4 for a fourth round)")
    ap.add_argument("--ours", default="", help='arguments for ours alone, one string (--ours="--no-levers ...")')
    ap.add_argument("--every-s", type=float, default=60.0, help="a progress line this often")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a, common = ap.parse_known_args(argv)
    gpus = [g.strip() for g in a.gpus.split(",")]
    if len(gpus) != 2 or not all(g.isdigit() for g in gpus) or int(gpus[0]) == int(gpus[1]):
        ap.error(f"--gpus {a.gpus}: two different CUDA indices, ours first (e.g. 0,1)")
    a.gpus = gpus
    try:  # the bench's own rule, so the file names are the ones it writes
        a.shape_tag = shape_name(parse_shape(a.shape)[1])
    except ValueError as e:
        ap.error(f"--shape {a.shape}: {e}")
    if a.budget_s <= 0:
        ap.error(f"--budget-s {a.budget_s}: must be positive")
    a.common = common
    return a


def cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch or no driver: no GPU to place either run on
        return 0


def plan(a, cuda: bool) -> dict:
    """The two runs' commands, environments, CPU halves and files, and the rescore after them."""
    date = time.strftime("%Y-%m-%d")
    tag = a.shape_tag
    d = Path(a.dir)
    files = {k: d / f"{date}-h200-{k}-{tag}{a.suffix}" for k in ("peers", "train")}
    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    halves = (cpus[:half], cpus[half:] or cpus[:half])
    base = [sys.executable, str(BENCH), "--shape", a.shape, *a.common, "--budget-s", f"{a.budget_s:g}"]
    runs = {}
    for name, gpu, cores, extra in (
        ("ours", a.gpus[0], halves[0], ["--no-peers", *shlex.split(a.ours)]),
        ("peers", a.gpus[1], halves[1], ["--peers-only"]),
    ):
        f = files["train" if name == "ours" else "peers"]
        env = dict(os.environ)
        if cuda:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        runs[name] = {
            "cmd": base + extra + ["--json", f"{f}.json", "--log", f"{f}.log"],
            "env": env,
            "cpus": cores,
            "gpu": gpu if cuda else "cpu",
            "json": Path(f"{f}.json"),
        }
    then = [
        sys.executable,
        str(BENCH),
        "--rescore",
        str(runs["ours"]["json"]),
        "--peers-from",
        str(runs["peers"]["json"]),
    ]
    return {"runs": runs, "rescore": then}


def tail(path: str, n: int = 15) -> str:
    lines = Path(path).read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def stop(pr: subprocess.Popen) -> None:
    """Kill a run and every process it started (its session), if still running."""
    if pr.poll() is None:
        try:
            os.killpg(pr.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main(argv=None) -> int:
    a = parse(argv)
    n = cuda_count()
    if n == 1 and not a.dry_run:
        print(
            "side_by_side.py: one CUDA device here; ours and the peers need one each "
            "(on one GPU they would disturb each other's times: use the pair of calls instead)",
            file=sys.stderr,
        )
        return 1
    if n and n <= max(int(g) for g in a.gpus) and not a.dry_run:
        print(f"side_by_side.py: --gpus {','.join(a.gpus)}: this host has {n} CUDA devices", file=sys.stderr)
        return 1
    p = plan(a, cuda=n > 1)
    for name, r in p["runs"].items():
        print(
            f"[side] {name} on GPU {r['gpu']}, CPUs {r['cpus'][0]}-{r['cpus'][-1]}: {shlex.join(r['cmd'])}", flush=True
        )
    print(f"[side] then: {shlex.join(p['rescore'])}", flush=True)
    taken = [str(f) for r in p["runs"].values() for f in (r["json"], r["json"].with_suffix(".log")) if f.exists()]
    if taken:
        print(
            f"side_by_side.py: {taken[0]} exists (an earlier round's results are kept): name this round with --suffix",
            file=sys.stderr,
        )
        return 1
    if a.dry_run:
        return 0
    if not n:
        print(
            "[side] no CUDA device: both run on the CPU (a check of the orchestration, not a measurement)", flush=True
        )
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs, outs = {}, {}
    for name, r in p["runs"].items():
        outs[name] = tempfile.NamedTemporaryFile("w+", prefix=f"side-{name}-", suffix=".out", delete=False)
        cores = set(r["cpus"])
        # a session of its own: stopping a run stops the peer processes it started too
        procs[name] = subprocess.Popen(
            r["cmd"],
            env=r["env"],
            stdout=outs[name],
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda c=cores: os.sched_setaffinity(0, c),
        )
    deadline = a.budget_s + 30.0
    next_note = a.every_s
    try:
        while any(pr.poll() is None for pr in procs.values()):
            el = time.monotonic() - t0
            if el > deadline:
                for name, pr in procs.items():
                    if pr.poll() is None:
                        print(
                            f"[side] {name}: past its budget by 30 s, stopped (its JSON keeps the rows it saved)",
                            flush=True,
                        )
                        stop(pr)
                break
            if el >= next_note:
                print(
                    f"[side] {el:.0f} s: "
                    + ", ".join(
                        f"{k} {'running' if pr.poll() is None else f'done (exit {pr.returncode})'}"
                        for k, pr in procs.items()
                    ),
                    flush=True,
                )
                next_note += a.every_s
            time.sleep(1.0)
    except KeyboardInterrupt:
        for pr in procs.values():
            stop(pr)
        raise
    wall = time.monotonic() - t0
    bad = []
    for name, pr in procs.items():
        rc = pr.wait()
        outs[name].close()
        print(f"[side] {name}: exit {rc}", flush=True)
        if rc != 0:
            bad.append(name)
            print(tail(outs[name].name), flush=True)
        os.unlink(outs[name].name)
    missing = [k for k, r in p["runs"].items() if not r["json"].exists()]
    if missing:
        print(f"side_by_side.py: no results file from {', '.join(missing)}; nothing scored", file=sys.stderr)
        return 1
    ours = p["runs"]["ours"]["json"]
    try:  # the bench's own --rescore, in this process; a refusal is its one line
        res = rescore(str(ours), str(p["runs"]["peers"]["json"]))
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 1
    res["pairing"] = {
        "how": "side by side: one call, ours and the peers at once on two GPUs of one host, "
        "each on half of its CPU cores",
        "ours": {"gpu": p["runs"]["ours"]["gpu"], "cpus": len(p["runs"]["ours"]["cpus"])},
        "peers": {"gpu": p["runs"]["peers"]["gpu"], "cpus": len(p["runs"]["peers"]["cpus"])},
        "wall_s": round(wall, 1),
    }
    write_results(ours, res)
    print(f"[side] scored {ours} against {p['runs']['peers']['json']} in {wall:.0f} s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
