# Helpers of the rules (rules/steps.smk) and the Snakefile's hooks.
import sys

from draftport.plan import cluster

# Software of each step (snakemake --lint wants one per step), as `make setup` installs it in .venv.
ENV = "../envs/draftport.yaml"

# The report step's files shown by `snakemake --report`: (caption, category)
REPORT_FILES = {
    "summary.html": ("../report/summary.rst", "1. Summary"),
    "tau.png": ("../report/tau.rst", "2. Phases"),
    "positions.png": ("../report/positions.rst", "2. Phases"),
    "loss.png": ("../report/loss.rst", "2. Phases"),
    "phases.csv": ("../report/phases.rst", "2. Phases"),
    "compare.html": ("../report/compare.rst", "3. Compare"),
}


def outputs(step):
    """A step's metrics.json (written last); the report's files with their captions."""
    out = [bridge.done(step)]
    if step == "report":
        out += [report(bridge.art("report", f), caption=c, category=g) for f, (c, g) in REPORT_FILES.items()]
    return out


def on_start():
    bridge.note_lock_owner(workflow.persistence)  # [S1] a kill -9 leaves the lock: the next run clears it
    if os.environ.get("DVC_STAGE"):
        return  # a DVC stage recording its run (--touch): nothing runs
    runs = {j.rule.name for j in workflow.dag.needrun_jobs()}  # [S3]
    if any(R.BY_NAME[r].run for r in runs if r in R.BY_NAME):
        # Create the experiment once, before jobs write to one sqlite file in parallel; an
        # unreachable tracking server stops here, before any compute.
        shell(f"python -m draftport.pipeline.tracking init {CFG['profile']}")


def on_success():
    if os.environ.get("DVC_STAGE"):
        return  # inside `dvc repro`, which writes dvc.lock itself
    stages = sorted({j.rule.name for j in workflow.dag.jobs if j.rule.shellcmd})  # [S3]
    if bridge.uses_params_yaml(CFG, BASE, stages):
        bridge.dvc_commit(stages, log=lambda m: print(m, file=sys.stderr))
    else:
        print("dvc.lock not updated: this run used another profile than params.yaml "
              "(DVC tracks params.yaml)", file=sys.stderr)
