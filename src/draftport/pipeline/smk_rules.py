"""rules/<stage>.smk from the step registry: one plain Snakemake rule per row, written out.

A reader of rules/ sees every step's inputs (its upstream steps' metrics.json, by step name, and
its code), its output, the dotted params keys it reads, its log, threads, resources and command.
What depends on the params stays readable: `branch(<condition>, then=...)` for an input that
exists only under some params, an `if` block for a row that does (registry `enabled`), and the
helpers of rules/common.smk (the target's step, the code, the command, the resources).

The files are generated (`python -m draftport.pipeline.bridge smk-rules`), never edited by hand;
`--check` (and tests/pipeline/test_pipeline_dvc.py) fails when they drift from the registry.
"""

from __future__ import annotations

from draftport.plan import registry
from draftport.plan.registry import Step, done

RULES_DIR = "rules"

# The plan's stages, one rules/<stage>.smk each, in the Snakefile's include order: every row of the
# registry is in exactly one (a new row fails the generator until it is placed).
STAGES: dict[str, tuple[str, ...]] = {
    "world": ("world",),
    "data": (
        "fetch",
        "features_new",
        "features_eval",
        "features_monitor",
        "vocab_new",
        "features_phase2",
        "budget",
        "features_dataset",
    ),
    "phase0": ("compare", "eval_phase0", "drift"),
    "phase1": ("train_phase1_scratch", "eval_phase1_scratch", "train_phase1", "eval_phase1"),
    "phase2": ("train_phase2", "eval_phase2"),
    "curves": ("train_curves", "eval_curves"),
    "decision": ("decision", "publish"),
    "report": ("report",),
    "online": ("online_phase0", "online_phase1"),
}
STAGE_DOCS = {
    "world": "the embedded K2 -> K2.5 analog (only when world.build)",
    "data": "the source drafter, the targets' answers and hidden states, the new draft map",
    "phase0": "the source drafter as fetched, against the new target",
    "phase1": "fine-tune the source on the new target's data, and the control from scratch",
    "phase2": "continue Phase 1's drafter on the scaled data",
    "curves": "learning curves: fine-tune and scratch by sample count and seed",
    "decision": "the recommendation, and the chosen drafter as a hub-ready folder",
    "report": "plots and tables",
    "online": "vLLM serves the Phase 0 / Phase 1 drafters (make vllm-venv first)",
}

# The report step's files shown by `snakemake --report`: (caption, category)
REPORT_FILES = {
    "summary.html": ("../report/summary.rst", "1. Summary"),
    "tau.png": ("../report/tau.rst", "2. Phases"),
    "positions.png": ("../report/positions.rst", "2. Phases"),
    "loss.png": ("../report/loss.rst", "2. Phases"),
    "phases.csv": ("../report/phases.rst", "2. Phases"),
    "compare.html": ("../report/compare.rst", "3. Compare"),
}

HEADER = """\
# GENERATED from the step registry (src/draftport/plan/registry.py) by
# `python -m draftport.pipeline.bridge smk-rules`: do not edit (tests/pipeline/test_pipeline_dvc.py
# fails when this file and the registry drift apart). The helpers are in rules/common.smk.
"""


def conds_of(step: Step) -> tuple[str, ...]:
    """A row's `enabled` as a tuple of conditions."""
    return (step.enabled,) if isinstance(step.enabled, str) else tuple(step.enabled or ())


def cond_expr(cond: str) -> str:
    """A condition of the table (`key`: true, `key=value`) as Python on CFG."""
    key, eq, value = cond.partition("=")
    ref = "CFG" + "".join(f'["{p}"]' for p in key.split("."))
    return f'{ref} == "{value}"' if eq else ref


def all_expr(conds) -> str:
    return " and ".join(cond_expr(c) for c in conds)


def _candidates(step: Step) -> list[tuple[str, str, frozenset]]:
    """(kind, what, conditions) per input and `after` step, in the order registry.upstream reads
    them: ("step", <upstream step>, the conditions under which it is that input's folder and exists)
    or ("target", new|old, the input's conditions)."""
    out = []
    for inp in step.inputs.values():
        when = frozenset(inp.when)
        if inp.path.startswith("@"):
            out.append(("target", inp.path[1:], when))
            continue
        up = inp.path.split("/")[0]
        subs = [s for s in registry.STEPS if s.replaces == up]
        for s in subs:  # the stand-in exists under its conditions; the step it replaces under the others
            mine, theirs = conds_of(registry.BY_NAME[up]), conds_of(s)
            if not (len(mine) == len(theirs) == 1 and mine[0].split("=")[0] == theirs[0].split("=")[0] != mine[0]):
                raise ValueError(f"{s.name} replaces {up}: both must exist under one key's values")
            out.append(("step", s.name, when | set(theirs)))
        out.append(("step", up, when | set(conds_of(registry.BY_NAME[up]))))
    for a in step.after:
        out.append(("step", a, frozenset(conds_of(registry.BY_NAME[a]))))
    return out


