# Helpers shared by the rules. Every step is `python scripts/<step>.py --logfile logs/<step>.log`,
# the exact command its DVC stage runs; values reach it through params.yaml, or through
# --params <file> under another profile (pl.params_arg), and `params: values=` lets
# Snakemake's params trigger see them.
import os
import sys

# Software of each step (snakemake --lint wants one per step), as `make setup` installs it in .venv.
ENV = "../envs/draftport.yaml"


def done(*steps):
    """Upstream steps' metrics.json: small files, compared by checksum when their mtime moves."""
    return [pl.done(s) for s in steps]


def world_done():
    return done("world") if CFG["world"]["build"] else []


def online_done():
    """The online steps (rules/online.smk) when params online.enabled is on: `all` and the report."""
    return done(*pl.ONLINE) if CFG["online"]["enabled"] else []


def res(rule, key):
    """The rule's `resources.<rule>` value layered on `resources.default` (draftport.cluster)."""
    from draftport import cluster

    return cluster.rule_resources(CFG, rule)[key]


def launch(rule):
    """`python`, or `torchrun --standalone --nproc_per_node <gpu>` for a training rule that asks."""
    from draftport import cluster

    return cluster.launcher(CFG, rule)


def values(step):
    return pl.P.step_params(CFG, step)


def extra(step):
    return pl.params_arg(CFG, BASE, step)


def on_start():
    pl.note_lock_owner(workflow.persistence)  # a kill -9 leaves the lock: the next run clears it
    if os.environ.get("DVC_STAGE"):
        return  # a DVC stage recording its run (--touch): nothing runs
    runs = {j.rule.name for j in workflow.dag.needrun_jobs()}
    if runs & set(pl.TRACKED):
        # Create the experiment once, before jobs write to one sqlite file in parallel; an
        # unreachable tracking server stops here, before any compute.
        shell(f"python -m draftport.tracking init {CFG['profile']}")


def on_success():
    if os.environ.get("DVC_STAGE"):
        return  # inside `dvc repro`, which writes dvc.lock itself
    stages = sorted({j.rule.name for j in workflow.dag.jobs if j.rule.shellcmd})
    if pl.uses_params_yaml(CFG, BASE, stages):
        pl.dvc_commit(stages, log=lambda m: print(m, file=sys.stderr))
    else:
        print("dvc.lock not updated: this run used another profile than params.yaml "
              "(DVC tracks params.yaml)", file=sys.stderr)
