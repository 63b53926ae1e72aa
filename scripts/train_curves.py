"""Step train_curves: learning curves: fine-tune and scratch at each curves.n_samples x seed, one
budget rule (its registry row: src/draftport/plan/registry.py)."""

from draftport.pipeline.runner import main

if __name__ == "__main__":
    raise SystemExit(main("train_curves"))
