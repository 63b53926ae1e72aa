"""Step features_new: the new target's own greedy answers to Phase 1's training prompts, and its
hidden states at the source drafter's aux layers (artifacts/features_new/train)."""

from draftport.pipeline import build_features, check_source_fits, run_step, target_dir


def features_new(s):
    t, f = s.p["targets"], s.p["features"]
    check_source_fits(f)
    return {"train": build_features(s.path("train"), target_dir(t["new"]), t["prompts_train"], f,
                                    n=s.p["phase1"]["n_samples"], trust=t["trust_remote_code"])}


if __name__ == "__main__":
    raise SystemExit(run_step("features_new", features_new))
