"""Step phase1_scratch (control): the same architecture, data and budget as Phase 1, trained
from a random init on the new map: what fine-tuning the source must beat."""

from draftport.pipeline import art, run_step, train_and_evaluate


def phase1_scratch(s):
    return train_and_evaluate(s, "phase1", features=art("features_new", "train"), init="scratch")


if __name__ == "__main__":
    raise SystemExit(run_step("phase1_scratch", phase1_scratch))
