"""The learning curves' plan, torch-free: their points (n x init x seed) and the budget rule that
gives each point its steps (the curves step trains them; the estimate bills them)."""

from __future__ import annotations

import math


def budget_steps(n: int, c: dict) -> int:
    """The budget rule: the same epochs at every n, at least min_steps, at most train.steps
    (with train.patience > 0 a point may stop earlier, at a plateau of its held-out tau)."""
    bs = c["train"]["batch_size"]
    return min(c["train"]["steps"], max(c["min_steps"], math.ceil(c["epochs"] * n / bs)))


def points(c: dict) -> list[dict]:
    """Every point of the curves group c: name, init, n_samples, seed."""
    return [{"name": f"{init}_n{n}_s{seed}", "init": init, "n_samples": n, "seed": seed}
            for n in c["n_samples"] for init in c["inits"] for seed in c["seeds"]]
