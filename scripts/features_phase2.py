"""Step features_phase2: Phase 2's scaled data: the next prompts after Phase 1's (no overlap),
answered by the new target, up to phase2.n_samples in all."""

from draftport.pipeline import build_features, check_source_fits, run_step, target_dir


def features_phase2(s):
    t, f = s.p["targets"], s.p["features"]
    check_source_fits(f)
    n1, n2 = s.p["phase1"]["n_samples"], s.p["phase2"]["n_samples"]
    return {"train": build_features(s.path("train"), target_dir(t["new"]), t["prompts_train"], f,
                                    n=n2 - n1, offset=n1, trust=t["trust_remote_code"]), "offset": n1}


if __name__ == "__main__":
    raise SystemExit(run_step("features_phase2", features_phase2))
