"""How long the embedded game plan takes from a fresh clone, and how long doing nothing takes.

In a fresh copy of the repository (tracked + untracked, not ignored, files; git and DVC
initialised), times:
  - set-up: `make setup` (a new .venv with the pinned deps; --setup, else the current venv is used)
  - `snakemake --cores N phase1` from nothing (world, fetch, compare, Phase 0, data, Phase 1 + control)
  - a second `snakemake --cores N phase1` (nothing to do), `snakemake -n phase1`
  - `dvc status eval_phase1` and `dvc repro eval_phase1` with nothing changed
and prints them with the accept lengths of every phase (and of the source on the old target).
--phase2 also runs `snakemake all` (Phase 2 + report) and times it. Prints figures; asserts nothing.

    .venv/bin/python benchmarks/bench_pipeline.py [--cores 2] [--setup] [--phase2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sh(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[tuple[float, float], subprocess.CompletedProcess]:
    """Run cmd; ((wall s, CPU s of the children), result). Exits on failure."""
    t = time.time()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    dt = time.time() - t
    ru2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru2.ru_utime - ru.ru_utime) + (ru2.ru_stime - ru.ru_stime)
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}  ({dt:.1f} s, rc {r.returncode})\n{r.stdout}\n{r.stderr}\n")
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd)} (see {log})\n{r.stderr[-2000:]}")
    return (dt, cpu), r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--setup", action="store_true", help="time `make setup` (a new .venv) in the copy")
    ap.add_argument("--phase2", action="store_true", help="also run and time `snakemake all`")
    ap.add_argument("--keep", help="work in this folder and keep it (default: a temp folder, removed)")
    a = ap.parse_args()

    work = Path(a.keep or tempfile.mkdtemp(prefix="bench-pipeline-"))
    repo = work / "repo"
    if repo.exists():
        shutil.rmtree(repo)
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        if (ROOT / f).is_file():
            (repo / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, repo / f)
    log = work / "bench.log"
    log.write_text("")
    env = {
        **os.environ,
        "DVC_NO_ANALYTICS": "1",
        "GIT_AUTHOR_NAME": "b",
        "GIT_AUTHOR_EMAIL": "b@b",
        "GIT_COMMITTER_NAME": "b",
        "GIT_COMMITTER_EMAIL": "b@b",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("OMP_NUM_THREADS", None)
    sh(["git", "init", "-q"], repo, env, log)
    figures: dict[str, tuple[float, float]] = {}
    if not (repo / "README.md").exists():  # pyproject's readme: pip refuses to build without it
        (repo / "README.md").write_text("draftport\n")
    if a.setup:
        figures["setup: make setup (new .venv)"], _ = sh(["make", "setup"], repo, env, log)
        bin_dir = repo / ".venv" / "bin"
    else:
        bin_dir = Path(sys.executable).parent
    env["PATH"] = f"{bin_dir}:{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(repo / "src")
    if not (repo / ".dvc").is_dir():
        sh([str(bin_dir / "dvc"), "init", "-q"], repo, env, log)
    sh(["git", "add", "-A"], repo, env, log)
    sh(["git", "commit", "-qm", "bench"], repo, env, log)

    smk, dvc = str(bin_dir / "snakemake"), str(bin_dir / "dvc")
    figures[f"snakemake --cores {a.cores} phase1 (fresh)"], _ = sh(
        [smk, "--cores", str(a.cores), "phase1"], repo, env, log
    )
    figures[f"snakemake --cores {a.cores} phase1 (again, nothing to do)"], _ = sh(
        [smk, "--cores", str(a.cores), "phase1"], repo, env, log
    )
    figures["snakemake -n phase1"], _ = sh([smk, "-n", "phase1"], repo, env, log)
    figures["dvc status eval_phase1"], r = sh([dvc, "status", "eval_phase1"], repo, env, log)
    clean = "up to date" in r.stdout
    figures["dvc repro eval_phase1 (nothing changed)"], _ = sh([dvc, "repro", "eval_phase1"], repo, env, log)
    if a.phase2:
        figures[f"snakemake --cores {a.cores} all (phase2 + report)"], _ = sh(
            [smk, "--cores", str(a.cores), "all"], repo, env, log
        )
        figures["dvc repro (nothing changed, all stages)"], _ = sh([dvc, "repro"], repo, env, log)

    steps, seconds = {}, {}
    for d in sorted((repo / "artifacts").iterdir()):
        m = d / "metrics.json"
        if m.is_file():
            steps[d.name] = json.loads(m.read_text())
            t = repo / "logs" / f"{d.name}.json"  # the runner keeps times out of artifacts/
            seconds[d.name] = json.loads(t.read_text())["seconds"] if t.is_file() else None
    print(
        f"\nfigures ({os.cpu_count()} CPUs, --cores {a.cores}, load average at the end "
        f"{os.getloadavg()[0]:.1f}; log: {log})"
    )
    print(f"  {'':<55} {'wall':>8}   {'CPU (user+sys)':>14}")
    for k, (wall, cpu) in figures.items():
        print(f"  {k:<55} {wall:8.1f} s {cpu:12.1f} s")
    print(f"  dvc status clean after snakemake: {clean}")
    print("\nseconds per step:", seconds)
    print("\naccept length (tau) on the new target:")
    for ph in ("phase0", "phase1_scratch", "phase1", "phase2"):
        if f"eval_{ph}" in steps:
            m = steps[f"eval_{ph}"]
            print(
                f"  {ph:<16} tau {m['accept_length']:.3f}  projected {m['projected_tok_s']:.1f} tok/s "
                f"(break-even tau {m['break_even_accept_length']:.2f})"
            )
    if "source_on_old_accept_length" in steps.get("eval_phase0", {}):
        print(f"  source on the old target: tau {steps['eval_phase0']['source_on_old_accept_length']:.3f}")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
