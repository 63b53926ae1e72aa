"""Step vocab_new: the new target's draft vocabulary (d2t/t2d from its own answers to Phase 1's
prompts), and how it overlaps the source drafter's map."""

from draftport import plan
from draftport.pipeline import art, run_step, source_dir, target_config, target_dir
from draftport.vocab import compare_maps


def vocab_new(s):
    vocab = target_config(target_dir(s.p["targets"]["new"]))["vocab_size"]
    stats = plan.build_vocab(art("features_new", "train"), s.path("vocab.safetensors"),
                             draft_vocab_size=s.p["vocab_new"]["draft_vocab_size"], vocab_size=vocab)
    new_d2t, _ = plan.read_vocab(s.path("vocab.safetensors"))
    cmp = compare_maps(plan.cfg_d2t(source_dir()), new_d2t)
    return {**stats, "vs_source": {k: cmp[k] for k in ("overlap", "jaccard", "src_only", "dst_only",
                                                        "positions_differ", "overlap_frac_of_src")}}


if __name__ == "__main__":
    raise SystemExit(run_step("vocab_new", vocab_new))
