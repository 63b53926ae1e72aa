"""HTML and CSV tables: the report's, and the compare step's rendering of compare_drafters'
report (compare.html, config.csv, weights.csv). No plotting here: the compare step needs none."""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return "" if v is None else str(v)


def html_table(rows: list[dict], cols: list[str], headers: list[str] | None = None, mark: str | None = None) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in (headers or cols))
    body = []
    for r in rows:
        cls = ' class="bad"' if mark and r.get(mark) is False else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def write_csv(path: Path, rows: list[dict], cols: list[str]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow([_fmt(r.get(c)) for c in cols])


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
p.lead{color:#555;margin:0 0 14px} table{border-collapse:collapse;font-size:13px;margin:6px 0 12px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:right} th{background:#f4f6f8}
td:first-child,th:first-child,td:last-child{text-align:left} tr.bad td{background:#fdecea}
.verdict{padding:8px 12px;border-radius:4px;margin:6px 0} .ok{background:#e8f5e9} .no{background:#fdecea}
img{max-width:100%;border:1px solid #eee;margin:4px 0} .grid{display:grid;grid-template-columns:1fr 1fr;gap:10px}
.kpi{display:inline-block;margin:0 18px 8px 0;padding:8px 14px;background:#f4f6f8;border-radius:6px}
.kpi b{display:block;font-size:20px} small{color:#666}
"""


def compare_tables(rep: dict, out_dir: Path) -> None:
    """compare.html (+ config.csv, weights.csv) from compare_drafters' report."""
    out_dir = Path(out_dir)
    write_csv(out_dir / "config.csv", rep["config"], ["field", "src", "dst", "match", "note"])
    write_csv(
        out_dir / "weights.csv",
        rep["weights"],
        ["name", "src_shape", "dst_shape", "src_dtype", "dst_dtype", "status", "note"],
    )
    (out_dir / "compare.html").write_text(_page("Source drafter vs the new target's layout", compare_html(rep)))


def compare_html(rep: dict) -> str:
    v, verdict = rep["vocab"], rep["verdict"]
    ok = verdict["compatible_architecture"]
    parts = [
        f'<div class="verdict {"ok" if ok else "no"}"><b>{"Compatible" if ok else "Incompatible"} '
        f"architecture.</b> {html.escape('; '.join(verdict['reasons']))}</div>",
        f"<p><b>Vocab action:</b> {html.escape(verdict['vocab_action'])}</p>",
    ]
    if verdict["warnings"]:
        parts.append("<ul>" + "".join(f"<li>{html.escape(w)}</li>" for w in verdict["warnings"]) + "</ul>")
    parts.append(f"<p>{html.escape(v.get('explanation') or '')}</p>")
    vrows = [
        {"what": k, "value": v.get(k)}
        for k in ("draft_vocab_size", "overlap", "jaccard", "src_only", "dst_only", "positions_differ", "identical")
    ]
    parts.append(html_table(vrows, ["what", "value"], ["draft map", "src vs dst"]))
    parts.append("<h3>Config</h3>" + html_table(rep["config"], ["field", "src", "dst", "match", "note"], mark="match"))
    parts.append(
        "<h3>Weights (from the safetensors headers)</h3>"
        + html_table(rep["weights"], ["name", "src_shape", "dst_shape", "src_dtype", "dst_dtype", "status", "note"])
    )
    return "\n".join(parts)


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )
