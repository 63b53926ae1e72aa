"""End to end on the micro profile, in a copy of the repository: Snakemake and DVC on one pipeline,
a real MLflow server on 127.0.0.1.

The copy's params.yaml is the micro profile merged in (DVC tracks params.yaml, so this makes the
micro profile the one both tools see). Checked, in order:
  snakemake phase1 -> dvc status clean, snakemake -n plans nothing, a second run does nothing;
  snakemake all + --report;  MLflow (REST) has phase0/phase1/phase1_scratch/phase2 with the
  same metric names, tags, loss by step;  edit a Phase 2 value -> dvc repro reruns phase2 and the
  report only -> snakemake -n plans nothing;  dvc checkout (new mtimes) -> snakemake plans nothing;
  dvc push to a local remote;  an unreachable tracking server fails before compute.
Slow (a few minutes on 2 cores); CI runs it.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import mlflow_ui
import pytest
import yaml
from decision_check import says_what_the_numbers_show
from mlflow_server import MlflowServer, free_port, rest
from repo import BIN, ROOT, micro_copy

from draftport.plan import registry

pytestmark = pytest.mark.slow
# The online step (vLLM) runs when the vLLM venv exists; CI sets DRAFTPORT_REQUIRE_VLLM.
VLLM_PY = Path(os.environ.get("DRAFTPORT_VLLM_PYTHON") or ROOT / ".venv-vllm/bin/python")
HAVE_VLLM = VLLM_PY.exists()
REQUIRE_VLLM = bool(os.environ.get("DRAFTPORT_REQUIRE_VLLM"))
TIMES: dict[str, float] = {}


class Repo:
    def __init__(self, path: Path, env: dict):
        self.path, self.env = path, env

    def run(self, *cmd, check=True, timeout=1200, env=None, log: Path | None = None) -> subprocess.CompletedProcess:
        """cmd in the repo; its output captured, or with log written to that file (for a command that
        leaves a process behind holding its stdout/stderr: through pipes, the call would wait for it)."""
        t = time.time()
        kw = dict(cwd=self.path, text=True, timeout=timeout, env={**self.env, **(env or {})})
        if log is None:
            r = subprocess.run(list(cmd), capture_output=True, **kw)
        else:
            with open(log, "w") as f:
                r = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, **kw)
            r.stdout, r.stderr = "", log.read_text()
        TIMES[" ".join(cmd[:4])] = time.time() - t
        if check and r.returncode:
            raise AssertionError(f"{' '.join(cmd)} -> {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}")
        return r

    def start(self, *cmd, log: Path) -> subprocess.Popen:
        """cmd in the repo, not waited for: its output written to log."""
        with open(log, "w") as f:
            return subprocess.Popen(
                list(cmd), cwd=self.path, text=True, env=self.env, stdout=f, stderr=subprocess.STDOUT
            )

    def smk(self, *args, **kw):
        return self.run(str(BIN / "snakemake"), *args, **kw)

    def dvc(self, *args, **kw):
        return self.run(str(BIN / "dvc"), *args, **kw)

    def metrics(self, step) -> dict:
        return json.loads((self.path / "artifacts" / step / "metrics.json").read_text())


def _online_and_reference(micro: dict) -> None:
    micro["online"]["enabled"] = HAVE_VLLM  # `all` and the report then include the online steps
    micro["curves"]["arms_n_samples"] = [32]  # the arms (params.yaml's answers and 3 recipes): rules R7, R8
    # a reference row (the upper bound Phase 0 reports): here the source itself, fetched again
    micro["reference"] = {"repo_id": micro["source"]["repo_id"], "revision": "main", "note": "the source (test)"}
    # two held-out sets, the second a few long prompts: per-set and per-bucket figures end to end (vLLM's too)
    micro["targets"]["eval_sets"] = [
        {"name": "chat", "prompts": "artifacts/world/corpus/heldout_new.jsonl", "share": 0.75, "n": None},
        {"name": "long", "prompts": "artifacts/world/corpus/heldout_long.jsonl", "share": 0.25, "n": 8},
    ]


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    path = tmp / "repo"
    micro_copy(path, _online_and_reference)
    server = MlflowServer(tmp)
    uri = server.uri
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(path / "src"),
        "MLFLOW_TRACKING_URI": uri,
        "DVC_NO_ANALYTICS": "1",
        "HF_HUB_OFFLINE": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "DRAFTPORT_VLLM_PYTHON": str(VLLM_PY),
        # a step that runs a draftport module its registry row does not list fails
        "DRAFTPORT_STRICT_MODULES": "1",
    }
    env.pop("OMP_NUM_THREADS", None)
    r = Repo(path, env)
    r.run("git", "init", "-q")
    if not (path / ".dvc").is_dir():
        r.dvc("init", "-q")
    r.run("git", "add", "-A")
    r.run("git", "commit", "-qm", "test copy")
    server.env = env
    again = None
    try:
        server.start()
        r.uri = uri
        # test_identical_runs_give_identical_bytes's second clean copy runs the same plan beside
        # this one's (while test_phase1_from_scratch runs it), not after it: its own folder and store
        other = clean_copy(
            tmp_path_factory.mktemp("again") / "repo", {**env, "MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}
        )
        t0, log = time.time(), other.path.parent / "phase1.log"
        again = other.start(str(BIN / "snakemake"), "--cores", "2", "phase1", log=log)
        r.again = other, again, log, t0
        yield r
    finally:
        if again is not None and again.poll() is None:
            again.kill()
            again.wait()
        server.stop()
        print("\ntimings (s):", json.dumps({k: round(v, 1) for k, v in TIMES.items()}, indent=1))


def runs_by_name(uri, profile="micro") -> dict[str, list[dict]]:
    exp = rest(uri, f"experiments/get-by-name?experiment_name=draftport-{profile}")["experiment"]
    runs = rest(uri, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 100})["runs"]
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(run["info"]["run_name"], []).append(run)
    return out


def test_phase1_from_scratch(repo):
    r = repo.smk("--cores", "2", "phase1")
    for step in (
        "world",
        "fetch",
        "compare",
        "eval_phase0",
        "features_new",
        "train_phase1",
        "eval_phase1",
        "train_phase1_scratch",
        "eval_phase1_scratch",
    ):
        assert (repo.path / "artifacts" / step / "metrics.json").is_file(), step
    assert (repo.path / "artifacts/train_phase1/drafter/model.safetensors").is_file()
    assert "dvc.lock: committed" in r.stderr
    m = repo.metrics("eval_phase1")
    for key in (
        "accept_length",
        "projected_tok_s",
        "break_even_accept_length",
        "gain_vs_phase0",
        "gain_vs_phase1_scratch",
        "accept_rate_pos_0",
        "cond_acc_0",
    ):
        assert key in m, key
    assert m["break_even_accept_length"] == pytest.approx(82.0 * 0.030)
    # every k up to eval.k_max from the same pass (the figure at eval.k among them) and the tree
    assert m["accept_length_k3"] == m["accept_length"] and "accept_length_k8" in m and 1 <= m["best_k"] <= 8
    assert "accept_length_tree_3_2_4" in m
    assert not (repo.path / "artifacts/train_phase2").exists()
    assert not (repo.path / "artifacts/eval_phase2").exists()
    # logs a person can read: no carriage-return progress updates, a line every few seconds
    for log in (repo.path / "logs").glob("*.log"):
        text = log.read_text()
        assert "\r" not in text, log.name
        assert len(text.splitlines()) < 400, (log.name, len(text.splitlines()))
    p0 = repo.metrics("eval_phase0")  # the reference, fetched like the source, on the same eval set
    assert (repo.path / "artifacts/fetch/reference/config.json").is_file()
    assert p0["reference_accept_length"] == pytest.approx(p0["accept_length"])


def clean_copy(path: Path, env: dict) -> Repo:
    """Another copy as the fixture makes its own: the same params, a git repository, DVC."""
    other = Repo(path, {**env, "PYTHONPATH": str(path / "src")})
    micro_copy(other.path, _online_and_reference)
    other.run("git", "init", "-q")
    if not (other.path / ".dvc").is_dir():
        other.dvc("init", "-q")
    other.run("git", "add", "-A")
    other.run("git", "commit", "-qm", "test copy")
    return other


def test_identical_runs_give_identical_bytes(repo):
    """A second clean copy runs the same plan on this machine (`snakemake phase1`, started by the
    fixture beside the first copy's run): every step's folder has the same DVC hash (timings and
    MLflow run ids stay out of artifacts/)."""
    other, proc, log, t0 = repo.again
    rc = proc.wait(timeout=1200)
    TIMES["snakemake --cores 2 phase1 (again, beside)"] = time.time() - t0
    assert rc == 0, f"snakemake phase1 in the second copy -> {rc}\n{log.read_text()[-6000:]}"
    a = yaml.safe_load((repo.path / "dvc.lock").read_text())["stages"]
    b = yaml.safe_load((other.path / "dvc.lock").read_text())["stages"]
    assert set(a) == set(b) and len(a) >= 9
    differ = {s: (a[s]["outs"], b[s]["outs"]) for s in a if a[s]["outs"] != b[s]["outs"]}
    assert differ == {}


def test_dvc_agrees_after_snakemake(repo):
    out = repo.dvc("status", "--json", "eval_phase1").stdout
    assert json.loads(out) == {}, out


def test_snakemake_plans_nothing_after_itself(repo):
    assert "Nothing to be done" in repo.smk("-n", "phase1").stdout
    r = repo.smk("--cores", "2", "phase1")
    assert "Nothing to be done" in r.stdout + r.stderr


def test_online_step_agrees_with_offline(repo):
    """vLLM serves the Phase 0 and Phase 1 drafters of the micro world; its tau agrees with the
    offline evaluator on the same sequences and lands next to accept_length and in MLflow."""
    if not HAVE_VLLM:
        if REQUIRE_VLLM:
            pytest.fail(f"DRAFTPORT_REQUIRE_VLLM is set but {VLLM_PY} is missing: run `make vllm-venv`")
        pytest.skip(f"no vLLM venv at {VLLM_PY} (make vllm-venv)")
    repo.smk("--cores", "2", "online", timeout=1800)
    tol = yaml.safe_load((repo.path / "params.yaml").read_text())["online"]["tolerance"]
    runs = runs_by_name(repo.uri)
    for phase in ("phase0", "phase1"):
        m = repo.metrics(f"online_{phase}")
        assert m["accept_length"] == repo.metrics(f"eval_{phase}")["accept_length"]
        assert m["online_num_drafts"] > 0 and m["online_num_prompts"] == 24 + 8  # chat's 24, long's 8
        assert abs(m["online_accept_length"] - m["offline_same_prompts_accept_length"]) <= tol, m
        assert 1.0 <= m["online_accept_length"] <= 4.0
        assert m["online_time_ratio"] > 0
        report = json.loads((repo.path / f"artifacts/online_{phase}/online.json").read_text())
        assert report["export"] and report["rows"][0]["metric"] == "accept length (tau)"
        run = runs[phase][-1]
        logged = {x["key"]: x["value"] for x in run["data"]["metrics"]}
        assert logged["online_accept_length"] == pytest.approx(m["online_accept_length"])
        assert logged["accept_length"] == pytest.approx(m["accept_length"])
        tags = {t["key"]: t["value"] for t in run["data"]["tags"]}
        assert tags["draftport.online"] == "agrees"
    # online steps are Snakemake-only: DVC still has nothing to do up to phase1, a rerun plans nothing
    assert json.loads(repo.dvc("status", "--json", "eval_phase1").stdout) == {}
    assert "Nothing to be done" in repo.smk("-n", "online").stdout
    print(
        "\nonline (micro): "
        + ", ".join(
            f"{ph}: vLLM {repo.metrics('online_' + ph)['online_accept_length']:.4f} / offline "
            f"{repo.metrics('online_' + ph)['offline_same_prompts_accept_length']:.4f}"
            for ph in ("phase0", "phase1")
        )
    )


def test_all_and_the_report(repo):
    repo.smk("--cores", "2", "all")
    assert json.loads(repo.dvc("status", "--json").stdout) == {}
    assert planned(repo) == set()  # the rerun matrix below starts from here
    repo.smk("--report", "report.html")
    html = (repo.path / "report.html").read_text()
    assert len(html) > 50_000 and "Summary" in html
    for f in ("tau.png", "positions.png", "loss.png", "summary.html", "compare.html", "phases.csv"):
        assert (repo.path / "artifacts/report" / f).stat().st_size > 0
    shown = repo.dvc("metrics", "show", "--json").stdout
    assert "accept_length" in shown
    summary = (repo.path / "artifacts/report/summary.html").read_text()
    # the drift probe (micro: both targets), in its step, the report and phase0's MLflow run
    d = repo.metrics("drift")
    for key in (
        "cos_layer_0",
        "cka_layer_0",
        "rel_norm_change_layer_0",
        "cos_final",
        "cka_final",
        "greedy_agreement",
        "tau_source_old_features",
        "tau_source_new_features",
        "tau_gap",
    ):
        assert key in d, key
    assert 0 < d["cos_final"] <= 1 and 0 <= d["greedy_agreement"] <= 1
    p0 = repo.metrics("eval_phase0")  # named eval sets: the probe pools every prompt alike
    assert d["tau_source_new_features"] == pytest.approx(p0.get("accept_length_pooled", p0["accept_length"]))
    assert "drift probe" in summary
    phase0 = runs_by_name(repo.uri)["phase0"][-1]
    assert "cos_final" in {m["key"] for m in phase0["data"]["metrics"]}
    # the decision: curves (2 n x 2 seeds x 2 inits), bootstrap CIs, rules; the report's first section
    dec = json.loads((repo.path / "artifacts/decision/decision.json").read_text())
    assert dec["schema"] == "draftport.decision/1"
    assert [row["n_samples"] for row in dec["curves"]["source"]] == [32, 128]
    assert all(
        row["n_seeds"] == 2 and row["ci"][0] <= row["accept_length"] <= row["ci"][1]
        for init in ("source", "scratch")
        for row in dec["curves"][init]
    )
    assert [g["n_samples"] for g in dec["gain"]] == [32, 128]
    assert set(dec["phases"]) == {"phase0", "phase1_scratch", "phase1", "phase2"}
    assert dec["drift"]["tau_gap"] == pytest.approx(d["tau_gap"])
    rec = dec["recommendation"]
    assert rec["init"] in ("source", "scratch", "either") and [r["id"] for r in rec["rules"]] == [
        "R1",
        "R2",
        "R3",
        "R4",
        "R5",
        "R6",
        "R7",
        "R8",
        "R9",
        "R10",
        "R11",
    ]
    # the traffic (R10): Phase 1 trained on chat prompts only, measured on chat and on long prompts
    t = dec["traffic"]
    assert [(x["name"], x["share"]) for x in t["sets"]] == [("chat", 0.75), ("long", 0.25)] and t["weighted"]
    for ph, row in t["phases"].items():
        assert set(row["sets"]) == {"chat", "long"}, ph
        assert all(v["ci"][0] <= v["accept_length"] <= v["ci"][1] for v in [row["weighted"], *row["sets"].values()])
    assert t["context_buckets"]["names"] == ["0-32", "32-64", "64+"]
    long_only = [r for r in t["buckets"]["phase0"] if r["bucket"] == "64+"][0]
    assert long_only["num_cycles"] > 0  # long prompts reach past 64 tokens: measured there
    assert dec["phases"]["phase1"]["accept_length"] == pytest.approx(t["phases"]["phase1"]["weighted"]["accept_length"])
    assert "traffic-weighted" in " ".join(rec["text"])
    assert (repo.path / "artifacts/report/sets.png").stat().st_size > 0
    assert "Accept length by kind of traffic and context length" in summary
    p1_run = runs_by_name(repo.uri)["phase1"][-1]
    assert {"accept_length/chat", "accept_length/long"} <= {m["key"] for m in p1_run["data"]["metrics"]}
    # the arms at n=32 (each init on the dataset's own answers, three recipes), each paired with plain
    assert set(dec["curves"]) == {
        "source",
        "scratch",
        "source-dataset",
        "scratch-dataset",
        "source-l2sp",
        "source-lr_low",
        "source-frozen",
    }
    assert [g["n_samples"] for g in dec["answers_gain"]["source"]] == [32] and set(dec["recipe_gain"]) == {
        "l2sp",
        "lr_low",
        "frozen",
    }
    assert says_what_the_numbers_show(dec) == []
    # the hours: measured by the steps, in every curve row and phase; the dataset arm regenerates nothing
    assert all(row["hours"]["total"] > 0 for rows in dec["curves"].values() for row in rows)
    assert all(row["hours"]["regenerate"] == 0 for row in dec["curves"]["source-dataset"])
    assert dec["curves"]["source"][0]["hours"]["regenerate"] > 0 and dec["hours"]["plan"]["total"] > 0
    assert summary.index("<h2>Decision</h2>") == summary.index("<h2>")
    assert (repo.path / "artifacts/report/curves.png").stat().st_size > 0
    printed = repo.run(sys.executable, "-m", "draftport.cli", "decide").stdout
    assert printed.startswith("Do: ") and printed.splitlines()[0] == rec["headline"]  # the headline first
    assert printed.splitlines()[1].startswith("Recommendation: init " + rec["init"])
    # MLflow: the parent run `curves`, one nested run per point with its tags and tau
    runs = [r for rs in runs_by_name(repo.uri).values() for r in rs]
    parent = [r for r in runs if r["info"]["run_name"] == "curves"]
    assert len(parent) == 1
    kids = [
        r
        for r in runs
        if {t["key"]: t["value"] for t in r["data"].get("tags", [])}.get("mlflow.parentRunId")
        == parent[0]["info"]["run_id"]
    ]
    tags = sorted(
        (t["arm"], t["init"], int(t["n_samples"]), int(t["seed"]))
        for t in ({x["key"]: x["value"] for x in k["data"]["tags"]} for k in kids)
    )
    plain = sorted((i, i, n, sd) for i in ("source", "scratch") for n in (32, 128) for sd in (0, 1))
    arms = sorted(
        (a, a.split("-")[0], 32, sd)
        for a in ("source-dataset", "scratch-dataset", "source-l2sp", "source-lr_low", "source-frozen")
        for sd in (0, 1)
    )
    assert tags == sorted(plain + arms)
    assert all("accept_length" in {m["key"] for m in k["data"]["metrics"]} for k in kids)
    # the world's source drafter: teacher-forced on the old corpus, its held-out tau on the old
    # target traced every eval_every steps (the plateau curve), plotted in the report
    sd = json.loads((repo.path / "artifacts/world/source_drafter.json").read_text())
    assert sd["answers"] == "corpus" and sd["n_samples"] == 96 and [c["step"] for c in sd["monitor"]] == [10, 20]
    assert (repo.path / "artifacts/report/source_curve.png").stat().st_size > 0
    # tau during training: Phase 1's held-out tau by step, in its run and in curve.csv
    p1 = runs_by_name(repo.uri)["phase1"][0]["info"]["run_id"]
    hist = rest(repo.uri, f"metrics/get-history?run_id={p1}&metric_key=accept_length")["metrics"]
    assert {m["step"] for m in hist} >= {4, 8, 12}
    assert (repo.path / "artifacts/train_phase1/curve.csv").read_text().splitlines()[0] == "step,accept_length"
    if HAVE_VLLM:  # online.enabled: both tau side by side, per position
        assert "Accept length in vLLM" in summary and "pos 1: vLLM / offline" in summary
        rows = (repo.path / "artifacts/report/online.csv").read_text().splitlines()
        assert [r.split(",")[0] for r in rows[1:]] == ["phase0", "phase1"]
    else:
        assert "Accept length in vLLM" not in summary


def planned(repo, target="all") -> set[str]:
    """The jobs `snakemake -n` plans (its job stats table), target rules left out."""
    out = repo.smk("-n", target).stdout
    if "Nothing to be done" in out:
        return set()
    table = out.split("Job stats:")[1].split("total")[0]
    jobs = {line.split()[0] for line in table.splitlines()[3:] if line.strip()}
    return jobs - {"all", "phase0", "phase1", "phase2", "curves", "online"}


def dvc_changed(repo) -> set[str]:
    return set(json.loads(repo.dvc("status", "--json").stdout))


EVALS = {"eval_phase0", "eval_phase1_scratch", "eval_phase1", "eval_phase2"}
TRAINED = {
    "train_phase1_scratch",
    "train_phase1",
    "train_phase2",
    "eval_phase1_scratch",
    "eval_phase1",
    "train_phase2",
    "eval_phase2",
}


CURVE_EVAL = {"eval_curves", "decision"}  # the curves' evaluation and the decision reading it
CAPTURES = {"features_new", "features_eval", "features_monitor", "features_phase2", "features_dataset"}
ONLINE = {"online_phase0", "online_phase1"} if HAVE_VLLM else set()  # online.enabled when vLLM is here
ALL = (
    {"world", "fetch", "vocab_new", "compare", "eval_phase0", "drift", "train_curves", "report"}
    | CAPTURES
    | TRAINED
    | EVALS
    | CURVE_EVAL
    | ONLINE
)  # the test copy's whole plan (publish is off)


@pytest.mark.parametrize(
    "edit,value,smk_plans,dvc_sees",
    [
        # evaluation settings rerun evaluations only (and what reads them); no drafter is retrained
        ("eval.k", 4, EVALS | CURVE_EVAL | {"drift", "report"} | ONLINE, EVALS | CURVE_EVAL | {"drift", "report"}),
        ("costmodel.verify_ms", 15.0, EVALS | {"drift", "decision", "report"} | ONLINE, EVALS | {"decision", "report"}),
        # a training value reruns that training and what depends on it, nothing upstream
        (
            "phase1.train.lr",
            0.001,
            TRAINED | {"decision", "report"} | (ONLINE & {"online_phase1"}),
            {"train_phase1_scratch", "train_phase1"},
        ),
        # the eval set's size: that feature step and the evaluations, never the training data
        (
            "features.eval_samples",
            30,
            {"features_eval"} | EVALS | CURVE_EVAL | {"drift", "report"} | ONLINE,
            {"features_eval"},
        ),
        # the curves' training: its points and what reads them; no phase
        ("curves.epochs", 2.0, {"train_curves"} | CURVE_EVAL | {"report"}, {"train_curves"}),
        ("decision.level", 0.9, {"decision", "report"}, {"decision"}),
        # code is a dependency: a library module reruns the steps that run it
        ("src/draftport/outputs/report.py", None, {"report"}, {"report"}),
        (
            "src/draftport/evaluation/costmodel.py",
            None,
            EVALS | {"drift", "decision", "report"} | ONLINE,
            EVALS | {"decision"},
        ),
        ("src/draftport/evaluation/drift.py", None, {"drift", "decision", "report"}, {"drift"}),
        # the rules read the curves: they rerun the decision, never the curves' evaluation
        ("src/draftport/evaluation/decision/rules.py", None, {"decision", "report"}, {"decision"}),
        # the curves' evaluation code reruns their evaluation, never their 60 trainings
        ("src/draftport/pipeline/steps/curve_eval_steps.py", None, CURVE_EVAL | {"report"}, {"eval_curves"}),
        # the plumbing is no step's code: a help text of the params' schema, the runner, the step table
        ("src/draftport/plan/params.py", None, set(), set()),
        ("src/draftport/pipeline/runner.py", None, set(), set()),
        ("src/draftport/plan/registry.py", None, set(), set()),
        # the capture's serving path: every capture and what reads the captures, never the world or fetch
        ("src/draftport/engines/openai.py", None, ALL - {"world", "fetch"}, CAPTURES),
        # the compare step's tables: Phase 1's fine-tune reads its verdict, the control does not
        (
            "src/draftport/outputs/tables.py",
            None,
            {"compare", "train_phase1", "eval_phase1", "train_phase2", "eval_phase2", "decision", "report"}
            | (ONLINE & {"online_phase1"}),
            {"compare", "report"},
        ),
    ],
)
def test_rerun_matrix_plans_exactly_what_an_edit_affects(repo, edit, value, smk_plans, dvc_sees):
    """After `snakemake all`: one edit in the copy, then what `snakemake -n` and `dvc status` see;
    the edit is undone (content and mtime) before the next case, and each case ends by checking
    that nothing is planned again (so the next one starts clean; `test_all_and_the_report` checks
    the first's start)."""
    f = repo.path / (edit if edit.startswith("src/") else "params.yaml")
    text, st = f.read_text(), f.stat()
    try:
        if edit.startswith("src/"):
            f.write_text(text + "\n# an edit\n")
        else:
            cfg = yaml.safe_load(text)
            *parents, last = edit.split(".")
            cur = cfg
            for k in parents:
                cur = cur[k]
            assert cur[last] != value
            cur[last] = value
            f.write_text(yaml.safe_dump(cfg, sort_keys=False))
        assert planned(repo) == smk_plans
        assert dvc_changed(repo) == dvc_sees
    finally:
        f.write_text(text)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert planned(repo) == set() and dvc_changed(repo) == set()


def test_registry_modules_are_the_ones_each_step_ran(repo):
    """Each step's registry row lists the draftport modules it imported (logs/<step>.json records
    them; under DRAFTPORT_STRICT_MODULES an unlisted one fails the step), and lists no module it
    never ran except the engine paths another profile takes (vLLM capture, a served target)."""
    branch = {
        "data.vllm_capture",
        "engines.vllm.venv",
        "engines.vllm.runners.features_vllm",
        "engines.openai",
        "engines.vllm.runners.online_vllm",  # run as a file inside the vLLM venv
        "data.packing",  # imported only by a training with train.packing: true
        # a training step captures (features, its storage check, the spool) only with features.storage
        # online / hybrid: tests/pipeline/test_online_storage.py runs those under DRAFTPORT_STRICT_MODULES
        "training.spool",
        "data.storage",
        "data.features",
        # the decision derives a real target's serving step times (serving.step_table null, world.build
        # false): the estimate's modules, which the embedded world's decision never runs
        "profile.estimate",
        "profile.rates",
        "evaluation.budget",
        "model.config",
        "model.flops",
        "outputs.render",
        "plan.cluster",
    }
    checked = 0
    for row in registry.STEPS:
        rec = repo.path / "logs" / f"{row.name}.json"
        if not rec.is_file():
            continue
        ran = set(json.loads(rec.read_text())["modules"])
        declared = set(registry.PLUMBING_MODULES) | set(row.modules)
        assert declared - ran <= branch, (row.name, sorted(declared - ran - branch))
        checked += 1
    assert checked >= 15


def test_mlflow_has_every_phase_with_the_same_metrics(repo):
    runs = runs_by_name(repo.uri)
    assert set(runs) >= {"phase0", "phase1", "phase1_scratch", "phase2"}
    sha = repo.run("git", "rev-parse", "HEAD").stdout.strip()
    rev = json.loads((repo.path / "artifacts/fetch/revision.json").read_text())["commit"]
    for name in ("phase0", "phase1", "phase1_scratch", "phase2"):
        run = runs[name][0]
        metrics = {m["key"] for m in run["data"].get("metrics", [])}
        assert {
            "accept_length",
            "projected_tok_s",
            "break_even_accept_length",
            "accept_rate_pos_0",
            "cond_acc_0",
        } <= metrics, (name, metrics)
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        assert tags["mlflow.source.git.commit"].startswith(sha), tags
        assert tags["draftport.source_revision"] == rev
        assert run["info"]["status"] == "FINISHED"
        params = {p["key"] for p in run["data"].get("params", [])}
        assert "eval.k" in params
        if name != "phase0":
            hist = rest(repo.uri, f"metrics/get-history?run_id={run['info']['run_id']}&metric_key=loss")
            assert len(hist["metrics"]) >= 2, name


def test_dvc_repro_reruns_only_what_a_param_edit_touches(repo):
    p = repo.path / "params.yaml"
    cfg = yaml.safe_load(p.read_text())
    cfg["phase2"]["train"]["steps"] -= 2
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))
    status = json.loads(repo.dvc("status", "--json").stdout)
    assert set(status) == {"train_phase2"}, status
    out = repo.dvc("repro").stdout
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"train_phase2", "eval_phase2", "decision", "report"}, out
    assert json.loads(repo.dvc("status", "--json").stdout) == {}
    r = repo.smk("-n", "all")
    assert "Nothing to be done" in r.stdout, r.stdout[-3000:]
    runs = runs_by_name(repo.uri)["phase2"]
    assert len(runs) == 2
    assert {t["value"] for run in runs for t in run["data"]["tags"] if t["key"] == "draftport.runner"} == {
        "dvc",
        "snakemake",
    }


