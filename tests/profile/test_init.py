"""`draftport init`: a profile from what a team has, header-only, through the real CLI.

The Kimi pair comes from a pre-populated hub cache of header-only files (the drafter's shapes,
Kimi-K2.5's published config with its remote code named in auto_map); the shipped
configs/kimi-k2.5.yaml must be what init writes for it. Mismatched pairs and bad prompt files are
one line each naming the file, exit 2, nothing written."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from draftport.data.fetch import publish_to_cache
from draftport.model.fixtures import frequency_maps, kimi_k2_config, small_config, write_header_only_drafter
from draftport.plan import params
from draftport.profile.estimate import KIMI_K2_TEXT

ROOT = Path(__file__).resolve().parents[2]
KIMI_ARGS = [
    "kimi-k2.5",
    "--source",
    "AQ-MedAI/Kimi-K2-Instruct-eagle3",
    "--target-new",
    "moonshotai/Kimi-K2.5",
    "--reference",
    "AQ-MedAI/Kimi-K25-eagle3",
    "--regenerate",
    "openai",
    "--base-url",
    "http://127.0.0.1:8000/v1",
    "--trust-remote-code",
    "--no-pin",
]


def kimi_target(folder: Path) -> Path:
    """Kimi-K2.5 as init reads it: a multimodal wrapper's config.json (text_config) and a tokenizer
    that is repo code (auto_map)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "model_type": "kimi_k25",
                "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
                "text_config": {**KIMI_K2_TEXT, "max_position_embeddings": 262144},
            }
        )
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}})
    )
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    cfg = kimi_k2_config()
    write_header_only_drafter(root / "k2", cfg, *frequency_maps(cfg, seed=1), with_embed=False)
    commit = publish_to_cache(root / "k2", root / "cache", "AQ-MedAI/Kimi-K2-Instruct-eagle3")
    publish_to_cache(kimi_target(root / "k25"), root / "cache", "moonshotai/Kimi-K2.5")
    return root / "cache", commit


def init(*args, cache=None, cwd=ROOT):
    env = {**os.environ, "NO_COLOR": "1"}
    if cache is not None:
        env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "draftport.cli", "init", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_kimi_profile_is_what_init_writes(hub, tmp_path):
    cache, _ = hub
    out = tmp_path / "kimi-k2.5.yaml"
    r = init(*KIMI_ARGS, "--out", out, cache=cache)
    assert r.returncode == 0, r.stderr
    assert out.read_text() == (ROOT / "configs" / "kimi-k2.5.yaml").read_text(), (
        "configs/kimi-k2.5.yaml: regenerate it with `draftport init` (this test's KIMI_ARGS)"
    )
    cfg = params.load(out)
    assert cfg["features"]["aux_layer_ids"] == [2, 30, 58] and cfg["features"]["aux_convention"] == "sglang"
    assert cfg["features"]["engine"] == "vllm" and cfg["features"]["tensor_parallel_size"] == 8
    assert cfg["targets"]["trust_remote_code"] == ["moonshotai/Kimi-K2.5"]
    assert cfg["vocab_new"]["draft_vocab_size"] == 32000 and cfg["phase1"]["n_samples"] == 37000
    # what a user still has to do is printed, one line per key
    gaps = r.stdout.split("still missing")[1]
    for key in (
        "targets.prompts_train",
        "targets.prompts_eval_new",
        "costmodel",
        "source.revision",
        "features.base_url",
    ):
        assert f"  - {key}: " in gaps, key
    # the estimate is printed, the learning curves included
    assert "learning curves: " in r.stdout and "phase2 disk bfloat16" in r.stdout


def test_init_pins_the_revision_it_resolved(hub, tmp_path):
    cache, commit = hub
    out = tmp_path / "pinned.yaml"
    r = init(*KIMI_ARGS[:-1], "--json", "--out", out, cache=cache)
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(out.read_text())
    assert cfg["source"]["revision"] == commit and len(commit) == 40
    rep = json.loads(r.stdout)
    assert "source.revision" not in [g[0] for g in rep["gaps"]]
    assert rep["estimate"]["curves_hours"] > 0


def test_the_kimi_profiles_dry_run_plans_the_decision():
    r = subprocess.run(
        [
            Path(sys.executable).parent / "snakemake",
            "--configfile=configs/kimi-k2.5.yaml",
            "--cores",
            "8",
            "-n",
            "decision",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    for step in ("fetch", "features_new", "train_phase1", "train_curves", "decision"):
        assert step in r.stdout


def small_target(folder: Path, *, hidden=64, vocab=1000, layers=8, ctx=4096) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "vocab_size": vocab,
                "num_hidden_layers": layers,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "max_position_embeddings": ctx,
            }
        )
    )
    return folder


