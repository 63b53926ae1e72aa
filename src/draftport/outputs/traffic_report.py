"""The report's traffic section, from decision.json's "traffic" block (rule R10): accept length per
held-out set and traffic-weighted (a table, sets.png and traffic.csv), each set's learning curves
(curves_by_set.png) and accept length per context bucket of the verify position (a table and
buckets.png). Nothing when the decision has no traffic block (a decision.json from before it)."""

from __future__ import annotations

import html
from pathlib import Path

from draftport.outputs.style import COLORS, LABELS, PHASES, pyplot
from draftport.outputs.tables import html_table, write_csv

PNGS = ("sets.png", "curves_by_set.png", "buckets.png")
CSV_COLS = ["phase", "set", "share", "accept_length", "ci_low", "ci_high"]
ARM_COLORS = ("#3d7dca", "#f2a541", "#2a9d5c", "#9b59b6", "#e74c3c", "#7f8c8d", "#16a085", "#8e5b3a")


def _fig(row: dict | None) -> str:
    """A figure with its CI, or "not measured"."""
    if not row or row.get("accept_length") is None:
        return "not measured"
    ci = row.get("ci")
    return f"{row['accept_length']:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _phases(t: dict) -> list[str]:
    return [ph for ph in PHASES if ph in t["phases"]] + sorted(ph for ph in t["phases"] if ph not in PHASES)


def _label(ph: str) -> str:
    return LABELS.get(ph, ph).replace("\n", " ")


def _bar_groups(ax, groups: list[str], series: dict[str, list[dict | None]]) -> None:
    """Bars per group, one per series, with the CI as error bars (gaps where not measured)."""
    width = 0.8 / max(len(series), 1)
    for j, (ph, rows) in enumerate(series.items()):
        xs, ys, lo, hi = [], [], [], []
        for i, row in enumerate(rows):
            if row and row.get("accept_length") is not None:
                x, y = i + (j - (len(series) - 1) / 2) * width, row["accept_length"]
                ci = row.get("ci") or [y, y]
                xs, ys, lo, hi = xs + [x], ys + [y], lo + [y - ci[0]], hi + [ci[1] - y]
        ax.bar(xs, ys, width=width, color=COLORS.get(ph, "#888888"), label=_label(ph), yerr=[lo, hi], capsize=2)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("accept length τ")


def _legend_below(fig, ax) -> None:
    """The phases' legend under the axes, clear of the bars."""
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))


def plot_sets(t: dict, out: Path) -> None:
    """Accept length of every phase on each held-out set (and the traffic-weighted figure), with CIs."""
    plt = pyplot()
    sets = [s["name"] for s in t["sets"]]
    groups = [f"{s['name']}\n{100 * s['share']:.3g}%" for s in t["sets"]] + (["weighted"] if t["weighted"] else [])
    series = {
        ph: [t["phases"][ph]["sets"].get(name) for name in sets]
        + ([t["phases"][ph]["weighted"]] if t["weighted"] else [])
        for ph in _phases(t)
    }
    fig, ax = plt.subplots(figsize=(max(6.5, 1.9 * len(groups) + 2), 5.0))
    _bar_groups(ax, groups, series)
    ax.set_title("Accept length per held-out set (share of traffic)", loc="left", fontsize=11)
    _legend_below(fig, ax)
    fig.savefig(out)
    plt.close(fig)


