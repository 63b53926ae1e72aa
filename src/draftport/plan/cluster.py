"""What each rule asks of the machine: Snakemake `resources:`, threads, and the launcher.

params `resources` holds a `default` entry and per-rule entries that override keys of it:

    resources:
      default: {gpu: 0, mem_mb: 4000, runtime: 60, threads: 1, torchrun: false}
      phase1:  {gpu: 8, mem_mb: 400000, runtime: 720, threads: 32, torchrun: true}

A rule reads them through `rule_resources(cfg, rule)` (RES in rules/common.smk),
so a cluster executor (profiles/slurm/) schedules every job on what it needs: `gpu` becomes
slurm's --gpus, `mem_mb` --mem, `runtime` (minutes) --time, threads --cpus-per-task.
`launcher(cfg, rule)` is the program that runs the rule's script: `python`, or for a training
rule with `torchrun: true`, `torchrun --standalone --nproc_per_node <gpu>` (one process per GPU,
the same script; draftport.training.loop joins the process group and splits every batch).

No torch, no snakemake here: the Snakefile imports this on every start.
"""

from __future__ import annotations

from draftport.errors import DraftportError

KEYS = ("gpu", "mem_mb", "runtime", "threads", "torchrun")


def rule_resources(cfg: dict, rule: str) -> dict:
    """The rule's entry layered on `default` (every key present)."""
    res = cfg["resources"]
    out = {**res["default"], **(res.get(rule) or {})}
    missing = [k for k in KEYS if k not in out]
    if missing:
        raise DraftportError(f"resources.default.{missing[0]}", "missing")
    return out


def launcher(cfg: dict, rule: str) -> str:
    # lazy: the registry is torch-free too; a step that launches its own trainings runs as one process
    from draftport.plan.registry import TORCHRUN_INSIDE

    r = rule_resources(cfg, rule)
    if not r["torchrun"] or rule in TORCHRUN_INSIDE:
        return "python"
    return f"torchrun --standalone --nproc_per_node {r['gpu']}"


def snakemake_resources(cfg: dict, rule: str) -> dict:
    """The values a rule's `resources:` directive declares (threads go to `threads:`)."""
    r = rule_resources(cfg, rule)
    return {"gpu": r["gpu"], "mem_mb": r["mem_mb"], "runtime": r["runtime"]}
