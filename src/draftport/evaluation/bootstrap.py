"""Bootstrap confidence intervals over prompts: a drafter's accept length (accepted drafts and
cycles per prompt, resampled by prompt, seeds pooled) and the paired difference of two drafters on
the same prompts; with strata (the traffic's held-out sets and their shares) the share-weighted
figure, prompts resampled within each stratum. What the decision and the adaptive budget's rule
both compute with."""

from __future__ import annotations

import numpy as np

from draftport.errors import DraftportError

BOOT_CHUNK = 256  # bootstrap replicates drawn at a time (memory: chunk * P indices)


def prompt_counts(accepted, cycles, where: str):
    """[S, P] float arrays of accepted / cycles, checked (1-D input is one seed row)."""
    try:
        a = np.asarray(accepted, dtype=float)
        c = np.asarray(cycles, dtype=float)
    except (TypeError, ValueError):
        raise DraftportError(where, "accepted and cycles must be numbers (arrays of shape [seeds, prompts])") from None
    if a.ndim == 1:
        a = a[None, :]
    if c.ndim == 1:
        c = c[None, :]
    if a.ndim != 2 or c.ndim != 2:
        raise DraftportError(
            where,
            f"accepted and cycles must be [prompts] or [seeds, prompts], got shapes "
            f"{list(a.shape)} and {list(c.shape)}",
        )
    if a.shape != c.shape:
        raise DraftportError(where, f"accepted and cycles differ in shape: {list(a.shape)} vs {list(c.shape)}")
    if a.size == 0:
        raise DraftportError(where, f"no counts (shape {list(a.shape)}): need at least one seed and one prompt")
    if not (np.isfinite(a).all() and np.isfinite(c).all()):
        raise DraftportError(where, "accepted and cycles must be finite")
    if (a < 0).any() or (c < 0).any():
        raise DraftportError(where, "accepted and cycles must be >= 0 (they are counts)")
    if c.sum() == 0:
        raise DraftportError(where, "sum of cycles is 0: no verify cycle was measured, accept length undefined")
    return a, c


def check_boot(n_boot: int, level: float):
    if not isinstance(n_boot, int) or n_boot < 1:
        raise DraftportError("n_boot", f"must be an integer >= 1, got {n_boot!r}")
    if not 0.0 < float(level) < 1.0:
        raise DraftportError("level", f"must be in (0, 1), got {level!r}")


def check_strata(strata, P: int, where: str) -> list[tuple]:
    """strata as [(prompt indices, share)], checked: indices in [0, P), disjoint, covering every
    prompt; shares > 0 summing to 1."""
    if not isinstance(strata, (list, tuple)) or not strata:
        raise DraftportError(where, "strata must be a non-empty list of (prompt indices, share) pairs")
    out = []
    for i, st in enumerate(strata):
        if not isinstance(st, (list, tuple)) or len(st) != 2:
            raise DraftportError(where, f"strata[{i}] must be a pair (prompt indices, share), got {st!r}")
        ix, share = np.asarray(st[0]), st[1]
        if ix.ndim != 1 or ix.size == 0 or not np.issubdtype(ix.dtype, np.integer):
            raise DraftportError(where, f"strata[{i}]: prompt indices must be a non-empty 1-D list of integers")
        if ix.min() < 0 or ix.max() >= P:
            raise DraftportError(
                where, f"strata[{i}]: prompt indices must lie in [0, {P}), got {int(ix.min())}..{int(ix.max())}"
            )
        if isinstance(share, bool) or not isinstance(share, (int, float, np.number)) or not share > 0:
            raise DraftportError(where, f"strata[{i}]: share must be a number > 0, got {share!r}")
        out.append((ix.astype(np.intp), float(share)))
    every = np.concatenate([ix for ix, _ in out])
    if np.unique(every).size != every.size:
        raise DraftportError(where, "strata overlap: a prompt index appears in more than one stratum")
    if every.size != P:
        raise DraftportError(where, f"strata cover {every.size} of the {P} prompts: they must cover every prompt")
    total = sum(share for _, share in out)
    if not abs(total - 1.0) <= 1e-6:
        raise DraftportError(where, f"strata shares sum to {total:.6g}, not 1")
    return out


def weighted_tau(a, c, strata, where: str) -> float:
    """sum_s share_s * tau_s of [S, P] counts, tau_s pooled over every seed row on stratum s's prompts."""
    total = 0.0
    for i, (ix, share) in enumerate(strata):
        cyc = c[:, ix].sum()
        if cyc == 0:
            raise DraftportError(where, f"stratum {i} has no cycle: its accept length is undefined")
        total += share * (1.0 + a[:, ix].sum() / cyc)
    return total


def weighted_rows(a, c, strata, where: str):
    """Each seed row's sum_s share_s * tau_s of [S, P] counts."""
    rows = np.zeros(a.shape[0])
    for i, (ix, share) in enumerate(strata):
        row_cyc = c[:, ix].sum(axis=1)
        if (row_cyc == 0).any():
            bad = [int(r) for r in np.flatnonzero(row_cyc == 0)]
            raise DraftportError(
                where, f"seed row(s) {bad} have no cycle on stratum {i}: their accept length is undefined"
            )
        rows += share * (1.0 + a[:, ix].sum(axis=1) / row_cyc)
    return rows


