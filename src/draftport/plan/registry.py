"""The step table: the one place a step of the game plan is described.

Per step: its named inputs (paths inside upstream steps' folders, handed to the script as
arguments), the dotted param keys it reads, the library modules it runs, its flags. The
Snakefile's rules (rules/<stage>.smk, one rule per row) and dvc.yaml's stages
(draftport.pipeline.bridge) are both generated from it. Adding a step is one row here, one script
(scripts/<name>.py), one function (the row's `fn`) and its stage in
draftport.pipeline.smk_rules.STAGES; then `python -m draftport.pipeline.bridge smk-rules` and
`... dvc-yaml` regenerate rules/ and dvc.yaml.

No torch, no snakemake here: the Snakefile imports this at every start.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

ARTIFACTS = "artifacts"


@dataclass(frozen=True)
class Input:
    """A path inside an upstream step's folder (`step/rel`), or a target (`@new`, `@old`: the
    fetch step's copy when targets.<which> is a hub id, else the folder the param names).
    when: dotted keys that must all hold (true, or `key=value`) for the input to exist."""

    path: str
    when: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step:
    name: str
    doc: str
    fn: str  # "module:function" under draftport.pipeline.steps
    params: tuple[str, ...]  # dotted keys of params.yaml the step reads
    modules: tuple[str, ...]  # library modules it runs (its code dependencies)
    inputs: dict[str, Input] = field(default_factory=dict)
    after: tuple[str, ...] = ()  # upstream steps read through params paths only
    run: str | None = None  # MLflow run (the phase's name) it creates or extends
    run_from: str | None = None  # the step whose run it extends (else it starts one)
    trains: bool = False  # makes a drafter: torchrun-able, checkpoints
    dvc: bool = True  # has a DVC stage (online steps need the vLLM venv)
    cache: bool = True  # DVC caches its outs (features: too big, not cached)
    # dotted key(s), each true or `key=value`: the step exists only when all hold
    enabled: str | tuple[str, ...] | None = None
    # a step it stands in for, with the same outputs: inputs in that step's folder read this one's
    # when this one exists (budget, adaptive, for features_phase2)
    replaces: str | None = None


# Library modules every step runs that compute nothing of its outputs: the runner and what it
# imports (the step's lifecycle, the params' schema, the step table, the tools' records, progress,
# atomic files). No step's code dependency: rewording a param's help or editing the runner reruns
# nothing. A step's values are its params (every value a step uses is written in params.yaml:
# tests/plan/test_params.py), its code the modules its row lists.
PLUMBING_MODULES = ("errors", "files", "plan.params", "progress", "plan.registry", "pipeline.runner", "pipeline.bridge")

FEATURE_KEYS = (
    "targets.new",
    "targets.trust_remote_code",
    "features.aux_layer_ids",
    "features.aux_convention",
    "features.max_new_tokens",
    "features.batch_size",
    "features.dtype",
    "features.device",
    "features.engine",
    "features.tensor_parallel_size",
    "features.regenerate",
    "features.base_url",
    "features.served_model",
    "features.compile",
)
FEATURE_MODULES = (
    "data.features",
    "data.shards",
    "data.capture",
    "data.vllm_capture",
    "engines.vllm.venv",
    "engines.vllm.runners.features_vllm",
    "engines.openai",
    "data.storage",
    "model.device",
    "model.formats",
    "model.config",
    "model.target",
    "pipeline.steps.data_steps",
)
EVAL_KEYS = ("eval", "costmodel", "serving.ms_per_draft_token")  # the last: best_k at batch 1, as R11 has it
# what an evaluation at eval.k alone reads (budget rounds, the card's tau table; the learning curves
# add eval.k_max): eval.k_max and eval.trees edits rerun evaluations, never a curve's training
CHAIN_EVAL_KEYS = ("eval.k", "eval.batch_size", "eval.max_samples", "eval.device", "eval.context_buckets")
# the drafter's fast path (training.ttt dispatches to it, so every step that imports ttt runs it)
FAST_MODULES = ("model.fast.path", "model.fast.attention", "model.fast.linear", "model.fast.unroll", "model.fast.loss")
# what drafting with a drafter bound to a target runs (the offline evaluator and everything below it)
DRAFTING_MODULES = (
    "evaluation.accept",
    "evaluation.trees",
    "model.bind",
    "data.shards",
    "model.drafter",
    "model.vocab",
    "model.device",
    "model.formats",
    "model.config",
    "model.target",
)
EVAL_MODULES = (
    *DRAFTING_MODULES,
    "data.capture",
    "evaluation.costmodel",
    "evaluation.serving",  # metrics' best_k at batch 1
    "pipeline.tracking",
    "pipeline.steps.eval_steps",
)
# the decision package: its __init__ (decide) and every module it imports
DECISION_MODULES = (
    "evaluation.decision",
    "evaluation.decision.inputs",
    "evaluation.decision.rules",
    "evaluation.decision.tables",
    "evaluation.decision.text",
    "evaluation.decision.traffic",
)
# what a training step runs: the TTT loss and its fast path, besides drafting (its held-out monitor)
LOSS_MODULES = (*FAST_MODULES, "training.ttt")
# spool on: the capture runs in training, hence the features and vLLM modules
TRAIN_MODULES = (
    "training.phases",
    "training.loop",
    "training.batches",
    "training.optim",
    *LOSS_MODULES,
    "data.capture",
    "data.draftmap",
    "model.flops",
    *DRAFTING_MODULES,
    "pipeline.tracking",
    "pipeline.steps.train_steps",
    "data.packing",
    "training.spool",
    "data.features",
    "data.storage",
    "data.vllm_capture",
    "engines.vllm.venv",
    "engines.vllm.runners.features_vllm",
)
# the points of the learning curves (draftport.plan.curves.points)
CURVE_KEYS = (
    "curves.n_samples",
    "curves.seeds",
    "curves.inits",
    "curves.arms_n_samples",
    "curves.answers",
    "curves.recipes",
)
SOURCE = Input("fetch/source")
TARGET = Input("@new")
EVAL_SET = Input("features_eval/eval_new")
VOCAB = Input("vocab_new/vocab.safetensors")
MONITOR_KEYS = ("monitor.k", "monitor.batch_size")
# where and how large the spool of a training step is when its data is stored online / hybrid (the
# capture itself is what its sequences folder records); read in disk mode too (unused there)
SPOOL_KEYS = ("targets.trust_remote_code", "features.spool_gb", "features.spool_dir")


def monitor_input(group: str) -> Input:
    """The held-out set of tau during training: an input only when the group's train.eval_every > 0."""
    return Input("features_monitor/held_out", (f"{group}.train.eval_every",))


