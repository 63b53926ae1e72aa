"""Step phase1: fine-tune the source drafter on the new target's data (its lm_head moved onto the
new map by target id, or the source map kept: phase1.vocab_policy), against Phase 0 and the
from-scratch control."""

from draftport.errors import DraftportError
from draftport.pipeline import art, read_json, run_step, train_and_evaluate


def phase1(s):
    verdict = read_json(art("compare", "compare.json"))["verdict"]
    if not verdict["compatible_architecture"]:
        raise DraftportError("compare", "the source drafter does not load into the new layout: "
                             + "; ".join(verdict["reasons"]))
    out = train_and_evaluate(s, "phase1", features=art("features_new", "train"), init="source",
                             vocab_policy=s.p["phase1"]["vocab_policy"])
    for ref in ("phase0", "phase1_scratch"):
        out[f"gain_vs_{ref}"] = out["accept_length"] - read_json(art(ref, "metrics.json"))["accept_length"]
    return out


if __name__ == "__main__":
    raise SystemExit(run_step("phase1", phase1))