def boot_taus(rng, per_prompt_pairs, P: int, n_boot: int, strata=None):
    """For each replicate, one draw of P prompt indices (with strata: each stratum's own prompts,
    drawn independently); per (A, C) pair (per-prompt sums over that drafter's seeds) the pooled tau
    of the drawn prompts (with strata: sum_s share_s * tau_s). Returns one array [n_boot] per pair
    (nan where the drawn prompts of a stratum have no cycle at all)."""
    outs = [np.empty(n_boot) for _ in per_prompt_pairs]
    done = 0
    while done < n_boot:
        m = min(BOOT_CHUNK, n_boot - done)
        if strata is None:
            draws = [(rng.integers(0, P, size=(m, P)), 1.0)]
        else:
            draws = [(ix[rng.integers(0, ix.size, size=(m, ix.size))], share) for ix, share in strata]
        for out, (A, C) in zip(outs, per_prompt_pairs):
            total = None
            for idx, share in draws:
                num = A[idx].sum(axis=1)
                den = C[idx].sum(axis=1)
                with np.errstate(divide="ignore", invalid="ignore"):
                    tau = np.where(den > 0, 1.0 + num / np.where(den > 0, den, 1.0), np.nan)
                # strata=None: tau itself, so the figures stay bit-identical to the unstratified bootstrap
                total = tau if strata is None else (share * tau if total is None else total + share * tau)
            out[done : done + m] = total
        done += m
    return outs


def percentile_ci(samples, level: float) -> list[float]:
    ok = samples[np.isfinite(samples)]
    if ok.size == 0:
        raise DraftportError("bootstrap", "every bootstrap replicate drew prompts without a single cycle")
    lo, hi = np.percentile(ok, [100.0 * (1.0 - level) / 2.0, 100.0 * (1.0 + level) / 2.0])
    return [float(lo), float(hi)]


def tau_ci(
    accepted,
    cycles,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    where: str = "tau_ci",
    strata=None,
) -> dict:
    """Pooled accept length of [S, P] counts (S seeds, P prompts; 1-D = one seed) and its percentile
    bootstrap CI over prompts (the same drawn prompts for every seed row). strata: [(prompt indices,
    share), ...] -> the traffic-weighted sum_s share_s * tau_s, prompts resampled within each stratum.

    Returns {"accept_length", "ci": [lo, hi], "seeds": per-row tau, "seed_std" (population std of
    the rows' tau, 0.0 for one row), "n_prompts"}. Deterministic given `seed`."""
    check_boot(n_boot, level)
    a, c = prompt_counts(accepted, cycles, where)
    row_cyc = c.sum(axis=1)
    if (row_cyc == 0).any():
        bad = [int(i) for i in np.flatnonzero(row_cyc == 0)]
        raise DraftportError(where, f"seed row(s) {bad} have no cycle: their accept length is undefined")
    P = a.shape[1]
    if strata is None:
        rows = 1.0 + a.sum(axis=1) / row_cyc
        tau = 1.0 + a.sum() / c.sum()
    else:
        strata = check_strata(strata, P, where)
        tau, rows = weighted_tau(a, c, strata, where), weighted_rows(a, c, strata, where)
    (boot,) = boot_taus(np.random.default_rng(seed), [(a.sum(axis=0), c.sum(axis=0))], P, n_boot, strata)
    return {
        "accept_length": float(tau),
        "ci": percentile_ci(boot, level),
        "seeds": [float(t) for t in rows],
        "seed_std": float(np.std(rows)) if len(rows) > 1 else 0.0,
        "n_prompts": int(P),
    }


def paired_diff_ci(
    a_acc,
    a_cyc,
    b_acc,
    b_cyc,
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    where: str = "paired_diff_ci",
    strata=None,
) -> dict:
    """tau_a - tau_b (each pooled over its own seeds) on the SAME P prompts, with a percentile
    bootstrap CI from one shared prompt draw per replicate. strata: as tau_ci's (each side
    traffic-weighted, one draw within each stratum shared by a and b).

    Returns {"diff", "ci": [lo, hi], "significant" (the CI excludes 0), "better": "a" | "b" | None}."""
    check_boot(n_boot, level)
    a, ac = prompt_counts(a_acc, a_cyc, f"{where} (a)")
    b, bc = prompt_counts(b_acc, b_cyc, f"{where} (b)")
    if a.shape[1] != b.shape[1]:
        raise DraftportError(
            where, f"a and b must be measured on the same prompts: a has {a.shape[1]} prompts, b has {b.shape[1]}"
        )
    if strata is None:
        diff = (1.0 + a.sum() / ac.sum()) - (1.0 + b.sum() / bc.sum())
    else:
        strata = check_strata(strata, a.shape[1], where)
        diff = weighted_tau(a, ac, strata, f"{where} (a)") - weighted_tau(b, bc, strata, f"{where} (b)")
    ta, tb = boot_taus(
        np.random.default_rng(seed),
        [(a.sum(axis=0), ac.sum(axis=0)), (b.sum(axis=0), bc.sum(axis=0))],
        a.shape[1],
        n_boot,
        strata,
    )
    ci = percentile_ci(ta - tb, level)
    significant = ci[0] > 0.0 or ci[1] < 0.0
    better = ("a" if ci[0] > 0.0 else "b") if significant else None
    return {"diff": float(diff), "ci": ci, "significant": bool(significant), "better": better}
