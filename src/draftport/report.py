"""The pipeline's report: plots (matplotlib) and tables, one page a user would rather look at.

build_report reads every step's metrics.json (and the phases' history.csv) and writes, under
artifacts/report/: tau.png (accept length per phase next to the cost model's projected tok/s and
break-even line), positions.png (acceptance by draft position), loss.png (training curves),
phases.csv / positions.csv (the same numbers; DVC plots read them) and summary.html (everything
on one page, images inlined). compare_tables renders the compare step's report as HTML/CSV.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path
from typing import Any

PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")
LABELS = {"phase0": "Phase 0\nsource as-is", "phase1_scratch": "Phase 1 control\nfrom scratch",
          "phase1": "Phase 1\nfine-tuned", "phase2": "Phase 2\nscaled data"}
COLORS = {"phase0": "#9e9e9e", "phase1_scratch": "#f2a541", "phase1": "#3d7dca", "phase2": "#2a9d5c",
          "old": "#d0d0d0"}


def _read(path) -> Any:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def _history(path) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        return []
    with open(p) as fh:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(fh)]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.spines.top": False, "axes.spines.right": False,
                         "figure.dpi": 110})
    return plt


# ---- plots -----------------------------------------------------------------------------------
def plot_tau(phases: dict, cost: dict, k: int, out: Path, source_on_old: float | None,
             figsize=(9.5, 5.2)) -> None:
    plt = _plt()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    names = [p for p in PHASES if p in phases]
    taus = [phases[p]["accept_length"] for p in names]
    cycle_s = (cost["verify_ms"] + k * cost["draft_ms"]) / 1000.0
    be = cost["baseline_tok_s"] * cycle_s
    fig, ax = plt.subplots(figsize=figsize)
    xs = list(range(len(names)))
    labels = [LABELS[p] for p in names]
    bars = list(zip(xs, taus, [COLORS[p] for p in names], [True] * len(names)))
    if source_on_old is not None:
        xs = [x + 1 for x in xs]
        bars = [(0, source_on_old, COLORS["old"], False)] + [(x + 1, t, c, b) for x, t, c, b in bars]
        labels = ["source on\nold target\n(reference)"] + labels
    top = max(max(t for _, t, _, _ in bars) * 1.3, be * 1.3)
    ax.axhspan(be, top, color="#e8f5e9", zorder=0)
    ax.axhline(be, color="#c0392b", ls="--", lw=1.5, zorder=1)
    for x, t, color, main in bars:
        ax.bar(x, t, color=color, width=0.62, zorder=2, hatch=None if main else "//",
               edgecolor=None if main else "#888")
        text = f"τ {t:.2f}\n{t / cycle_s:.0f} tok/s"
        inside = t - 1.0 > 0.45 * (top - 1.0) * 0.5
        ax.text(x, t - 0.05 if inside else t + 0.04, text, ha="center", va="top" if inside else "bottom",
                fontsize=10, fontweight="bold" if main else "normal", zorder=3,
                color=("white" if main else "#333") if inside else "#222")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(1.0, top)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel("accept length τ (tokens per verify, bonus included)")
    sec = ax.secondary_yaxis("right", functions=(lambda t: t / cycle_s, lambda s: s * cycle_s))
    cycle = (f"verify {cost['verify_ms']:g} ms + {k} × {cost['draft_ms']:g} ms drafts" if cost["draft_ms"]
             else f"{cost['verify_ms']:g} ms per verify cycle")
    sec.set_ylabel(f"projected tok/s ({cycle})")
    sec.spines["right"].set_visible(True)
    ax.legend(handles=[Line2D([], [], color="#c0392b", ls="--", lw=1.5,
                              label=f"break-even τ {be:.2f} = {cost['baseline_tok_s']:g} tok/s without a drafter"),
                       Patch(facecolor="#e8f5e9", edgecolor="#7fb685", label="above it, the drafter pays")],
              loc="upper left", frameon=False, fontsize=9.5, ncol=2)
    ax.set_title("Accept length per phase and what it buys", loc="left", fontweight="bold")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_positions(phases: dict, k: int, out: Path) -> None:
    plt = _plt()
    names = [p for p in PHASES if p in phases]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
    width = 0.8 / max(len(names), 1)
    for j, p in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(k)]
        a1.bar(xs, [phases[p].get(f"accept_rate_pos_{i}", 0) for i in range(k)], width=width,
               color=COLORS[p], label=LABELS[p].replace("\n", " "))
        a2.plot(range(k), [phases[p].get(f"cond_acc_{i}", 0) for i in range(k)], marker="o",
                color=COLORS[p], lw=2)
    for a in (a1, a2):
        a.set_xticks(range(k), [f"draft {i + 1}" for i in range(k)])
        a.set_ylim(0, 1)
    a1.set_title("Share of cycles accepting draft i (and all before it)", loc="left", fontsize=11)
    a2.set_title("Conditional acceptance of draft i", loc="left", fontsize=11)
    fig.legend(*a1.get_legend_handles_labels(), loc="lower center", ncol=len(names), frameon=False, fontsize=9.5)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out)
    plt.close(fig)


def plot_loss(histories: dict[str, list[dict]], out: Path) -> None:
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
    offset = {"phase2": histories.get("phase1", [{}])[-1].get("step", 0) if histories.get("phase1") else 0}
    for p in ("phase1_scratch", "phase1", "phase2"):
        h = histories.get(p) or []
        if not h:
            continue
        xs = [r["step"] + offset.get(p, 0) for r in h]
        a1.plot(xs, [r.get("loss") for r in h], color=COLORS[p], lw=2, label=LABELS[p].replace("\n", " "))
        a2.plot(xs, [r.get("acc_0") for r in h], color=COLORS[p], lw=2)
    a1.set_title("Training loss (TTT, weighted over steps)", loc="left", fontsize=11)
    a2.set_title("Top-1 accuracy of the first draft (training batches)", loc="left", fontsize=11)
    for a in (a1, a2):
        a.set_xlabel("step (Phase 2 continues Phase 1)")
    a1.legend(frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ---- tables ----------------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return "" if v is None else str(v)


def html_table(rows: list[dict], cols: list[str], headers: list[str] | None = None,
               mark: str | None = None) -> str:
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
    write_csv(out_dir / "weights.csv", rep["weights"],
              ["name", "src_shape", "dst_shape", "src_dtype", "dst_dtype", "status", "note"])
    (out_dir / "compare.html").write_text(_page("Source drafter vs the new target's layout",
                                                compare_html(rep)))


def compare_html(rep: dict) -> str:
    v, verdict = rep["vocab"], rep["verdict"]
    ok = verdict["compatible_architecture"]
    parts = [f'<div class="verdict {"ok" if ok else "no"}"><b>{"Compatible" if ok else "Incompatible"} '
             f'architecture.</b> {html.escape("; ".join(verdict["reasons"]))}</div>',
             f"<p><b>Vocab action:</b> {html.escape(verdict['vocab_action'])}</p>"]
    if verdict["warnings"]:
        parts.append("<ul>" + "".join(f"<li>{html.escape(w)}</li>" for w in verdict["warnings"]) + "</ul>")
    parts.append(f"<p>{html.escape(v.get('explanation') or '')}</p>")
    vrows = [{"what": k, "value": v.get(k)} for k in ("draft_vocab_size", "overlap", "jaccard", "src_only",
                                                      "dst_only", "positions_differ", "identical")]
    parts.append(html_table(vrows, ["what", "value"], ["draft map", "src vs dst"]))
    parts.append("<h3>Config</h3>" + html_table(rep["config"], ["field", "src", "dst", "match", "note"],
                                                 mark="match"))
    parts.append("<h3>Weights (from the safetensors headers)</h3>" + html_table(
        rep["weights"], ["name", "src_shape", "dst_shape", "src_dtype", "dst_dtype", "status", "note"]))
    return "\n".join(parts)


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n")


def _img(path: Path, wrap: bool = False) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    if wrap:  # docutils refuses lines over 10,000 characters; data URLs ignore the line breaks
        data = "\n".join(data[i:i + 76] for i in range(0, len(data), 76))
    return f'<img src="data:image/png;base64,{data}">'


# ---- the report step ---------------------------------------------------------------------------
PHASE_COLS = ["phase", "accept_length", "projected_tok_s", "speedup_vs_baseline", "vs_break_even",
              "accept_length_all_positions", "train_steps", "final_loss", "eval_samples"]


def online_rows(A: Path, k: int) -> list[dict]:
    """One row per online step that ran: the phase's offline tau, the offline evaluator on vLLM's
    own sequences, vLLM's tau, per-position rates side by side, and the time each took."""
    rows = []
    for ph in ("phase0", "phase1"):
        m = _read(A / f"online_{ph}" / "metrics.json")
        if m is None:
            continue
        row = {"phase": ph, "offline_eval_set": m["accept_length"],
               "offline_same": m["offline_same_prompts_accept_length"], "vllm": m["online_accept_length"],
               "difference": m["online_offline_difference"], "prompts": m["online_num_prompts"],
               "vllm_seconds": m["online_seconds"], "offline_seconds": m["offline_same_prompts_seconds"],
               "offline_eval_seconds": m["offline_same_prompts_eval_seconds"],
               "time_ratio": m["online_time_ratio"]}
        for i in range(k):
            row[f"pos_{i + 1}"] = (f"{m[f'online_accept_rate_pos_{i}']:.3f} / "
                                   f"{m[f'offline_same_prompts_accept_rate_pos_{i}']:.3f}")
        rows.append(row)
    return rows


