"""A team's own pair, end to end as the docs tell it: targets that are transformers' own
DeepseekV3ForCausalLM (the Kimi family's MLA + MoE) or Qwen3ForCausalLM (dense, q/k norms), a
source drafter in a hub cache, prompt files; `draftport init` writes the profile (nobody edits
it), Snakemake runs the whole plan to the decision and the report, `draftport decide` prints the
recommendation and `draftport publish` writes the checked hub folder.

The pair comes from the world builder (configs/micro-deepseek.yaml, configs/micro-qwen3.yaml),
moved out of artifacts/ so that it is just folders on disk, as a user's would be. vLLM's CPU
engine does not serve DeepSeek-V3 next to an EAGLE-3 drafter (configs/micro-deepseek.yaml says
why); the online steps are not run here (the vLLM tests run them on the Llama micro world)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from repo import BIN, copy_repo, smk

from draftport.plan import params

pytestmark = pytest.mark.slow


def draftport(*args, cwd):
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}", "NO_COLOR": "1"}
    return subprocess.run(
        [sys.executable, "-m", "draftport.cli", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "world, arch",
    [
        ("micro-deepseek", "DeepseekV3ForCausalLM"),  # Kimi's: MLA + MoE
        ("micro-qwen3", "Qwen3ForCausalLM"),
    ],
)  # dense, q/k norms
def test_a_pair_from_init_to_the_decision(tmp_path, world, arch):
    repo = tmp_path / "repo"
    copy_repo(repo)
    smk(f"--configfile=configs/{world}.yaml", "--cores", "2", "world", cwd=repo)
    pair = repo / "pairs" / "dsk"
    pair.parent.mkdir()
    shutil.move(repo / "artifacts" / "world", pair)
    shutil.rmtree(repo / "artifacts")
    for t in ("target_old", "target_new"):
        assert json.loads((pair / t / "config.json").read_text())["architectures"] == [arch]

    r = draftport(
        "init",
        "micro-dsk",
        "--source",
        "draftport/world-k2-eagle3",
        "--cache-dir",
        "pairs/dsk/hub",
        "--offline",
        "--target-new",
        "pairs/dsk/target_new",
        "--target-old",
        "pairs/dsk/target_old",
        "--prompts",
        "pairs/dsk/corpus/new.jsonl",
        "--prompts-eval",
        "pairs/dsk/corpus/heldout_new.jsonl",
        "--like",
        "configs/micro.yaml",
        "--phase1-samples",
        "64",
        "--phase2-samples",
        "128",
        "--baseline-tok-s",
        "82",
        "--verify-ms",
        "30",
        "--draft-ms",
        "0",
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr
    assert "nothing missing: snakemake --configfile=configs/micro-dsk.yaml" in r.stdout, r.stdout[-3000:]
    cfg = params.load(repo / "configs" / "micro-dsk.yaml", base=repo / "params.yaml")
    assert not cfg["world"]["build"] and cfg["features"]["aux_convention"] == "vllm"  # the drafter's own marker
    assert cfg["features"]["aux_layer_ids"] == [0, 1, 2] and cfg["drift"]["enabled"]

    smk("--configfile=configs/micro-dsk.yaml", "--cores", "2", "all", cwd=repo)
    art = repo / "artifacts"
    for step in (
        "fetch",
        "compare",
        "eval_phase0",
        "drift",
        "eval_phase1_scratch",
        "eval_phase1",
        "eval_phase2",
        "eval_curves",
        "decision",
        "report",
    ):
        assert (art / step / "metrics.json").is_file(), step
    assert not (art / "world").exists()  # the pair is the user's folders, not a world the plan built
    compare = json.loads((art / "compare" / "compare.json").read_text())
    assert compare["verdict"], compare
    dec = json.loads((art / "decision" / "decision.json").read_text())
    assert dec["recommendation"]["init"] in ("source", "scratch", "either")
    assert [x["id"] for x in dec["recommendation"]["rules"]] == [f"R{i}" for i in range(1, 12)]
    assert [(x["name"], x["share"]) for x in dec["traffic"]["sets"]] == [("heldout", 1.0)]  # init's profile: one set
    # --like micro: its buckets (0, 32, 64); the first holds cycles of every drafter
    assert not dec["traffic"]["weighted"] and dec["traffic"]["context_buckets"]["names"] == ["0-32", "32-64", "64+"]
    assert all(rows[0]["num_cycles"] > 0 for rows in dec["traffic"]["buckets"].values())

    r = draftport("decide", cwd=repo)
    assert r.returncode == 0 and "Recommendation: init " in r.stdout, r.stderr
    r = draftport(
        "publish", "--configfile", "configs/micro-dsk.yaml", "--out", tmp_path / "published", "--json", cwd=repo
    )
    assert r.returncode == 0, r.stderr
    pub = json.loads(r.stdout)
    assert pub["export"] and (tmp_path / "published" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "published" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"
    ]