def _eval(phase: str, train_step: str, **more: Input) -> Step:
    return Step(
        f"eval_{phase}",
        f"{phase}: its drafter's offline accept length on the new target's held-out set",
        "eval_steps:eval_trained",
        ("targets.new", *EVAL_KEYS),
        EVAL_MODULES,
        {
            "drafter": Input(f"{train_step}/drafter"),
            "target": TARGET,
            "features": EVAL_SET,
            "trained": Input(f"{train_step}/metrics.json"),
            **more,
        },
        run=phase,
        run_from=train_step,
    )


STEPS: tuple[Step, ...] = (
    Step(
        "world",
        "the embedded K2 -> K2.5 analog: corpus, tokenizer, two targets, the source drafter in a hub cache",
        "data_steps:world",
        ("world", "source.repo_id", "features.aux_layer_ids", "features.aux_convention"),
        (
            "world",
            "world.language",
            "world.tokenizer",
            "world.targets",
            "world.source",
            "data.features",
            "data.draftmap",
            "training.phases",
            "training.loop",
            "training.batches",
            "training.batches",
            "training.optim",
            "model.flops",
            *LOSS_MODULES,
            *DRAFTING_MODULES,
            "data.capture",
            "data.fetch",
            "data.storage",
            "data.packing",
            "pipeline.steps.data_steps",
        ),
        enabled="world.build",
    ),
    Step(
        "fetch",
        "the source drafter at its pinned revision (and targets given as hub ids, the reference)",
        "data_steps:fetch",
        ("source", "reference", "targets.new", "targets.old", "targets.trust_remote_code", "world.build"),
        ("data.fetch", "model.formats", "model.config", "pipeline.steps.data_steps"),
        after=("world",),
    ),
    Step(
        "features_new",
        "the new target's answers to Phase 1's prompts and its hidden states",
        "data_steps:features_new",
        (*FEATURE_KEYS, "features.storage", "targets.prompts_train", "phase1.n_samples"),
        FEATURE_MODULES,
        {"source": SOURCE, "target": TARGET},
        after=("world",),
        cache=False,
    ),
    Step(
        "features_eval",
        "held-out sets answered by each target (the new one; the old one, the source's home)",
        "data_steps:features_eval",
        (
            *FEATURE_KEYS,
            "targets.old",
            "targets.prompts_eval_new",
            "targets.prompts_eval_old",
            "features.eval_samples",
            "targets.eval_sets",
            "targets.prompts_train",  # the eval sets are checked disjoint from it
        ),
        (*FEATURE_MODULES, "data.evalsets"),
        {"source": SOURCE, "target": TARGET, "target_old": Input("@old", ("targets.old", "targets.prompts_eval_old"))},
        after=("world",),
        cache=False,
    ),
    Step(
        "features_monitor",
        "the held-out set of tau during training: the last training prompts, answered by the new target",
        "data_steps:features_monitor",
        (*FEATURE_KEYS, "targets.prompts_train", "monitor.n_samples"),
        FEATURE_MODULES,
        {"source": SOURCE, "target": TARGET},
        after=("world",),
        cache=False,
    ),
    Step(
        "vocab_new",
        "the new target's draft map (top-N ids of its own answers) and its overlap with the source's",
        "data_steps:vocab_new",
        ("targets.new", "vocab_new"),
        ("data.draftmap", "data.shards", "model.vocab", "model.formats", "model.config", "pipeline.steps.data_steps"),
        {"features": Input("features_new/train"), "source": SOURCE, "target": TARGET},
    ),
    Step(
        "features_phase2",
        "Phase 2's scaled data: the next prompts after Phase 1's, answered by the new target",
        "data_steps:features_phase2",
        (*FEATURE_KEYS, "features.storage", "targets.prompts_train", "phase1.n_samples", "phase2.n_samples"),
        FEATURE_MODULES,
        {"source": SOURCE, "target": TARGET},
        after=("world",),
        cache=False,
        enabled="data.budget=fixed",
    ),
    Step(
        "budget",
        "the adaptive data budget: Phase 2's data in rounds of n x data.factor, each trained and scored, "
        "until more data stops paying",
        "budget_step:budget",
        (
            *FEATURE_KEYS,
            "features.storage",
            "targets.prompts_train",
            "phase1.n_samples",
            "phase2.n_samples",
            "data",
            "curves.epochs",
            "curves.min_steps",
            "curves.train",
            *CHAIN_EVAL_KEYS,
            "decision.n_boot",
            "decision.level",
            "decision.seed",
            "decision.min_gain",
            "resources",
            "profile",
            *MONITOR_KEYS,
            *SPOOL_KEYS,
        ),
        (
            *TRAIN_MODULES,
            *FEATURE_MODULES,
            "evaluation.budget",
            *DECISION_MODULES,
            "evaluation.traffic",
            "evaluation.bootstrap",
            "evaluation.hours",
            "plan.curves",
            "plan.cluster",
            "data.fetch",
            "pipeline.steps.points",
            "pipeline.steps.curve_steps",
            "pipeline.steps.budget_step",
        ),
        {
            "features": Input("features_new/train"),
            "eval": EVAL_SET,
            "vocab": VOCAB,
            "source": SOURCE,
            "target": TARGET,
            "monitor": monitor_input("curves"),
        },
        after=("world",),
        run="budget",
        cache=False,
        enabled="data.budget=adaptive",
        replaces="features_phase2",
    ),
    Step(
        "features_dataset",
        "the regenerate-or-not arm's data: the prompts' own answers, teacher-forced through the new target",
        "data_steps:features_dataset",
        (*FEATURE_KEYS, "features.storage", "targets.prompts_train", "curves.arms_n_samples"),
        FEATURE_MODULES,
        {"source": SOURCE, "target": TARGET},
        after=("world",),
        cache=False,
        enabled=("curves.enabled", "curves.answers", "curves.arms_n_samples"),
    ),
    Step(
        "compare",
        "the source drafter against the layout the new target needs: config, weights, vocab, verdict",
        "compare_step:compare",
        ("targets.new",),
        (
            "outputs.compare",
            "data.draftmap",
            "model.vocab",
            "model.fixtures",
            "model.formats",
            "model.config",
            "outputs.tables",
            "pipeline.steps.compare_step",
        ),
        {"source": SOURCE, "vocab": VOCAB, "target": TARGET},
    ),
    Step(
        "eval_phase0",
        "phase0: the source drafter as fetched on the new target (and on the old one; the reference)",
        "eval_steps:eval_phase0",
        ("profile", "targets.new", "targets.old", "targets.prompts_eval_old", "reference", *EVAL_KEYS),
        EVAL_MODULES,
        {
            "drafter": SOURCE,
            "target": TARGET,
            "features": EVAL_SET,
            "target_old": Input("@old", ("targets.old", "targets.prompts_eval_old")),
            "features_old": Input("features_eval/eval_old", ("targets.old", "targets.prompts_eval_old")),
            "reference": Input("fetch/reference", ("reference",)),
        },
        run="phase0",
    ),
    Step(
        "drift",
        "beside Phase 0: the old and the new target on the same tokens, how far the states moved",
        "eval_steps:drift",
        (
            "targets.new",
            "targets.old",
            "targets.trust_remote_code",
            "eval.k",
            "eval.batch_size",
            "eval.max_samples",
            "eval.device",
            "features.batch_size",
            "features.dtype",
            "features.device",
            "features.engine",
            "features.tensor_parallel_size",
            "drift",
        ),
        (
            "evaluation.drift",
            "data.features",
            *DRAFTING_MODULES,
            "data.capture",
            "pipeline.tracking",
            "pipeline.steps.eval_steps",
            "data.vllm_capture",
            "engines.vllm.venv",
            "engines.vllm.runners.features_vllm",
        ),
        {
            "drafter": SOURCE,
            "target": TARGET,
            "target_old": Input("@old"),
            "features": EVAL_SET,
            "phase0": Input("eval_phase0/metrics.json"),
        },
        run="phase0",
        run_from="eval_phase0",
        cache=False,
        enabled="drift.enabled",
    ),
    Step(
        "train_phase1_scratch",
        "the control: Phase 1's architecture, data and budget from a random init on the new map",
        "train_steps:train_phase1_scratch",
        ("profile", "targets.new", "phase1.train", *MONITOR_KEYS, *SPOOL_KEYS),
        TRAIN_MODULES,
        {
            "features": Input("features_new/train"),
            "vocab": VOCAB,
            "source": SOURCE,
            "target": TARGET,
            "monitor": monitor_input("phase1"),
        },
        run="phase1_scratch",
        trains=True,
    ),
    _eval("phase1_scratch", "train_phase1_scratch"),
    Step(
        "train_phase1",
        "fine-tune the source drafter on the new target's data (lm_head moved onto the new map)",
        "train_steps:train_phase1",
        ("profile", "targets.new", "phase1.train", "phase1.vocab_policy", *MONITOR_KEYS, *SPOOL_KEYS),
        TRAIN_MODULES,
        {
            "features": Input("features_new/train"),
            "vocab": VOCAB,
            "source": SOURCE,
            "target": TARGET,
            "compare": Input("compare/compare.json"),
            "monitor": monitor_input("phase1"),
        },
        run="phase1",
        trains=True,
    ),
    _eval(
        "phase1",
        "train_phase1",
        phase0=Input("eval_phase0/metrics.json"),
        phase1_scratch=Input("eval_phase1_scratch/metrics.json"),
    ),
    Step(
        "train_phase2",
        "continue Phase 1's drafter (its map kept) on the scaled data",
        "train_steps:train_phase2",
        ("profile", "targets.new", "phase2.train", *MONITOR_KEYS, *SPOOL_KEYS),
        TRAIN_MODULES,
        {
            "features": Input("features_phase2/train"),
            "vocab": VOCAB,
            "init": Input("train_phase1/drafter"),
            "source": SOURCE,
            "target": TARGET,
            "monitor": monitor_input("phase2"),
        },
        run="phase2",
        trains=True,
    ),
    _eval("phase2", "train_phase2", phase1=Input("eval_phase1/metrics.json")),
    Step(
        "train_curves",
        "learning curves: fine-tune and scratch at each curves.n_samples x seed, one budget rule",
        "curve_steps:train_curves",
        (
            "profile",
            "targets.new",
            *CURVE_KEYS,
            "curves.epochs",
            "curves.min_steps",
            "curves.train",
            *MONITOR_KEYS,
            *SPOOL_KEYS,
        ),
        (*TRAIN_MODULES, "plan.curves", "pipeline.steps.points", "pipeline.steps.curve_steps"),
        {
            "features": Input("features_new/train"),
            "features_phase2": Input("features_phase2/train"),
            "features_dataset": Input("features_dataset/train", ("curves.answers", "curves.arms_n_samples")),
            "vocab": VOCAB,
            "source": SOURCE,
            "target": TARGET,
            "monitor": monitor_input("curves"),
        },
        run="curves",
        trains=True,
        enabled="curves.enabled",
    ),
    Step(
        "eval_curves",
        "every learning-curve point's drafter on the new target's held-out set (per-prompt counts)",
        "curve_eval_steps:eval_curves",
        ("targets.new", *CHAIN_EVAL_KEYS, "eval.k_max", *CURVE_KEYS),
        (
            *DRAFTING_MODULES,
            "pipeline.tracking",
            "evaluation.traffic",
            "evaluation.bootstrap",
            "pipeline.steps.points",
            "pipeline.steps.curve_eval_steps",
        ),
        {"points": Input("train_curves/points.json"), "target": TARGET, "features": EVAL_SET},
        run="curves",
        run_from="train_curves",
        enabled="curves.enabled",
    ),
    Step(
        "decision",
        "the recommendation with evidence: init, recipe, answers, data, Phase 2, hours, serving; bootstrap CIs, R1-R11",
        "decision_step:decision",
        (
            "costmodel",
            "eval.k",
            "decision",
            "serving",
            "resources",
            "phase1.n_samples",
            "phase2.n_samples",
            "phase1.train.ttt_steps",
            "publish.repo_id",
            "publish.folder",
            "source.repo_id",
            "targets.prompts_train",
            "targets.new",
            "world.build",
        ),
        (
            *DECISION_MODULES,
            "evaluation.serving",
            # a real target's step times, derived (serving.step_table null)
            "profile.estimate",
            "profile.rates",
            "evaluation.budget",
            "data.storage",
            "model.config",
            "model.flops",
            "outputs.render",
            "plan.cluster",
            "evaluation.traffic",
            "evaluation.bootstrap",
            "evaluation.hours",
            "evaluation.costmodel",
            "plan.curves",
            "pipeline.steps.decision_step",
        ),
        {
            "curves": Input("eval_curves/curves.json", ("curves.enabled",)),
            **{ph: Input(f"eval_{ph}/eval.json") for ph in ("phase0", "phase1_scratch", "phase1", "phase2")},
            # data_* / train_*: only that those steps ran first (their measured seconds are read from logs/)
            **{f"data_{st}": Input(f"{st}/metrics.json") for st in ("features_new", "features_phase2")},
            "data_features_dataset": Input(
                "features_dataset/metrics.json", ("curves.enabled", "curves.answers", "curves.arms_n_samples")
            ),
            **{f"train_{ph}": Input(f"train_{ph}/metrics.json") for ph in ("phase1_scratch", "phase1", "phase2")},
            "drift": Input("drift/metrics.json", ("drift.enabled",)),
            "budget": Input("budget/budget.json", ("data.budget=adaptive",)),
            "source": Input("fetch/source/fetch.lock.json"),  # the drafter's bytes (derived step times)
        },
    ),
    Step(
        "report",
        "plots and tables: tau per phase vs projected tok/s, per-position acceptance, loss, comparison",
        "report_step:report",
        ("profile", "costmodel", "eval.k", "online.enabled"),
        (
            "outputs.report",
            "outputs.tables",
            "outputs.style",
            "outputs.traffic_report",
            "evaluation.serving",
            "pipeline.steps.report_step",
        ),
        {
            "compare": Input("compare/compare.json"),
            "world": Input("world/metrics.json", ("world.build",)),
            "source_drafter": Input("world/source_drafter.json", ("world.build",)),
            "decision": Input("decision/decision.json"),
            "curves": Input("eval_curves/curves.json", ("curves.enabled",)),
            **{ph: Input(f"eval_{ph}/metrics.json") for ph in ("phase0", "phase1_scratch", "phase1", "phase2")},
            "drift": Input("drift/metrics.json", ("drift.enabled",)),
            **{f"history_{ph}": Input(f"train_{ph}/history.csv") for ph in ("phase1_scratch", "phase1", "phase2")},
            **{f"online_{ph}": Input(f"online_{ph}/metrics.json", ("online.enabled",)) for ph in ("phase0", "phase1")},
        },
    ),
    *(
        Step(
            f"online_{ph}",
            f"{ph}'s drafter served by vLLM next to the offline evaluator on the same sequences",
            f"online_steps:online_{ph}",
            (
                "targets.new",
                "targets.prompts_eval_new",
                "targets.eval_sets",
                "targets.prompts_train",
                "features.aux_convention",
                "eval.k",
                "online.n_prompts",
                "online.max_new_tokens",
                "online.max_num_seqs",
                "online.tolerance",
                "online.dtype",
                "online.vllm_python",
                "online.tensor_parallel_size",
                "online.embed_tokens",
            ),
            (
                "evaluation.online",
                "engines.vllm.venv",
                "engines.vllm.runners.online_vllm",
                "engines.export",
                "data.features",
                *DRAFTING_MODULES,
                "data.capture",
                "pipeline.tracking",
                "pipeline.steps.online_steps",
                "data.evalsets",
            ),
            {
                "drafter": SOURCE if ph == "phase0" else Input("train_phase1/drafter"),
                "target": TARGET,
                "phase": Input(f"eval_{ph}/metrics.json"),
            },
            dvc=False,
        )
        for ph in ("phase0", "phase1")
    ),
    Step(
        "publish",
        "the chosen drafter as a hub-ready folder: flat config, the new target's embed_tokens, a model card; checked",
        "publish_step:publish",
        ("targets.new", *CHAIN_EVAL_KEYS, "costmodel", "decision", "publish"),
        (
            "outputs.publish",
            "engines.export",
            "evaluation.online",
            "engines.vllm.venv",
            "evaluation.roundtrip",
            "engines.speculators",
            *DECISION_MODULES,
            "evaluation.serving",
            "evaluation.traffic",
            "evaluation.bootstrap",
            *DRAFTING_MODULES,
            "data.capture",
            "evaluation.costmodel",
            "pipeline.steps.publish_step",
        ),
        {
            "decision": Input("decision/decision.json"),
            "target": TARGET,
            "features": EVAL_SET,
            "source": Input("fetch/source/fetch.lock.json"),
            "data_phase1": Input("features_new/train/index.json"),
            "data_phase2": Input("features_phase2/train/index.json", ("data.budget=fixed",)),
            "data_phase2_chain": Input("budget/train/chain.json", ("data.budget=adaptive",)),
            **{f"drafter_{ph}": Input(f"train_{ph}/drafter") for ph in ("phase1_scratch", "phase1", "phase2")},
            **{f"train_{ph}": Input(f"train_{ph}/metrics.json") for ph in ("phase1_scratch", "phase1", "phase2")},
            **{f"eval_{ph}": Input(f"eval_{ph}/eval.json") for ph in ("phase1_scratch", "phase1", "phase2")},
            "online_phase1": Input("online_phase1/metrics.json", ("online.enabled",)),
        },
        enabled="publish.enabled",
    ),
)
BY_NAME: dict[str, Step] = {s.name: s for s in STEPS}
STEP_NAMES: tuple[str, ...] = tuple(BY_NAME)
TRAINING_STEPS: tuple[str, ...] = tuple(s.name for s in STEPS if s.trains)
# steps that launch their own trainings under torchrun (resources.<step>.torchrun: one process per
# GPU for each training) while the step itself stays one process (budget: it holds the capture too)
TORCHRUN_INSIDE: tuple[str, ...] = ("budget",)