def test_dvc_repro_with_nothing_changed(repo):
    out = repo.dvc("repro").stdout
    assert "Running stage" not in out
    assert "Data and pipelines are up to date" in out


def test_dvc_checkout_does_not_make_snakemake_rerun(repo):
    shutil.rmtree(repo.path / "artifacts/train_phase1")
    shutil.rmtree(repo.path / "artifacts/world")
    repo.dvc("checkout")  # restored from the cache with new mtimes, newer than every downstream file
    assert (repo.path / "artifacts/train_phase1/drafter/model.safetensors").is_file()
    r = repo.smk("-n", "all")
    assert "Nothing to be done" in r.stdout, r.stdout[-3000:]
    assert json.loads(repo.dvc("status", "--json").stdout) == {}


def test_dvc_push_to_a_local_remote(repo, tmp_path):
    repo.dvc("remote", "add", "-d", "local", str(tmp_path / "remote"))
    repo.dvc("push")
    pushed = [p for p in (tmp_path / "remote").rglob("*") if p.is_file()]
    lock = yaml.safe_load((repo.path / "dvc.lock").read_text())
    phase1 = lock["stages"]["train_phase1"]["outs"][0]["md5"]
    assert any(p.name.endswith(phase1[2:]) or phase1[2:] in str(p) for p in pushed)


