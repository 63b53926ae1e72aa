"""tau of drafters trained on the same samples stored two ways: bf16 vs fp8_e4m3 states
(`features.dtype`), or on disk vs captured during training (`features.storage` online / hybrid).

Two pipeline runs of one profile that differ only in that setting (the same world, seeds and
samples): every trained phase's drafter of each run is measured on the SAME held-out features
(run A's `features_eval`: what a serving engine hands the drafter is the target's own states),
and the paired difference B - A gets a percentile bootstrap CI over prompts
(draftport.evaluation.decision.paired_diff_ci). Each run is named by its features_new's storage and dtype;
the two must differ in one of them and hold the same answers. Prints one JSON object.

    python benchmarks/features_tau.py RUN_A RUN_B [--k 3] [--n-boot 2000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftport.data.shards import open_set
from draftport.evaluation.accept import evaluate_drafter
from draftport.evaluation.decision import paired_diff_ci, tau_ci

PHASES = ("phase1_scratch", "phase1", "phase2")


def counts(res: dict):
    ps = res["per_sample"]
    return ps["accepted"], ps["cycles"]


def label(run: Path) -> str:
    idx = json.loads((run / "artifacts/features_new/train/index.json").read_text())
    return f"{idx.get('storage', 'disk')} {idx['dtype']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path, help="run A (its held-out features measure both)")
    ap.add_argument("b", type=Path, help="run B")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--n-boot", type=int, default=2000)
    a = ap.parse_args(argv)
    feats = a.a / "artifacts/features_eval/eval_new"
    target = a.a / "artifacts/world/target_new"
    la, lb = label(a.a), label(a.b)
    if la == lb:
        raise SystemExit(f"{a.a} and {a.b}: both features_new are {la}: nothing differs")
    sa, sb = open_set(a.a / "artifacts/features_new/train"), open_set(a.b / "artifacts/features_new/train")
    if len(sa) != len(sb) or any(not (sa.sample(i)["tokens"] == sb.sample(i)["tokens"]).all() for i in range(len(sa))):
        raise SystemExit(f"{a.a} and {a.b}: features_new hold other answers: not the same samples")
    out = {
        "a": {"run": str(a.a), "features": la},
        "b": {"run": str(a.b), "features": lb},
        "eval_features": str(feats),
        "k": a.k,
        "phases": {},
    }
    for ph in PHASES:
        d, res = {}, {}
        for name, run in (("a", a.a), ("b", a.b)):
            drafter = run / f"artifacts/train_{ph}/drafter"
            if not drafter.is_dir():
                break
            res[name] = evaluate_drafter(drafter, target, feats, k=a.k, batch_size=32)
            d[name] = tau_ci(*counts(res[name]), n_boot=a.n_boot)
        if len(res) < 2:
            continue
        diff = paired_diff_ci(*counts(res["b"]), *counts(res["a"]), n_boot=a.n_boot)
        out["phases"][ph] = {
            "a": {"tau": d["a"]["accept_length"], "ci": d["a"]["ci"]},
            "b": {"tau": d["b"]["accept_length"], "ci": d["b"]["ci"]},
            "b_minus_a": {"diff": diff["diff"], "ci": diff["ci"], "significant": diff["significant"]},
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
