"""Publishing: the chosen drafter as a hub-ready folder that loads back, passes the
export checks and carries a model card huggingface_hub parses; the upload is refused before any
network call unless every check passes.

A tiny pipeline is made on the fly (tests/helpers/publish_pipeline.py): a stub target (embedding
+ lm_head), random feature sets, real (short) trainings of the source, Phase 1 (fine-tune), its
scratch control and Phase 2, real evaluations, a real fetch from a hub cache and a real decision.
Only HfApi's two network calls are replaced, by recorders.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml
from huggingface_hub import HfApi, ModelCard
from publish_pipeline import AUX, build_pipeline
from repo import ROOT
from tiny_targets import stub_target

from draftport.engines.export import validate_export
from draftport.errors import DraftportError
from draftport.model.config import read_config
from draftport.model.formats import find_target_embedding, load_drafter_state, read_header, tensor_sha256
from draftport.outputs.publish import check_folder, choose_phase, from_pipeline, push
from draftport.plan import params


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return build_pipeline(tmp_path_factory.mktemp("publish"))


@pytest.fixture(scope="module")
def published(pipe):
    out = pipe["root"] / "out" / "drafter"
    rep = from_pipeline(pipe["params"], pipe["inputs"], out, repo_id="org/k25-eagle3")
    return {**pipe, "out": out, "rep": rep}


def test_the_step_reads_what_the_registry_gives_it(pipe):
    assert set(pipe["inputs"]) >= {
        "decision",
        "target",
        "features",
        "source",
        "drafter_phase1",
        "eval_phase1",
        "data_phase1",
        "data_phase2",
        "train_phase2",
    }
    assert "online_phase1" not in pipe["inputs"]  # online.enabled is false
    assert all(p.exists() for p in pipe["inputs"].values()), pipe["inputs"]


def test_trained_drafters_name_the_target_they_were_trained_for(pipe):
    """The source names the old target; every phase trained from it names the new one."""
    assert read_config(pipe["inputs"]["source"].parent)[1]["verifier"] == "org/target-old"
    for ph in ("phase1_scratch", "phase1", "phase2"):
        assert read_config(pipe["inputs"][f"drafter_{ph}"])[1]["verifier"] == "org/target-new", ph


def test_the_folder_is_hub_ready_and_loads_back(published):
    out, rep, target = published["out"], published["rep"], published["target"]
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert rep["phase"] == choose_phase(published["decision"])[0] in ("phase1", "phase2")  # no curves: init either
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and "speculators_model_type" not in raw
    assert raw["verifier"] == "org/target-new"
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    validate_export(out, target, embed_tokens="target")
    cfg, state = load_drafter_state(out)
    assert "embed_tokens.weight" in state and cfg.extra["verifier"] == "org/target-new"
    # the embedding is the new target's, bit for bit; every other tensor the phase's drafter's
    mine = read_header(out / "model.safetensors")[0]
    assert tensor_sha256(mine["embed_tokens.weight"]) == tensor_sha256(find_target_embedding(target))
    theirs = read_header(published["inputs"][f"drafter_{rep['phase']}"] / "model.safetensors")[0]
    assert set(mine) - {"embed_tokens.weight"} == set(theirs)
    assert all(tensor_sha256(mine[n]) == tensor_sha256(theirs[n]) for n in theirs)
    # the card: metadata parsed back by huggingface_hub
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/target-new"
    assert card.data.library_name == "vllm" and "eagle3" in card.data.tags


def test_the_card_says_what_the_issue_lists(published):
    text = (published["out"] / "README.md").read_text()
    rep = published["rep"]
    ev = published["evals"][rep["phase"]]
    # tau per k, measured on the folder itself: k = eval.k equals the phase's own evaluation
    taus = {r["k"]: r["accept_length"] for r in rep["taus"]}
    assert set(taus) == {1, 3} and taus[3] == ev["accept_length"]
    assert f"| 3 | {ev['accept_length']:.3f} |" in text and "draftport offline evaluator" in text
    assert "tau = 1 + accepted draft tokens / verify cycles" in text
    assert "48 samples" in text  # training data counts
    fetched = json.loads((published["inputs"]["source"]).read_text())
    assert f"org/src-eagle3@{fetched['commit']}" in text  # lineage: repo@revision
    assert "vLLM's numbering" in text and "[0, 1, 2] in SGLang's numbering" in text
    assert (
        'vllm serve org/target-new --speculative-config \'{"method": "eagle3", "model": "org/k25-eagle3", '
        '"num_speculative_tokens": 3}\'' in text
    )
    assert "--speculative-draft-model-path org/k25-eagle3" in text
    assert (
        "speculators convert org/k25-eagle3 --algorithm eagle3 --verifier org/target-new --output-path "
        'drafter-speculators --algorithm-kwargs \'{"eagle_aux_hidden_state_layer_ids": [1, 2, 3], '
        '"norm_before_residual": false}\''
    ) in text
    assert "Recommendation: init" in text  # the decision's summary


def test_a_named_phase_and_a_bad_one(pipe, tmp_path):
    rep = from_pipeline(pipe["params"], pipe["inputs"], tmp_path / "p2", phase="phase2")
    assert rep["phase"] == "phase2"
    text = (tmp_path / "p2" / "README.md").read_text()
    assert "Phase 1 (fine-tuned) -> Phase 2 -> this drafter" in text
    with pytest.raises(DraftportError, match="publish.phase: must be one of"):
        choose_phase(pipe["decision"], "phase0")
    rec = {"recommendation": {"init": "scratch", "phase2": "helps"}}
    assert choose_phase(rec)[0] == "phase1_scratch"
    assert choose_phase({"recommendation": {"init": "source", "phase2": "helps"}})[0] == "phase2"
    assert choose_phase({"recommendation": {"init": "either", "phase2": "hurts"}})[0] == "phase1"


def test_a_failed_check_leaves_no_folder(pipe, tmp_path):
    """The embedding asked for is checked against the target's bytes: a drafter whose other
    tensors are not what the export made fails, and nothing is left under the final name."""
    bad = dict(pipe["inputs"])
    bad["target"] = stub_target(tmp_path / "other_target", seed=5)  # not the one the phase was measured on
    with pytest.raises(DraftportError, match="the phase's evaluation measured"):
        from_pipeline(pipe["params"], bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


class Recorder:
    def __init__(self):
        self.calls = []


@pytest.fixture
def hub(monkeypatch):
    """HfApi's two network calls, recorded instead of sent."""
    rec = Recorder()

    def create_repo(self, repo_id, **kw):
        rec.calls.append(("create_repo", repo_id, kw))

    def upload_folder(self, *, repo_id, folder_path, **kw):
        rec.calls.append(("upload_folder", repo_id, folder_path))
        return type("Info", (), {"commit_url": f"https://huggingface.co/{repo_id}/commit/0"})()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return rec