def test_unreachable_tracking_server_fails_before_compute(repo):
    bad = "http://127.0.0.1:9"
    t = time.time()
    r = repo.smk("--cores", "1", "--forcerun", "eval_phase0", "phase0", check=False, env={"MLFLOW_TRACKING_URI": bad})
    assert r.returncode != 0
    assert f"{bad}: MLflow tracking server unreachable" in r.stdout + r.stderr
    assert "Execute 1 jobs" not in r.stdout + r.stderr  # stopped in onstart, before the job
    assert time.time() - t < 120
    r = repo.run(sys.executable, "scripts/eval_phase0.py", check=False, env={"MLFLOW_TRACKING_URI": bad})
    assert r.returncode == 2 and r.stderr.strip().endswith(
        f"error: {bad}: MLflow tracking server "
        f"unreachable ([Errno 111] Connection refused); "
        f"start it or unset MLFLOW_TRACKING_URI to log "
        f"to sqlite:///mlflow.db"
    )


def test_dvc_exp_run_sweeps_one_training_value(repo):
    """A DVC user's first move: `dvc exp run -S key=value` reruns exactly the stages that read the
    key (and what reads them), nothing upstream; `dvc exp show` lists the value and the phases'
    accept length per experiment. Last in the module: it leaves the experiment in the workspace."""
    repo.run("git", "add", "-A")
    repo.run("git", "commit", "-qm", "the plan as run", check=False)  # experiments start from a commit
    out = repo.dvc("exp", "run", "-n", "lr-low", "-S", "phase1.train.lr=0.001", "eval_phase1").stdout
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"train_phase1_scratch", "eval_phase1_scratch", "train_phase1", "eval_phase1"}, out
    assert yaml.safe_load((repo.path / "params.yaml").read_text())["phase1"]["train"]["lr"] == 0.001
    rows = json.loads(repo.dvc("exp", "show", "--json").stdout)
    base = rows[1] if rows[0]["rev"] == "workspace" else rows[0]

    def figures(rec):
        d = rec["data"]
        return (
            d["params"]["params.yaml"]["data"]["phase1"]["train"]["lr"],
            d["metrics"]["artifacts/eval_phase1/metrics.json"]["data"]["accept_length"],
        )

    exps = [e["revs"][0] for e in base.get("experiments") or []]
    named = [e for e in exps if e.get("name") == "lr-low"]
    assert len(named) == 1
    lr, tau = figures(named[0])
    assert lr == 0.001 and tau == pytest.approx(repo.metrics("eval_phase1")["accept_length"])
    lr0, tau0 = figures(base)
    assert lr0 != lr and tau0 != tau  # the committed plan's own figures, beside the experiment's
    table = repo.dvc(
        "exp",
        "show",
        "--md",
        "--drop",
        ".*",
        "--keep",
        "Experiment|artifacts/eval_phase1/metrics.json:accept_length$|phase1.train.lr",
    ).stdout
    assert "lr-low" in table and "accept_length" in table


