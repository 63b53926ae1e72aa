"""docs/architecture.md stays the house's map: its step table is the registry's, every module is
listed there, and every module's first line says what it holds."""

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

from draftport.pipeline.runner import function_of
from draftport.plan import registry

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _load_docgen():
    spec = importlib.util.spec_from_file_location("docgen", ROOT / "tools" / "docgen.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def modules():
    for p in sorted((ROOT / "src" / "draftport").rglob("*.py")):
        yield ".".join(p.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__"), p


def test_the_docs_generated_blocks_are_the_code():
    """The step table (the registry) and the module table (each module's first paragraph)."""
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "docgen.py"), "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert registry.table_markdown() in DOC.read_text()


def test_docgen_renders_a_stale_block_anew():
    docgen = _load_docgen()
    stale = "<!-- generated: steps -->\n| old |\n<!-- end: steps -->\n"
    assert docgen.render(stale) != stale
    assert registry.table_markdown() in docgen.render(stale)


def test_every_module_has_a_first_line_and_a_row_in_the_docs():
    doc = DOC.read_text()
    for name, path in modules():
        first = (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
        assert first, f"{path}: no docstring saying what the module holds"
        assert f"| `{name}` |" in doc, f"docs/architecture.md: no row for {name}"


def test_every_registry_row_has_its_script_and_function():
    for s in registry.STEPS:
        script = (ROOT / "scripts" / f"{s.name}.py").read_text()
        assert f'main("{s.name}")' in script, s.name
        assert callable(function_of(s)), s.name
