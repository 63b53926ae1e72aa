"""A step's code dependencies are what it computes with (plan.registry: its row's modules), never
the plumbing every step runs (PLUMBING_MODULES: the runner, the step table, the params' schema, the
tools' records, atomic files): the rules' inputs and dvc.yaml's deps say so. The rerun matrix of
tests/pipeline/test_pipeline.py edits the files after a complete run."""

from __future__ import annotations

from repo import ROOT

from draftport.pipeline import bridge
from draftport.plan import params, registry

PLUMBING_FILES = {
    "src/draftport/errors.py",
    "src/draftport/files.py",
    "src/draftport/plan/params.py",
    "src/draftport/progress.py",
    "src/draftport/plan/registry.py",
    "src/draftport/pipeline/runner.py",
    "src/draftport/pipeline/bridge.py",
}


def test_no_step_depends_on_the_plumbing():
    assert {f"src/draftport/{m.replace('.', '/')}.py" for m in registry.PLUMBING_MODULES} == PLUMBING_FILES
    for row in registry.STEPS:
        files = set(registry.module_files(row))
        assert not files & PLUMBING_FILES, (row.name, sorted(files & PLUMBING_FILES))
        assert all((ROOT / f).is_file() for f in files), row.name
    dvc = (ROOT / "dvc.yaml").read_text()
    assert not any(f"- {f}" in dvc for f in PLUMBING_FILES)


def test_a_training_loop_edit_never_reaches_fetch_or_the_capture_of_a_real_pair():
    cfg = params.load(ROOT / "configs/kimi-k2.5.yaml")
    loop = "src/draftport/training/loop.py"
    reached = {r.name for r in registry.active(cfg) if loop in bridge.smk_inputs(r.name, cfg)}
    assert reached == {"train_phase1_scratch", "train_phase1", "train_phase2", "train_curves"}, reached
    for step in ("fetch", "features_new", "features_eval", "features_phase2", "features_monitor", "vocab_new"):
        assert loop not in bridge.smk_inputs(step, cfg), step
    capture = "src/draftport/data/features.py"
    assert capture in bridge.smk_inputs("features_new", cfg) and capture not in bridge.smk_inputs("fetch", cfg)
