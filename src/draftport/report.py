"""The pipeline's report: plots (matplotlib) and tables, one page a user would rather look at.

build_report reads every step's metrics.json (and the phases' history.csv) and writes, under
artifacts/report/: tau.png (accept length per phase next to the cost model's projected tok/s and
break-even line), positions.png (acceptance by draft position), loss.png (training curves),
phases.csv / positions.csv (the same numbers; DVC plots read them) and summary.html (everything
on one page, images inlined). The HTML/CSV tables (and the compare step's) are draftport.tables.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path
from typing import Any

from .tables import _page, compare_html, html_table, write_csv

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
def _img(path: Path, wrap: bool = False) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    if wrap:  # docutils refuses lines over 10,000 characters; data URLs ignore the line breaks
        data = "\n".join(data[i:i + 76] for i in range(0, len(data), 76))
    return f'<img src="data:image/png;base64,{data}">'


# ---- the report step ---------------------------------------------------------------------------
PHASE_COLS = ["phase", "accept_length", "projected_tok_s", "speedup_vs_baseline", "vs_break_even",
              "accept_length_all_positions", "train_steps", "final_loss", "eval_samples"]


def online_rows(inputs: dict, k: int) -> list[dict]:
    """One row per online step that ran: the phase's offline tau, the offline evaluator on vLLM's
    own sequences, vLLM's tau, per-position rates side by side, and the time each took."""
    rows = []
    for ph in ("phase0", "phase1"):
        m = _read(inputs[f"online_{ph}"]) if f"online_{ph}" in inputs else None
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


def drift_rows(d: dict) -> list[dict]:
    """One row per aux layer and the final state: how far the new target's states moved."""
    names = sorted((k[len("cos_layer_"):] for k in d if k.startswith("cos_layer_")), key=int)
    rows = []
    for name, key in [(f"aux layer {n}", f"layer_{n}") for n in names] + [("final state", "final")]:
        rows.append({"state": name, "cos": d.get(f"cos_{key}"), "cka": d.get(f"cka_{key}"),
                     "rel_norm_change": d.get(f"rel_norm_change_{key}"), "rel_diff_norm": d.get(f"rel_diff_norm_{key}")})
    return rows


def drift_section(d: dict) -> list[str]:
    taus = [{"what": "source drafter, old target's states (same tokens)", "tau": d.get("tau_source_old_features")},
            {"what": "source drafter, new target's states (Phase 0)", "tau": d.get("tau_source_new_features")},
            {"what": "the gap: the target's own change on a fixed text", "tau": d.get("tau_gap")}]
    if d.get("tau_source_on_old_answers") is not None:
        taus.insert(0, {"what": "source drafter on the old target's own answers", "tau": d["tau_source_on_old_answers"]})
    return ["<h2>How far the new target's hidden states moved (drift probe)</h2>",
            f"<p class='lead'>The old target run over the new target's answers to the held-out prompts "
            f"({d.get('tokens')} assistant tokens of {d.get('samples')} samples). Greedy agreement of the two "
            f"targets on those tokens: <b>{d.get('greedy_agreement', float('nan')):.3f}</b>.</p>",
            html_table(drift_rows(d), ["state", "cos", "cka", "rel_norm_change", "rel_diff_norm"],
                       ["state", "mean cosine", "linear CKA", "| ‖new‖ − ‖old‖ | / ‖old‖", "‖new − old‖ / ‖old‖"]),
            html_table(taus, ["what", "tau"], ["accept length", "τ"])]


def build_report(out_dir, p: dict, inputs: dict) -> dict:
    """inputs (the step's, by name): phase0 .. phase2 (each phase's evaluation metrics.json),
    history_<phase> (its training's history.csv), compare (compare.json), world (its
    metrics.json), online_<phase> (the online steps' metrics.json); absent ones are left out."""
    out_dir = Path(out_dir)
    inputs = {k: Path(v) for k, v in inputs.items()}
    k, cost = p["eval"]["k"], p["costmodel"]
    phases = {ph: m for ph in PHASES if ph in inputs and (m := _read(inputs[ph]))}
    histories = {ph: _history(inputs[f"history_{ph}"]) for ph in ("phase1_scratch", "phase1", "phase2")
                 if f"history_{ph}" in inputs}
    world = _read(inputs["world"]) if "world" in inputs else None
    compare = _read(inputs["compare"]) if "compare" in inputs else None
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
    on_rows = online_rows(inputs, k) if on_enabled else []
    if on_rows:
        write_csv(out_dir / "online.csv", on_rows, list(on_rows[0]))
    body += online_section(on_rows, k, on_enabled)
    drift = _read(inputs["drift"]) if "drift" in inputs else None
    if drift is not None:
        body += drift_section(drift)
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
