"""The plan without Snakemake: a target's steps run one after another, in the step table's order,
with the commands Snakemake's rules run (draftport.pipeline.bridge.shell_command), launched by the
interpreter that runs this module (the node's `python` may be another, or missing).

For a machine that can carry the library's own dependencies but not Snakemake's, DVC's and MLflow's
(an air-gapped GPU node given the `core` wheelhouse): `--no-tracking` runs the tracked steps
without an MLflow run. A step whose metrics.json exists is kept unless --force names it; a failed
step stops the run with its exit status, its log in logs/<step>.log.

    python -m draftport.pipeline.local all --configfile configs/gpu.yaml [--no-tracking]
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from draftport.errors import DraftportError
from draftport.pipeline import bridge
from draftport.plan import cluster, params, registry

TRACKING_ENV = "DRAFTPORT_TRACKING"  # "off": the runner opens no MLflow run (draftport.pipeline.runner)


def plan(target: str, cfg: dict) -> list[str]:
    """The target's steps and every step upstream of them, in the step table's order."""
    if target == "all":  # the Snakefile's rule all
        wanted = [
            "report",
            "decision",
            *(registry.target_steps("online", cfg) if cfg["online"]["enabled"] else []),
            *(["publish"] if cfg["publish"]["enabled"] else []),
        ]
    elif target in registry.TARGETS:
        wanted = registry.target_steps(target, cfg)
    elif target in registry.BY_NAME and registry.enabled(registry.BY_NAME[target], cfg):
        wanted = [target]
    else:
        raise DraftportError(
            "target", f"{target!r}: not a target ({', '.join(registry.TARGETS)}, all) nor a step of this plan"
        )
    wanted = [w for w in wanted if registry.enabled(registry.BY_NAME[w], cfg)]
    need: set[str] = set()
    todo = list(wanted)
    while todo:
        name = todo.pop()
        if name not in need:
            need.add(name)
            todo.extend(registry.upstream(registry.BY_NAME[name], cfg))
    return [s.name for s in registry.active(cfg) if s.name in need]


def this_interpreter(launcher: str) -> str:
    """The rule's launcher run by this interpreter: `python` and `torchrun` on PATH may be another
    environment's, or missing (a node with python3 alone)."""
    exe = shlex.quote(sys.executable)
    if launcher == "python":
        return exe
    if launcher.startswith("torchrun "):
        return f"{exe} -m torch.distributed.run {launcher.removeprefix('torchrun ')}"
    return launcher


def run(
    target: str, configfiles: list[str], *, tracking: bool = True, force: tuple[str, ...] = (), log=print
) -> dict[str, float]:
    """Run the plan's steps not done yet; -> seconds per step run. Raises DraftportError naming the
    step that failed."""
    for f in configfiles:
        if not Path(f).is_file():
            raise DraftportError(f, "no such parameter file")
    cfg, base = params.load(*configfiles), params.load()
    env = {**os.environ, **({} if tracking else {TRACKING_ENV: "off"})}
    seconds = {}
    steps = plan(target, cfg)
    for i, name in enumerate(steps, 1):
        if Path(registry.done(name)).is_file() and name not in force:
            log(f"[{i}/{len(steps)}] {name}: done before, kept")
            continue
        cmd = bridge.shell_command(name, cfg, base, this_interpreter(cluster.launcher(cfg, name)))
        log(f"[{i}/{len(steps)}] {name}: {cmd}")
        t0 = time.time()
        rc = subprocess.run(cmd, shell=True, env=env).returncode
        seconds[name] = round(time.time() - t0, 1)
        if rc:
            raise DraftportError(f"step {name}", f"exited {rc} after {seconds[name]} s (logs/{name}.log)")
    return seconds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftport.pipeline.local", description=__doc__.splitlines()[0])
    ap.add_argument("target", help="phase0, phase1, phase2, curves, decision, all, or one step")
    ap.add_argument("--configfile", action="append", default=[], help="a profile layered on params.yaml")
    ap.add_argument("--no-tracking", action="store_true", help="no MLflow runs (no MLflow on this machine)")
    ap.add_argument("--force", action="append", default=[], help="run this step again even if done")
    a = ap.parse_args(argv)
    try:
        took = run(a.target, a.configfile, tracking=not a.no_tracking, force=tuple(a.force))
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"done: {len(took)} step(s) run, {sum(took.values()):.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
