"""The kimi-k2.5 profile plans the whole game plan with every job's GPUs, memory, runtime and
command (Snakemake dry run, nothing runs); the embedded profile's commands stay plain `python`."""

import importlib.util
import re

import pytest
import yaml
from repo import ROOT, smk

from draftport.plan import cluster, params, registry

KIMI = "configs/kimi-k2.5.yaml"
JOBS = {
    "fetch",
    "features_new",
    "features_eval",
    "vocab_new",
    "features_phase2",
    "features_monitor",
    "compare",
    "eval_phase0",
    "train_phase1_scratch",
    "eval_phase1_scratch",
    "train_phase1",
    "eval_phase1",
    "train_phase2",
    "eval_phase2",
}
TRAINING = {"train_phase1_scratch", "train_phase1", "train_phase2"}


def plan(*args) -> dict:
    """rule -> {resources, command} from `snakemake -n -p` output."""
    r = smk("-n", "-p", "--forceall", *args)
    out = r.stdout + r.stderr
    jobs = {}
    for block in out.split("\nrule ")[1:]:
        name = block.split(":", 1)[0].strip()
        res = re.search(r"resources: (.*)", block)
        cmd = re.search(r"Shell command: (.*)|\n    (python|torchrun) (.*)", block)
        resources = dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {}
        jobs[name] = {
            "resources": resources,
            "command": (cmd.group(0).split("Shell command: ")[-1].strip() if cmd else ""),
        }
    return jobs


@pytest.fixture(scope="module")
def kimi():
    return plan("phase2", "--configfile", KIMI)


def test_kimi_profile_plans_every_job_without_the_embedded_world(kimi):
    assert set(kimi) - {"phase2"} == JOBS  # no world: the targets and the source come from the hub


def test_every_kimi_job_carries_its_resources(kimi):
    cfg = params.load(ROOT / KIMI, base=ROOT / "params.yaml")
    for name, job in kimi.items():
        if name not in JOBS:
            continue  # the target rule (no command, no resources)
        want = cluster.snakemake_resources(cfg, name)
        got = {k: int(job["resources"][k]) for k in ("gpu", "mem_mb", "runtime")}
        assert got == want, name
    assert int(kimi["features_new"]["resources"]["gpu"]) == 8  # vLLM, tensor parallel 8
    assert int(kimi["compare"]["resources"]["gpu"]) == 0  # headers only


def test_kimi_training_rules_run_under_torchrun_one_process_per_gpu(kimi):
    for name in TRAINING:
        cmd = kimi[name]["command"]
        assert cmd.startswith(f"torchrun --standalone --nproc_per_node 8 scripts/{name}.py --params "), cmd
        assert " --input features=" in cmd and " --input vocab=" in cmd
        assert cmd.endswith(f"--logfile logs/{name}.log")
    for name in JOBS - TRAINING:
        assert kimi[name]["command"].startswith(f"python scripts/{name}.py --params "), name


def test_kimi_profile_reads_the_reference_and_the_scale_paths():
    cfg = params.load(ROOT / KIMI, base=ROOT / "params.yaml")
    assert cfg["reference"]["repo_id"] == "AQ-MedAI/Kimi-K25-eagle3"
    f = cfg["features"]
    assert (f["engine"], f["tensor_parallel_size"], f["regenerate"]) == ("vllm", 8, "openai")
    assert (f["aux_layer_ids"], f["aux_convention"]) == ([2, 30, 58], "sglang")
    assert cfg["vocab_new"]["draft_vocab_size"] == 32000
    assert all(cfg[g]["train"]["ttt_steps"] == 7 for g in ("phase1", "phase2"))


def test_embedded_profile_plans_plain_python_on_no_gpu():
    jobs = plan("phase2")
    assert "world" in jobs
    cfg = params.load(base=ROOT / "params.yaml")
    for name, job in jobs.items():
        if name == "phase2":
            continue  # the target rule
        assert job["command"] == registry.command(registry.BY_NAME[name], cfg), name
        assert job["command"].startswith(f"python scripts/{name}.py "), name
        assert int(job["resources"]["gpu"]) == 0


def test_torchrun_only_for_training_rules_with_gpus():
    base = params.read_yaml(ROOT / "params.yaml")
    bad = params.merge(base, {"resources": {"compare": {"torchrun": True, "gpu": 1}}})
    with pytest.raises(params.ParamsError, match=r"resources\.compare\.torchrun: only training rules"):
        params.validate(bad)
    bad = params.merge(base, {"resources": {"train_phase1": {"torchrun": True}}})
    with pytest.raises(params.ParamsError, match=r"resources\.train_phase1\.torchrun: needs gpu >= 1"):
        params.validate(bad)


def test_slurm_profile_plans_with_the_rules_resources():
    """profiles/slurm/config.yaml parsed by Snakemake itself; the executor is swapped for the
    dry run only when the slurm plugin is not installed (planning needs no plugin code then)."""
    prof = yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())
    assert prof["executor"] == "slurm" and prof["jobs"] >= 1
    args = ["phase2", "--configfile", KIMI, "--profile", "profiles/slurm"]
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        args += ["--executor", "dryrun"]
    jobs = plan(*args)
    assert set(jobs) - {"phase2"} == JOBS
    assert int(jobs["train_phase2"]["resources"]["gpu"]) == 8


def test_the_readme_spelling_of_the_kimi_plan_works():
    """`snakemake -n --configfile=configs/kimi-k2.5.yaml phase2`, as the README writes it: with the
    `=`, the target stays a target (a bare --configfile would take `phase2` for a file)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"snakemake -n --configfile={KIMI} phase2" in readme
    r = smk("-n", f"--configfile={KIMI}", "phase2")
    assert "phase2" in r.stdout and "This was a dry-run" in r.stdout
