"""The pipeline's report: plots (matplotlib) and tables, one page a user would rather look at.

build_report reads every step's metrics.json (and the phases' history.csv) and writes, under
artifacts/report/: tau.png (accept length per phase next to the cost model's projected tok/s and
break-even line), positions.png (acceptance by draft position), loss.png (training curves),
phases.csv / positions.csv (the same numbers; DVC plots read them) and summary.html (everything
on one page, images inlined). The HTML/CSV tables (and the compare step's) are draftport.outputs.tables.

With the decision step's decision.json, summary.html opens with its recommendation (the rules
fired, τ by training samples per init with CIs, the gain of fine-tuning the source, the phases)
and decision.csv holds one row per (init, n_samples); with curves.json (and/or the decision)
curves.png plots τ against the training samples; tau_by_step.png the held-out τ logged during
training (history.csv's accept_length, where present); source_curve.png the source drafter's own
training monitor (source_drafter.json). Each is left out when its input is absent or empty.
"""

from __future__ import annotations

import base64
import csv
import html
import json
from pathlib import Path
from typing import Any

from draftport.outputs.style import COLORS, LABELS, PHASES, pyplot
from draftport.outputs.tables import _page, compare_html, html_table, write_csv
from draftport.outputs.traffic_report import traffic_section


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
    return pyplot()