@pytest.fixture
def pair(tmp_path):
    cfg = small_config()  # hidden 64, vocab 1000, aux ids [1, 3, 5]
    src = write_header_only_drafter(tmp_path / "drafter", cfg, *frequency_maps(cfg))
    return tmp_path, src


@pytest.mark.parametrize(
    "target_kw, message",
    [
        ({"hidden": 128}, "the drafter reads hidden states of size 64 but the new target's hidden_size is 128"),
        ({"vocab": 1200}, "vocab_size 1000 but the new target's is 1200 (d2t maps into the target vocab)"),
        ({"layers": 5}, "aux layer ids [5] out of range for a target with 5 layers (sglang convention)"),
    ],
)
def test_a_mismatched_pair_is_one_line_and_writes_nothing(pair, target_kw, message):
    tmp, src = pair
    tgt = small_target(tmp / "target", **target_kw)
    out = tmp / "x.yaml"
    r = init("x", "--source", src, "--target-new", tgt, "--out", out)
    assert r.returncode == 2 and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert lines[0] == f"draftport: error: source ({src})/config.json: {message}", r.stderr
    assert lines[-1] == f"draftport: error: 1 problem(s): {out} not written"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_files_are_checked(pair):
    tmp, src = pair
    tgt = small_target(tmp / "target")
    train = write_jsonl(tmp / "train.jsonl", [{"user": f"q{i}"} for i in range(400)] + [{"user": "q3"}])
    held = write_jsonl(tmp / "held.jsonl", [{"user": f"h{i}"} for i in range(20)] + [{"user": "q7"}])
    out = tmp / "p.yaml"
    r = init(
        "p",
        "--source",
        src,
        "--target-new",
        tgt,
        "--prompts",
        train,
        "--prompts-eval",
        held,
        "--out",
        out,
        "--like",
        ROOT / "configs" / "micro.yaml",
    )
    assert r.returncode == 2 and not out.exists()
    assert f"draftport: error: {held}:21: 1 held-out prompts are also training prompts" in r.stderr
    write_jsonl(held, [{"user": f"h{i}"} for i in range(20)] + ['{"user": 3}'])
    r = init("p", "--source", src, "--target-new", tgt, "--prompts", train, "--prompts-eval", held, "--out", out)
    assert r.returncode == 2 and f"{held}:21: each line needs a non-empty string 'user' field" in r.stderr
    write_jsonl(held, [{"user": f"h{i}"} for i in range(20)])
    r = init(
        "p",
        "--source",
        src,
        "--target-new",
        tgt,
        "--prompts",
        train,
        "--prompts-eval",
        held,
        "--out",
        out,
        "--like",
        ROOT / "configs" / "micro.yaml",
        "--phase1-samples",
        "64",
        "--phase2-samples",
        "128",
    )
    assert r.returncode == 0, r.stderr
    assert "note  targets.prompts_train: 1 duplicate prompts (first: line 401 repeats line 4)" in r.stdout
    cfg = params.load(out)
    assert (cfg["phase1"]["n_samples"], cfg["phase2"]["n_samples"]) == (64, 128)
    assert cfg["features"]["device"] == "cpu" and cfg["phase1"]["train"]["steps"] == 12  # as configs/micro.yaml
    assert cfg["features"]["eval_samples"] == 20
    # an existing profile is never replaced without --force
    before = out.read_text()
    r = init("p", "--source", src, "--target-new", tgt, "--prompts", train, "--prompts-eval", held, "--out", out)
    assert r.returncode == 2 and "exists: pass --force" in r.stderr and out.read_text() == before


