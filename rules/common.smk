# Helpers of the rules (rules/<stage>.smk, generated from the step registry) and the Snakefile's hooks.
import sys

from draftport.plan import cluster

# Software of each step (snakemake --lint wants one per step), as `make setup` installs it in .venv.
ENV = "../envs/draftport.yaml"

# Each step's threads and resources under these params (params `resources`: draftport.plan.cluster).
RES = {_s.name: cluster.rule_resources(CFG, _s.name) for _s in R.STEPS}


def code(step):
    """A step's code: its script and the library modules it runs (its registry row's modules)."""
    return R.module_files(R.BY_NAME[step])


def values(*keys):
    """The values at these dotted keys of the params (a rule's `params:`, Snakemake's params trigger)."""
    return R.values_at(CFG, keys)


def command(step):
    """The step's command: the registry's (DVC's stage runs the same), with --params under another
    profile and torchrun for a training step that asks for it. It is a param, which the shell
    directive only formats."""
    return bridge.shell_command(step, CFG, BASE, cluster.launcher(CFG, step))


def target_steps(besides=(), **which):
    """The finished steps whose folders hold the targets marked true (new=, old=: targets.new,
    targets.old): the fetch step's copy of a hub id, the world's own targets. None for a folder of
    the user's, a step that does not run under these params, or one the rule lists already (besides)."""
    out = []
    for name, on in which.items():
        step = R.step_of(R.target_path(CFG, name)) if on else None
        if step and step not in besides and R.enabled(R.BY_NAME[step], CFG) and bridge.done(step) not in out:
            out.append(bridge.done(step))
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
