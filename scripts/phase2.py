"""Step phase2: continue Phase 1's drafter (its map kept) on the scaled data."""

from draftport.pipeline import art, read_json, run_step, train_and_evaluate


def phase2(s):
    out = train_and_evaluate(s, "phase2", features=art("features_phase2", "train"),
                             init=art("phase1", "drafter"))
    out["gain_vs_phase1"] = out["accept_length"] - read_json(art("phase1", "metrics.json"))["accept_length"]
    return out


if __name__ == "__main__":
    raise SystemExit(run_step("phase2", phase2))
