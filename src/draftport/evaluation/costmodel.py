"""Speculative-decoding cost model: is a drafter worth serving?

One cycle = k draft steps + one target verify. The engine emits tau tokens per cycle
(accepted drafts + the bonus token), so  tok/s = tau / (verify + k * draft).
With a per-draft conditional acceptance p and an unbounded chain, tau = 1 / (1 - p);
with k drafts, tau = (1 - p^(k+1)) / (1 - p).

Seeds' anchor: baseline 82 tok/s, 30 ms verify -> break-even tau 2.46 (p ~ 59%).
No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftport.errors import DraftportError


@dataclass
class CostModel:
    baseline_tok_s: float
    verify_ms: float
    draft_ms: float = 0.0  # per draft step
    k: int | None = None  # None: the chain-length-free bound tau = 1/(1-p)

    def __post_init__(self):
        for name in ("baseline_tok_s", "verify_ms"):
            if not getattr(self, name) > 0:
                raise DraftportError(None, f"{name} must be > 0, got {getattr(self, name)}")
        if self.draft_ms < 0:
            raise DraftportError(None, f"draft_ms must be >= 0, got {self.draft_ms}")
        if self.k is not None and self.k < 1:
            raise DraftportError(None, f"k must be >= 1, got {self.k}")
        if self.draft_ms > 0 and self.k is None:
            # Without k the cycle has no draft steps to charge: the cost would vanish silently.
            raise DraftportError(None, "draft_ms needs k (the number of draft steps per cycle)")

    def cycle_s(self, k: int | None = None) -> float:
        k = self.k if k is None else k
        return (self.verify_ms + (k or 0) * self.draft_ms) / 1000.0

    def tok_s(self, accept_length: float, k: int | None = None) -> float:
        return accept_length / self.cycle_s(k)

    def accept_length_for(self, tok_s: float) -> float:
        return tok_s * self.cycle_s()

    @property
    def break_even_accept_length(self) -> float:
        return self.accept_length_for(self.baseline_tok_s)

    def cond_acc_for(self, accept_length: float) -> float | None:
        """Per-draft conditional acceptance p that yields accept_length (None: unreachable with k)."""
        if accept_length <= 1.0:
            # A verify cheaper than a plain decode step: even tau = 1 (every draft rejected) pays.
            return 0.0
        return cond_acc(accept_length, self.k)

    def table(self, targets=(100.0, 150.0, 200.0)) -> dict:
        rows = []
        for t in [self.baseline_tok_s, *targets]:
            tau = self.accept_length_for(t)
            rows.append({"tok_s": t, "accept_length": tau, "cond_acc": self.cond_acc_for(tau)})
        return {
            "baseline_tok_s": self.baseline_tok_s,
            "verify_ms": self.verify_ms,
            "draft_ms": self.draft_ms,
            "k": self.k,
            "break_even_accept_length": self.break_even_accept_length,
            "break_even_cond_acc": self.cond_acc_for(self.break_even_accept_length),
            "targets": rows,
        }


def accept_length_from_p(p: float, k: int | None = None) -> float:
    if k is None:
        return float("inf") if p >= 1 else 1.0 / (1.0 - p)
    if p >= 1:
        return float(k + 1)
    return (1.0 - p ** (k + 1)) / (1.0 - p)


def cond_acc(accept_length: float, k: int | None = None) -> float | None:
    """Inverse of accept_length_from_p (bisection for finite k)."""
    if accept_length < 1:
        raise DraftportError(None, f"accept length must be >= 1, got {accept_length}")
    if k is None:
        return 1.0 - 1.0 / accept_length
    if accept_length > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if accept_length_from_p(mid, k) < accept_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def best_k(accept_rate_pos: list[float], cm: CostModel) -> dict:
    """Best number of draft tokens from measured per-position acceptance.

    accept_rate_pos[i] = fraction of cycles in which draft i+1 was accepted (all earlier ones
    were too), so tau(k) = 1 + sum(accept_rate_pos[:k]).
    """
    if not accept_rate_pos:
        raise DraftportError(None, "need at least one per-position acceptance rate")
    bad = [r for r in accept_rate_pos if not 0.0 <= r <= 1.0]
    if bad:
        raise DraftportError(None, f"per-position acceptance rates must lie in [0, 1], got {bad[0]}")
    return best_k_of([(k, 1.0 + sum(accept_rate_pos[:k])) for k in range(1, len(accept_rate_pos) + 1)], cm)


def best_k_of(taus: list[tuple[int, float]], cm: CostModel) -> dict:
    """Best number of draft tokens from (k, tau) pairs: an evaluation's tau measured at each k
    (draftport.evaluation.accept's by_k), or best_k's extrapolation from one k's rates."""
    rows = [{"k": k, "accept_length": tau, "tok_s": cm.tok_s(tau, k)} for k, tau in taus]
    best = max(rows, key=lambda r: r["tok_s"])
    return {"best_k": best["k"], "best_tok_s": best["tok_s"], "by_k": rows}
