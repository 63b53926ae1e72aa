"""What the port costs in hours: the rates the pipeline's own steps measured (seconds of
regeneration and capture per sample, seconds of each training) turned into device-hours per
learning-curve point and per phase, and the payback of a chosen drafter at a serving volume.

Device-hours = wall hours x max(1, the step's resources.gpu): on the CPU (the embedded world) one
process is one device. Hours are measured, so they vary from run to run (every other figure of the
decision reruns exactly). Torch-free."""

from __future__ import annotations

from draftport.errors import DraftportError


def devices(resources: dict | None, step: str) -> int:
    if not resources:
        return 1
    return max(1, int({**resources.get("default", {}), **(resources.get(step) or {})}.get("gpu", 0)))


def _seconds(t: dict | None, where: str) -> tuple[int, float, float]:
    """(samples, regenerate s, capture s) of a features step's training set, as it measured it."""
    if not t:
        return 0, 0.0, 0.0
    try:
        return int(t["samples"]), float(t["regenerate"]), float(t["capture"])
    except (KeyError, TypeError, ValueError):
        raise DraftportError(where, "no samples / regenerate / capture seconds: rerun the features step") from None


def rates(data: dict, resources: dict | None = None) -> dict:
    """Device-seconds per sample: regenerating an answer, capturing a regenerated sample, capturing
    a dataset sample (prefill of the dataset's answer), from what the features steps measured
    (data: {"features_new": {"samples", "regenerate", "capture"}, "features_phase2" (or "budget": the
    adaptive rounds'): ..., "features_dataset": ... or None}: their timing["train"], logs/<step>.json)."""
    n = reg = cap = 0.0
    for step in (st for st in data if st != "features_dataset"):
        k, r, c = _seconds(data.get(step), f"logs/{step}.json")
        dev = devices(resources, step)
        n, reg, cap = n + k, reg + r * dev, cap + c * dev
    if n == 0:
        raise DraftportError("logs/features_new.json", "no samples: the data rates are unknown")
    out = {"regenerate_s_per_sample": reg / n, "capture_s_per_sample": cap / n, "capture_dataset_s_per_sample": None}
    k, _, c = _seconds(data.get("features_dataset"), "logs/features_dataset.json")
    if k:
        out["capture_dataset_s_per_sample"] = c * devices(resources, "features_dataset") / k
    return out


def split(n: int, train_s: float, r: dict, answers: str = "regenerated") -> dict:
    """Device-hours of a drafter trained on n samples: regenerate (0 for the dataset's answers),
    capture, train (train_s: its training's device-seconds)."""
    dataset = answers == "dataset"
    cap = (
        r["capture_dataset_s_per_sample"]
        if dataset and r["capture_dataset_s_per_sample"] is not None
        else r["capture_s_per_sample"]
    )
    h = {
        "regenerate": 0.0 if dataset else n * r["regenerate_s_per_sample"] / 3600,
        "capture": n * cap / 3600,
        "train": train_s / 3600,
    }
    return {**h, "total": sum(h.values())}


def payback(port_hours: float, tok_s_chosen: float, tok_s_break_even: float, tokens_per_day: float) -> dict:
    """Days of serving tokens_per_day until port_hours are recovered: each day the chosen drafter
    saves tokens_per_day x (1 / tok_s at break-even - 1 / tok_s chosen) seconds of decoding at the
    cost model's per-request speed, an hour of decoding counted as one device-hour (a deployment of
    G GPUs decoding c requests at once spends G / c device-hours on one: scale by that). None when
    the drafter is not faster than break-even."""
    saved_h = tokens_per_day * (1.0 / tok_s_break_even - 1.0 / tok_s_chosen) / 3600
    return {
        "tokens_per_day": tokens_per_day,
        "saved_hours_per_day": saved_h,
        "port_hours": port_hours,
        "days": port_hours / saved_h if saved_h > 0 else None,
    }
