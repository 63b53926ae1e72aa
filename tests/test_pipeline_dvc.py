"""Snakefile and dvc.yaml agree; the glue's pieces behave (fast: no pipeline run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftport import params as P
from draftport import pipeline as pl

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def smk(*args, cwd=ROOT, check=True):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    r = subprocess.run([str(BIN / "snakemake"), *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check and r.returncode:
        raise AssertionError(r.stdout[-3000:] + r.stderr[-3000:])
    return r


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return pl.dvc_yaml_text()
    finally:
        os.chdir(cwd)


def test_dvc_yaml_is_generated_from_the_snakefile(generated):
    committed = (ROOT / "dvc.yaml").read_text()
    assert committed == generated, "dvc.yaml drifted: run `python -m draftport.pipeline dvc-yaml`"


def test_stages_are_the_rules_with_their_commands_keys_and_outs(generated):
    stages = yaml.safe_load(generated)["stages"]
    rules = ["world", "fetch", "features_new", "features_eval", "vocab_new", "features_phase2",
             "compare", "phase0", "phase1_scratch", "phase1", "phase2", "report"]
    assert list(stages) == rules
    for name, st in stages.items():
        assert st["cmd"] == f"python scripts/{name}.py --logfile logs/{name}.log"
        assert st["params"] == P.STEP_KEYS[name]
        out = st["outs"][0]
        assert (next(iter(out)) if isinstance(out, dict) else out) == f"artifacts/{name}"
        assert f"scripts/{name}.py" in st["deps"]
    # the named targets: `dvc repro phase1` reaches the control, Phase 0 and the comparison
    assert {"artifacts/phase1_scratch", "artifacts/phase0", "artifacts/compare"} <= set(stages["phase1"]["deps"])


def test_snakemake_lint_is_clean():
    r = smk("--lint")
    assert "Congratulations" in r.stdout + r.stderr


def test_dry_run_plans_phase1_with_the_dvc_commands(tmp_path):
    # --forceall: the plan must be the whole chain even where a user's `make phase1` already ran
    r = smk("-n", "-p", "--forceall", "phase1", "--directory", str(ROOT))
    out = r.stdout + r.stderr
    for step in ("world", "fetch", "features_new", "features_eval", "vocab_new", "compare", "phase0",
                 "phase1_scratch", "phase1"):
        assert f"python scripts/{step}.py --logfile logs/{step}.log" in out
    assert "phase2" not in out.split("Job stats")[-1]


def test_another_profile_passes_its_values_by_file():
    r = smk("-n", "-p", "phase0", "--configfile", "configs/micro.yaml")
    out = r.stdout + r.stderr
    assert "python scripts/phase0.py --params .snakemake/draftport/params/phase0-" in out
    path = out.split("python scripts/phase0.py --params ")[1].split()[0]
    vals = yaml.safe_load((ROOT / path).read_text())
    micro = P.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")
    assert vals == P.step_params(micro, "phase0")


def test_bad_parameter_stops_snakemake_before_any_job(tmp_path):
    (tmp_path / "bad.yaml").write_text("eval: {k: 0}\nphase1: {n_sample: 3}\n")
    r = smk("-n", "phase1", "--configfile", str(tmp_path / "bad.yaml"), check=False)
    assert r.returncode != 0
    lines = [l for l in (r.stdout + r.stderr).splitlines() if "bad parameters" in l]
    assert lines == ["error: bad parameters: eval.k: must be >= 1, got 0"]
    assert "Traceback" not in r.stdout + r.stderr


def test_params_arg_is_empty_for_params_yaml_and_content_named_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = P.load(base=ROOT / "params.yaml")
    assert pl.params_arg(base, base, "phase1") == ""
    other = P.merge(base, {"phase2": {"train": {"steps": 7}}})
    assert pl.params_arg(other, base, "phase1") == ""  # phase1 does not read phase2's values
    a = pl.params_arg(other, base, "phase2")
    assert a.startswith(" --params .snakemake/draftport/params/phase2-")
    assert pl.params_arg(other, base, "phase2") == a
    assert yaml.safe_load(Path(a.split()[-1]).read_text())["phase2"]["train"]["steps"] == 7


def test_dropping_snakemake_records_matches_snakemakes_file_layout(tmp_path):
    from snakemake.persistence.file import FilePersistence

    meta = tmp_path / "metadata"
    meta.mkdir()

    class Fake:
        _max_len = None

        def _fetch_max_len(self, subject):
            return os.pathconf(subject, "PC_NAME_MAX")

    names = ["artifacts/phase1/metrics.json", "artifacts/phase1_scratch/metrics.json",
             "artifacts/phase1/" + "x" * 400 + ".json"]
    for n in names:
        rec = Path(FilePersistence._record_path(Fake(), str(meta), n))
        rec.parent.mkdir(parents=True, exist_ok=True)
        rec.write_text("{}")
    assert pl.drop_snakemake_records("phase1", root=str(meta)) == 2
    left = [p for p in meta.rglob("*") if p.is_file()]
    assert len(left) == 1 and pl.record_name("artifacts/phase1_scratch/metrics.json") == left[0].name


def test_unreachable_tracking_server_is_one_line_with_the_uri():
    from draftport.errors import DraftportError
    from draftport.tracking import check_reachable

    with pytest.raises(DraftportError) as e:
        check_reachable("http://127.0.0.1:9", timeout=2)
    assert str(e.value).startswith("http://127.0.0.1:9: MLflow tracking server unreachable")


def test_tracking_retries_while_the_database_is_locked():
    from draftport.tracking import retry

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
    m = pl.cost_metrics(2.46, {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}, k=3)
    assert m["break_even_accept_length"] == pytest.approx(2.46)
    assert m["projected_tok_s"] == pytest.approx(82.0)


def test_report_builds_from_metrics(tmp_path):
    from draftport.report import build_report

    A = tmp_path / "artifacts"
    k = 3
    for i, ph in enumerate(("phase0", "phase1_scratch", "phase1", "phase2")):
        tau = 1.2 + 0.5 * i
        m = {"accept_length": tau, "accept_length_all_positions": tau, "eval_samples": 10,
             **pl.cost_metrics(tau, {"baseline_tok_s": 82.0, "verify_ms": 30.0, "draft_ms": 0.0}, k)}
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
    res = build_report(out, p, artifacts=str(A))
    for f in ("tau.png", "positions.png", "loss.png", "phases.csv", "positions.csv", "summary.html", "compare.html"):
        assert (out / f).stat().st_size > 0, f
    assert res["break_even_accept_length"] == pytest.approx(2.46)
    assert "data:image/png;base64," in (out / "summary.html").read_text()


# The kimi profile's plan (jobs, resources, torchrun commands): tests/test_kimi_plan.py


def test_params_yaml_world_is_the_worlds_default_preset():
    from draftport.world import WORLD_PRESETS

    for cfg, preset in ((P.read_yaml(ROOT / "params.yaml"), "default"),
                        (P.merge(P.read_yaml(ROOT / "params.yaml"), P.read_yaml(ROOT / "configs/micro.yaml")), "micro")):
        w = {k: v for k, v in cfg["world"].items() if k not in ("build", "source_drafter")}
        assert w == WORLD_PRESETS[preset], f"params world vs draftport.world.WORLD_PRESETS[{preset!r}]"