def test_push_reaches_the_upload_with_the_folder_and_repo(published, hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    res = push(published["out"], "org/k25-eagle3", published["target"])
    assert [c[0] for c in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[1][1:] == ("org/k25-eagle3", str(published["out"]))
    assert res["repo_id"] == "org/k25-eagle3" and res["base_model"] == "org/target-new"


def test_push_is_refused_before_any_network_call(published, hub, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(DraftportError, match="HF_TOKEN: not set"):
        push(published["out"], "org/k25-eagle3", published["target"])
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(DraftportError, match="--repo-id: expected a hub repo id"):
        push(published["out"], "not-a-repo", published["target"])
    with pytest.raises(DraftportError, match="do not name org/other"):
        push(published["out"], "org/other", published["target"])
    # a broken folder: the embedding replaced by another target's
    broken = tmp_path / "broken"
    shutil.copytree(published["out"], broken)
    other = stub_target(tmp_path / "t_other", seed=7)
    with pytest.raises(DraftportError, match="not publishable: .*embed_tokens differs from the target's"):
        push(broken, "org/k25-eagle3", other)
    (broken / "README.md").unlink()
    with pytest.raises(DraftportError, match="README.md .* is missing"):
        push(broken, "org/k25-eagle3", published["target"])
    assert hub.calls == []


def test_push_refuses_a_base_model_that_is_not_on_the_hub(pipe, hub, monkeypatch, tmp_path):
    p = json.loads(json.dumps(pipe["params"]))
    p["publish"]["base_model"] = str(pipe["target"])  # a local folder: what targets.new is in the world
    from_pipeline(p, pipe["inputs"], tmp_path / "local", repo_id="org/x")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    with pytest.raises(DraftportError, match="publish.base_model: .* is not a hub id"):
        push(tmp_path / "local", "org/x", pipe["target"])
    assert hub.calls == []


def test_publish_params_are_checked():
    base = params.read_yaml(ROOT / "params.yaml")
    assert params.validate(base)["publish"]["enabled"] is False  # opt-in
    for key, value, needle in (
        ("k", [3, 1], "ascending"),
        ("folder", "a/b", "plain folder name"),
        ("embed_tokens", "old", "drop"),
        ("phase", "phase0", "phase1_scratch"),
    ):
        bad = json.loads(json.dumps(base))
        bad["publish"][key] = value
        with pytest.raises(params.ParamsError, match=f"publish.{key}.*{needle}"):
            params.validate(bad)


def test_the_cli_refuses_a_push_without_a_token_in_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    res = subprocess.run(
        [sys.executable, "-m", "draftport.cli", "publish", "--push", "--repo-id", "org/x"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "draftport: error:" in lines[0], res.stderr


def test_the_step_runs_under_its_registry_row(pipe, tmp_path):
    """scripts/publish.py as Snakemake and DVC run it: its folder, publish.json and metrics.json,
    and every draftport module it ran listed in its row (DRAFTPORT_STRICT_MODULES)."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    over = {
        "targets": {"new": "org/target-new"},
        "publish": {"enabled": True, "k": [1, 3], "repo_id": "org/k25"},
        "decision": {"n_boot": 200},
    }
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(over))
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "publish.py"),
        "--params",
        "profile.yaml",
        *(a for name, path in pipe["inputs"].items() for a in ("--input", f"{name}={path}")),
        "--logfile",
        "logs/publish.log",
    ]
    env = {**os.environ, "DRAFTPORT_STRICT_MODULES": "1"}
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    step = tmp_path / "artifacts" / "publish"
    rep = json.loads((step / "publish.json").read_text())
    metrics = json.loads((step / "metrics.json").read_text())
    assert rep["folder"] == "drafter" and (step / "drafter" / "README.md").is_file()
    assert metrics["accept_length_k3"] == pipe["evals"][rep["phase"]]["accept_length"]
    validate_export(step / "drafter", pipe["target"], embed_tokens="target")


def test_the_cli_builds_the_folder_from_the_artifacts(pipe, tmp_path):
    """`draftport publish` in a checkout whose artifacts/ the pipeline filled (here: the fixture's)."""
    root = pipe["root"]
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "over.yaml").write_text(
        yaml.safe_dump(
            {
                "targets": {"new": str(pipe["target"])},
                "publish": {"k": [3], "base_model": "org/target-new"},
                "decision": {"n_boot": 200},
            }
        )
    )
    out = tmp_path / "cli_out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "draftport.cli",
            "publish",
            "--params",
            str(tmp_path / "params.yaml"),
            "--configfile",
            str(tmp_path / "over.yaml"),
            "--out",
            str(out),
            "--repo-id",
            "org/k25",
            "--phase",
            "phase1_scratch",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        env={k: v for k, v in os.environ.items() if k != "HF_TOKEN"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(r.stdout)  # --json: nothing else on stdout
    assert rep["phase"] == "phase1_scratch" and rep["repo_id"] == "org/k25"
    assert [t["k"] for t in rep["taus"]] == [3]
    assert rep["taus"][0]["accept_length"] == pipe["evals"]["phase1_scratch"]["accept_length"]
    validate_export(out, pipe["target"], embed_tokens="target")
    assert "--speculative-draft-model-path org/k25" in (out / "README.md").read_text()


def test_embed_tokens_drop_publishes_none_and_says_so(pipe, tmp_path):
    p = json.loads(json.dumps(pipe["params"]))
    p["publish"]["embed_tokens"] = "drop"
    rep = from_pipeline(p, pipe["inputs"], tmp_path / "drop")
    assert "embed_tokens.weight" not in read_header(tmp_path / "drop" / "model.safetensors")[0]
    assert "no embed_tokens: vLLM and SGLang embed with the target's" in (tmp_path / "drop" / "README.md").read_text()
    assert rep["taus"][-1]["accept_length"] == pipe["evals"][rep["phase"]]["accept_length"]
    with pytest.raises(DraftportError, match="online.embed_tokens is target but the export carries no embed_tokens"):
        check_folder(tmp_path / "drop", pipe["target"], embed_tokens="target")
