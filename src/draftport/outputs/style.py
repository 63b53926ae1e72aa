"""What every chart of the report shares: the phases' order, labels and colours, and matplotlib
set up headless."""

from __future__ import annotations

PHASES = ("phase0", "phase1_scratch", "phase1", "phase2")
LABELS = {
    "phase0": "Phase 0\nsource as-is",
    "phase1_scratch": "Phase 1 control\nfrom scratch",
    "phase1": "Phase 1\nfine-tuned",
    "phase2": "Phase 2\nscaled data",
}
COLORS = {"phase0": "#9e9e9e", "phase1_scratch": "#f2a541", "phase1": "#3d7dca", "phase2": "#2a9d5c", "old": "#d0d0d0"}


def pyplot():
    # lazy: matplotlib is optional (the pipeline extra); the Agg backend before pyplot
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 11, "axes.spines.top": False, "axes.spines.right": False, "figure.dpi": 110})
    return plt