def online_section(rows: list[dict], k: int, enabled: bool) -> list[str]:
    if not enabled:
        return []
    if not rows:
        return ["<h2>Accept length in vLLM</h2><p>The online steps have not run (<code>snakemake online"
                "</code>).</p>"]
    cols = ["phase", "offline_eval_set", "offline_same", "vllm", "difference"] + [
        f"pos_{i + 1}" for i in range(k)] + ["prompts", "vllm_seconds", "offline_seconds", "time_ratio"]
    heads = ["phase", "τ offline (eval set)", "τ offline (vLLM's sequences)", "τ vLLM", "vLLM − offline"] + [
        f"pos {i + 1}: vLLM / offline" for i in range(k)] + ["prompts", "vLLM s", "offline s", "vLLM / offline time"]
    return ["<h2>Accept length in vLLM</h2><p class='lead'>The drafter exported flat and served by vLLM's "
            "EAGLE-3 speculative decoding (greedy); τ = 1 + accepted / drafts from vLLM's counters, next to "
            "the offline evaluator replaying exactly the sequences vLLM served. Offline seconds include "
            "loading the target and capturing its states.</p>", html_table(rows, cols, heads)]


def build_report(out_dir, p: dict, artifacts: str = "artifacts") -> dict:
    out_dir = Path(out_dir)
    A = Path(artifacts)
    k, cost = p["eval"]["k"], p["costmodel"]
    phases = {ph: m for ph in PHASES if (m := _read(A / ph / "metrics.json"))}
    histories = {ph: _history(A / ph / "history.csv") for ph in ("phase1_scratch", "phase1", "phase2")}
    world = _read(A / "world" / "metrics.json")
    compare = _read(A / "compare" / "compare.json")
    source_on_old = phases.get("phase0", {}).get("source_on_old_accept_length")

    plot_tau(phases, cost, k, out_dir / "tau.png", source_on_old)
    plot_tau(phases, cost, k, out_dir / "tau_small.png", source_on_old, figsize=(7.6, 5.4))
    plot_positions(phases, k, out_dir / "positions.png")
    plot_loss(histories, out_dir / "loss.png")

    rows = []
    for ph, m in phases.items():
        rows.append({"phase": ph, **{c: m.get(c) for c in PHASE_COLS[1:]},
                     "vs_break_even": m["accept_length"] - m["break_even_accept_length"]})
    write_csv(out_dir / "phases.csv", rows, PHASE_COLS)
    pos_rows = [{"phase": ph, "position": i + 1, "accept_rate": m.get(f"accept_rate_pos_{i}"),
                 "cond_acc": m.get(f"cond_acc_{i}")} for ph, m in phases.items() for i in range(k)]
    write_csv(out_dir / "positions.csv", pos_rows, ["phase", "position", "accept_rate", "cond_acc"])

    be = next(iter(phases.values()))["break_even_accept_length"] if phases else None
    kpis = []
    if source_on_old is not None:
        kpis.append(("source on old target", f"τ {source_on_old:.2f}"))
    for ph, m in phases.items():
        kpis.append((LABELS[ph].replace("\n", " "), f"τ {m['accept_length']:.2f} · {m['projected_tok_s']:.0f} tok/s"))
    if be is not None:
        kpis.append(("break-even", f"τ {be:.2f} · {cost['baseline_tok_s']:g} tok/s"))
    body = [f"<p class='lead'>Profile <b>{html.escape(p['profile'])}</b>. τ = offline accept length on the "
            f"new target's held-out prompts, k = {k} drafts per cycle, bonus token counted. Projected tok/s = "
            f"τ / (verify {cost['verify_ms']:g} ms + {k} × {cost['draft_ms']:g} ms).</p>",
            "".join(f"<div class='kpi'><small>{html.escape(a)}</small><b>{html.escape(b)}</b></div>" for a, b in kpis),
            "<h2>Accept length per phase</h2>", _img(out_dir / "tau.png"),
            html_table(rows, PHASE_COLS, ["phase", "τ", "tok/s", "× baseline", "τ − break-even",
                                          "τ (every position)", "train steps", "final loss", "eval samples"]),
            "<h2>Acceptance by draft position</h2>", _img(out_dir / "positions.png"),
            "<h2>Training curves</h2>", _img(out_dir / "loss.png")]
    # only when the DAG made the online steps inputs of this one (params online.enabled)
    on_enabled = bool(p.get("online", {}).get("enabled"))
    on_rows = online_rows(A, k) if on_enabled else []
    if on_rows:
        write_csv(out_dir / "online.csv", on_rows, list(on_rows[0]))
    body += online_section(on_rows, k, on_enabled)
    if compare is not None:
        (out_dir / "compare.html").write_text(_page("Source drafter vs the new target's layout",
                                                    compare_html(compare)))
        body += ["<h2>Source drafter vs the new target's layout</h2>", compare_html(compare)]
    if world is not None:
        t = world.get("targets", {})
        wrows = [{"what": key, "value": t.get(key)} for key in sorted(t)]
        wrows += [{"what": f"source drafter {key}", "value": val} for key, val in world.get("source", {}).items()]
        body += ["<h2>The embedded world</h2>", html_table(wrows, ["what", "value"])]
    if compare is None:
        (out_dir / "compare.html").write_text(_page("No comparison", "<p>The compare step has not run.</p>"))
    # The Snakemake report's landing page embeds this fragment (report/workflow.rst): the chart
    # and its numbers first, the rest one click away.
    (out_dir / "landing.html").write_text(
        "<div>" + _img(out_dir / "tau_small.png", wrap=True) + html_table(
            [{"phase": r["phase"], "accept_length": r["accept_length"], "projected_tok_s": r["projected_tok_s"],
              "vs_break_even": r["vs_break_even"]} for r in rows],
            ["phase", "accept_length", "projected_tok_s", "vs_break_even"],
            ["phase", "τ", "projected tok/s", "τ − break-even"]) + "</div>\n")
    (out_dir / "summary.html").write_text(_page("draftport: porting the drafter to the new target", "\n".join(body)))
    return {"phases": {ph: {"accept_length": m["accept_length"], "projected_tok_s": m["projected_tok_s"]}
                       for ph, m in phases.items()},
            "break_even_accept_length": be}
