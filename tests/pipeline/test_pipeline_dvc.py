"""Snakefile and dvc.yaml agree; the glue's pieces behave (fast: no pipeline run)."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from repo import ROOT, smk
from snakemake.persistence.file import FilePersistence

from draftport.errors import DraftportError
from draftport.outputs.report import build_report
from draftport.pipeline import bridge
from draftport.pipeline.steps.eval_steps import cost_metrics
from draftport.pipeline.tracking import check_reachable, retry
from draftport.plan import params, registry


@pytest.fixture(scope="module")
def generated():
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return bridge.dvc_yaml_text()
    finally:
        os.chdir(cwd)


def test_dvc_yaml_is_generated_from_the_registry(generated):
    committed = (ROOT / "dvc.yaml").read_text()
    assert committed == generated, "dvc.yaml drifted: run `python -m draftport.pipeline.bridge dvc-yaml`"


def test_stages_are_the_registry_rows_with_their_commands_keys_code_and_outs(generated):
    stages = yaml.safe_load(generated)["stages"]
    cfg = params.load(base=ROOT / "params.yaml")
    assert list(stages) == [s.name for s in registry.active(cfg) if s.dvc]  # enabled: publish is opt-in
    for name, st in stages.items():
        row = registry.BY_NAME[name]
        assert st["cmd"].startswith(f"python scripts/{name}.py") and st["cmd"].endswith(f"--logfile logs/{name}.log")
        assert st["cmd"] == registry.command(row, cfg)
        assert st["params"] == list(row.params)
        out = st["outs"][0]
        assert (next(iter(out)) if isinstance(out, dict) else out) == f"artifacts/{name}"
        assert f"scripts/{name}.py" in st["deps"]
        for f in registry.module_files(row):  # code is a dependency, and every listed module exists
            assert f in st["deps"] and (ROOT / f).is_file(), (name, f)
    # the evaluation of Phase 1 reaches its drafter's training, the control and Phase 0
    assert {"artifacts/train_phase1", "artifacts/eval_phase1_scratch", "artifacts/eval_phase0"} <= set(
        stages["eval_phase1"]["deps"]
    )
    # evaluations and trainings are apart: no evaluation key reaches a training stage
    for name in registry.TRAINING_STEPS:
        assert not [k for k in stages[name]["params"] if k.split(".")[0] in ("eval", "costmodel")], name
    assert "src/draftport/training/loop.py" not in stages["eval_phase1"]["deps"]
    # the evaluator's code does (a training measures its held-out tau with it: train.eval_every),
    # the cost model's never
    assert "src/draftport/evaluation/accept.py" in stages["train_phase1"]["deps"]
    assert "src/draftport/evaluation/costmodel.py" not in stages["train_phase1"]["deps"]


def test_snakefile_rules_are_the_registry_rows():
    """The Snakefile's rules (parsed by Snakemake) run the same commands as the DVC stages and
    take the same code as inputs."""
    cfg = params.load(base=ROOT / "params.yaml")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with bridge.snakemake_workflow() as wf:
            rules = {r.name: r for r in wf.rules if r.shellcmd}
            assert sorted(rules) == sorted(s.name for s in registry.active(cfg))
            for name, rule in rules.items():
                row = registry.BY_NAME[name]
                assert rule.shellcmd == "{params.cmd}" and rule.params.cmd == registry.command(row, cfg), name
                assert rule.params.values == registry.step_params(cfg, name), name
                ins = sorted(str(f) for f in rule.input)  # the upstream steps' metrics.json and the code, once each
                assert ins == sorted(bridge.smk_inputs(name, cfg)), name
                assert set(registry.module_files(row)) <= set(ins), name
    finally:
        os.chdir(cwd)


def test_rules_are_generated_from_the_registry(tmp_path, capsys):
    """rules/<stage>.smk are the generator's text; an edit of one fails --check, naming the file."""
    assert bridge.main(["smk-rules", "--check", "--root", str(ROOT)]) == 0, capsys.readouterr().err
    shutil.copytree(ROOT / "rules", tmp_path / "rules")
    f = tmp_path / "rules" / "phase1.smk"
    f.write_text(f.read_text().replace('"logs/train_phase1.log"', '"logs/train_phase1.txt"'))
    capsys.readouterr()
    assert bridge.main(["smk-rules", "--check", "--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("rules/phase1.smk drifted from the step registry"), err
    bridge.main(["smk-rules", "--root", str(tmp_path)])  # regenerating repairs it
    assert f.read_text() == (ROOT / "rules" / "phase1.smk").read_text()


def test_snakemake_lint_is_clean():
    r = smk("--lint")
    assert "Congratulations" in r.stdout + r.stderr


def test_dry_run_plans_phase1_with_the_dvc_commands(tmp_path):
    # --forceall: the plan must be the whole chain even where a user's `make phase1` already ran
    r = smk("-n", "-p", "--forceall", "phase1", "--directory", str(ROOT))
    out = r.stdout + r.stderr
    for step in (
        "world",
        "fetch",
        "features_new",
        "features_eval",
        "vocab_new",
        "compare",
        "eval_phase0",
        "train_phase1_scratch",
        "eval_phase1_scratch",
        "train_phase1",
        "eval_phase1",
    ):
        assert f"python scripts/{step}.py " in out and f" --logfile logs/{step}.log" in out, step
    assert "phase2" not in out.split("Job stats")[-1]


def test_another_profile_passes_its_values_by_file():
    r = smk("-n", "-p", "--forceall", "phase0", "--configfile", "configs/micro.yaml")
    out = r.stdout + r.stderr
    assert "python scripts/eval_phase0.py --params .snakemake/draftport/params/eval_phase0-" in out
    path = out.split("python scripts/eval_phase0.py --params ")[1].split()[0]
    vals = yaml.safe_load((ROOT / path).read_text())
    micro = params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")
    assert vals == registry.step_params(micro, "eval_phase0")


def test_bad_parameter_stops_snakemake_before_any_job(tmp_path):
    (tmp_path / "bad.yaml").write_text("eval: {k: 0}\nphase1: {n_sample: 3}\n")
    r = smk("-n", "phase1", "--configfile", str(tmp_path / "bad.yaml"), check=False)
    assert r.returncode != 0
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "bad parameters" in l]
    assert lines == ["error: bad parameters: eval.k: must be >= 1, got 0"]
    assert "Traceback" not in r.stdout + r.stderr


def test_params_arg_is_empty_for_params_yaml_and_content_named_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = params.load(base=ROOT / "params.yaml")
    assert bridge.params_arg(base, base, "train_phase1") == ""
    other = params.merge(base, {"phase2": {"train": {"steps": 7}}})
    assert bridge.params_arg(other, base, "train_phase1") == ""  # phase1 does not read phase2's values
    assert bridge.params_arg(other, base, "eval_phase2") == ""  # nor does phase2's evaluation
    a = bridge.params_arg(other, base, "train_phase2")
    assert a.startswith(" --params .snakemake/draftport/params/train_phase2-")
    assert bridge.params_arg(other, base, "train_phase2") == a
    assert yaml.safe_load(Path(a.split()[-1]).read_text())["phase2"]["train"]["steps"] == 7


def test_dropping_snakemake_records_matches_snakemakes_file_layout(tmp_path):
    meta = tmp_path / "metadata"
    meta.mkdir()

    class Fake:
        _max_len = None

        def _fetch_max_len(self, subject):
            return os.pathconf(subject, "PC_NAME_MAX")

    names = [
        "artifacts/phase1/metrics.json",
        "artifacts/phase1_scratch/metrics.json",
        "artifacts/phase1/" + "x" * 400 + ".json",
    ]
    for n in names:
        rec = Path(FilePersistence._record_path(Fake(), str(meta), n))
        rec.parent.mkdir(parents=True, exist_ok=True)
        rec.write_text("{}")
    assert bridge.drop_snakemake_records("phase1", root=str(meta)) == 2
    left = [p for p in meta.rglob("*") if p.is_file()]
    assert len(left) == 1 and bridge.record_name("artifacts/phase1_scratch/metrics.json") == left[0].name


def test_unreachable_tracking_server_is_one_line_with_the_uri():
    with pytest.raises(DraftportError) as e:
        check_reachable("http://127.0.0.1:9", timeout=2)
    assert str(e.value).startswith("http://127.0.0.1:9: MLflow tracking server unreachable")


def test_tracking_retries_while_the_database_is_locked():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "ok"

    assert retry(flaky) == "ok" and len(calls) == 3
    with pytest.raises(ValueError):
        retry(lambda: (_ for _ in ()).throw(ValueError("other")))


def test_cost_metrics_match_the_seeds():
    m = cost_metrics(2.46, {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}, k=3)
    assert m["break_even_accept_length"] == pytest.approx(2.46)
    assert m["projected_tok_s"] == pytest.approx(82.0)


def test_report_builds_from_metrics(tmp_path):
    A = tmp_path / "artifacts"
    k = 3
    for i, ph in enumerate(("phase0", "phase1_scratch", "phase1", "phase2")):
        tau = 1.2 + 0.5 * i
        m = {
            "accept_length": tau,
            "accept_length_all_positions": tau,
            "eval_samples": 10,
            **cost_metrics(tau, {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}, k),
        }
        for j in range(k):
            m[f"accept_rate_pos_{j}"] = 0.5 ** (j + 1)
            m[f"cond_acc_{j}"] = 0.5
        if ph == "phase0":
            m["source_on_old_accept_length"] = 2.9
        (A / ph).mkdir(parents=True)
        (A / ph / "metrics.json").write_text(json.dumps(m))
        if ph != "phase0":
            (A / ph / "history.csv").write_text("step,loss,acc_0,lr\n10,5.0,0.2,0.001\n20,4.0,0.3,0.001\n")
    out = tmp_path / "report"
    out.mkdir()
    p = {"profile": "t", "eval": {"k": k}, "costmodel": {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}}
    inputs = {ph: A / ph / "metrics.json" for ph in ("phase0", "phase1_scratch", "phase1", "phase2")}
    inputs.update({f"history_{ph}": A / ph / "history.csv" for ph in ("phase1_scratch", "phase1", "phase2")})
    res = build_report(out, p, inputs)
    for f in ("tau.png", "positions.png", "loss.png", "phases.csv", "positions.csv", "summary.html", "compare.html"):
        assert (out / f).stat().st_size > 0, f
    assert res["break_even_accept_length"] == pytest.approx(2.46)
    assert "data:image/png;base64," in (out / "summary.html").read_text()


# The kimi profile's plan (jobs, resources, torchrun commands): tests/plan/test_kimi_plan.py

# The world takes its values from the params' world group (no copy of them in draftport.world):
# tests/data/test_world.py::test_the_world_is_built_from_the_params_world_group
