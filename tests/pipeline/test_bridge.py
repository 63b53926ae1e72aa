"""The Snakemake internals draftport.pipeline.bridge relies on ([S1]..[S4] in its docstring), checked
against the installed Snakemake on a tiny real workflow: an upgrade that moves one fails here,
not silently in a user's resume or `dvc repro`."""

import json
import os
import subprocess
import sys
from pathlib import Path

from draftport.pipeline import bridge

BIN = Path(sys.executable).parent

SNAKEFILE = """
import json

rule all:
    input: "artifacts/x/metrics.json"

rule x:
    output: "artifacts/x/metrics.json"
    params: values={"a": 1}
    shell: "mkdir -p artifacts/x && echo '{{}}' > {output}"

onstart:
    json.dump({
        "locks": [str(f) for f in workflow.persistence._lockfile.values()],             # [S1]
        "needrun": sorted(j.rule.name for j in workflow.dag.needrun_jobs()),           # [S3]
        "jobs": sorted((j.rule.name, bool(j.rule.shellcmd)) for j in workflow.dag.jobs),
        "locks_exist": [Path(f).is_file() for f in workflow.persistence._lockfile.values()],
    }, open("seen.json", "w"))
"""


def test_snakemake_internals_the_bridge_uses(tmp_path):
    (tmp_path / "Snakefile").write_text("from pathlib import Path\n" + SNAKEFILE)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
    subprocess.run(
        [str(BIN / "snakemake"), "--cores", "1", "--quiet"], cwd=tmp_path, env=env, check=True, capture_output=True
    )
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["locks"] and all(seen["locks_exist"])  # [S1]: the lock files this run holds
    assert seen["needrun"] == ["all", "x"]  # [S3]
    assert seen["jobs"] == [["all", False], ["x", True]]
    # [S2]: the record of the step's output, in the layout drop_snakemake_records decodes
    meta = tmp_path / ".snakemake" / "metadata"
    assert bridge.drop_snakemake_records("x", root=str(meta)) == 1
    assert not [p for p in meta.rglob("*") if p.is_file()]


def test_parsed_workflow_api(tmp_path):
    """[S4] the parsed rules, as the tests read them."""
    (tmp_path / "Snakefile").write_text("from pathlib import Path\n" + SNAKEFILE)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with bridge.snakemake_workflow() as wf:
            rules = {r.name: r for r in wf.rules}
            assert rules["x"].params.values == {"a": 1} and rules["x"].shellcmd
    finally:
        os.chdir(cwd)
