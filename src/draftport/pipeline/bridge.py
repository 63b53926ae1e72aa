"""The only code that knows Snakemake's and DVC's records, so that after either tool has run, the
other finds nothing to do (the traps, one per bullet, are below).

* Both tools run the same command per step (draftport.plan.registry.command): dvc.yaml is
  generated from the registry (`python -m draftport.pipeline.bridge dvc-yaml`), never edited by
  hand, and so are the Snakefile's rules, rules/<stage>.smk (`... smk-rules`,
  draftport.pipeline.smk_rules); tests fail when either drifts, and when the parsed rules run
  other commands or take other inputs than the registry says.
* Values come from params.yaml. A rule passes its step's values through `params:` (Snakemake's
  params trigger) and dvc.yaml lists the same dotted keys (DVC's params); the script sees exactly
  those. Under another profile (`--configfile`) the Snakemake command gains `--params <file>`
  holding that step's values; DVC tracks params.yaml.
* Each step owns artifacts/<step>/. DVC tracks the folder; Snakemake sees one small file in it,
  metrics.json, written last. Downstream rules take upstream metrics.json files as input: small
  files are compared by checksum when their mtime moves, so `dvc checkout` rewriting mtimes makes
  Snakemake rerun nothing. Code is a dependency of both: the step's script and the library
  modules its registry row lists.
* After Snakemake succeeds, `dvc commit` records the steps of its DAG in dvc.lock (the Snakefile's
  onsuccess), so `dvc status` finds nothing to do. When DVC runs a step (DVC_STAGE is set), the
  runner drops Snakemake's records of that step's files first (an older run's params would make
  Snakemake redo it) and, once done, has Snakemake record the new run (`snakemake --touch` of
  that one rule writes params, input checksums and code without running anything), so a later
  `snakemake` plans nothing, even after `dvc checkout` rewrote the mtimes.

Snakemake internals used here (snakemake 9.x, pinned <10 in pyproject; tests/pipeline/test_bridge.py
checks each against the installed version):
  [S1] `workflow.persistence._lockfile` (dict of the lock files this run holds): note_lock_owner
  [S2] the file persistence's record layout under .snakemake/metadata (urlsafe base64 of the
       path, split into '@'-prefixed chunks of NAME_MAX): drop_snakemake_records
  [S3] `workflow.dag.needrun_jobs()` and `workflow.dag.jobs` with `job.rule.name`,
       `job.rule.shellcmd` in onstart/onsuccess (the Snakefile)
  [S4] `SnakemakeApi(...).workflow(...)._workflow.rules` to read the parsed rules (tests only)
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from base64 import urlsafe_b64decode, urlsafe_b64encode
from pathlib import Path

import yaml

from draftport.errors import DraftportError
from draftport.files import atomic_write_text
from draftport.plan import params, registry
from draftport.plan.registry import art, done

SMK_PARAMS_DIR = ".snakemake/draftport/params"
REPORT_PLOTS = ("tau.png", "positions.png", "loss.png")


# ---- Snakefile side ------------------------------------------------------------------------
def configure(config: dict, base_file: str = params.PARAMS_FILE) -> tuple[dict, dict]:
    """(effective params, params.yaml alone), both validated; one-line error otherwise."""
    try:
        cfg = params.validate(config)
        base = params.load(base=base_file)
    except DraftportError as e:
        # One line, no traceback: Snakemake prints a WorkflowError with its stack.
        print(f"error: bad parameters: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return cfg, base


def params_arg(cfg: dict, base: dict, step: str) -> str:
    """'' when the step's values are params.yaml's; else ' --params <file>' holding them.

    The file is named by its content, so it changes (and Snakemake reruns the step) exactly
    when one of the step's values changes.
    """
    vals = registry.step_params(cfg, step)
    if vals == registry.step_params(base, step):
        return ""
    text = yaml.safe_dump(vals, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(SMK_PARAMS_DIR, f"{step}-{digest}.yaml")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    return f" --params {path}"


def shell_command(step: str, cfg: dict, base: dict, launch: str = "python") -> str:
    """The rule's shell command: the registry's, with --params under another profile and the
    launcher (torchrun) of a training rule that asks for one."""
    cmd = registry.command(registry.BY_NAME[step], cfg)
    extra = params_arg(cfg, base, step)
    head = f"python scripts/{step}.py"
    return cmd.replace(head, f"{launch} scripts/{step}.py{extra}", 1)


def smk_inputs(step: str, cfg: dict) -> list[str]:
    """A rule's inputs: its upstream steps' metrics.json and its code."""
    row = registry.BY_NAME[step]
    return [done(u) for u in registry.upstream(row, cfg)] + registry.module_files(row)


# ---- Snakemake's lock after a kill -9 -----------------------------------------------------------
# A Snakemake process killed hard (kill -9, a preempted machine) leaves .snakemake/locks behind,
# and the next identical command stops with a LockException asking for --unlock. The onstart hook
# records which lock files this process holds and who it is (pid, its start time, boot id, host);
# at parse time, before Snakemake checks its lock, the lock files of a recorded process that is
# gone are removed. A lock of a live process, of another host, or not recorded is left alone.
LOCK_OWNERS = ".snakemake/draftport/lock-owners"


def _proc_identity(pid: int) -> str | None:
    """'<boot id>:<start ticks>' of a live process, None when there is none with that pid (or
    only its zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else f"{boot}:{fields[19]}"


def _lock_id(path) -> str:
    st = os.stat(path)
    return f"{st.st_ino}:{st.st_mtime_ns}"


def note_lock_owner(persistence, root: str = LOCK_OWNERS) -> None:
    """[S1] onstart (the lock is held by then): record this process as the owner of its lock files."""
    locks = [str(f) for f in getattr(persistence, "_lockfile", {}).values() if Path(f).is_file()]
    if not locks:
        return
    pid = os.getpid()
    rec = {
        "pid": pid,
        "process": _proc_identity(pid),
        "host": socket.gethostname(),
        "locks": {f: _lock_id(f) for f in locks},
    }

    atomic_write_text(Path(root, f"{pid}.json"), json.dumps(rec) + "\n")


def clear_stale_locks(root: str = LOCK_OWNERS, log=None) -> int:
    """Parse time: remove the lock files of recorded Snakemake processes that died holding them."""
    base = Path(root)
    if not base.is_dir():
        return 0
    n, gone = 0, []
    for rec_file in sorted(base.glob("*.json")):
        try:
            rec = json.loads(rec_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rec.get("host") != socket.gethostname():
            continue  # a shared folder: that host's processes cannot be seen from here
        if rec.get("process") is not None and _proc_identity(rec["pid"]) == rec["process"]:
            continue  # still running: its lock stands
        for f, ident in rec.get("locks", {}).items():
            with contextlib.suppress(OSError):
                if _lock_id(f) == ident:  # the very file it wrote, not a later run's
                    os.unlink(f)
                    n += 1
        gone.append(str(rec["pid"]))
        rec_file.unlink(missing_ok=True)
    if n:
        (log or (lambda m: print(m, file=sys.stderr)))(
            f"removed {n} Snakemake lock file(s) left by killed run(s) (pid {', '.join(gone)}); "
            f"their unfinished steps run again and resume from their checkpoints"
        )
    return n


def uses_params_yaml(cfg: dict, base: dict, steps) -> bool:
    return all(registry.step_params(cfg, s) == registry.step_params(base, s) for s in steps)


def dvc_commit(stages: list[str], log=print) -> None:
    """Record finished Snakemake steps in dvc.lock (so `dvc status` agrees with Snakemake)."""
    stages = [s for s in stages if Path(done(s)).is_file() and registry.BY_NAME[s].dvc]
    if not stages or not Path(".dvc").is_dir() or not Path("dvc.yaml").is_file():
        return
    if _lock_current(stages):
        return
    dvc = shutil.which("dvc") or str(Path(sys.executable).with_name("dvc"))
    t = time.time()
    r = subprocess.run(
        [dvc, "commit", "--force", "--quiet", *stages],
        capture_output=True,
        text=True,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
    )
    if r.returncode:
        log(f"dvc commit failed (dvc.lock not updated): {(r.stderr or r.stdout).strip()}")
    else:
        log(f"dvc.lock: committed {len(stages)} stages in {time.time() - t:.1f} s")


def _lock_current(stages: list[str]) -> bool:
    """Cheap check: dvc.lock newer than every file of the stages and than params.yaml/dvc.yaml."""
    lock = Path("dvc.lock")
    if not lock.is_file():
        return False
    try:
        locked = yaml.safe_load(lock.read_text()).get("stages", {})
    except Exception:
        return False
    if any(s not in locked for s in stages):
        return False
    t = lock.stat().st_mtime
    if any(Path(f).stat().st_mtime > t for f in (params.PARAMS_FILE, "dvc.yaml") if Path(f).exists()):
        return False
    for s in stages:
        for root, _, files in os.walk(art(s)):
            for f in files:
                if os.stat(os.path.join(root, f)).st_mtime > t:
                    return False
    return True


def drop_snakemake_records(step: str, root: str = ".snakemake/metadata") -> int:
    """[S2] Forget Snakemake's provenance of artifacts/<step>/* (file persistence backend).

    Called when DVC runs the step: the files about to be written will not match what an older
    Snakemake run recorded (params, input checksums); without a record Snakemake judges them by
    time stamps alone, which DVC's ordered run keeps consistent.
    """
    base = Path(root)
    if not base.is_dir():
        return 0
    prefix = art(step) + os.sep
    n = 0
    for rec in list(base.rglob("*")):
        if not rec.is_file():
            continue
        rel = rec.relative_to(base).parts
        try:
            name = urlsafe_b64decode("".join(p.lstrip("@") for p in rel).encode()).decode()
        except Exception:
            continue
        if name.startswith(prefix):
            rec.unlink()
            n += 1
            with contextlib.suppress(OSError):
                if rec.parent != base:
                    rec.parent.rmdir()
    return n


def record_for_snakemake(step: str) -> None:
    """After DVC ran the step: let Snakemake record it as its own run would (`--touch` records
    params, input checksums and code of the rule without running it), so a later `snakemake`
    finds nothing to do, even after `dvc checkout` rewrote every mtime."""
    smk = shutil.which("snakemake") or str(Path(sys.executable).with_name("snakemake"))
    t = time.time()
    r = subprocess.run(
        [smk, done(step), "--touch", "--forcerun", step, "--allowed-rules", step, "--cores", "1", "--quiet", "all"],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        print(
            f"{step}: could not record the DVC run for Snakemake (a later snakemake run may redo "
            f"it): {(r.stderr or r.stdout).strip().splitlines()[-1:]}",
            file=sys.stderr,
        )
    else:
        print(f"{step}: recorded for Snakemake in {time.time() - t:.1f} s")


def record_name(path: str) -> str:  # for tests: the file persistence's record name of a path
    return urlsafe_b64encode(path.encode()).decode()


# ---- dvc.yaml from the registry ---------------------------------------------------------------
DVC_HEADER = """\
# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge dvc-yaml`: do not edit. Each stage runs the command of the
# Snakemake rule of the same name; params are the dotted keys the step reads; deps are its
# script, the library modules it runs and its upstream steps' folders; outs its folder.
# tests/pipeline/test_pipeline_dvc.py fails when this file and the registry drift apart.
"""


def stage(step: str, cfg: dict) -> dict:
    row = registry.BY_NAME[step]
    deps = registry.module_files(row) + [art(u) for u in registry.upstream(row, cfg)]
    out = art(step)
    return {
        "cmd": registry.command(row, cfg),
        "deps": list(dict.fromkeys(deps)),
        "params": list(row.params),
        # persist: DVC's run-cache would otherwise copy an uncached out into .dvc/cache all the
        # same (dvc/stage/cache.py, with link type copy): terabytes of features at real scale
        "outs": [out] if row.cache else [{out: {"cache": False, "persist": True}}],
    }


def train_group(step: str) -> str:
    """The params group whose `train` a training step runs (phase1, phase2, curves)."""
    return next(k.split(".")[0] for k in registry.BY_NAME[step].params if k.endswith(".train"))


def dvc_yaml_text(params_file: str = params.PARAMS_FILE) -> str:
    """dvc.yaml for params.yaml's profile, from the registry."""
    cfg = params.load(base=params_file)
    stages = {s.name: stage(s.name, cfg) for s in registry.active(cfg) if s.dvc}
    # an uncached step's metrics.json is in no experiment's commit (`dvc exp show` would print "!")
    metrics = [done(s) for s in stages if registry.BY_NAME[s].cache]
    evals = [s for s in stages if s.startswith("eval_phase")]
    phases = [s for s in registry.TRAINING_STEPS if s in stages and s.startswith("train_phase")]
    watched = [s for s in phases if registry.get(cfg, f"{train_group(s)}.train.eval_every")]
    plots = (
        [art("report", p) for p in REPORT_PLOTS]
        + [
            {"loss": {"template": "linear", "x": "step", "y": {art(s, "history.csv"): "loss" for s in phases}}},
        ]
        + (
            [
                {
                    "held_out_accept_length": {
                        "template": "linear",
                        "x": "step",
                        "y": {art(s, "curve.csv"): "accept_length" for s in watched},
                    }
                }
            ]
            if watched
            else []
        )
        + [
            {
                "accept_length_by_phase": {
                    "template": "bar_horizontal",
                    "x": "accept_length",
                    "y": {art(s, "tau.csv"): "phase" for s in evals},
                }
            },
            {
                "accept_rate_by_position": {
                    "template": "linear",
                    "x": "position",
                    "y": {art(s, "positions.csv"): "accept_rate" for s in evals},
                }
            },
        ]
    )
    doc = {"stages": stages, "metrics": metrics, "plots": plots}
    return DVC_HEADER + yaml.safe_dump(doc, sort_keys=False, width=100)


@contextlib.contextmanager
def snakemake_workflow(snakefile: str = "Snakefile", configfiles: tuple = ()):
    """[S4] The parsed Snakemake workflow (rules with their input/output/params/shell), no DAG."""
    # lazy: snakemake is optional (the pipeline extra); only this [S4] check parses the workflow
    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, OutputSettings, Quietness, ResourceSettings

    with SnakemakeApi(OutputSettings(quiet={Quietness.ALL})) as api:
        wf_api = api.workflow(
            resource_settings=ResourceSettings(cores=1),
            config_settings=ConfigSettings(configfiles=[Path(c) for c in configfiles]),
            snakefile=Path(snakefile).absolute(),
        )
        yield wf_api._workflow


def write_smk_rules(root: Path, check: bool = False) -> int:
    """rules/<stage>.smk from the registry; check: 1 and one line naming the first drifted file."""
    from draftport.pipeline import smk_rules

    texts = smk_rules.texts()
    if check:
        for rel, text in texts.items():
            f = root / rel
            if not f.is_file() or f.read_text() != text:
                print(
                    f"{rel} drifted from the step registry: run `python -m draftport.pipeline.bridge smk-rules`",
                    file=sys.stderr,
                )
                return 1
        print(f"{', '.join(texts)} match the step registry")
        return 0
    for rel, text in texts.items():
        atomic_write_text(root / rel, text)
    print(f"wrote {', '.join(texts)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m draftport.pipeline.bridge")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("dvc-yaml", help="write dvc.yaml from the step registry (--check: fail on drift)")
    g.add_argument("--check", action="store_true")
    g.add_argument("--out", default="dvc.yaml")
    r = sub.add_parser("smk-rules", help="write rules/<stage>.smk from the step registry (--check: fail on drift)")
    r.add_argument("--check", action="store_true")
    r.add_argument("--root", default=".", help="the project folder (rules/ is in it)")
    c = sub.add_parser("dvc-commit", help="record finished steps in dvc.lock")
    c.add_argument("stages", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "dvc-yaml":
        try:
            text = dvc_yaml_text()
        except DraftportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        old = Path(a.out).read_text() if Path(a.out).is_file() else ""
        if a.check:
            if old != text:
                sys.stdout.writelines(
                    difflib.unified_diff(
                        old.splitlines(True), text.splitlines(True), a.out, "generated from the registry"
                    )
                )
                print(
                    f"{a.out} drifted from the step registry: run `python -m draftport.pipeline.bridge dvc-yaml`",
                    file=sys.stderr,
                )
                return 1
            print(f"{a.out} matches the step registry")
            return 0

        atomic_write_text(a.out, text)
        print(f"wrote {a.out} ({text.count(chr(10))} lines)")
        return 0
    if a.cmd == "smk-rules":
        return write_smk_rules(Path(a.root), check=a.check)
    if a.cmd == "dvc-commit":
        dvc_commit(a.stages)
        return 0
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
