"""Bad input through the entry points users run, one table of cases.

Every case starts from a copy of one micro world (the pipeline's steps run once, through their
scripts, up to Phase 1's from-scratch control), breaks one input, runs one real command
(`python scripts/<step>.py`, `draftport ...`, `snakemake ...`, `python -m draftport.plan.params`,
`python -m draftport.evaluation.online`) and checks what a user sees and what is left on disk:
  - a non-zero exit status;
  - stderr's last non-empty line is the one-line error `<file or dotted key>: <problem>`;
  - no "Traceback" in stdout or stderr;
  - every file under artifacts/ is byte-identical and unmoved (same path, sha256, mtime): no new,
    partial or hidden temporary file in the step's folder, the step's previous outputs (Phase 1
    control's drafter, a finished step's metrics.json) and every upstream artifact untouched;
  - the command's own output folder, when it names one, is not created.
README.md's "Bad input" table lists every case with its message: test_readme_lists_every_case.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import yaml
from repo import BIN, ROOT
from safetensors.numpy import load_file, save_file

from draftport.data.shards import FeatureSet, Sequence, capture_meta, write_sequences

PY = sys.executable
# Run once for the fixture; Phase 0 and Phase 1 are left out (no case needs their outputs).
FIXTURE_STEPS = (
    "world",
    "fetch",
    "features_new",
    "features_eval",
    "features_monitor",
    "vocab_new",
    "compare",
    "train_phase1_scratch",
)

SRC = "artifacts/fetch/source"
SRC_ST = f"{SRC}/model.safetensors"
SRC_CFG = f"{SRC}/config.json"
VOCAB = "artifacts/vocab_new/vocab.safetensors"
SHARD = "artifacts/features_new/train/shard_00000.safetensors"
TARGET_CFG = "artifacts/world/target_new/config.json"


def step(name: str) -> list[str]:
    return [PY, f"scripts/{name}.py", "--logfile", f"logs/{name}.log"]


# ---- how to break an input --------------------------------------------------------------------
def edit_params(repo: Path, fn: Callable[[dict], None]) -> None:
    p = repo / "params.yaml"
    cfg = yaml.safe_load(p.read_text())
    fn(cfg)
    p.write_text(yaml.safe_dump(cfg, sort_keys=False))


def set_key(dotted: str, value):
    def fn(repo):
        def put(cfg):
            *parents, last = dotted.split(".")
            cur = cfg
            for k in parents:
                cur = cur[k]
            cur[last] = value

        edit_params(repo, put)

    return fn


def drop_key(dotted: str):
    def fn(repo):
        def drop(cfg):
            *parents, last = dotted.split(".")
            cur = cfg
            for k in parents:
                cur = cur[k]
            del cur[last]

        edit_params(repo, drop)

    return fn


def write(rel: str, text: str):
    def fn(repo):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)

    return fn


def both(*fns):
    def fn(repo):
        for f in fns:
            f(repo)

    return fn


def yaml_syntax_error(repo):
    with open(repo / "params.yaml", "a") as f:
        f.write("eval: {k: 3, batch_size: 32\n")  # the flow mapping is never closed


def truncate(rel: str):
    def fn(repo):
        os.truncate(repo / rel, (repo / rel).stat().st_size // 2)

    return fn


def garbage(rel: str):
    def fn(repo):
        (repo / rel).write_bytes(np.random.default_rng(0).bytes(4096))

    return fn


def lying_header(repo):
    f = repo / SRC_ST
    raw = f.read_bytes()
    # fc [64, 192] claimed as [64, 191]: same byte length, only the claim changes
    assert b'"shape":[64,192]' in raw
    f.write_bytes(raw.replace(b'"shape":[64,192]', b'"shape":[64,191]', 1))


def flip_bytes(rel: str):
    def fn(repo):
        f = repo / rel
        raw = bytearray(f.read_bytes())
        raw[-100:-96] = bytes(255 - b for b in raw[-100:-96])
        f.write_bytes(bytes(raw))

    return fn


def rewrite_tensors(rel: str, fn_tensors):
    """Load a safetensors file with numpy, change its tensors, save it back (a valid file)."""

    def fn(repo):
        t = dict(load_file(str(repo / rel)))
        fn_tensors(t)
        (repo / rel).unlink()
        save_file(t, str(repo / rel))

    return fn


def edit_json(rel: str, fn_json):
    def fn(repo):
        p = repo / rel
        d = json.loads(p.read_text())
        fn_json(d)
        p.write_text(json.dumps(d, indent=2))

    return fn


def d2t_short(t):
    t["d2t"] = t["d2t"][:-1].copy()


def d2t_out_of_range(t):
    d = t["d2t"].copy()
    d[-3:] += 5000
    t["d2t"] = d


def t2d_disagrees(t):
    t2d = t["t2d"].copy()
    t2d[np.nonzero(t2d)[0][:5]] = False
    t["t2d"] = t2d


def to_pickle(repo):
    (repo / SRC_ST).unlink()
    (repo / SRC / "pytorch_model.bin").write_bytes(b"\x80\x04\x95pickle that must never be opened")


def aux_ids(ids):
    def fn(d):
        d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids

    return fn


def drafter_for_wider_target(repo):
    """A coherent drafter, but its fc reads a target of hidden size 96 (this target has 64)."""
    rewrite_tensors(SRC_ST, lambda t: t.update({"fc.weight": np.zeros((64, 3 * 96), np.float32)}))(repo)
    edit_json(SRC_CFG, lambda d: d.update(target_hidden_size=96))(repo)


def wider_target(repo):
    """targets.new -> a copy of the new target whose hidden size is 96 (the drafter's is 64)."""
    dst = repo / "wide_target"
    shutil.copytree(repo / "artifacts/world/target_new", dst)
    t = dict(load_file(str(dst / "model.safetensors")))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t[name] = np.zeros((t[name].shape[0], 96), np.float32)
    (dst / "model.safetensors").unlink()
    save_file(t, str(dst / "model.safetensors"))
    edit_json("wide_target/config.json", lambda d: d.update(hidden_size=96))(repo)
    set_key("targets.new", "wide_target")(repo)


def empty_index(repo):
    edit_json("artifacts/features_new/train/index.json", lambda d: d.update(samples=0, tokens=0, shards=[]))(repo)


def online_with_a_tiny_spool(repo):
    """features_new as storage online writes it (the answers only), and a spool bound of 1 KB."""
    train = repo / "artifacts/features_new/train"
    fs = FeatureSet(train)
    seqs = []
    for i in range(len(fs)):
        s = fs.sample(i)
        seqs.append(Sequence(s["tokens"].tolist(), s["response_start"]))
    meta = capture_meta(fs.index)
    write_sequences(
        train,
        seqs,
        meta=meta,
        capture={
            "storage": "online",
            "engine": "transformers",
            "dtype": fs.index["dtype"],
            "device": "cpu",
            "batch_size": 8,
            "tensor_parallel_size": 1,
            "shard_samples": 256,
            "hidden_size": fs.index["hidden_size"],
            "compile": False,
        },
    )
    set_key("features.storage", "online")(repo)
    set_key("features.spool_gb", 1e-6)(repo)


def long_prompts(repo):
    words = " ".join(["kra"] * 700)
    (repo / "prompts").mkdir(exist_ok=True)
    (repo / "prompts/long.jsonl").write_text(json.dumps({"user": f"{words} 12?", "assistant": "x"}) + "\n")


def delete(rel: str):
    def fn(repo):
        p = repo / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()

    return fn


# ---- the cases ----------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    input: str  # what is wrong, in the README's words
    make: Callable[[Path], None]
    cmd: list[str]  # run in the repository copy
    where: str  # the file or dotted key the message must name
    problem: str  # a fragment of the problem the message must state
    absent: tuple[str, ...] = ()  # output paths that must not be created
    known_gap: str | None = None  # why the message is not ours yet (the case then must fail)
    keeps: tuple[str, ...] = ()  # earlier outputs that must be there before and unchanged after


ONLINE = [
    PY,
    "-m",
    "draftport.evaluation.online",
    "artifacts/world/target_new",
    SRC,
    "artifacts/world/corpus/heldout_new.jsonl",
    "online_out",
    "--n",
    "4",
]

CASES = [
    # params.yaml
    Case(
        "params-typo",
        "params.yaml: a misspelt key (`eval.kk`)",
        set_key("eval.kk", 3),
        step("eval_phase0"),
        "eval.kk",
        "unknown key (did you mean eval.k?)",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "params-wrong-type",
        'params.yaml: `eval.batch_size: "32"` (a string)',
        set_key("eval.batch_size", "32"),
        step("eval_phase0"),
        "eval.batch_size",
        'expected an integer, got "32"',
        ("artifacts/eval_phase0",),
    ),
    Case(
        "params-out-of-range",
        "params.yaml: `phase1.train.lr: 5.0`",
        set_key("phase1.train.lr", 5.0),
        step("train_phase1_scratch"),
        "phase1.train.lr",
        "must be <= 1, got 5",
    ),
    Case(
        "device-cuda-without-gpu",
        "params.yaml: `phase1.train.device: cuda` on a machine with no GPU",
        set_key("phase1.train.device", "cuda"),
        step("train_phase1_scratch"),
        "phase1.train.device",
        "cuda asked for, but torch sees no CUDA device on this machine",
        keeps=(
            "artifacts/train_phase1_scratch/drafter/model.safetensors",
            "artifacts/train_phase1_scratch/metrics.json",
        ),
    ),
    Case(
        "eval-device-cuda-without-gpu",
        "params.yaml: `eval.device: cuda` on a machine with no GPU",
        set_key("eval.device", "cuda"),
        step("eval_phase0"),
        "eval.device",
        "cuda asked for, but torch sees no CUDA device on this machine",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "params-eval-k-zero",
        "params.yaml: `eval.k: 0`",
        set_key("eval.k", 0),
        step("eval_phase0"),
        "eval.k",
        "must be >= 1, got 0",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "params-yaml-syntax",
        "params.yaml: an unclosed `{`",
        yaml_syntax_error,
        step("features_new"),
        "params.yaml:",
        "not valid YAML",
    ),
    Case(
        "params-missing-key",
        "params.yaml: `eval.batch_size` deleted",
        drop_key("eval.batch_size"),
        step("eval_phase0"),
        "eval.batch_size",
        "missing",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "params-null",
        "params.yaml: `source.revision: null`",
        set_key("source.revision", None),
        step("fetch"),
        "source.revision",
        "must be set (null is not allowed here)",
    ),
    Case(
        "params-aux-out-of-range",
        "params.yaml: `features.aux_layer_ids: [0, 1, 7]`, the targets have 2 layers",
        set_key("features.aux_layer_ids", [0, 1, 7]),
        step("features_new"),
        "features.aux_layer_ids",
        "[7] out of range for the world's 2-layer targets",
    ),
    Case(
        "params-aux-sglang-out-of-range",
        "params.yaml: `features.aux_convention: sglang` with aux id 2 on 2-layer "
        "targets (SGLang's id 2 would be the state leaving a third layer)",
        set_key("features.aux_convention", "sglang"),
        step("features_new"),
        "features.aux_layer_ids",
        "[2] out of range for the world's 2-layer targets (sglang convention)",
    ),
    Case(
        "params-storage-unknown",
        "params.yaml: `features.storage: cloud`",
        set_key("features.storage", "cloud"),
        step("features_new"),
        "features.storage",
        'must be one of disk, online, hybrid; got "cloud"',
    ),
    Case(
        "spool-below-one-shard",
        "storage online with `features.spool_gb: 1.0e-06` (1 KB: less than one shard), Phase 1's control rerun",
        online_with_a_tiny_spool,
        step("train_phase1_scratch"),
        "features.spool_gb",
        "is less than one shard",
        keeps=(
            "artifacts/train_phase1_scratch/drafter/model.safetensors",
            "artifacts/train_phase1_scratch/metrics.json",
        ),
    ),
    Case(
        "params-phase2-not-larger",
        "params.yaml: `phase2.n_samples` below `phase1.n_samples`",
        set_key("phase2.n_samples", 10),
        step("features_phase2"),
        "phase2.n_samples",
        "must exceed phase1.n_samples",
        ("artifacts/features_phase2",),
    ),
    Case(
        "step-not-in-plan",
        "params.yaml: `data.budget: adaptive`, then the fixed plan's step `features_phase2` "
        "run (a dvc.yaml made before the edit)",
        set_key("data.budget", "adaptive"),
        step("features_phase2"),
        "data.budget",
        "adaptive: step features_phase2 is not part of this plan (it needs data.budget=fixed; "
        "step budget stands in for it): regenerate dvc.yaml",
        ("artifacts/features_phase2",),
    ),
    # profiles
    Case(
        "profile-unknown",
        "`snakemake --configfile configs/nope.yaml` (no such profile)",
        lambda repo: None,
        [str(BIN / "snakemake"), "-n", "phase1", "--configfile", "configs/nope.yaml"],
        "configs/nope.yaml",
        "no such",
        known_gap="Snakemake 9.27.1 opens a --configfile outside its own FileNotFoundError guard "
        "(snakemake/common/configfile.py) and prints the traceback before the Snakefile runs",
    ),
    Case(
        "profile-typo",
        "a profile with a misspelt key (`eval: {kk: 3}`)",
        write("configs/typo.yaml", "eval: {kk: 3}\n"),
        [str(BIN / "snakemake"), "-n", "phase1", "--configfile", "configs/typo.yaml"],
        "eval.kk",
        "unknown key (did you mean eval.k?)",
    ),
    Case(
        "params-cli-unknown-profile",
        "`python -m draftport.plan.params --configfile configs/nope.yaml`",
        lambda repo: None,
        [PY, "-m", "draftport.plan.params", "--configfile", "configs/nope.yaml"],
        "configs/nope.yaml",
        "no such parameter file",
    ),
    Case(
        "params-cli-profile-wrong-type",
        'a profile with `phase1: {n_samples: "many"}`',
        write("configs/bad.yaml", "phase1: {n_samples: many}\n"),
        [PY, "-m", "draftport.plan.params", "--configfile", "configs/bad.yaml"],
        "phase1.n_samples",
        'expected an integer, got "many"',
    ),
    # safetensors and checkpoints
    Case(
        "source-truncated",
        "the source drafter's model.safetensors cut in half",
        truncate(SRC_ST),
        step("compare"),
        SRC_ST,
        "truncated",
        keeps=("artifacts/compare/metrics.json", "artifacts/fetch/metrics.json"),
    ),
    Case(
        "source-garbage",
        "the source drafter's model.safetensors replaced by random bytes",
        garbage(SRC_ST),
        step("eval_phase0"),
        SRC_ST,
        "not a safetensors file",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "source-lying-header",
        "a safetensors header that claims fc.weight is [64, 191]",
        lying_header,
        step("compare"),
        SRC_ST,
        "header lies about tensor 'fc.weight'",
    ),
    Case(
        "source-pickle",
        "the source drafter shipped as pytorch_model.bin (pickle)",
        to_pickle,
        step("compare"),
        f"{SRC}/pytorch_model.bin",
        "pickle checkpoints are refused",
    ),
    Case(
        "source-config-not-json",
        "the source drafter's config.json is not JSON",
        write(SRC_CFG, '{"hidden_size": 64,'),
        step("compare"),
        SRC_CFG,
        "not valid JSON",
    ),
    Case(
        "cli-shapes-contradict-config",
        "`draftport compare` on a drafter whose config.json says head_dim 16 (its weights hold 32)",
        edit_json(SRC_CFG, lambda d: d.update(head_dim=16)),
        [str(BIN / "draftport"), "compare", SRC, "artifacts/compare/new_layout"],
        SRC_ST,
        "tensor midlayer.self_attn.k_proj.weight has shape [64, 128], config.json implies [32, 128]",
    ),
    Case(
        "cli-inspect-garbage",
        "`draftport inspect` on a folder whose safetensors is random bytes",
        garbage(SRC_ST),
        [str(BIN / "draftport"), "inspect", SRC],
        SRC_ST,
        "not a safetensors file",
    ),
    # vocab maps
    Case(
        "d2t-length",
        "the source drafter's d2t one entry short of draft_vocab_size",
        rewrite_tensors(SRC_ST, d2t_short),
        step("compare"),
        SRC_ST,
        "tensor d2t has shape [127], config.json implies [128]",
    ),
    Case(
        "d2t-out-of-range",
        "the new draft map's d2t points past the vocab",
        rewrite_tensors(VOCAB, d2t_out_of_range),
        step("train_phase1_scratch"),
        VOCAB,
        "outside the vocab of 512 (3 slots out of range)",
        keeps=(
            "artifacts/train_phase1_scratch/drafter/model.safetensors",
            "artifacts/train_phase1_scratch/metrics.json",
        ),
    ),
    Case(
        "t2d-disagrees",
        "the new draft map's t2d disagrees with its d2t",
        rewrite_tensors(VOCAB, t2d_disagrees),
        step("compare"),
        VOCAB,
        "t2d disagrees with d2t",
    ),
    Case(
        "vocab-garbage",
        "the new draft map's vocab.safetensors is random bytes",
        garbage(VOCAB),
        step("compare"),
        VOCAB,
        "not a safetensors file",
    ),
    # shapes and aux layers against the target
    Case(
        "drafter-hidden-mismatch",
        "a drafter whose fc reads a hidden size of 96 (the target has 64)",
        drafter_for_wider_target,
        step("eval_phase0"),
        SRC,
        "features have hidden size 64, the drafter expects 96",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "target-hidden-mismatch",
        "`targets.new`: a target of hidden size 96 (the drafter's is 64)",
        wider_target,
        step("eval_phase0"),
        "wide_target",
        "target embedding [512, 96] does not fit the drafter",
        ("artifacts/eval_phase0",),
    ),
    Case(
        "drafter-aux-mismatch",
        "the source drafter's config reads aux layers [0, 1, 7]",
        edit_json(SRC_CFG, aux_ids([0, 1, 7])),
        step("features_eval"),
        "features.aux_layer_ids",
        "but the source drafter reads [0, 1, 7]",
    ),
    Case(
        "online-aux-out-of-range",
        "`python -m draftport.evaluation.online` with a drafter whose aux layers are [0, 1, 7]",
        edit_json(SRC_CFG, aux_ids([0, 1, 7])),
        ONLINE,
        SRC,
        "aux layer ids [0, 1, 7] out of range 0..2",
        ("online_out",),
    ),
    # data
    Case(
        "prompts-empty",
        "`targets.prompts_train`: an empty jsonl",
        both(write("prompts/empty.jsonl", ""), set_key("targets.prompts_train", "prompts/empty.jsonl")),
        step("features_new"),
        "prompts/empty.jsonl",
        "no samples",
        keeps=(SHARD, "artifacts/features_new/metrics.json"),
    ),
    Case(
        "prompts-bad-line",
        "`targets.prompts_train`: a jsonl whose 2nd line is not JSON",
        both(
            write("prompts/bad.jsonl", '{"user": "Kra 5?"}\n{"user": \n'),
            set_key("targets.prompts_train", "prompts/bad.jsonl"),
        ),
        step("features_new"),
        "prompts/bad.jsonl:2",
        "not a JSON line",
    ),
    Case(
        "prompts-too-long",
        "`targets.prompts_eval_new`: a prompt longer than the target's context (512)",
        both(long_prompts, set_key("targets.prompts_eval_new", "prompts/long.jsonl")),
        step("features_eval"),
        "prompts/long.jsonl:1",
        "does not fit the target's context of 512",
    ),
    Case(
        "online-prompts-too-long",
        "`python -m draftport.evaluation.online` with a prompt longer than the context",
        long_prompts,
        ONLINE[:5] + ["prompts/long.jsonl", "online_out", "--n", "1"],
        "prompts/long.jsonl:1",
        "exceeds the target's context of 512",
        ("online_out",),
    ),
    Case(
        "features-empty",
        "a features folder whose index.json lists no samples",
        empty_index,
        step("vocab_new"),
        "artifacts/features_new/train/index.json",
        "holds no samples (empty dataset)",
    ),
    Case(
        "shard-corrupted",
        "a feature shard whose sha256 differs from index.json (Phase 1's control reruns on it)",
        flip_bytes(SHARD),
        step("train_phase1_scratch"),
        SHARD,
        "corrupted (sha256 differs from index.json)",
        keeps=(
            "artifacts/train_phase1_scratch/drafter/model.safetensors",
            "artifacts/train_phase1_scratch/metrics.json",
        ),
    ),
    # missing or broken upstream artifacts
    Case(
        "upstream-missing",
        "artifacts/vocab_new/vocab.safetensors deleted",
        delete(VOCAB),
        step("compare"),
        VOCAB,
        "missing",
    ),
    Case(
        "upstream-step-missing",
        "artifacts/features_new/ deleted (the draft map is counted on it)",
        delete("artifacts/features_new"),
        step("vocab_new"),
        "artifacts/features_new/train",
        "no index.json",
        keeps=("artifacts/vocab_new/vocab.safetensors",),
    ),
    Case(
        "target-config-not-json",
        "the new target's config.json is not JSON",
        write(TARGET_CFG, "{vocab_size: 512"),
        step("vocab_new"),
        TARGET_CFG,
        "not valid JSON",
    ),
    Case(
        "fetch-unknown-revision",
        "`source.revision: v9`, a revision the hub cache lacks",
        set_key("source.revision", "v9"),
        step("fetch"),
        "draftport/world-k2-eagle3",
        "revision v9 is not in the hub cache",
    ),
]


# ---- the micro world -----------------------------------------------------------------------------
def env_for(repo: Path, tmp: Path) -> dict:
    env = {
        **os.environ,
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(repo / "src"),
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DVC_NO_ANALYTICS": "1",
    }
    env.pop("DVC_STAGE", None)
    return env


@pytest.fixture(scope="module")
def world(tmp_path_factory, micro_upstream):
    """A repository copy whose params.yaml is the micro profile, with the steps a case needs run:
    those up to the training data once for the session (conftest's micro_upstream, the same micro
    copy), the others here through their scripts."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    repo = tmp / "world"
    shutil.copytree(micro_upstream, repo, symlinks=True)
    env = env_for(repo, tmp)
    for s in FIXTURE_STEPS:
        if (repo / "artifacts" / s / "metrics.json").is_file():
            continue  # run in micro_upstream
        r = subprocess.run(step(s), cwd=repo, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{s}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return repo, tmp


def snapshot(root: Path) -> dict:
    """Every file and folder under root (hidden ones too): sha256 and mtime of files."""
    out = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = ("dir",)
        else:
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
    return out


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.known_gap)] if c.known_gap else [])
        for c in CASES
    ],
)
@pytest.mark.slow
def test_bad_input(world, tmp_path, case):
    src, tmp = world
    repo = tmp_path / "repo"
    shutil.copytree(src, repo, symlinks=True)
    case.make(repo)
    before = snapshot(repo / "artifacts")
    for rel in case.keeps:
        assert str(Path(rel).relative_to("artifacts")) in before, rel
    r = subprocess.run(case.cmd, cwd=repo, env=env_for(repo, tmp), capture_output=True, text=True, timeout=300)
    out = f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert r.returncode != 0, out
    assert "Traceback" not in r.stdout + r.stderr, out
    line = last_line(r.stderr)
    print(f"{case.id}: {line}")  # the message the README's table shows (pytest -rP prints it)
    assert case.where in line, out
    assert case.problem in line.split(case.where, 1)[1], out
    assert re.match(r"^(draftport: )?error: ", line), out
    after = snapshot(repo / "artifacts")
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"artifacts changed: {changed[:10]}\n{out}"
    for rel in case.absent:
        assert not (repo / rel).exists(), f"{rel} was created\n{out}"


def test_cases_are_distinct():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


def readme_rows() -> dict[str, str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    m = re.search(r"^## Bad input\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "README.md has no '## Bad input' section"
    rows = {}
    for line in m.group(1).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = line
    return rows


def test_readme_lists_every_case():
    """Each case id has a row in README.md's "Bad input" table holding its file/key and problem."""
    rows = readme_rows()
    for c in CASES:
        assert c.id in rows, f"README.md's Bad input table lacks {c.id}"
        row = rows[c.id].replace("\\|", "|")
        assert c.where in row and c.problem in row, f"{c.id}: README row does not show {c.where!r}: {c.problem!r}"
    assert set(rows) == {c.id for c in CASES}, f"README rows without a case: {set(rows) - {c.id for c in CASES}}"
