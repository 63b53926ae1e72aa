"""Wall time of a profile's training phases on N GPUs, from a measured one-GPU throughput.

    tokens  = steps x global batch x tokens per sample
    seconds = tokens / (one-GPU tok/s x GPUs x scaling efficiency)

The one-GPU figure is read from a benchmark result (benchmarks/results/*.json of
benchmarks/bench_train_h200.py): `tokens_per_s_lm_head_trainable` when the phase trains lm_head
(draftport's default; Phase 1's vocab remap needs it), else `tokens_per_s_mask_precomputed`
(lm_head frozen, the target's greedy choice stored with the features, as features.build_features
stores it). Every input is printed next to the result so the arithmetic can be redone by hand.
Data generation (the target's answers and hidden states) is not included.
"""

from __future__ import annotations

import json
from pathlib import Path

from .data import bytes_per_token
from .errors import DraftportError

DEFAULT_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "2026-11-29-h200.json"
PHASES = (("phase1_scratch", "phase1"), ("phase1", "phase1"), ("phase2", "phase2"))


def train_seconds(*, steps: int, batch_size: int, tokens_per_sample: int, tok_s_per_gpu: float, gpus: int,
                  efficiency: float) -> float:
    if min(steps, batch_size, tokens_per_sample, gpus) < 1 or tok_s_per_gpu <= 0 or not 0 < efficiency <= 1:
        raise DraftportError("estimate", "steps, batch, tokens per sample, GPUs must be >= 1; "
                             "throughput > 0; efficiency in (0, 1]")
    return steps * batch_size * tokens_per_sample / (tok_s_per_gpu * gpus * efficiency)


def bench_throughput(path=DEFAULT_BENCH) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DraftportError(path, "no such benchmark result")
    d = json.loads(path.read_text())
    try:
        return {"device": d["device"], "date": d["date"], "seq": d["config"]["seq"],
                "ttt_steps": d["config"]["ttt_steps"], "hidden_size": d["config"]["hidden_size"],
                "lm_head_trainable": float(d["tokens_per_s_lm_head_trainable"]),
                "lm_head_frozen": float(d["tokens_per_s_mask_precomputed"])}
    except KeyError as e:
        raise DraftportError(path, f"benchmark result lacks {e}") from None


def estimate(cfg: dict, *, tokens_per_sample: int | None = None, gpus: int | None = None,
             efficiency: float = 0.9, bench=DEFAULT_BENCH) -> dict:
    """Per training rule: tokens, throughput used, hours; plus the feature storage per phase."""
    b = bench_throughput(bench)
    tps = tokens_per_sample or b["seq"]
    rows = []
    for rule, group in PHASES:
        tr = cfg[group]["train"]
        step = f"train_{rule}"  # the training step's resources (draftport.steps.registry)
        n_gpu = gpus or max(1, int({**cfg["resources"]["default"], **cfg["resources"].get(step, {})}["gpu"]))
        trainable = tr.get("train_lm_head", True)
        rate = b["lm_head_trainable"] if trainable else b["lm_head_frozen"]
        steps, batch = int(tr["steps"]), int(tr["batch_size"])
        sec = train_seconds(steps=steps, batch_size=batch, tokens_per_sample=tps, tok_s_per_gpu=rate,
                            gpus=n_gpu, efficiency=efficiency)
        n = cfg[group]["n_samples"]
        rows.append({"rule": rule, "steps": steps, "batch_size": batch, "samples": n,
                     "epochs": round(steps * batch / n, 2), "tokens": steps * batch * tps,
                     "lm_head": "trainable" if trainable else "frozen", "tok_s_per_gpu": round(rate),
                     "gpus": n_gpu, "seconds": sec, "hours": sec / 3600})
    hidden = b["hidden_size"]
    per_tok = bytes_per_token(hidden, cfg["features"]["dtype"])
    storage = {g: cfg[g]["n_samples"] * tps * per_tok for g in ("phase1", "phase2")}
    return {"bench": {k: b[k] for k in ("device", "date", "seq", "ttt_steps")}, "tokens_per_sample": tps,
            "efficiency": efficiency, "rows": rows,
            "phase1_hours": sum(r["hours"] for r in rows if r["rule"] in ("phase1_scratch", "phase1")),
            "phase2_hours": sum(r["hours"] for r in rows if r["rule"] == "phase2"),
            "bytes_per_token": per_tok, "hidden_size": hidden, "storage_bytes": storage}


def render(rep: dict) -> str:
    """The table `draftport estimate` prints (render.estimate_renderables), as plain text."""
    import io

    from rich.console import Console, Group

    from .render import estimate_renderables

    buf = io.StringIO()
    Console(file=buf, width=150, color_system=None, highlight=False).print(Group(*estimate_renderables(rep)))
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())
