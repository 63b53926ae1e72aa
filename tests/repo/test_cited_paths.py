"""Every repository path the code, the docs and the Makefile cite exists: a comment pointing at a
test file that moved, or a page naming a script that was deleted, fails here."""

from __future__ import annotations

import re
import subprocess

from repo import ROOT

# a path into one of the repository's own folders, ending in a file name with an extension or a slash
CITED = re.compile(
    r"(?<![\w./-])((?:src/draftport|tests|benchmarks|docs|configs|scripts|tools|rules|profiles|report|envs)"
    r"/[\w./-]*[\w/])"
)
# a placeholder or a pattern stands for many files: not one path to check
PATTERN = re.compile(r"[<>{}*?\[\]]|NAME|\.\.\.|/$")
# not files of this repository, each for its reason: what a command writes (a results file, a profile
# `draftport init` writes, a fetch's lock), the bad input a doc or test makes up, another project's file
WRITTEN = ("benchmarks/results/",)
NOT_OURS = {
    "configs/micro-dsk.yaml": "written by the walkthrough's `draftport init micro-dsk`",
    "configs/mine.yaml": "written by a test's `draftport init mine`",
    "configs/kimi-k2.5.source.lock.json": "written by the kimi profile's first fetch",
    "configs/nope.yaml": "the missing profile of a bad-input case",
    "configs/typo.yaml": "a bad-input case writes it",
    "configs/bad.yaml": "a bad-input case writes it",
    "configs/x.yaml": "an example name",
    "configs/X.yaml": "an example name",
    "configs/llama3-70B-ealge3.json": "SpecForge's repository",
    "configs/qwen3-30B-A3B-eagle3.json": "SpecForge's repository",
    "benchmarks/FILE": "a placeholder",
    "configs/micro": "the prefix of configs/micro-<arch>.yaml",
}


def cited_paths() -> dict[str, list[str]]:
    """path -> where it is cited (file:line), over the tracked text files."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out: dict[str, list[str]] = {}
    for f in files:
        if (
            f.startswith("benchmarks/results/")
            or not f.endswith((".py", ".md", ".smk", ".yaml", ".yml", ".toml", ".rst"))
            and f not in ("Makefile", "Snakefile", ".ci/run")
        ):
            continue
        for i, line in enumerate((ROOT / f).read_text(errors="replace").splitlines(), 1):
            for m in CITED.finditer(line):
                path = m.group(1).rstrip(".")
                tail = line[m.end() : m.end() + 1]
                if PATTERN.search(path) or tail in "<{*" and tail or path.startswith(WRITTEN):
                    continue
                out.setdefault(path, []).append(f"{f}:{i}")
    return out


def test_the_finder_sees_paths_and_skips_patterns():
    assert CITED.findall("see tests/repo/test_docs.py and docs/decision.md#rules.") == [
        "tests/repo/test_docs.py",
        "docs/decision.md",
    ]
    assert PATTERN.search("benchmarks/results/<date>-h200-train") and PATTERN.search("tests/{model,data}")


def test_every_cited_path_exists():
    paths = cited_paths()
    assert len(paths) > 50
    missing = {
        p: where[:3] for p, where in paths.items() if not (ROOT / p.split("#")[0]).exists() and p not in NOT_OURS
    }
    assert not missing, missing