# Named targets (Snakemake rules without a command): the steps each one asks for.
TARGETS: dict[str, tuple[str, ...]] = {
    "phase0": ("eval_phase0", "drift"),
    "phase1": ("eval_phase1",),
    "phase2": ("eval_phase2",),
    "curves": ("eval_curves",),
    "online": ("online_phase0", "online_phase1"),
}


def target_steps(target: str, cfg: dict) -> list[str]:
    """A named target's steps that exist under these params."""
    return [s for s in TARGETS[target] if enabled(BY_NAME[s], cfg)]


# ---- what a row means under a profile ---------------------------------------------------------
def art(step: str, *parts: str) -> str:
    """A path in the step's folder, artifacts/<step>/..."""
    return "/".join((ARTIFACTS, step, *parts))


def done(step: str) -> str:
    """The file Snakemake sees for a step: written last, so it exists only for a finished step."""
    return art(step, "metrics.json")


def get(cfg: dict, dotted: str):
    """cfg's value at a dotted key (a KeyError names a key the params do not have)."""
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            raise KeyError(dotted)
        cur = cur[part]
    return cur


def holds(cfg: dict, cond: str) -> bool:
    """A condition of the table: `key` (its value is true) or `key=value` (its value, as text, is value)."""
    key, eq, value = cond.partition("=")
    return str(get(cfg, key)) == value if eq else bool(get(cfg, key))


