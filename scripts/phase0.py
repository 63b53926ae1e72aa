"""Step phase0 (probe): the source drafter as fetched, its own map, on the new target's held-out
set; and on the old target's, the number it was built for; and the profile's reference drafter
(one trained for the new target itself), the upper bound, on the same set."""

from draftport.pipeline import art, evaluate_on, phase_metrics, run_step, source_dir, target_dir, write_json


def phase0(s):
    t = s.p["targets"]
    res = evaluate_on(source_dir(), target_dir(t["new"]), art("features_eval", "eval_new"), s.p)
    write_json(s.path("eval.json"), res)
    out = phase_metrics(res, s.p)
    if t["old"] and t["prompts_eval_old"]:
        old = evaluate_on(source_dir(), target_dir(t["old"], "old"), art("features_eval", "eval_old"), s.p)
        write_json(s.path("eval_old.json"), old)
        out["source_on_old_accept_length"] = old["accept_length"]
    if s.p["reference"]:  # the upper bound: a drafter trained for the new target itself
        ref = evaluate_on(art("fetch", "reference"), target_dir(t["new"]), art("features_eval", "eval_new"), s.p)
        write_json(s.path("eval_reference.json"), ref)
        out["reference_accept_length"] = ref["accept_length"]
        print(f"phase0: reference {s.p['reference']['repo_id']}: accept length {ref['accept_length']:.3f} "
              f"(source {res['accept_length']:.3f})")
    return out


if __name__ == "__main__":
    raise SystemExit(run_step("phase0", phase0))
