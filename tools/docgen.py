"""Regenerate the docs' generated blocks from the code: `python tools/docgen.py` rewrites them in
place, `python tools/docgen.py --check` exits 1 naming each block that differs (a test runs it).

A generated block sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`; everything
around it is hand-written and left as it is."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))

from draftport.plan import registry  # noqa: E402  (after the path: works from a bare checkout)


def modules() -> list[tuple[str, Path]]:
    """Every module of the package, dotted, with its file (packages by their __init__)."""
    out = []
    for p in sorted((SRC / "draftport").rglob("*.py")):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        out.append((name, p))
    return sorted(out)


def first_paragraph(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def module_table() -> str:
    rows = ["| module | holds |", "|---|---|"]
    rows += [f"| `{name}` | {first_paragraph(p).replace('|', '/')} |" for name, p in modules()]
    return "\n".join(rows) + "\n"


GENERATORS = {"steps": registry.table_markdown, "modules": module_table}
# the files that hold generated blocks
FILES = (ROOT / "docs" / "architecture.md",)
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


def render(text: str) -> str:
    def fill(m: re.Match) -> str:
        if m.group(2) not in GENERATORS:
            raise SystemExit(f"unknown generated block {m.group(2)!r} (known: {', '.join(GENERATORS)})")
        return m.group(1) + GENERATORS[m.group(2)]() + m.group(4)
    return BLOCK.sub(fill, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated block is out of date")
    a = ap.parse_args(argv)
    stale = []
    for f in FILES:
        text = f.read_text()
        new = render(text)
        if new == text:
            continue
        if a.check:
            stale.append(f.relative_to(ROOT))
        else:
            tmp = f.with_suffix(f.suffix + ".tmp")
            tmp.write_text(new)
            tmp.replace(f)
            print(f"wrote {f.relative_to(ROOT)}")
    if stale:
        print("out of date (run `python tools/docgen.py`): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