def enabled(step: Step, cfg: dict) -> bool:
    conds = (step.enabled,) if isinstance(step.enabled, str) else step.enabled or ()
    return all(holds(cfg, c) for c in conds)


def folder_of(step: str, cfg: dict) -> str:
    """The step whose folder an input in `step`'s folder is read from: a step that replaces it when
    that one exists under cfg, else step itself."""
    for s in STEPS:
        if s.replaces == step and enabled(s, cfg):
            return s.name
    return step


def active(cfg: dict) -> list[Step]:
    """The rows that exist under these params (world only when world.build)."""
    return [s for s in STEPS if enabled(s, cfg)]


def is_hub_id(value: str) -> bool:
    """org/name that is not a local folder (artifacts/... paths are the pipeline's own)."""
    return (
        not Path(value).exists()
        and value.count("/") == 1
        and not value.startswith((".", "/"))
        and not value.startswith(ARTIFACTS + "/")
    )


def target_path(cfg: dict, which: str) -> str:
    """A target folder: the fetch step's copy when targets.<which> is a hub id, else the folder."""
    value = cfg["targets"][which]
    return f"{ARTIFACTS}/fetch/target_{which}" if is_hub_id(value) else value


def inputs(step: Step, cfg: dict) -> dict[str, str]:
    """The step's named inputs under these params, as paths (what its script receives)."""
    out = {}
    for name, inp in step.inputs.items():
        if not all(holds(cfg, k) for k in inp.when):
            continue
        if inp.path.startswith("@"):
            out[name] = target_path(cfg, inp.path[1:])
        else:
            up, _, rest = inp.path.partition("/")
            out[name] = f"{ARTIFACTS}/{folder_of(up, cfg)}/{rest}"
    return out


