"""The repository under test: its root, Snakemake run in it, and copies of it on the micro profile
(what the pipeline tests run the tools in)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from draftport.plan import params

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def smk(*args, cwd=ROOT, check=True):
    """snakemake *args in cwd (the repository by default); its output captured."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    r = subprocess.run([str(BIN / "snakemake"), *args], cwd=cwd, capture_output=True, text=True, env=env)
    if check and r.returncode:
        raise AssertionError(r.stdout[-3000:] + r.stderr[-3000:])
    return r


def copy_repo(dst: Path) -> None:
    """The repository's tracked and unignored files, less artifacts/ and logs/, copied to dst."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file() and not f.startswith(("artifacts/", "logs/")):
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def micro_copy(dst: Path, edit=None) -> dict:
    """A copy of the repository whose params.yaml is the micro profile merged in (DVC tracks
    params.yaml, so both tools see it), changed by edit(cfg) first; returns those params."""
    copy_repo(dst)
    cfg = params.merge(params.read_yaml(dst / "params.yaml"), params.read_yaml(dst / "configs/micro.yaml"))
    if edit is not None:
        edit(cfg)
    (dst / "params.yaml").write_text("# the micro profile, merged (test copy)\n" + yaml.safe_dump(cfg, sort_keys=False))
    return cfg