def test_dvc_queue_runs_a_grid_with_runs_in_mlflow_and_plots_between_experiments(repo, tmp_path):
    """`dvc exp run --queue -S ...` + `dvc queue start`: each experiment runs in a temporary copy
    (the uncached feature folders copied in with -C, so nothing upstream reruns), logs its phases
    to the tracking store tagged with its name, and `dvc exp show` / `dvc plots diff` put the grid
    side by side. After the workspace experiment above (it queues from the same commit)."""
    grid = {
        "grid-lr-1.7e-3": 0.0017,
        "grid-lr-2.3e-3": 0.0023,
    }  # values no earlier test ran (the run-cache would restore those)
    copies = [a for f in ("features_new", "features_eval", "features_monitor") for a in ("-C", f"artifacts/{f}")]
    for name, lr in grid.items():
        repo.dvc("exp", "run", "--queue", "-n", name, "-S", f"phase1.train.lr={lr}", *copies, "eval_phase1")
    # The worker `dvc queue start` leaves behind keeps the stdout/stderr it was handed: read through
    # pipes, the call returns only when that worker exits (it stops itself a while after the queue
    # is empty; once, in a CI run, it sat idle for 15 minutes and the call with it). Its output goes to a
    # file instead, and `dvc queue stop` ends the worker once the grid is done.
    repo.dvc("queue", "start", "-j", "1", timeout=300, log=tmp_path / "queue-start.log")
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            status = repo.dvc("queue", "status").stdout
            if not any(w in status for w in ("Running", "Queued")):
                break
            time.sleep(5)
    finally:
        repo.dvc("queue", "stop", check=False)
    for name in grid:
        assert f"{name}" in status and "Failed" not in status, status
        log = repo.dvc("queue", "logs", name).stdout
        ran = {line.split("'")[1] for line in log.splitlines() if line.startswith("Running stage")}
        assert ran == {"train_phase1_scratch", "eval_phase1_scratch", "train_phase1", "eval_phase1"}, log[-3000:]

    rows = json.loads(repo.dvc("exp", "show", "--json").stdout)
    exps = {e["revs"][0].get("name"): e["revs"][0] for r in rows for e in r.get("experiments") or []}
    taus = {}
    for name, lr in grid.items():
        d = exps[name]["data"]
        assert d["params"]["params.yaml"]["data"]["phase1"]["train"]["lr"] == lr
        taus[name] = d["metrics"]["artifacts/eval_phase1/metrics.json"]["data"]["accept_length"]
    assert taus["grid-lr-1.7e-3"] != taus["grid-lr-2.3e-3"]
    changed = repo.dvc("exp", "show", "--only-changed", "--md").stdout
    assert "grid-lr-1.7e-3" in changed and "!" not in changed, changed  # no column an experiment lacks

    # the copies logged to the tracking store the user compares in, each run tagged with its experiment
    runs = [r for rs in runs_by_name(repo.uri).values() for r in rs]
    for name in grid:
        tagged = {
            r["info"]["run_name"]: r
            for r in runs
            if {"key": "draftport.dvc_exp", "value": name} in r["data"].get("tags", [])
        }
        assert set(tagged) == {"phase1_scratch", "phase1"}, (name, set(tagged))
        m = {x["key"]: x["value"] for x in tagged["phase1"]["data"]["metrics"]}
        assert m["accept_length"] == pytest.approx(taus[name])

    # tau per phase between the two experiments, as `dvc plots diff` draws it
    plots = json.loads(repo.dvc("plots", "diff", *grid, "--json").stdout)["data"]
    [bar] = plots["accept_length_by_phase"]
    values = bar["content"]["data"]["values"]
    seen = {(v["rev"], v["phase"]): float(v["accept_length"]) for v in values}
    for name in grid:
        assert seen[(name, "phase1")] == pytest.approx(taus[name], abs=1e-5)
        assert (name, "phase1_scratch") in seen and (name, "phase0") in seen


