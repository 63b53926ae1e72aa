"""The documentation builds and its commands run as written.

The site (mkdocs.yml, docs/) builds with `mkdocs build --strict`: a broken link or anchor, a page
missing from the nav or any other warning fails. Every command line in a ```bash, ```sh or
```console block of README.md, CONTRIBUTING.md and docs/*.md runs in a cheap form, from the
repository root, exactly as written otherwise:

- `draftport X ...`: its whole argument line is parsed by the live CLI (an option that does not
  exist, a missing required one or a bad value fails), and `draftport X --help` runs;
- `snakemake ...`: a dry run (`-n` added) that must plan without error; every snakemake line must
  say `--cores`;
- `make X`: the Makefile has target X (`make -n X`);
- `dvc ...`: the whole line is parsed by DVC's own parser;
- `python -m M ...`, `python FILE ...`, `pip X`, `mkdocs X`: `--help`.

Commands that cannot run here are checked in the same cheap form only: a GPU launch (the H200
benchmarks, a training on 8 GPUs), `--push` to the hub, a slurm submission. Commands of other
programs that are not installed here (an engine's server: vllm, sglang, speculators) stand in
```text blocks, which are not run. Output lines of ```console blocks (those without `$ `) are
not commands.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import typer.main
import yaml

from draftport.cli import app

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(bash|sh|console)[^\n]*\n(.*?)^```", re.S | re.M)
# A profile a page names as a placeholder for yours: planned with a real one
# profiles a walkthrough writes before it plans them: planned dry as the profile they come from
# (micro-dsk is init's profile of the micro-deepseek pair: tests/pipeline/test_own_pair.py runs it)
PLACEHOLDERS = {
    "configs/NAME.yaml": "configs/micro.yaml",
    "configs/X.yaml": "configs/micro.yaml",
    "configs/micro-dsk.yaml": "configs/micro-deepseek.yaml",
}
SEPARATORS = {"&&", "||", ";", "|"}


def _lines(lang: str, body: str):
    """(offset in the block, command text) of each command line, continuation lines joined."""
    pending, start = "", 0
    for i, raw in enumerate(body.splitlines()):
        line = raw.rstrip()
        if not pending:
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every command in the docs' command blocks."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            first = text.count("\n", 0, m.start(2)) + 1
            for offset, line in _lines(m.group(1), m.group(2)):
                where = f"{doc.relative_to(ROOT)}:{first + offset}"
                words = shlex.split(line, comments=True)
                argv: list[str] = []
                for w in [*words, ";"]:
                    if w in SEPARATORS:
                        if argv:
                            out.append((where, argv))
                        argv = []
                    elif not argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w):
                        continue  # an environment variable for the command (HF_TOKEN=...)
                    else:
                        argv.append(w)
    return out


COMMANDS = commands()


def _run(call: tuple[str, ...]) -> str:
    """'' when the call exits 0, else what it said."""
    r = subprocess.run(list(call), cwd=ROOT, capture_output=True, text=True, timeout=300)
    return "" if r.returncode == 0 else f"{' '.join(call)}: exit {r.returncode}\n{r.stdout[-1500:]}{r.stderr[-1500:]}"


# ---- each program: the checks made in this process, and the calls it needs (run once, side by side)
def _draftport(argv: list[str]) -> list[tuple[str, ...]]:
    """The whole line parsed by the live CLI (nothing runs), then `draftport X --help`."""
    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="draftport")
    if argv[1:] in ([], ["--help"], ["--version"]):
        return [(str(BIN / "draftport"), "--help")]
    name, *rest = argv[1:]
    cmd = group.get_command(root, name)
    assert cmd is not None, f"draftport has no command {name!r} (commands: {', '.join(group.commands)})"
    if "--help" not in rest:
        cmd.make_context(name, rest, parent=root)  # raises on an unknown option, a missing one, a bad value
    return [(str(BIN / "draftport"), name, "--help")]


def _snakemake(argv: list[str]) -> list[tuple[str, ...]]:
    args = [functools.reduce(lambda a, kv: a.replace(*kv), PLACEHOLDERS.items(), a) for a in argv[1:]]
    assert "--cores" in args or any(a.startswith("--cores=") for a in args) or "-c" in args, (
        "every snakemake command in the docs says --cores"
    )
    if "--report" in args:  # a report needs a finished run: plan the same targets instead
        i = args.index("--report")
        del args[i : i + 2]
    if "--profile" in args:  # its executor plugin may be missing here: the profile must read, then plan dry
        i = args.index("--profile")
        profile = ROOT / args[i + 1] / "config.yaml"
        assert profile.is_file(), f"{profile}: no such profile"
        assert isinstance(yaml.safe_load(profile.read_text()), dict), f"{profile}: not a mapping"
        del args[i : i + 2]
    if "--executor" in args:  # dry runs plan with the local executor's resources
        i = args.index("--executor")
        del args[i : i + 2]
    # -n first, once: two lines that differ only in where they say it plan once
    return [(str(BIN / "snakemake"), "-n", *[a for a in args if a not in ("-n", "--dry-run")])]


def _dvc(argv: list[str]) -> list[tuple[str, ...]]:
    from dvc.cli import DvcParserError, parse_args

    try:
        parse_args(argv[1:])
    except (DvcParserError, SystemExit) as e:
        pytest.fail(f"dvc does not parse {' '.join(argv[1:])!r}: {e!r}")
    return []


def _make(argv: list[str]) -> list[tuple[str, ...]]:
    targets = [a for a in argv[1:] if not a.startswith("-")]
    assert targets, "make without a target"
    return [("make", "-n", t) for t in targets]  # fails on a target the Makefile lacks


def _python(argv: list[str]) -> list[tuple[str, ...]]:
    if argv[1] == "-m":
        if argv[2] == "pip" and len(argv) > 3:
            return [(sys.executable, "-m", "pip", argv[3], "--help")]
        return [(sys.executable, "-m", argv[2], "--help")]
    script = ROOT / argv[1]
    assert script.is_file(), f"{argv[1]}: no such script"
    # --help is only harmless where the script parses its arguments
    assert re.search(r"\bargparse\b|\btyper\b", script.read_text()), (
        f"{argv[1]} parses no arguments: --help would run it; name it in prose instead"
    )
    return [(sys.executable, str(script), "--help")]


def _tool_help(argv: list[str]) -> list[tuple[str, ...]]:
    """pip X / mkdocs X: the subcommand's --help."""
    return [(str(BIN / argv[0]), *[a for a in argv[1:2] if not a.startswith("-")], "--help")]


