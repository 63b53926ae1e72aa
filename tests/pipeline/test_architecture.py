"""docs/architecture.md stays the house's map: its step table is the registry's, every module is
listed there, and every module's first line says what it holds."""

import ast
from pathlib import Path

from draftport.pipeline.runner import function_of
from draftport.plan import registry as R

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def modules():
    for p in sorted((ROOT / "src" / "draftport").rglob("*.py")):
        yield ".".join(p.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__"), p


def test_the_docs_step_table_is_the_registry():
    assert R.table_markdown() in DOC.read_text(), "docs/architecture.md: paste `python -m draftport.plan.registry`"


def test_every_module_has_a_first_line_and_a_row_in_the_docs():
    doc = DOC.read_text()
    for name, path in modules():
        first = (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
        assert first, f"{path}: no docstring saying what the module holds"
        assert f"| `{name}` |" in doc, f"docs/architecture.md: no row for {name}"


def test_every_registry_row_has_its_script_and_function():
    for s in R.STEPS:
        script = (ROOT / "scripts" / f"{s.name}.py").read_text()
        assert f'main("{s.name}")' in script, s.name
        assert callable(function_of(s)), s.name
