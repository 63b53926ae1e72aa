import os

# Tiny tensors: one thread avoids oversubscription when the suite shares the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass

import sys
from pathlib import Path

import pytest

# Shared builders and the processes tests launch (workers, the MLflow server and UI) live in
# tests/helpers, the benchmarks tests run at toy size in benchmarks/: importable by name from every
# test area.
sys.path.insert(0, str(Path(__file__).parent / "helpers"))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "benchmarks"))


# ---- pytest-xdist: `make test` runs the suite on every core (-n auto --dist loadfile) ----------------
# A file is one unit of work, so its module-scoped fixtures (a world, a pipeline run, a server) are
# built once, on one worker. Every fixture writes under tmp_path_factory (a folder per worker) and
# serves on a port from mlflow_server.free_port (one per worker).

# The files that take longest, longest first (seconds of the serial suite, before the shared
# fixtures below, on the 2-core machine with another job beside it, 2026-12): the workers take them
# before the rest (in collection order), so that the run does not end with one worker on a long
# file and the other idle. A new long file belongs here.
HEAVY_FIRST = (
    "tests/pipeline/test_pipeline.py",  # 1284 s
    "tests/pipeline/test_own_pair.py",  # 398 s
    "tests/pipeline/test_resume.py",  # 296 s
    "tests/pipeline/test_online_storage.py",  # 237 s
    "tests/pipeline/test_bad_inputs.py",  # 200 s
    "tests/data/test_vllm_features.py",  # 199 s
    "tests/pipeline/test_rules_variants.py",  # 165 s
    "tests/pipeline/test_budget.py",  # 151 s
    "tests/pipeline/test_gpu_profile.py",  # 133 s
    "tests/pipeline/test_ui.py",  # 91 s
    "tests/training/test_fsdp.py",  # 87 s
    "tests/profile/test_init.py",  # 82 s
    "tests/pipeline/test_online.py",  # 66 s
    "tests/model/test_fast_path.py",  # 61 s
    "tests/bench/test_bench_train.py",  # 47 s
    "tests/outputs/test_speculators.py",  # 45 s
    "tests/bench/test_bench_capture.py",  # 42 s
    "tests/pipeline/test_tracking_hiccup.py",  # 41 s
    "tests/data/test_packing.py",  # 35 s
    "tests/training/test_train.py",  # 34 s
    "tests/bench/test_side_by_side.py",  # 30 s
)
# -n auto: at most this many workers. No run can end before test_pipeline.py, which one worker runs
# alone (about a third of the serial suite): 4 workers already finish the rest in that time.
MAX_WORKERS = 4


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """-n auto: the CPUs this process may run on (xdist's own count, psutil's physical cores,
    ignores a container's CPU set), at most MAX_WORKERS; PYTEST_XDIST_AUTO_NUM_WORKERS still decides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def pytest_collection_modifyitems(config, items):
    """Under xdist, HEAVY_FIRST's files first (the order is the workers' queue with
    --dist loadfile --no-loadscope-reorder); a single process keeps the collection order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        rank = {f: i for i, f in enumerate(HEAVY_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(HEAVY_FIRST)))


# ---- shared artifacts: built once per run, only read by the tests that take them --------------------
@pytest.fixture(scope="session")
def micro_world(tmp_path_factory) -> Path:
    """The micro profile's world base (configs/micro.yaml's world group over params.yaml: corpus,
    tokenizer, the two targets), as build_world_base writes it. Read only: a test that writes
    does so in its own folder."""
    from shared import shared_dir

    def build(out: Path) -> None:
        from draftport.plan.params import load
        from draftport.world import build_world_base

        root = Path(__file__).resolve().parents[1]
        build_world_base(
            out / "w", load(root / "configs/micro.yaml", base=root / "params.yaml")["world"], progress=False
        )

    return shared_dir(tmp_path_factory, "micro-world", build) / "w"


@pytest.fixture(scope="session")
def micro_upstream(tmp_path_factory) -> Path:
    """A copy of the repository on the micro profile (repo.micro_copy, no edit), a git repository
    with its first commit, whose steps up to the trainings' data ran under Snakemake: world, fetch,
    features_new, features_eval, features_monitor, vocab_new (dvc.lock written by the run). Read
    only: a test copies it (shutil.copytree(..., symlinks=True), resume_copy.Copy.clone) and works
    in its copy."""
    from shared import shared_dir

    def build(out: Path) -> None:
        from repo import BIN, micro_copy
        from resume_copy import Copy

        micro_copy(out / "repo")
        c = Copy(out / "repo")
        c.run("git", "init", "-q")
        if not (c.path / ".dvc").is_dir():
            c.run(BIN / "dvc", "init", "-q")
        c.run("git", "add", "-A")
        c.run("git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "test copy")
        c.run(BIN / "snakemake", "--cores", "2", "features_new", "features_eval", "features_monitor", "vocab_new")

    return shared_dir(tmp_path_factory, "micro-upstream", build) / "repo"