# ---- plots -----------------------------------------------------------------------------------
def plot_tau(phases: dict, cost: dict, k: int, out: Path, source_on_old: float | None, figsize=(9.5, 5.2)) -> None:
    plt = _plt()
    # lazy: matplotlib is optional (the pipeline extra)
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
    top = max(max((t for _, t, _, _ in bars), default=1.0) * 1.3, be * 1.3)  # no phase yet: the axes alone
    ax.axhspan(be, top, color="#e8f5e9", zorder=0)
    ax.axhline(be, color="#c0392b", ls="--", lw=1.5, zorder=1)
    for x, t, color, main in bars:
        ax.bar(
            x, t, color=color, width=0.62, zorder=2, hatch=None if main else "//", edgecolor=None if main else "#888"
        )
        text = f"τ {t:.2f}\n{t / cycle_s:.0f} tok/s"
        inside = t - 1.0 > 0.45 * (top - 1.0) * 0.5
        ax.text(
            x,
            t - 0.05 if inside else t + 0.04,
            text,
            ha="center",
            va="top" if inside else "bottom",
            fontsize=10,
            fontweight="bold" if main else "normal",
            zorder=3,
            color=("white" if main else "#333") if inside else "#222",
        )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(1.0, top)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel("accept length τ (tokens per verify, bonus included)")
    sec = ax.secondary_yaxis("right", functions=(lambda t: t / cycle_s, lambda s: s * cycle_s))
    cycle = (
        f"verify {cost['verify_ms']:g} ms + {k} × {cost['draft_ms']:g} ms drafts"
        if cost["draft_ms"]
        else f"{cost['verify_ms']:g} ms per verify cycle"
    )
    sec.set_ylabel(f"projected tok/s ({cycle})")
    sec.spines["right"].set_visible(True)
    ax.legend(
        handles=[
            Line2D(
                [],
                [],
                color="#c0392b",
                ls="--",
                lw=1.5,
                label=f"break-even τ {be:.2f} = {cost['baseline_tok_s']:g} tok/s without a drafter",
            ),
            Patch(facecolor="#e8f5e9", edgecolor="#7fb685", label="above it, the drafter pays"),
        ],
        loc="upper left",
        frameon=False,
        fontsize=9.5,
        ncol=2,
    )
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
        a1.bar(
            xs,
            [phases[p].get(f"accept_rate_pos_{i}", 0) for i in range(k)],
            width=width,
            color=COLORS[p],
            label=LABELS[p].replace("\n", " "),
        )
        a2.plot(range(k), [phases[p].get(f"cond_acc_{i}", 0) for i in range(k)], marker="o", color=COLORS[p], lw=2)
    for a in (a1, a2):
        a.set_xticks(range(k), [f"draft {i + 1}" for i in range(k)])
        a.set_ylim(0, 1)
    a1.set_title("Share of cycles accepting draft i (and all before it)", loc="left", fontsize=11)
    a2.set_title("Conditional acceptance of draft i", loc="left", fontsize=11)
    fig.legend(
        *a1.get_legend_handles_labels(), loc="lower center", ncol=max(len(names), 1), frameon=False, fontsize=9.5
    )
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
    if a1.get_legend_handles_labels()[0]:
        a1.legend(frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


INITS = ("source", "scratch")
INIT_LABELS = {"source": "fine-tune the source", "scratch": "train from scratch"}
INIT_COLORS = {"source": COLORS["phase1"], "scratch": COLORS["phase1_scratch"]}


def _num(v) -> float | None:
    """A finite float, or None (absent, null, NaN, not a number)."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if x == x and x not in (float("inf"), float("-inf")) else None


def _ci(item: dict) -> tuple[float | None, float | None]:
    ci = item.get("ci") if isinstance(item, dict) else None
    if isinstance(ci, (list, tuple)) and len(ci) == 2:
        return _num(ci[0]), _num(ci[1])
    return None, None


def break_even(p: dict, decision: dict | None = None) -> float | None:
    """The break-even accept length: the decision's (its cost model), else the params' cost model:
    baseline_tok_s * (verify_ms + k * draft_ms) / 1000."""
    be = _num(((decision or {}).get("costmodel") or {}).get("break_even_accept_length"))
    if be is not None:
        return be
    cost, k = p.get("costmodel") or {}, (p.get("eval") or {}).get("k")
    try:
        return cost["baseline_tok_s"] * (cost["verify_ms"] + k * cost["draft_ms"]) / 1000.0
    except (KeyError, TypeError):
        return None


def _be_line(ax, be: float | None) -> None:
    if be is not None:
        ax.axhline(be, color="#c0392b", ls="--", lw=1.5, zorder=1, label=f"break-even τ {be:.2f}")
        lo, hi = ax.get_ylim()  # room around the line, not pinned to the frame
        pad = 0.06 * max(hi - lo, 0.5)
        ax.set_ylim(min(lo, be - pad), max(hi, be + pad))


def curve_series(decision: dict | None, curves: dict | None) -> dict[str, dict]:
    """Per init: the pooled τ by n (decision.json's curves, else the seeds' mean from curves.json)
    with its CI where known, and the single seeds' (n, τ) points (curves.json)."""
    out = {}
    dec_curves = (decision or {}).get("curves") or {}
    points = (curves or {}).get("points") or []
    for init in INITS:
        seeds = [
            (n, t)
            for pt in points
            if pt.get("init") == init
            and (n := _num(pt.get("n_samples"))) is not None
            and (t := _num(pt.get("accept_length"))) is not None
        ]
        pooled = []
        if dec_curves.get(init):
            for it in dec_curves[init]:
                n, t = _num(it.get("n_samples")), _num(it.get("accept_length"))
                if n is not None and t is not None:
                    pooled.append((n, t, *_ci(it)))
        elif seeds and decision is None:
            by_n: dict[float, list[float]] = {}
            for n, t in seeds:
                by_n.setdefault(n, []).append(t)
            pooled = [(n, sum(ts) / len(ts), None, None) for n, ts in by_n.items()]
        pooled.sort()
        if pooled or seeds:
            out[init] = {"pooled": pooled, "seeds": seeds}
    return out


def plot_curves(series: dict[str, dict], be: float | None, out: Path, pooled_label: str) -> None:
    """τ against the number of training samples (log x), one line per init, CI band and error
    bars, the single seeds as faint dots, the break-even τ dashed."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 5.0))
    ns = [n for s in series.values() for n, *_ in s["pooled"]] + [n for s in series.values() for n, _ in s["seeds"]]
    if ns and min(ns) > 0:
        ax.set_xscale("log")
    elif ns:  # a zero-sample point (the untrained init): log away from it, linear through it
        ax.set_xscale("symlog", linthresh=min([n for n in ns if n > 0] or [1.0]))
    for init, s in series.items():
        color, label = INIT_COLORS[init], INIT_LABELS[init]
        if s["seeds"]:
            ax.scatter(
                [n for n, _ in s["seeds"]],
                [t for _, t in s["seeds"]],
                s=14,
                color=color,
                alpha=0.35,
                zorder=2,
                linewidths=0,
            )
        pooled = s["pooled"]
        if not pooled:
            continue
        xs, ys = [r[0] for r in pooled], [r[1] for r in pooled]
        ax.plot(xs, ys, color=color, lw=2, marker="o", zorder=3, label=f"{label} ({pooled_label})")
        band = [(x, lo, hi) for x, _, lo, hi in pooled if lo is not None and hi is not None]
        if band:
            ax.fill_between(
                [b[0] for b in band],
                [b[1] for b in band],
                [b[2] for b in band],
                color=color,
                alpha=0.15,
                zorder=1,
                linewidth=0,
            )
            ax.errorbar(
                [x for x, y, lo, hi in pooled if lo is not None and hi is not None],
                [y for x, y, lo, hi in pooled if lo is not None and hi is not None],
                yerr=[
                    [max(y - lo, 0) for x, y, lo, hi in pooled if lo is not None and hi is not None],
                    [max(hi - y, 0) for x, y, lo, hi in pooled if lo is not None and hi is not None],
                ],
                fmt="none",
                ecolor=color,
                elinewidth=1.2,
                capsize=3,
                zorder=3,
            )
    _be_line(ax, be)
    ax.set_xlabel("training samples (log scale)")
    ax.set_ylabel("accept length τ on the new target")
    ax.set_title(
        "Accept length by training samples: fine-tune the source vs from scratch",
        loc="left",
        fontweight="bold",
        fontsize=11.5,
    )
    ax.scatter([], [], s=14, color="#888", alpha=0.5, label="single seeds")
    ax.legend(frameon=False, fontsize=9.5, loc="best")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def tau_series(histories: dict[str, list[dict]]) -> dict[str, list[tuple[float, float]]]:
    """Per phase: (step, held-out τ) on the rows where an evaluation happened. Phase 2's steps
    continue Phase 1's (as in loss.png)."""
    h1 = histories.get("phase1") or []
    offset = {"phase2": h1[-1].get("step", 0) if h1 else 0}
    out = {}
    for ph in ("phase1_scratch", "phase1", "phase2"):
        pts = [
            (r["step"] + offset.get(ph, 0), t)
            for r in histories.get(ph) or []
            if "step" in r and (t := _num(r.get("accept_length"))) is not None
        ]
        if pts:
            out[ph] = pts
    return out


def plot_tau_by_step(
    series: dict[str, list[tuple[float, float]]], be: float | None, out: Path, phase0_tau: float | None = None
) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 4.6))
    names = {
        "phase1_scratch": "from scratch (Phase 1 control)",
        "phase1": "fine-tuned source (Phase 1)",
        "phase2": "scaled data (Phase 2)",
    }
    for ph, pts in series.items():
        ax.plot([s for s, _ in pts], [t for _, t in pts], color=COLORS[ph], lw=2, marker="o", ms=4, label=names[ph])
    if phase0_tau is not None:
        ax.axhline(
            phase0_tau, color=COLORS["phase0"], ls=":", lw=1.5, label=f"source as-is (Phase 0) τ {phase0_tau:.2f}"
        )
    _be_line(ax, be)
    ax.set_xlabel("step (Phase 2 continues Phase 1)")
    ax.set_ylabel("held-out accept length τ")
    ax.set_title("Accept length during training", loc="left", fontweight="bold", fontsize=11.5)
    ax.legend(frameon=False, fontsize=9.5, loc="best")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def source_monitor(sd: dict | None) -> list[tuple[float, float]]:
    mon = (sd or {}).get("monitor")
    if not isinstance(mon, list):
        return []
    return sorted(
        (s, t)
        for r in mon
        if isinstance(r, dict)
        and (s := _num(r.get("step"))) is not None
        and (t := _num(r.get("accept_length"))) is not None
    )