def plot_curves_by_set(t: dict, out: Path) -> bool:
    """One panel per set: every arm's τ by training samples on that set's prompts; False when no curve."""
    curves = t.get("curves") or {}
    if not any(curves.get(s["name"]) for s in t["sets"]):
        return False
    plt = pyplot()
    fig, axes = plt.subplots(1, len(t["sets"]), figsize=(4.6 * len(t["sets"]) + 0.6, 4.2), squeeze=False)
    for ax, s in zip(axes[0], t["sets"]):
        for j, (arm, rows) in enumerate(sorted((curves.get(s["name"]) or {}).items())):
            ns = [r["n_samples"] for r in rows]
            color = ARM_COLORS[j % len(ARM_COLORS)]
            ax.plot(ns, [r["accept_length"] for r in rows], marker="o", color=color, label=arm)
            ax.fill_between(ns, [r["ci"][0] for r in rows], [r["ci"][1] for r in rows], color=color, alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("training samples")
        ax.set_title(f"{s['name']} ({100 * s['share']:.3g}%)", loc="left", fontsize=11)
    axes[0][0].set_ylabel("accept length τ")
    axes[0][0].legend(frameon=False, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return True


def plot_buckets(t: dict, out: Path) -> None:
    """Accept length of every phase per context bucket of the verify position, with CIs."""
    plt = pyplot()
    names = t["context_buckets"]["names"]
    series = {ph: t["buckets"][ph] for ph in _phases(t) if ph in t["buckets"]}
    fig, ax = plt.subplots(figsize=(max(6.5, 1.7 * len(names) + 2), 5.0))
    _bar_groups(ax, names, series)
    limit = t.get("context_limit") or {}
    beyond = [i for i, row in enumerate(next(iter(series.values()), [])) if row.get("beyond_source_limit")]
    if limit.get("limited") and beyond:
        ax.axvspan(beyond[0] - 0.5, len(names) - 0.5, color="#e74c3c", alpha=0.08, label="past the source's limit")
    ax.set_xlabel("verify position (tokens of context)")
    ax.set_title("Accept length by context length", loc="left", fontsize=11)
    _legend_below(fig, ax)
    fig.savefig(out)
    plt.close(fig)


def set_rows(t: dict) -> list[dict]:
    """traffic.csv: every phase's figure on every set (and weighted), one row each."""
    rows = []
    for ph in _phases(t):
        for s in t["sets"]:
            row = t["phases"][ph]["sets"].get(s["name"]) or {}
            ci = row.get("ci") or [None, None]
            rows.append(
                {
                    "phase": ph,
                    "set": s["name"],
                    "share": s["share"],
                    "accept_length": row.get("accept_length"),
                    "ci_low": ci[0],
                    "ci_high": ci[1],
                }
            )
        if t["weighted"]:
            w = t["phases"][ph]["weighted"]
            rows.append(
                {
                    "phase": ph,
                    "set": "weighted",
                    "share": 1.0,
                    "accept_length": w["accept_length"],
                    "ci_low": w["ci"][0],
                    "ci_high": w["ci"][1],
                }
            )
    return rows


def _sets_table(t: dict) -> str:
    cols = [s["name"] for s in t["sets"]] + (["weighted"] if t["weighted"] else [])
    rows = []
    for ph in _phases(t):
        row = {
            "phase": _label(ph),
            **{name: _fig(t["phases"][ph]["sets"].get(name)) for name in cols[: len(t["sets"])]},
        }
        if t["weighted"]:
            row["weighted"] = _fig(t["phases"][ph]["weighted"])
        rows.append(row)
    heads = [f"{s['name']} ({100 * s['share']:.3g}%, {s['n_prompts']} prompts)" for s in t["sets"]]
    return html_table(rows, ["phase", *cols], ["phase", *heads, *(["traffic-weighted"] if t["weighted"] else [])])


def _buckets_table(t: dict) -> str:
    phases = [ph for ph in _phases(t) if ph in t["buckets"]]
    rows = []
    for j, name in enumerate(t["context_buckets"]["names"]):
        first = t["buckets"][phases[0]][j]
        row = {"bucket": name + (" (past the source's limit)" if first.get("beyond_source_limit") else "")}
        row |= {ph: f"{_fig(t['buckets'][ph][j])}, {t['buckets'][ph][j]['num_cycles']} cycles" for ph in phases}
        rows.append(row)
    return html_table(rows, ["bucket", *phases], ["verify positions", *[_label(ph) for ph in phases]])


def traffic_section(decision: dict | None, out_dir: Path) -> list[str]:
    """The section's HTML parts (images inlined by `img`), its charts and traffic.csv written to out_dir."""
    out_dir = Path(out_dir)
    for name in (*PNGS, "traffic.csv"):  # a previous run's, when this one has none
        (out_dir / name).unlink(missing_ok=True)
    t = (decision or {}).get("traffic")
    if not isinstance(t, dict) or not t.get("phases"):
        return []
    lead = (
        "Accept length per held-out set (targets.eval_sets), with its share of the traffic; "
        + ("every figure of the decision is the traffic-weighted one. " if t["weighted"] else "")
        + f"The recommended drafter is measured as {t.get('recommended_phase') or 'no phase'}."
    )
    parts = ["<h2>Accept length by kind of traffic and context length</h2>", f"<p>{html.escape(lead)}</p>"]
    plot_sets(t, out_dir / "sets.png")
    write_csv(out_dir / "traffic.csv", set_rows(t), CSV_COLS)
    parts += [_sets_table(t), out_dir / "sets.png"]
    if plot_curves_by_set(t, out_dir / "curves_by_set.png"):
        parts += ["<h3>Learning curves per set</h3>", out_dir / "curves_by_set.png"]
    if t.get("buckets"):
        plot_buckets(t, out_dir / "buckets.png")
        parts += ["<h3>By context length</h3>", _buckets_table(t), out_dir / "buckets.png"]
    return parts
