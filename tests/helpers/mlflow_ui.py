"""The MLflow UI in a real browser, for the tests that open it: `draftport ui` serving a store
(ui_session), Debian's chromium driven by playwright (never a browser playwright downloads), and
readers of what a person sees on the UI's pages, from the DOM: the compare page's metric row per
run, the metric page's chart (legend, traces, axis) and its table, the runs table with the
curves' parent row expanded.

Without chromium or playwright the tests skip, or fail under DRAFTPORT_REQUIRE_BROWSER=1 (CI).
`python tests/helpers/mlflow_ui.py OUT_DIR [draftport ui options]`, in a folder whose store holds the
runs (after `make phase1` and `snakemake curves`), writes the README's screenshots."""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
CHROMIUM = os.environ.get("DRAFTPORT_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
REQUIRE = bool(os.environ.get("DRAFTPORT_REQUIRE_BROWSER"))
# As root, no sandbox; and none of chromium's own traffic (this machine reaches no outside host)
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WAIT_MS = 60_000


def need_browser() -> None:
    """Skip (fail under DRAFTPORT_REQUIRE_BROWSER) without playwright's sync API or chromium."""
    why = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        why = "playwright is not installed (pip install -c requirements.lock -e '.[test]')"
    if why is None and not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        why = f"no chromium at {CHROMIUM} (apt-get install -y chromium)"
    if why:
        if REQUIRE:
            pytest.fail(f"DRAFTPORT_REQUIRE_BROWSER is set but {why}")
        pytest.skip(why)


@contextmanager
def browser():
    # lazy: playwright is optional (the test extra); need_browser skips without it
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def new_page(b, width=1600, height=1000):
    """A page in a fresh context: no local storage, so the UI starts as a new user's does."""
    page = b.new_context(viewport={"width": width, "height": height}).new_page()
    page.set_default_timeout(WAIT_MS)
    return page


@contextmanager
def ui_session(cwd: Path, env: dict, port: int, *args: str, timeout: float = 300):
    """`draftport ui --json --port PORT` in cwd: yields its report (the addresses) once the server
    answers; then Ctrl-C (SIGINT), which must stop it and its server with exit status 0."""
    proc = subprocess.Popen(
        [str(BIN / "draftport"), "ui", "--json", "--port", str(port), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in proc.stdout] + [lines.put(None)], daemon=True).start()
    text, deadline = "", time.monotonic() + timeout
    report = None
    while report is None:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:
            proc.kill()
            raise AssertionError(f"draftport ui printed no report (rc {proc.poll()}):\n{text}\n{proc.stderr.read()}")
        text += line
        if line.rstrip() == "}":
            report = json.loads(text)
    try:
        yield report
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        err = proc.stderr.read()
    assert rc == 0 and "stopped" in err, (rc, err[-3000:])  # checked when the body passed


def close_overlays(page) -> None:
    """First-visit tips and the assistant's side panel: closed, as a person would (where shown)."""
    for loc in (
        page.get_by_role("button", name="Got it"),
        page.locator('button[data-component-id="mlflow.assistant.chat_panel.close"]'),
    ):
        for el in loc.all():
            if el.is_visible():
                el.click(timeout=5000)
                page.wait_for_timeout(300)


# ---- the compare page: #/compare-runs ----------------------------------------------------------
_COMPARE_JS = """(metric) => {
  const table = document.querySelector('table.mlflow-compare-run-table');
  const row = [...table.querySelectorAll('tr')].find(tr => tr.querySelector('th')?.textContent.trim() === 'Run Name:');
  const names = [...row.querySelectorAll('td')].map(td => td.textContent.trim());
  const ids = [...table.querySelectorAll('thead th a')].map(a => a.textContent.trim());
  const link = [...document.querySelectorAll('a[title="Plot chart"]')].find(a => a.textContent.trim() === metric);
  if (!link) return {names, ids, values: null, href: null};
  const cell = link.parentElement, top = cell.style.top;
  let box = cell.closest('[role=grid]');
  while (box && box.querySelectorAll('[role=grid]').length < 2) box = box.parentElement;
  const grid = [...box.querySelectorAll('[role=grid]')].find(g => !g.contains(cell));
  const values = [...grid.querySelectorAll('div[style]')].filter(d => d.style.top === top && d.style.left !== '')
    .sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left)).map(d => d.textContent.trim());
  return {names, ids, values, href: link.getAttribute('href')};
}"""


def compare_metric(page, url: str, metric: str = "accept_length") -> dict:
    """The compare page's run names, run ids and the metric's row (as shown, one value per run);
    the metrics grid renders only the rows in view, so it is scrolled until the row shows."""
    page.goto(url)
    page.wait_for_selector("table.mlflow-compare-run-table")
    page.wait_for_selector('a[title="Plot chart"]')
    got = page.evaluate(_COMPARE_JS, metric)
    grid = page.locator('a[title="Plot chart"]').first.locator("xpath=ancestor::*[@role='grid'][1]")
    for _ in range(200):
        if got["values"] is not None:
            break
        grid.evaluate("g => { g.scrollTop += 90; }")
        page.wait_for_timeout(100)
        got = page.evaluate(_COMPARE_JS, metric)
    return got


# ---- the metric page: #/metric (tau by step) ---------------------------------------------------
_CHART_JS = """(metric) => {
  const traces = [...document.querySelectorAll('.js-plotly-plot .scatterlayer .trace')].map(t => ({
    color: t.querySelector('.lines path')?.style.stroke, points: t.querySelectorAll('.points path').length}));
  const legend = [...document.querySelectorAll('span')].filter(s => s.textContent.trim().endsWith(` (${metric})`)
    && s.previousElementSibling && s.previousElementSibling.tagName.toLowerCase() === 'svg')
    .map(s => ({name: s.textContent.trim().slice(0, -metric.length - 3),
                color: s.previousElementSibling.querySelector('path')?.style.stroke}));
  const xtitle = [...document.querySelectorAll('.js-plotly-plot .xtitle')].map(t => t.textContent.trim());
  return {traces, legend, xtitle};
}"""


def metric_chart(page, url: str, metric: str = "accept_length") -> dict:
    """The metric page's chart (plotly): its legend (run name, colour), its traces (colour,
    points drawn), the x-axis title; and the table under it: per run, latest/min/max as
    (value, step)."""
    page.goto(url)
    page.wait_for_selector(".js-plotly-plot .scatterlayer .trace .points path")
    page.get_by_text(re.compile(r"\(step=\d+\)$")).first.wait_for()
    page.wait_for_timeout(500)
    got = page.evaluate(_CHART_JS, metric)
    rows = {}
    for tr in page.locator("table tbody tr").all():
        cells = [c.strip() for c in tr.locator("td").all_inner_texts()]
        vals = [re.fullmatch(r"(\S+) \(step=(\d+)\)", c) for c in cells[1:4]]
        if len(cells) >= 4 and all(vals):
            rows[cells[0]] = [(float(m.group(1)), int(m.group(2))) for m in vals]
    return {**got, "rows": rows}


# ---- the runs table: #/experiments/<id>/runs ----------------------------------------------------
RUN_NAME_CELL = '[role=gridcell][col-id="attributes.`Run Name`"]'


def run_names(page) -> list[str]:
    """The run names listed, top to bottom (ag-grid's rows by row-index, not DOM order)."""
    return page.evaluate(
        """(sel) => [...document.querySelectorAll('[role=row][row-index]')]
        .map(r => [Number(r.getAttribute('row-index')), r.querySelector(sel)?.textContent.trim()])
        .filter(([, name]) => name).sort((a, b) => a[0] - b[0]).map(([, name]) => name)""",
        f"{RUN_NAME_CELL} a",
    )


def runs_table(
    page, url: str, parent: str, metric: str | None = "accept_length", expect: set[str] | None = None
) -> dict:
    """The runs table as it opens, then with the parent run's row expanded (its nested runs
    under it), then with the metric's column added (Columns > Metrics): the run names listed
    before and after, and the metric's cell by run id."""
    page.goto(url)
    page.wait_for_selector(f"{RUN_NAME_CELL} a")
    if expect:  # the runs arrive after the table: wait until these are listed
        page.wait_for_function(
            """([sel, want]) => want.every(w => [...document.querySelectorAll(sel)]
                                  .some(a => a.textContent.trim() === w))""",
            arg=[f"{RUN_NAME_CELL} a", sorted(expect)],
        )
    close_overlays(page)
    before = run_names(page)
    cell = page.locator(RUN_NAME_CELL).filter(has=page.get_by_role("link", name=parent, exact=True))
    cell.locator("button").first.click()
    page.wait_for_function(
        "([sel, n]) => document.querySelectorAll(sel).length > n", arg=[f"{RUN_NAME_CELL} a", len(before)]
    )
    page.wait_for_timeout(500)
    after = run_names(page)
    values = {}
    if metric:
        page.locator('button[data-component-id*="runscolumnselector"]').click()
        page.get_by_placeholder("Search columns").fill(metric)
        node = page.locator(".du-bois-light-tree-treenode").filter(
            has=page.locator(".du-bois-light-tree-title", has_text=re.compile(f"^{re.escape(metric)}$"))
        )
        node.locator(".du-bois-light-tree-checkbox").first.click()
        page.keyboard.press("Escape")
        col = f'[role=gridcell][col-id="metrics.`{metric}`"]'
        page.wait_for_selector(col)
        page.wait_for_timeout(500)
        by_row: dict = {}  # ag-grid splits a row (pinned columns, the rest): joined by row-index
        for row in page.locator("[role=row][row-index]").all():
            cells = by_row.setdefault(row.get_attribute("row-index"), {})
            link = row.locator(f"{RUN_NAME_CELL} a")
            if link.count():
                cells["id"] = link.first.get_attribute("href").rstrip("/").split("/")[-1]
            val = row.locator(col)
            if val.count():
                cells["value"] = val.first.inner_text().strip()
        values = {c["id"]: c.get("value") for c in by_row.values() if "id" in c}
    return {"before": before, "after": after, "values": values}


def landing(page, url: str) -> dict:
    """An experiment's page as a new user lands on it; if that is not the runs, the switch the
    README names ("Model training") is clicked: where each lands, and the runs listed then."""
    page.goto(url)
    page.wait_for_function("() => /#\\/experiments\\/[^/]+\\/\\w+/.test(location.hash)")
    page.wait_for_timeout(1500)
    first = page.url
    if "/runs" not in first:
        close_overlays(page)
        page.get_by_text("Model training", exact=True).first.click()
        page.wait_for_function("() => location.hash.includes('/runs')")
    page.wait_for_selector(f"{RUN_NAME_CELL} a")
    return {"first": first, "then": page.url, "runs": run_names(page)}


def _drag_column(page, col_id: str, dx: float) -> None:
    """Resize a runs-table column by its header's handle, as a person drags it."""
    handle = page.locator(f'.ag-header-cell[col-id="{col_id}"] .ag-header-cell-resize').first
    box = handle.bounding_box()
    if box:
        y = box["y"] + box["height"] / 2
        page.mouse.move(box["x"] + 2, y)  # its left half: the next header overlaps the rest
        page.mouse.down()
        page.mouse.move(box["x"] + 2 + dx, y, steps=10)
        page.mouse.up()


def screenshots(report: dict, out: Path) -> list[Path]:
    """The README's pictures: the phases' compare view, the tau chart, the runs table (curves
    expanded, accept_length added)."""
    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with browser() as b:
        page = new_page(b, 1500, 930)
        compare_metric(page, report["urls"]["compare"])
        close_overlays(page)
        for section in ("Visualizations", "Parameters"):  # folded: run details and metrics in view
            page.get_by_text(section, exact=True).first.click()
            page.wait_for_timeout(500)
        shots.append(out / "mlflow_compare.png")
        page.screenshot(path=str(shots[-1]))
        page = new_page(b, 1500, 800)
        if "tau_by_step" in report["urls"]:
            metric_chart(page, report["urls"]["tau_by_step"])
            close_overlays(page)
            shots.append(out / "mlflow_tau.png")
            page.screenshot(path=str(shots[-1]))
        page = new_page(b, 1500, 820)
        runs_table(page, report["urls"]["runs"], "curves")
        close_overlays(page)
        _drag_column(page, "attributes.`Run Name`", 110)  # the nested runs' names in full
        _drag_column(page, "attributes.`Dataset`", -200)  # none here: room for accept_length
        page.mouse.move(5, 5)
        page.wait_for_timeout(500)
        shots.append(out / "mlflow_runs.png")
        page.screenshot(path=str(shots[-1]))
    return shots


if __name__ == "__main__":
    from mlflow_server import free_port

    with ui_session(Path.cwd(), dict(os.environ), free_port(), *sys.argv[2:]) as rep:
        for f in screenshots(rep, Path(sys.argv[1])):
            print(f)