def _inputs(step: Step) -> list[str]:
    """The rule's `input:` lines: one per upstream step (its metrics.json), the target's step, the code."""
    own = set(conds_of(step))  # they hold inside the rule's `if` block
    cands = _candidates(step)
    by_step: dict[str, list[frozenset]] = {}
    for kind, what, conds in cands:
        if kind == "step":
            by_step.setdefault(what, []).append(conds - own)
    # a step present whenever it exists needs no target lookup: the target's step is left out when it is one
    always = [s for s, alts in by_step.items() if any(a <= set(conds_of(registry.BY_NAME[s])) for a in alts)]
    lines, seen = [], set()
    for kind, what, conds in cands:
        if kind == "target":
            if "targets" in seen:
                continue
            seen.add("targets")
            which = []
            for k, w, c in cands:
                if k == "target":
                    c = sorted(c - own)
                    which.append(f"{w}={all_expr(c) if c else 'True'}")
            which += [f"besides=[{', '.join(repr(s).replace(chr(39), chr(34)) for s in always)}]"] if always else []
            lines.append(f"targets=target_steps({', '.join(dict.fromkeys(which))}),")
            continue
        if what in seen:
            continue
        seen.add(what)
        alts = [a for a in by_step[what] if not any(b < a for b in by_step[what])]  # A or (A and B) is A
        alts = sorted(set(alts), key=sorted)
        path = f'"{done(what)}"'
        if not all(alts):
            lines.append(f"{what}={path},")
        else:
            test = " or ".join(f"({all_expr(sorted(a))})" if len(alts) > 1 else all_expr(sorted(a)) for a in alts)
            lines.append(f"{what}=branch({test}, then={path}),")
    lines.append(f'code=code("{step.name}"),')
    return lines


def wrap(line: str, indent: str, width: int = 100) -> list[str]:
    """`name=f(a, b, ...),` as one line when it fits, else its arguments packed under it."""
    if len(indent + line) <= width or "(" not in line:
        return [indent + line]
    head, _, rest = line.partition("(")
    args, depth, cur = [], 0, ""
    for ch in rest[: -len("),")]:  # split at the call's own commas, not those inside its arguments
        depth += (ch in "([") - (ch in ")]")
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    args.append(cur.strip())
    out, cur = [indent + head + "("], ""
    for a in args:
        if cur and len(indent + "    " + cur + ", " + a + ",") > width:
            out.append(indent + "    " + cur + ",")
            cur = a
        else:
            cur = f"{cur}, {a}" if cur else a
    return [*out, indent + "    " + cur + ",", indent + "),"]


def rule_text(step: Step) -> str:
    name = step.name
    conds = conds_of(step)
    pad = "    " if conds else ""  # inside the `if` block of a row that exists under some params
    outs = [f'"{done(name)}",']
    if name == "report":
        outs += [
            f'report("{registry.art("report", f)}", caption="{c}", category="{g}"),'
            for f, (c, g) in REPORT_FILES.items()
        ]
    keys = ", ".join(f'"{k}"' for k in step.params)
    arg = pad + "        "
    body = [
        f"rule {name}:",
        "    input:",
        *(y for x in _inputs(step) for y in wrap(x, arg)),
        "    output:",
        *(arg + x for x in outs),
        "    params:",
        *wrap(f"values=values({keys}),", arg),
        f'{arg}cmd=command("{name}"),',
        "    conda:",
        f"{arg}ENV",
        "    log:",
        f'{arg}"logs/{name}.log",',
        f'    threads: RES["{name}"]["threads"]',
        "    resources:",
        *(f'{arg}{k}=RES["{name}"]["{k}"],' for k in ("gpu", "mem_mb", "runtime")),
        "    shell:",
        f'{arg}"{{params.cmd}}"',
    ]
    body = [x if x.startswith(arg) else pad + x for x in body]
    doc = f"# {name}: {step.doc}"
    if not conds:
        return "\n".join([doc, *body]) + "\n"
    return "\n".join([doc, f"# only when {' and '.join(conds)}", f"if {all_expr(conds)}:", "", *body]) + "\n"


def texts() -> dict[str, str]:
    """rules/<stage>.smk -> its text."""
    placed = [s for steps in STAGES.values() for s in steps]
    missing = [s for s in registry.STEP_NAMES if s not in placed]
    extra = [s for s in placed if s not in registry.BY_NAME or placed.count(s) > 1]
    if missing or extra:
        raise ValueError(f"smk_rules.STAGES must place every registry row once: missing {missing}, unknown {extra}")
    out = {}
    for stage, steps in STAGES.items():
        parts = [HEADER + f"# {stage}: {STAGE_DOCS[stage]}\n"]
        parts += [rule_text(registry.BY_NAME[s]) for s in steps]
        out[f"{RULES_DIR}/{stage}.smk"] = "\n\n".join(parts)
    return out
