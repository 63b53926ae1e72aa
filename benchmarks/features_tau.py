"""tau of drafters trained on fp8_e4m3 features against drafters trained on bfloat16 features.

Two pipeline runs of one profile that differ only in `features.dtype` (the same world, seeds and
samples): every trained phase's drafter of each run is measured on the SAME held-out features
(the bf16 run's `features_eval`: what a serving engine hands the drafter is the target's own
states, not an fp8 copy), and the paired difference fp8 - bf16 gets a percentile bootstrap CI
over prompts (draftport.decision.paired_diff_ci). Prints one JSON object.

    python benchmarks/fp8_tau.py RUN_BF16 RUN_FP8 [--k 3] [--n-boot 2000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftport.decision import paired_diff_ci, tau_ci
from draftport.evaluate import evaluate_drafter

PHASES = ("phase1_scratch", "phase1", "phase2")


def counts(res: dict):
    ps = res["per_sample"]
    return ps["accepted"], ps["cycles"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bf16", type=Path)
    ap.add_argument("fp8", type=Path)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--n-boot", type=int, default=2000)
    a = ap.parse_args(argv)
    feats = a.bf16 / "artifacts/features_eval/eval_new"
    target = a.bf16 / "artifacts/world/target_new"
    for run, dtype in ((a.bf16, "bfloat16"), (a.fp8, "fp8_e4m3")):
        got = json.loads((run / "artifacts/features_new/train/index.json").read_text())["dtype"]
        if got != dtype:
            raise SystemExit(f"{run}: features_new stored {got}, expected {dtype}")
    out = {"eval_features": str(feats), "k": a.k, "phases": {}}
    for ph in PHASES:
        d = {}
        res = {}
        for name, run in (("bf16", a.bf16), ("fp8", a.fp8)):
            drafter = run / f"artifacts/train_{ph}/drafter"
            if not drafter.is_dir():
                break
            res[name] = evaluate_drafter(drafter, target, feats, k=a.k, batch_size=32)
            acc, cyc = counts(res[name])
            d[name] = tau_ci(acc, cyc, n_boot=a.n_boot)
        if len(res) < 2:
            continue
        diff = paired_diff_ci(*counts(res["fp8"]), *counts(res["bf16"]), n_boot=a.n_boot)
        out["phases"][ph] = {"bf16": {"tau": d["bf16"]["accept_length"], "ci": d["bf16"]["ci"]},
                             "fp8": {"tau": d["fp8"]["accept_length"], "ci": d["fp8"]["ci"]},
                             "fp8_minus_bf16": {"diff": diff["diff"], "ci": diff["ci"],
                                                "significant": diff["significant"]}}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