def test_a_local_pair_profile_plans_the_decision(pair):
    """A profile init wrote for two local folders is a plan Snakemake accepts, from a copy of the
    repository (its own params.yaml, nothing of the checkout touched)."""
    tmp, src = pair
    repo = tmp / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".git", ".venv*", "artifacts", ".snakemake", "logs", "mlruns", "*.db", ".draftport", "site"
        ),
    )
    tgt = small_target(tmp / "target")
    old = small_target(tmp / "target_old")
    train = write_jsonl(tmp / "train.jsonl", [{"user": f"q{i}"} for i in range(300)])
    held = write_jsonl(tmp / "held.jsonl", [{"user": f"h{i}"} for i in range(40)])
    r = init(
        "mine",
        "--source",
        src,
        "--target-new",
        tgt,
        "--target-old",
        old,
        "--prompts",
        train,
        "--prompts-eval",
        held,
        "--like",
        "configs/micro.yaml",
        "--phase1-samples",
        "64",
        "--phase2-samples",
        "128",
        "--baseline-tok-s",
        "50",
        "--verify-ms",
        "25",
        cwd=repo,
    )
    assert r.returncode == 0, r.stderr
    assert "nothing missing" in r.stdout or "still missing" not in r.stdout.split("source:")[0]
    cfg = params.load(repo / "configs" / "mine.yaml", base=repo / "params.yaml")
    assert cfg["drift"]["enabled"] and cfg["costmodel"]["baseline_tok_s"] == 50.0
    r = subprocess.run(
        [Path(sys.executable).parent / "snakemake", "--configfile=configs/mine.yaml", "--cores", "2", "-n", "decision"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "drift" in r.stdout and "train_phase1" in r.stdout


def test_a_dense_target_on_one_gpu_is_estimated_as_dense(tmp_path):
    """A dense 32B target (Qwen3-32B's sizes) fits one GPU: init shards it over none, and its
    estimate derives the answers' rate from its own bf16 weights on that GPU, never calling it MoE."""
    cfg = kimi_k2_config(
        hidden_size=5120,
        intermediate_size=25600,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=151936,
        aux_layer_ids=[1, 31, 60],
        max_position_embeddings=40960,
    )
    src = write_header_only_drafter(tmp_path / "drafter", cfg, *frequency_maps(cfg))
    tgt = tmp_path / "qwen3-32b"
    tgt.mkdir()
    (tgt / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "hidden_size": 5120,
                "intermediate_size": 25600,
                "num_hidden_layers": 64,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "vocab_size": 151936,
                "max_position_embeddings": 40960,
                "torch_dtype": "bfloat16",
            }
        )
    )
    out = tmp_path / "dense.yaml"
    r = init("dense", "--source", src, "--target-new", tgt, "--out", out)
    assert r.returncode == 0, r.stderr
    assert params.load(out)["features"]["tensor_parallel_size"] == 1
    est = r.stdout.split("still missing")[0]
    assert "regenerate: " in est and "MoE" not in est
    assert "derived for the dense target: 1 instance(s) of TP1 on H200" in " ".join(est.split())


def test_eval_sets_are_checked_and_written(pair):
    """--eval-set NAME=PATH:SHARE, repeated: targets.eval_sets in the profile; a bad set is one line
    naming it, exit 2, nothing written."""
    from draftport.profile.init import Findings, check_eval_sets, parse_eval_set

    tmp, src = pair
    tgt = small_target(tmp / "target")
    train = write_jsonl(tmp / "train.jsonl", [{"user": f"q{i}"} for i in range(300)])
    chat = write_jsonl(tmp / "chat.jsonl", [{"user": f"c{i}"} for i in range(30)])
    code = write_jsonl(tmp / "code.jsonl", [{"user": f"k{i}"} for i in range(12)] + [{"user": "q5"}])
    out = tmp / "s.yaml"
    args = ["s", "--source", src, "--target-new", tgt, "--prompts", train, "--out", out, "--like", "configs/micro.yaml"]
    r = init(*args, "--eval-set", f"chat={chat}:0.7", "--eval-set", f"code={code}:0.3")
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.splitlines()[0] == (
        f"draftport: error: {code}:13: targets.eval_sets[1] (code): 1 of its 13 prompts are also training "
        f"prompts ({train}): a held-out set must be disjoint from training"
    )
    write_jsonl(code, [{"user": f"k{i}"} for i in range(12)])
    r = init(*args, "--eval-set", f"chat={chat}:0.7", "--eval-set", f"code={code}:0.3")
    assert r.returncode == 0, r.stderr
    cfg = params.load(out)
    assert cfg["targets"]["eval_sets"] == [
        {"name": "chat", "prompts": str(chat), "share": 0.7, "n": None},
        {"name": "code", "prompts": str(code), "share": 0.3, "n": None},
    ]
    assert cfg["targets"]["prompts_eval_new"] == str(chat) and cfg["features"]["eval_samples"] == 30
    # the other problems, in process: each one line naming the set or the option
    for specs, where in (
        ((f"chat={chat}:0.7", f"code={code}:0.2"), "targets.eval_sets: the shares add up to 0.9"),
        ((f"chat={chat}:0.5", f"chat={code}:0.5"), "targets.eval_sets[1] (chat): the name is also"),
        ((f"Chat={chat}:1",), "targets.eval_sets[0] (Chat): name: "),
        ((f"chat={tmp / 'none.jsonl'}:1",), "targets.eval_sets[0] (chat): "),
        ((f"chat={chat}",), "--eval-set: "),
    ):
        f = Findings()
        assert check_eval_sets(specs, train, f) == [] and len(f.problems) == 1
        assert ": ".join(f.problems[0]).startswith(where), (specs, f.problems)
    assert parse_eval_set("c=C:/data/x.jsonl:0.25") == {
        "name": "c",
        "prompts": "C:/data/x.jsonl",
        "share": 0.25,
        "n": None,
    }