def test_mlflow_ui_in_a_browser(repo):
    """Where the README sends a user to compare phases, in headless Chromium (Debian's, driven by
    playwright): `draftport ui` serving the micro pipeline's store (the sqlite file behind this
    module's tracking server). Its compare page shows each phase run's name and accept_length;
    its metric page charts accept_length by training step (tau during training) for the trained
    phases, one line per run with every logged step a point; its runs table lists the curves
    parent, its nested runs showing under it once expanded, and accept_length once added as a
    column; a new user who lands on the GenAI overview gets to the runs with "Model training".
    Expected values come from the tracking server's REST API. Nothing DVC or Snakemake track changes."""
    mlflow_ui.need_browser()
    db = repo.path.parent / "mlflow-server.db"  # MlflowServer(tmp)'s store: the fixture's server writes it
    assert db.is_file()
    # the workspace's runs: `draftport ui` at the server the steps logged to picks their records
    printed = repo.run(str(BIN / "draftport"), "ui", "--print-urls", "--json")
    at_server = json.loads(printed.stdout)
    assert at_server["serving"] is False and at_server["ui"] == repo.uri + "/"
    phases = list(at_server["runs"])
    assert phases == ["phase0", "phase1_scratch", "phase1", "phase2"]
    for phase, run in at_server["runs"].items():
        rec = json.loads((repo.path / ".draftport/runs" / f"eval_{phase}.json").read_text())
        assert run["by"] == "record" and run["run_id"] == rec["run_id"], (phase, run, rec)

    def run_of(rid):
        return rest(repo.uri, f"runs/get?run_id={rid}")["run"]

    def history(rid):
        return rest(repo.uri, f"metrics/get-history?run_id={rid}&metric_key=accept_length")["metrics"]

    env = {**repo.env, "MLFLOW_TRACKING_URI": f"sqlite:///{db}"}
    with mlflow_ui.ui_session(repo.path, env, free_port()) as rep, mlflow_ui.browser() as b:
        assert rep["serving"] and rep["ui"].startswith("http://127.0.0.1:")
        ids = {p: r["run_id"] for p, r in rep["runs"].items()}
        assert ids == {p: r["run_id"] for p, r in at_server["runs"].items()}  # the same runs, by their records
        tau = {
            p: next(m["value"] for m in run_of(rid)["data"]["metrics"] if m["key"] == "accept_length")
            for p, rid in ids.items()
        }

        # the compare page: each phase's name over its accept_length (shown to 3 decimals)
        shown = mlflow_ui.compare_metric(mlflow_ui.new_page(b), rep["urls"]["compare"])
        assert shown["ids"] == list(ids.values()) and shown["names"] == phases, shown
        assert len(shown["values"]) == len(phases), shown
        for phase, text in zip(shown["names"], shown["values"]):
            assert float(text) == pytest.approx(tau[phase], abs=5e-4 + 1e-9), (phase, text, tau[phase])

        # tau by step: the trained phases, one line each, a point per logged step, x = step
        chart = mlflow_ui.metric_chart(mlflow_ui.new_page(b), rep["urls"]["tau_by_step"])
        trained = [p for p in phases if p != "phase0"]
        assert [e["name"] for e in chart["legend"]] == trained, chart
        assert chart["xtitle"] == ["Step"], chart
        hists = {e["name"]: history(ids[e["name"]]) for e in chart["legend"]}
        # traces are told apart by colour, and MLflow picks a run's colour from a palette by its
        # id: two runs may share one. Per colour, the traces drawn hold the points of its runs
        for color in {e["color"] for e in chart["legend"]}:
            runs = [e["name"] for e in chart["legend"] if e["color"] == color]
            drawn = sorted(t["points"] for t in chart["traces"] if t["color"] == color and t["points"])
            assert drawn == sorted(len(hists[r]) for r in runs), (color, runs, drawn, hists)
        for entry in chart["legend"]:
            hist = hists[entry["name"]]
            assert len({m["step"] for m in hist}) >= 2  # a curve: monitored every eval_every steps, then the eval
            (latest, latest_step), (low, _), (high, _) = chart["rows"][entry["name"]]
            assert latest == pytest.approx(tau[entry["name"]]) and latest_step == max(m["step"] for m in hist)
            assert low == pytest.approx(min(m["value"] for m in hist))
            assert high == pytest.approx(max(m["value"] for m in hist))

        # the runs table: phases and the curves parent; its nested runs under it once expanded
        kids = rep["curves"]["children"]
        c = yaml.safe_load((repo.path / "params.yaml").read_text())["curves"]
        from draftport.plan.curves import points

        assert len(kids) == len(points(c)), kids  # one per point, the arms' included
        table = mlflow_ui.runs_table(
            mlflow_ui.new_page(b, 1600, 1400), rep["urls"]["runs"], "curves", expect={*phases, "curves"}
        )
        assert {*phases, "curves"} <= set(table["before"]) and not set(kids) & set(table["before"]), table
        after = table["after"]
        assert set(kids) <= set(after), table
        at = after.index("curves")
        assert sorted(after.index(k) for k in kids) == list(range(at + 1, at + 1 + len(kids))), after  # under it
        for phase, rid in ids.items():
            assert float(table["values"][rid]) == pytest.approx(tau[phase], rel=1e-6), (phase, table["values"])

        # a new user: the experiment's page, then the switch the README names
        land = mlflow_ui.landing(mlflow_ui.new_page(b), f"{rep['ui']}#/experiments/{rep['experiment_id']}")
        assert "/runs" in land["then"] and {*phases, "curves"} <= set(land["runs"]), land
        print(f"\nMLflow UI: landed on {land['first'].split('#')[1].split('?')[0]}, runs after 'Model training'")