def _source(argv: list[str]) -> list[tuple[str, ...]]:
    assert (ROOT / argv[1]).is_file(), f"{argv[1]}: nothing to source"
    return []


CHECKS = {
    "draftport": _draftport,
    "snakemake": _snakemake,
    "dvc": _dvc,
    "make": _make,
    "python": _python,
    "pip": _tool_help,
    "mkdocs": _tool_help,
    ".": _source,
}


@functools.lru_cache(maxsize=None)
def _results() -> dict[tuple[str, ...], str]:
    """Every call the commands need, each once, a few at a time (they are mostly imports)."""
    calls = set()
    for _, argv in COMMANDS:
        try:
            calls.update(CHECKS[argv[0]](argv))
        except Exception:  # noqa: BLE001 - the command's own test reports it
            pass
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(calls, pool.map(_run, calls)))


def test_the_docs_have_commands():
    programs = {argv[0] for _, argv in COMMANDS}
    assert {"draftport", "snakemake", "make", "dvc", "python"} <= programs, programs


@pytest.mark.parametrize("where,argv", COMMANDS, ids=[f"{w} {' '.join(a)[:60]}" for w, a in COMMANDS])
def test_command_runs_as_written(where, argv):
    check = CHECKS.get(argv[0])
    assert check is not None, (
        f"{where}: no cheap form known for {argv[0]!r}: teach tests/repo/test_docs.py "
        f"one, or put the command in a ```text block if it cannot run here"
    )
    for call in check(argv):
        problem = _results().get(call)
        if problem is None:
            problem = _run(call)
        assert not problem, problem


def test_the_site_builds_strictly(tmp_path):
    """mkdocs build --strict: any warning (a broken link or anchor, a page outside the nav) fails."""
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "WARNING" not in out, out
    for page in ("index.html", "your-own-pair/index.html", "configuration/index.html", "cli/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_links_outside_the_site_point_at_files():
    """README.md and CONTRIBUTING.md are read on GitHub, not built: their relative links are files."""
    for doc in (ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name}: link to {target}, which does not exist"
