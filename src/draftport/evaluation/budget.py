"""The adaptive data budget's rule: after each round of data (n grown by a factor, the source
fine-tuned at that n with several seeds, every drafter scored on the new target's held-out set),
project the next round's accept-length gain and stop when more data is not worth it.

The projection fits the curve's last two slopes per e-fold of n: slope_j = (tau_j - tau_(j-1)) /
ln(n_j / n_(j-1)). A curve tau = a - b * n^-c (the usual learning curve) has slopes that shrink by
a constant ratio per equal step of ln n, so the next slope is slope_r * rho, rho = slope_r /
slope_(r-1) clipped to [0, 1] (1 after the first round, or when the earlier slope is not
positive: no evidence of flattening, so no discount), and the projected gain is that slope times
ln(n_next / n_r). Its CI comes from the decision's percentile bootstrap over prompts: one draw of
prompts per replicate for every round (each round's seeds pooled), so the rounds stay paired.

Stop (in this order): the projected gain's upper CI bound < min_gain ("flattened"); n reached the
cap ("cap: samples"); the hours spent plus the next round's projected hours exceed max_hours ("cap:
hours"). Torch-free."""

from __future__ import annotations

import math

import numpy as np

from draftport.errors import DraftportError
from draftport.evaluation.bootstrap import (
    boot_taus,
    check_boot,
    check_strata,
    percentile_ci,
    prompt_counts,
    weighted_tau,
)

FLATTENED, CAP_SAMPLES, CAP_HOURS = "flattened", "cap: samples", "cap: hours"


def next_n(n: int, factor: float, cap: int) -> int:
    """The next round's n: n x factor rounded up, at most cap (and always more than n)."""
    return min(cap, max(n + 1, math.ceil(n * factor)))


def schedule(n1: int, factor: float, cap: int) -> list[int]:
    """Every n the rounds may reach: Phase 1's n (round 0), then x factor up to the cap."""
    ns = [n1]
    while ns[-1] < cap:
        ns.append(next_n(ns[-1], factor, cap))
    return ns


def _projection(taus: list, ns: list[int], n_next: int):
    """Projected gain of the round at n_next from the measured taus (floats or bootstrap arrays)."""
    slopes = [(taus[j] - taus[j - 1]) / math.log(ns[j] / ns[j - 1]) for j in range(1, len(ns))]
    last = slopes[-1]
    if len(slopes) >= 2:
        prev = slopes[-2]
        with np.errstate(divide="ignore", invalid="ignore"):
            rho = np.where(
                np.asarray(prev) > 0,
                np.clip(np.asarray(last) / np.where(np.asarray(prev) > 0, prev, 1.0), 0.0, 1.0),
                1.0,
            )
    else:
        rho = 1.0
    return last * rho * math.log(n_next / ns[-1])


def project_next_gain(
    rounds: list[dict], n_next: int, *, n_boot: int = 2000, level: float = 0.95, seed: int = 0, strata=None
) -> dict:
    """rounds: [{"n_samples", "accepted": [S][P], "cycles": [S][P]}, ...] in order (at least two,
    every one on the same P prompts). Returns {"taus", "gains" (round over round), "projected_gain",
    "ci": [lo, hi]} for the round at n_next. strata (bootstrap's): the traffic-weighted tau of the eval sets."""
    check_boot(n_boot, level)
    if len(rounds) < 2:
        raise DraftportError("budget", "a projection needs at least two rounds (Phase 1's n and one more)")
    ns = [int(r["n_samples"]) for r in rounds]
    if ns != sorted(set(ns)) or n_next <= ns[-1]:
        raise DraftportError("budget", f"rounds' n {ns} and the next {n_next} must be increasing")
    counts = [prompt_counts(r["accepted"], r["cycles"], f"budget round n={r['n_samples']}") for r in rounds]
    if len({a.shape[1] for a, _ in counts}) != 1:
        raise DraftportError("budget", "every round must be scored on the same prompts")
    P = counts[0][0].shape[1]
    if strata is None:
        taus = [float(1.0 + a.sum() / c.sum()) for a, c in counts]
    else:
        strata = check_strata(strata, P, "budget")
        taus = [float(weighted_tau(a, c, strata, "budget")) for a, c in counts]
    boots = boot_taus(
        np.random.default_rng(seed), [(a.sum(axis=0), c.sum(axis=0)) for a, c in counts], P, n_boot, strata=strata
    )
    proj = np.asarray(_projection(boots, ns, n_next)) + 0.0  # + 0.0: no -0.0 (a clipped rho) in the text
    return {
        "taus": taus,
        "gains": [taus[j] - taus[j - 1] for j in range(1, len(taus))],
        "projected_gain": float(_projection(taus, ns, n_next)) + 0.0,
        "ci": [v + 0.0 for v in percentile_ci(proj, level)],
    }


def stop_reason(
    projection: dict | None,
    *,
    n: int,
    cap: int,
    min_gain: float,
    hours_spent: float,
    next_hours: float,
    max_hours: float | None,
) -> str | None:
    """Why the rounds stop after the one at n, or None to go on (projection: project_next_gain's,
    None when n is already the cap)."""
    if projection is not None and projection["ci"][1] < min_gain:
        return FLATTENED
    if n >= cap:
        return CAP_SAMPLES
    if max_hours is not None and hours_spent + next_hours > max_hours:
        return CAP_HOURS
    return None


def explain(
    reason: str,
    *,
    n: int,
    projection: dict | None,
    min_gain: float,
    next_n_: int | None,
    hours_spent: float,
    next_hours: float,
    max_hours: float | None,
) -> str:
    """The stop in a sentence (budget.json and the decision's text)."""
    if reason == FLATTENED:
        p = projection
        return (
            f"stopped at n = {n:,}: the next round (n = {next_n_:,}) projects a gain of {p['projected_gain']:+.3f} "
            f"[{p['ci'][0]:+.3f}, {p['ci'][1]:+.3f}], its upper bound below min_gain {min_gain}"
        )
    if reason == CAP_SAMPLES:
        return f"stopped at n = {n:,}: the cap (phase2.n_samples) reached" + (
            f"; a further round (n = {next_n_:,}) would still gain {projection['projected_gain']:+.3f} "
            f"[{projection['ci'][0]:+.3f}, {projection['ci'][1]:+.3f}] (projected)"
            if projection is not None
            else ""
        )
    return (
        f"stopped at n = {n:,}: the next round's {next_hours:.3g} h on top of {hours_spent:.3g} h spent "
        f"would pass data.max_hours {max_hours}"
    )