def plot_source_curve(pts: list[tuple[float, float]], out: Path, n_samples=None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    ax.plot([s for s, _ in pts], [t for _, t in pts], color=COLORS["phase0"], lw=2, marker="o", ms=4)
    ax.set_xlabel("training step of the source drafter")
    ax.set_ylabel("τ on the old target's held-out answers")
    seen = f" ({n_samples} samples)" if n_samples is not None else ""
    ax.set_title(f"The source drafter's training on the old target{seen}", loc="left", fontweight="bold", fontsize=11.5)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


# ---- tables ----------------------------------------------------------------------------------
def _img(path: Path, wrap: bool = False) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    if wrap:  # docutils refuses lines over 10,000 characters; data URLs ignore the line breaks
        data = "\n".join(data[i : i + 76] for i in range(0, len(data), 76))
    return f'<img src="data:image/png;base64,{data}">'


# ---- the report step ---------------------------------------------------------------------------
PHASE_COLS = [
    "phase",
    "accept_length",
    "projected_tok_s",
    "speedup_vs_baseline",
    "vs_break_even",
    "accept_length_all_positions",
    "train_steps",
    "final_loss",
    "eval_samples",
]


def online_rows(inputs: dict, k: int) -> list[dict]:
    """One row per online step that ran: the phase's offline tau, the offline evaluator on vLLM's
    own sequences, vLLM's tau, per-position rates side by side, and the time each took."""
    rows = []
    for ph in ("phase0", "phase1"):
        m = _read(inputs[f"online_{ph}"]) if f"online_{ph}" in inputs else None
        if m is None:
            continue
        row = {
            "phase": ph,
            "offline_eval_set": m["accept_length"],
            "offline_same": m["offline_same_prompts_accept_length"],
            "vllm": m["online_accept_length"],
            "difference": m["online_offline_difference"],
            "prompts": m["online_num_prompts"],
            "vllm_seconds": m["online_seconds"],
            "offline_seconds": m["offline_same_prompts_seconds"],
            "offline_eval_seconds": m["offline_same_prompts_eval_seconds"],
            "time_ratio": m["online_time_ratio"],
        }
        for i in range(k):
            row[f"pos_{i + 1}"] = (
                f"{m[f'online_accept_rate_pos_{i}']:.3f} / {m[f'offline_same_prompts_accept_rate_pos_{i}']:.3f}"
            )
        rows.append(row)
    return rows


def online_section(rows: list[dict], k: int, enabled: bool) -> list[str]:
    if not enabled:
        return []
    if not rows:
        return ["<h2>Accept length in vLLM</h2><p>The online steps have not run (<code>snakemake online</code>).</p>"]
    cols = (
        ["phase", "offline_eval_set", "offline_same", "vllm", "difference"]
        + [f"pos_{i + 1}" for i in range(k)]
        + ["prompts", "vllm_seconds", "offline_seconds", "time_ratio"]
    )
    heads = (
        ["phase", "τ offline (eval set)", "τ offline (vLLM's sequences)", "τ vLLM", "vLLM − offline"]
        + [f"pos {i + 1}: vLLM / offline" for i in range(k)]
        + ["prompts", "vLLM s", "offline s", "vLLM / offline time"]
    )
    return [
        "<h2>Accept length in vLLM</h2><p class='lead'>The drafter exported flat and served by vLLM's "
        "EAGLE-3 speculative decoding (greedy); τ = 1 + accepted / drafts from vLLM's counters, next to "
        "the offline evaluator replaying exactly the sequences vLLM served. Offline seconds include "
        "loading the target and capturing its states.</p>",
        html_table(rows, cols, heads),
    ]


def drift_rows(d: dict) -> list[dict]:
    """One row per aux layer and the final state: how far the new target's states moved."""
    names = sorted((k[len("cos_layer_") :] for k in d if k.startswith("cos_layer_")), key=int)
    rows = []
    for name, key in [(f"aux layer {n}", f"layer_{n}") for n in names] + [("final state", "final")]:
        rows.append(
            {
                "state": name,
                "cos": d.get(f"cos_{key}"),
                "cka": d.get(f"cka_{key}"),
                "rel_norm_change": d.get(f"rel_norm_change_{key}"),
                "rel_diff_norm": d.get(f"rel_diff_norm_{key}"),
            }
        )
    return rows


def drift_section(d: dict) -> list[str]:
    taus = [
        {"what": "source drafter, old target's states (same tokens)", "tau": d.get("tau_source_old_features")},
        {"what": "source drafter, new target's states (Phase 0)", "tau": d.get("tau_source_new_features")},
        {"what": "the gap: the target's own change on a fixed text", "tau": d.get("tau_gap")},
    ]
    if d.get("tau_source_on_old_answers") is not None:
        taus.insert(
            0, {"what": "source drafter on the old target's own answers", "tau": d["tau_source_on_old_answers"]}
        )
    return [
        "<h2>How far the new target's hidden states moved (drift probe)</h2>",
        f"<p class='lead'>The old target run over the new target's answers to the held-out prompts "
        f"({d.get('tokens')} assistant tokens of {d.get('samples')} samples). Greedy agreement of the two "
        f"targets on those tokens: <b>{d.get('greedy_agreement', float('nan')):.3f}</b>.</p>",
        html_table(
            drift_rows(d),
            ["state", "cos", "cka", "rel_norm_change", "rel_diff_norm"],
            ["state", "mean cosine", "linear CKA", "| ‖new‖ − ‖old‖ | / ‖old‖", "‖new − old‖ / ‖old‖"],
        ),
        html_table(taus, ["what", "tau"], ["accept length", "τ"]),
    ]


DECISION_COLS = [
    "init",
    "n_samples",
    "accept_length",
    "ci_lo",
    "ci_hi",
    "seed_std",
    "n_seeds",
    "projected_tok_s",
    "speedup_vs_baseline",
    "beats_break_even",
    "gain_vs_scratch",
    "gain_ci_lo",
    "gain_ci_hi",
    "gain_significant",
]


def _ci_text(item) -> str:
    lo, hi = _ci(item)
    return "" if lo is None or hi is None else f"{lo:.3f} – {hi:.3f}"


def decision_rows(d: dict) -> list[dict]:
    """One row per (init, n_samples) of decision.json's curves, with the gain (source − scratch)
    at that n where the decision has one."""
    gains = {_num(g.get("n_samples")): g for g in d.get("gain") or [] if isinstance(g, dict)}
    rows = []
    for init in INITS:
        for it in (d.get("curves") or {}).get(init) or []:
            lo, hi = _ci(it)
            g = gains.get(_num(it.get("n_samples")), {})
            glo, ghi = _ci(g)
            rows.append(
                {
                    "init": init,
                    "n_samples": it.get("n_samples"),
                    "accept_length": it.get("accept_length"),
                    "ci_lo": lo,
                    "ci_hi": hi,
                    "seed_std": it.get("seed_std"),
                    "n_seeds": it.get("n_seeds"),
                    "projected_tok_s": it.get("projected_tok_s"),
                    "speedup_vs_baseline": it.get("speedup_vs_baseline"),
                    "beats_break_even": it.get("beats_break_even"),
                    "gain_vs_scratch": g.get("diff"),
                    "gain_ci_lo": glo,
                    "gain_ci_hi": ghi,
                    "gain_significant": g.get("significant"),
                }
            )
    return rows


def _yes(v) -> str:
    return "yes" if v is True else "no" if v is False else ("" if v is None else str(v))


def _gain_line(what: str, g: dict | None) -> str:
    if not isinstance(g, dict) or _num(g.get("diff")) is None:
        return ""
    sig = "significant" if g.get("significant") else "not significant"
    better = f", better: {g['better']}" if g.get("better") else ""
    ci = _ci_text(g)
    return (
        f"<p><b>{html.escape(what)}:</b> Δτ {g['diff']:+.3f}"
        + (f" (CI {html.escape(ci)})" if ci else "")
        + f", {sig}{html.escape(better)}.</p>"
    )


def _decision_kpis(rec: dict, init_txt: str) -> list[tuple[str, str]]:
    """The recommendation's KPI strip: (label, value) pairs."""
    n = rec.get("n_samples")
    ne = rec.get("n_enough")
    summary = [
        ("init", init_txt),
        ("pays off from (samples)", "—" if n is None else str(n)),
        ("enough data (samples)", "—" if ne is None else str(ne)),
        ("Phase 2", str(rec.get("phase2", "—"))),
        ("deploy the source now", _yes(rec.get("deploy_source_now"))),
        ("confidence", str(rec.get("confidence", "—"))),
    ]
    if "recipe" in rec:  # rules R7, R8 and the hours (decisions before them lack the keys)
        hrs = ((rec.get("chosen") or {}).get("hours") or {}).get("total")
        days = (rec.get("payback") or {}).get("days")
        summary[1:1] = [
            ("recipe", str(rec.get("recipe"))),
            ("regenerate the answers", {True: "yes", False: "no"}.get(rec.get("regenerate"), "not measured")),
        ]
        summary += [
            ("device-hours (the drafter)", "—" if hrs is None else f"{hrs:.3g}"),
            ("payback (days)", "—" if days is None else f"{days:.3g}"),
        ]
    return summary


def _decision_verdict(rec: dict) -> list[str]:
    """The section's heading, its one-paragraph verdict and the KPI strip."""
    init = rec.get("init")
    init_txt = {
        "source": "fine-tune the source drafter",
        "scratch": "train a drafter from scratch",
        "either": "either init (fine-tune the source or from scratch)",
    }.get(init, str(init))
    n = rec.get("n_samples")
    ne = rec.get("n_enough")
    summary = _decision_kpis(rec, init_txt)
    return [
        "<h2>Decision</h2>",
        f"<div class='verdict ok'><b>Recommendation:</b> {html.escape(init_txt)}"
        + (f": it beats break-even from {html.escape(str(n))} samples" if n is not None else "")
        + (f", gains nothing significant beyond {html.escape(str(ne))}" if ne is not None else "")
        + f"; Phase 2: {html.escape(str(rec.get('phase2', '—')))}; deploy the source now: "
        f"{html.escape(_yes(rec.get('deploy_source_now')))}; confidence: "
        f"<b>{html.escape(str(rec.get('confidence', '—')))}</b>.</div>",
        "".join(f"<div class='kpi'><small>{html.escape(a)}</small><b>{html.escape(b)}</b></div>" for a, b in summary),
    ]


def _recommendation_notes(rec: dict) -> list[str]:
    """The recommendation's sentences and the table of the rules that fired."""
    parts = []
    text = rec.get("text") or []
    if isinstance(text, str):
        text = [text]
    if text:
        parts.append("<ul class='recommendation'>" + "".join(f"<li>{html.escape(str(t))}</li>" for t in text) + "</ul>")
    rules = [r for r in rec.get("rules") or [] if isinstance(r, dict)]
    if rules:
        parts.append("<h3>Rules fired</h3>" + html_table(rules, ["id", "fired"], ["rule", "fired"]))
    return parts


def _break_even_lead(d: dict, lvl: str) -> list[str]:
    """The break-even τ and what the intervals are, when the decision has a cost model."""
    cost = d.get("costmodel") or {}
    if _num(cost.get("break_even_accept_length")) is None:
        return []
    return [
        f"<p class='lead'>Break-even τ {cost['break_even_accept_length']:.3f} "
        f"({html.escape(str(cost.get('baseline_tok_s')))} tok/s without a drafter); intervals are "
        f"{html.escape(lvl)}bootstrap CIs"
        + (f" ({html.escape(str(d['n_boot']))} resamples)" if d.get("n_boot") else "")
        + ".</p>"
    ]


def _init_curve_tables(d: dict, lvl: str) -> list[str]:
    """One table per init: τ by training samples, with the smallest n beating break-even."""
    parts = []
    smallest = d.get("smallest_n_beating_break_even") or {}
    for init in INITS:
        items = [it for it in (d.get("curves") or {}).get(init) or [] if isinstance(it, dict)]
        if not items:
            continue
        rows = [{**it, "ci_text": _ci_text(it)} for it in items]
        sm = smallest.get(init)
        note = (
            f" — smallest n beating break-even: {sm}"
            if sm is not None
            else " — no n beats break-even"
            if init in smallest
            else ""
        )
        parts.append(
            f"<h3>{html.escape(INIT_LABELS[init].capitalize())}{html.escape(note)}</h3>"
            + html_table(
                rows,
                [
                    "n_samples",
                    "accept_length",
                    "ci_text",
                    "seed_std",
                    "n_seeds",
                    "projected_tok_s",
                    "speedup_vs_baseline",
                    "beats_break_even",
                ],
                [
                    "samples",
                    "τ",
                    f"{lvl}CI",
                    "seeds' std",
                    "seeds",
                    "projected tok/s",
                    "× baseline",
                    "beats break-even",
                ],
            )
        )
    return parts


def _arm_tables(d: dict, lvl: str) -> list[str]:
    """The other arms' curves (the dataset's own answers, the recipes) and their gains."""
    parts = []
    arms = [
        {"arm": arm, **it, "ci_text": _ci_text(it), "hours_total": (it.get("hours") or {}).get("total")}
        for arm, items in (d.get("curves") or {}).items()
        if arm not in INITS
        for it in items
        if isinstance(it, dict)
    ]
    if arms:
        parts.append(
            "<h3>The arms: the dataset's own answers, the recipes</h3>"
            + html_table(
                arms,
                ["arm", "n_samples", "accept_length", "ci_text", "n_seeds", "projected_tok_s", "hours_total"],
                ["arm", "samples", "τ", f"{lvl}CI", "seeds", "projected tok/s", "device-hours"],
            )
        )
    for key, what in (("answers_gain", "regenerated − dataset answers"), ("recipe_gain", "recipe − plain fine-tuning")):
        rows = [
            {"of": name, **g, "ci_text": _ci_text(g), "sig": _yes(g.get("significant"))}
            for name, gs in (d.get(key) or {}).items()
            for g in gs
            if isinstance(g, dict)
        ]
        if rows:
            parts.append(
                f"<h3>Gain {html.escape(what)}</h3>"
                + html_table(
                    rows,
                    ["of", "n_samples", "diff", "ci_text", "sig", "better"],
                    ["arm", "samples", "Δτ", f"{lvl}CI", "significant", "better"],
                )
            )
    return parts


def _gain_and_phase_tables(d: dict, lvl: str) -> list[str]:
    """The gain of fine-tuning the source by n, the phases' τ, and the phases' gains in a line each."""
    parts = []
    gains = [g for g in d.get("gain") or [] if isinstance(g, dict)]
    if gains:
        grows = [{**g, "ci_text": _ci_text(g), "sig": _yes(g.get("significant"))} for g in gains]
        parts.append(
            "<h3>Gain of fine-tuning the source (source − scratch)</h3>"
            + html_table(
                grows,
                ["n_samples", "diff", "ci_text", "sig", "better"],
                ["samples", "Δτ", f"{lvl}CI", "significant", "better"],
            )
        )
    phases = d.get("phases") or {}
    prow = [{"phase": ph, **m, "ci_text": _ci_text(m)} for ph in PHASES if isinstance(m := phases.get(ph), dict)]
    prow += [
        {"phase": ph, **m, "ci_text": _ci_text(m)}
        for ph, m in phases.items()
        if ph not in PHASES and isinstance(m, dict)
    ]
    if prow:
        parts.append(
            "<h3>Phases</h3>"
            + html_table(
                prow,
                ["phase", "accept_length", "ci_text", "projected_tok_s", "speedup_vs_baseline", "beats_break_even"],
                ["phase", "τ", f"{lvl}CI", "projected tok/s", "× baseline", "beats break-even"],
            )
        )
    parts.append(_gain_line("Phase 1: fine-tuned vs from scratch", d.get("phase1_gain_vs_scratch")))
    parts.append(_gain_line("Phase 2 over Phase 1", d.get("phase2_gain")))
    return parts


def decision_section(d: dict, curves_png: Path | None) -> list[str]:
    """The report's first section from decision.json: the verdict, then its tables (empty parts left out)."""
    rec = d.get("recommendation") or {}
    level = _num(d.get("level"))
    lvl = f"{level * 100:g}% " if level is not None else ""
    parts = _decision_verdict(rec) + _recommendation_notes(rec)
    if curves_png is not None:
        parts.append(_img(curves_png))
    parts += _break_even_lead(d, lvl)
    parts += _init_curve_tables(d, lvl)
    parts += _arm_tables(d, lvl)
    parts += _gain_and_phase_tables(d, lvl)
    parts += _serving_tables(d.get("serving"))
    return [x for x in parts if x]


def _serving_tables(block: dict | None) -> list[str]:
    """R11: per drafter and batch size, tau and projected tok/s at every depth (one line a drafter),
    its best configuration, and the engine settings of the recommended one."""
    if not block:
        return []
    from draftport.evaluation.serving import describe, label, settings_json

    rows = []
    for role, dr in block["drafters"].items():
        for r in dr["per_batch"]:
            cells = ", ".join(f"{label(c)}: {c['accept_length']:.2f} / {c['tok_s']:.0f}" for c in r["configs"])
            rows.append(
                {
                    "drafter": f"{role} ({dr['phase']})",
                    "batch": r["batch_size"],
                    "alone": f"{r['target_alone_tok_s']:.1f}",
                    "by_k": cells,
                    "best": describe(r) if r["speculate"] else "off (the target alone is faster)",
                }
            )
    cols = ["drafter", "batch", "alone", "by_k", "best"]
    heads = ["drafter", "batch size", "target alone tok/s", "tau / tok/s a request", "best"]
    parts = [
        "<h3>Serving (R11)</h3>",
        f"<p>Step times: {html.escape(block['step_table']['source'])}"
        + (f" ({html.escape('; '.join(block['notes']))})" if block["notes"] else "")
        + ". Trees, where listed, are measured offline.</p>",
        html_table(rows, cols, heads),
    ]
    rec = block["drafters"].get("recommended")
    if rec is not None:
        parts.append(
            "<p>vLLM <code>--speculative-config</code>: <code>"
            + html.escape(settings_json(rec["vllm_speculative_config"]))
            + "</code></p>"
        )
    return parts


def _read_input(inputs: dict, name: str) -> Any:
    """The named input's JSON, None when the step was not given it."""
    return _read(inputs[name]) if name in inputs else None


def _read_dict_input(inputs: dict, name: str) -> dict | None:
    """The named input's JSON when it is an object, else None."""
    value = _read_input(inputs, name)
    return value if isinstance(value, dict) else None


def _plot_phases(out_dir: Path, phases: dict, histories: dict, cost: dict, k: int, source_on_old) -> None:
    """tau.png (and its small copy for the landing page), positions.png and loss.png."""
    plot_tau(phases, cost, k, out_dir / "tau.png", source_on_old)
    plot_tau(phases, cost, k, out_dir / "tau_small.png", source_on_old, figsize=(7.6, 5.4))
    plot_positions(phases, k, out_dir / "positions.png")
    plot_loss(histories, out_dir / "loss.png")


def _write_optional_outputs(out_dir: Path, p: dict, phases: dict, histories: dict, decision, curves, sdrafter):
    """curves.png, tau_by_step.png, source_curve.png and decision.csv, each only when its input has
    data; -> (curves.png or None, the τ-by-step series, the source drafter's monitor)."""
    be_tau = break_even(p, decision)
    # plots only made when their inputs have data: drop a previous run's (the folder may be reused)
    for name in ("curves.png", "tau_by_step.png", "source_curve.png", "decision.csv"):
        (out_dir / name).unlink(missing_ok=True)
    series = curve_series(decision, curves)
    curves_png = None
    if series:
        curves_png = out_dir / "curves.png"
        plot_curves(series, be_tau, curves_png, "pooled τ, CI" if (decision or {}).get("curves") else "mean of seeds")
    tau_steps = tau_series(histories)
    if tau_steps:
        plot_tau_by_step(
            tau_steps, be_tau, out_dir / "tau_by_step.png", _num(phases.get("phase0", {}).get("accept_length"))
        )
    monitor = source_monitor(sdrafter)
    if monitor:
        plot_source_curve(monitor, out_dir / "source_curve.png", (sdrafter or {}).get("n_samples"))
    if decision is not None:
        write_csv(out_dir / "decision.csv", decision_rows(decision), DECISION_COLS)
    return curves_png, tau_steps, monitor


def _write_phase_tables(out_dir: Path, phases: dict, k: int) -> list[dict]:
    """phases.csv and positions.csv; -> the phases' rows."""
    rows = []
    for ph, m in phases.items():
        rows.append(
            {
                "phase": ph,
                **{c: m.get(c) for c in PHASE_COLS[1:]},
                "vs_break_even": m["accept_length"] - m["break_even_accept_length"],
            }
        )
    write_csv(out_dir / "phases.csv", rows, PHASE_COLS)
    pos_rows = [
        {
            "phase": ph,
            "position": i + 1,
            "accept_rate": m.get(f"accept_rate_pos_{i}"),
            "cond_acc": m.get(f"cond_acc_{i}"),
        }
        for ph, m in phases.items()
        for i in range(k)
    ]
    write_csv(out_dir / "positions.csv", pos_rows, ["phase", "position", "accept_rate", "cond_acc"])
    return rows


def _phase_kpis(phases: dict, source_on_old, be, cost: dict) -> list[tuple[str, str]]:
    """The KPI strip: the source on the old target, each phase's τ and tok/s, the break-even."""
    kpis = []
    if source_on_old is not None:
        kpis.append(("source on old target", f"τ {source_on_old:.2f}"))
    for ph, m in phases.items():
        kpis.append((LABELS[ph].replace("\n", " "), f"τ {m['accept_length']:.2f} · {m['projected_tok_s']:.0f} tok/s"))
    if be is not None:
        kpis.append(("break-even", f"τ {be:.2f} · {cost['baseline_tok_s']:g} tok/s"))
    return kpis


def _phases_body(out_dir: Path, p: dict, k: int, cost: dict, rows: list[dict], kpis: list) -> list[str]:
    """The page's lead paragraph, the KPI strip, then τ per phase, by draft position and the loss."""
    return [
        f"<p class='lead'>Profile <b>{html.escape(p['profile'])}</b>. τ = offline accept length on the "
        f"new target's held-out prompts, k = {k} drafts per cycle, bonus token counted. Projected tok/s = "
        f"τ / (verify {cost['verify_ms']:g} ms + {k} × {cost['draft_ms']:g} ms).</p>",
        "".join(f"<div class='kpi'><small>{html.escape(a)}</small><b>{html.escape(b)}</b></div>" for a, b in kpis),
        "<h2>Accept length per phase</h2>",
        _img(out_dir / "tau.png"),
        html_table(
            rows,
            PHASE_COLS,
            [
                "phase",
                "τ",
                "tok/s",
                "× baseline",
                "τ − break-even",
                "τ (every position)",
                "train steps",
                "final loss",
                "eval samples",
            ],
        ),
        "<h2>Acceptance by draft position</h2>",
        _img(out_dir / "positions.png"),
        "<h2>Training curves</h2>",
        _img(out_dir / "loss.png"),
    ]


def _tau_by_step_part(out_dir: Path, tau_steps) -> list[str]:
    """The held-out τ during training, when the histories logged it."""
    if not tau_steps:
        return []
    return [
        "<p class='lead'>Held-out accept length during training (the steps where it was evaluated), "
        "fine-tuning the source vs from scratch, against the break-even τ.</p>",
        _img(out_dir / "tau_by_step.png"),
    ]


def _online_part(out_dir: Path, inputs: dict, p: dict, k: int) -> list[str]:
    """online.csv and the vLLM section, only when the DAG made the online steps inputs of this one
    (params online.enabled)."""
    on_enabled = bool(p.get("online", {}).get("enabled"))
    on_rows = online_rows(inputs, k) if on_enabled else []
    if on_rows:
        write_csv(out_dir / "online.csv", on_rows, list(on_rows[0]))
    return online_section(on_rows, k, on_enabled)


def _compare_part(out_dir: Path, compare) -> list[str]:
    """With the compare step's result: compare.html and its section."""
    if compare is None:
        return []
    (out_dir / "compare.html").write_text(_page("Source drafter vs the new target's layout", compare_html(compare)))
    return ["<h2>Source drafter vs the new target's layout</h2>", compare_html(compare)]


def _world_section(world) -> list[str]:
    """The embedded world's targets and source drafter, when the world step ran."""
    if world is None:
        return []
    t = world.get("targets", {})
    wrows = [{"what": key, "value": t.get(key)} for key in sorted(t)]
    wrows += [{"what": f"source drafter {key}", "value": val} for key, val in world.get("source", {}).items()]
    return ["<h2>The embedded world</h2>", html_table(wrows, ["what", "value"])]


def _source_training_section(out_dir: Path, monitor, sdrafter) -> list[str]:
    """The source drafter's training monitor, when source_drafter.json has one."""
    if not monitor:
        return []
    n_src = (sdrafter or {}).get("n_samples")
    seen = (
        f"It was trained on <b>{html.escape(str(n_src))}</b> samples of the old target's answers"
        if n_src is not None
        else "Its training samples are not recorded"
    )
    return [
        "<h2>The source drafter's training</h2>",
        f"<p class='lead'>{seen}; τ on the old target's held-out answers as it trained "
        f"(last: {monitor[-1][1]:.2f} at step {monitor[-1][0]:g}).</p>",
        _img(out_dir / "source_curve.png"),
    ]


def _write_landing(out_dir: Path, rows: list[dict]) -> None:
    """landing.html: the fragment the Snakemake report's landing page embeds (report/workflow.rst),
    the chart and its numbers first, the rest one click away."""
    (out_dir / "landing.html").write_text(
        "<div>"
        + _img(out_dir / "tau_small.png", wrap=True)
        + html_table(
            [
                {
                    "phase": r["phase"],
                    "accept_length": r["accept_length"],
                    "projected_tok_s": r["projected_tok_s"],
                    "vs_break_even": r["vs_break_even"],
                }
                for r in rows
            ],
            ["phase", "accept_length", "projected_tok_s", "vs_break_even"],
            ["phase", "τ", "projected tok/s", "τ − break-even"],
        )
        + "</div>\n"
    )


def build_report(out_dir, p: dict, inputs: dict) -> dict:
    """inputs (the step's, by name): phase0 .. phase2 (each phase's evaluation metrics.json),
    history_<phase> (its training's history.csv), compare (compare.json), world (its
    metrics.json), online_<phase> (the online steps' metrics.json), decision (decision.json: the
    recommendation, the first section), curves (curves.json: τ by training samples per seed),
    source_drafter (the world's source_drafter.json: its training monitor); absent ones are left out.
    Returns the phases' τ and tok/s, the break-even τ and, with a decision, its recommendation."""
    out_dir = Path(out_dir)
    inputs = {k: Path(v) for k, v in inputs.items()}
    k, cost = p["eval"]["k"], p["costmodel"]
    phases = {ph: m for ph in PHASES if ph in inputs and (m := _read(inputs[ph]))}
    histories = {
        ph: _history(inputs[f"history_{ph}"])
        for ph in ("phase1_scratch", "phase1", "phase2")
        if f"history_{ph}" in inputs
    }
    world = _read_input(inputs, "world")
    compare = _read_input(inputs, "compare")
    source_on_old = phases.get("phase0", {}).get("source_on_old_accept_length")
    _plot_phases(out_dir, phases, histories, cost, k, source_on_old)

    decision = _read_dict_input(inputs, "decision")
    curves = _read_dict_input(inputs, "curves")
    sdrafter = _read_dict_input(inputs, "source_drafter")
    curves_png, tau_steps, monitor = _write_optional_outputs(out_dir, p, phases, histories, decision, curves, sdrafter)
    rows = _write_phase_tables(out_dir, phases, k)

    be = next(iter(phases.values()))["break_even_accept_length"] if phases else None
    body = _phases_body(out_dir, p, k, cost, rows, _phase_kpis(phases, source_on_old, be, cost))
    body += _tau_by_step_part(out_dir, tau_steps)
    # the first section: after the lead paragraph and the phases' KPI strip (body[0], body[1])
    traffic = [_img(x) if isinstance(x, Path) else x for x in traffic_section(decision, out_dir)]
    if decision is not None:
        body[2:2] = decision_section(decision, curves_png) + traffic
    elif curves_png is not None:
        body[2:2] = ["<h2>Accept length by training samples</h2>", _img(curves_png)]
    body += _online_part(out_dir, inputs, p, k)
    drift = _read_input(inputs, "drift")
    if drift is not None:
        body += drift_section(drift)
    body += _compare_part(out_dir, compare)
    body += _world_section(world)
    body += _source_training_section(out_dir, monitor, sdrafter)
    if compare is None:
        (out_dir / "compare.html").write_text(_page("No comparison", "<p>The compare step has not run.</p>"))
    _write_landing(out_dir, rows)
    (out_dir / "summary.html").write_text(_page("draftport: porting the drafter to the new target", "\n".join(body)))
    res = {
        "phases": {
            ph: {"accept_length": m["accept_length"], "projected_tok_s": m["projected_tok_s"]}
            for ph, m in phases.items()
        },
        "break_even_accept_length": be,
    }
    if decision is not None and isinstance(decision.get("recommendation"), dict):
        res["decision"] = decision["recommendation"]
    return res