def step_of(path: str) -> str | None:
    """The step whose folder holds path (artifacts/<step>/...), None for a path outside them."""
    parts = path.split("/")
    return parts[1] if len(parts) >= 2 and parts[0] == ARTIFACTS and parts[1] in BY_NAME else None


def upstream(step: Step, cfg: dict) -> list[str]:
    """Steps that must have run first: those holding its inputs, and its `after` steps, when they exist."""
    names = [step_of(p) for p in inputs(step, cfg).values()] + list(step.after)
    return [n for n in dict.fromkeys(names) if n is not None and enabled(BY_NAME[n], cfg)]


def module_files(step: Step) -> list[str]:
    """Its code dependencies: the step's script and the library modules it runs, as repo paths."""
    root = Path(__file__).resolve().parents[1]
    files = [f"scripts/{step.name}.py"]
    for m in dict.fromkeys(step.modules):
        rel = Path(*m.split("."))
        f = rel.with_suffix(".py") if (root / rel.with_suffix(".py")).is_file() else rel / "__init__.py"
        files.append(f"src/draftport/{f}")
    return files


def step_params(cfg: dict, name: str) -> dict:
    """The nested sub-dict of cfg holding exactly the step's keys."""
    return values_at(cfg, BY_NAME[name].params)


def values_at(cfg: dict, keys) -> dict:
    """The nested sub-dict of cfg holding exactly these dotted keys."""
    out: dict = {}
    for dotted in keys:
        *parents, last = dotted.split(".")
        cur = out
        for p in parents:
            cur = cur.setdefault(p, {})
        cur[last] = copy.deepcopy(get(cfg, dotted))
    return out


