"""The package's import graph: no cycle (function-level imports count: a lazy import only hides
a cycle), and the modules the Snakefile and the header-only commands load stay torch-free."""

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "draftport"


def import_graph() -> dict[str, set[str]]:
    """module -> the draftport modules it imports anywhere in its file."""
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph = {}
    for name, p in mods.items():
        pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    m = ".".join(base + ([node.module] if node.module else []))
                else:
                    m = node.module or ""
                cands = [m] + [f"{m}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            deps |= {c for c in cands if c in mods and c != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_draftport():
    graph = import_graph()
    assert "draftport.pipeline.runner" in graph and len(graph) > 30
    assert cycles(graph) == []


BASE = {"errors", "files", "progress"}  # under every folder


def layers() -> list[str]:
    """The folders' order, as docs/architecture.md writes it (the block after `<!-- layers -->`)."""
    text = (SRC.parent / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers -->", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def floor(module: str) -> str:
    """draftport.model.fast.loss -> model; draftport.cli -> cli; draftport.errors -> base."""
    top = module.split(".")[1]
    return "base" if top in BASE else top


def against_the_order(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Imports from a folder listed after the importer's (the base imports nothing above it)."""
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod == "draftport":
            continue
        src = floor(mod)
        for dep in sorted(deps):
            dst = floor(dep)
            if dst == src or dst == "base" or dep == "draftport":
                continue
            if src == "base" or order.index(dst) > order.index(src):
                bad.append(f"{mod} imports {dep}")
    return bad


def test_the_order_finder_finds_an_upward_import():
    order = ["plan", "model", "data"]
    assert against_the_order(
        {"draftport.model.x": {"draftport.data.y"}, "draftport.data.y": {"draftport.model.x"}}, order
    ) == ["draftport.model.x imports draftport.data.y"]
    assert against_the_order({"draftport.errors": {"draftport.plan.p"}}, order) == [
        "draftport.errors imports draftport.plan.p"
    ]


def test_folders_import_one_way_as_the_architecture_page_orders_them():
    graph = import_graph()
    order = layers()
    folders = {floor(m) for m in graph if m != "draftport"} - {"base"}
    assert folders == set(order), folders ^ set(order)
    assert against_the_order(graph, order) == []


def test_snakefile_side_and_header_commands_do_not_import_torch():
    code = (
        "import sys; import draftport.pipeline.bridge, draftport.plan.registry, draftport.plan.params, "
        "draftport.plan.cluster, draftport.outputs.compare, draftport.cli; print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


def test_a_wheel_carries_every_module_and_the_in_venv_scripts(tmp_path):
    """A non-editable `pip install .` gets the whole package: the steps, the engines and the
    scripts that run inside the vLLM venv (found next to the package, never in the repo)."""
    root = SRC.parent
    work = tmp_path / "tree"
    shutil.copytree(SRC, work / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(root / f, work / f)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(work),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "wheel").glob("draftport-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {str(p.relative_to(SRC)) for p in PKG.rglob("*.py")}
    assert want <= names, sorted(want - names)
    assert "draftport/engines/vllm/runners/online_vllm.py" in names and "draftport/plan/registry.py" in names
    assert {"draftport/profile/rates.json", "draftport/plan/defaults.yaml"} <= names
    # installed, outside any checkout: the estimate of a profile from the packaged rates and params
    site, away = tmp_path / "site", tmp_path / "away"
    zipfile.ZipFile(wheel).extractall(site)
    away.mkdir()
    shutil.copy(root / "configs" / "kimi-k2.5.yaml", away / "kimi.yaml")
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, draftport; from draftport.cli import main; "
            f"assert draftport.__file__.startswith({str(site)!r}), draftport.__file__; sys.exit(main(sys.argv[1:]))",
            "estimate",
            "--configfile",
            "kimi.yaml",
        ],
        cwd=away,
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "measured: training NVIDIA H200" in r.stdout
        and "benchmarks/results/2026-12-03-h200-train-kimi.json" in r.stdout
    )
    assert "capture rate" in r.stdout and "stated" not in r.stdout.split("capture rate")[1].split("\n")[0]