def command(step: Step, cfg: dict) -> str:
    """The step's command (Snakemake's shell and DVC's cmd, verbatim), without a --params file."""
    ins = "".join(f" --input {k}={v}" for k, v in inputs(step, cfg).items())
    return f"python scripts/{step.name}.py{ins} --logfile logs/{step.name}.log"


def table_markdown() -> str:
    """The registry as a Markdown table (docs/architecture.md holds it; a test keeps them equal)."""
    rows = ["| step | does | inputs (from) | params | flags |", "|---|---|---|---|---|"]
    for s in STEPS:
        ins = (
            ", ".join(
                f"{k} ({v.path.split('/')[0] if not v.path.startswith('@') else 'target'})" for k, v in s.inputs.items()
            )
            or "-"
        )
        flags = (
            ", ".join(
                f
                for f, on in (
                    ("trains", s.trains),
                    (f"MLflow run {s.run}", bool(s.run)),
                    ("no DVC stage", not s.dvc),
                    ("not cached", not s.cache),
                    (
                        f"only when {' and '.join((s.enabled,) if isinstance(s.enabled, str) else s.enabled or ())}",
                        bool(s.enabled),
                    ),
                    (f"stands in for {s.replaces}", bool(s.replaces)),
                )
                if on
            )
            or "-"
        )
        rows.append(f"| `{s.name}` | {s.doc} | {ins} | {', '.join(f'`{p}`' for p in s.params)} | {flags} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table_markdown(), end="")
