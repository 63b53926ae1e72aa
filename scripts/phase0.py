"""Step phase0 (probe): the source drafter as fetched, its own map, on the new target's held-out
set; and on the old target's, the number it was built for."""

from draftport.pipeline import art, evaluate_on, phase_metrics, run_step, source_dir, target_dir, write_json


def phase0(s):
    t = s.p["targets"]
    res = evaluate_on(source_dir(), target_dir(t["new"]), art("features_eval", "eval_new"), s.p)
    write_json(s.path("eval.json"), res)
    out = phase_metrics(res, s.p)
    if t["old"] and t["prompts_eval_old"]:
        old = evaluate_on(source_dir(), target_dir(t["old"]), art("features_eval", "eval_old"), s.p)
        write_json(s.path("eval_old.json"), old)
        out["source_on_old_accept_length"] = old["accept_length"]
    return out


if __name__ == "__main__":
    raise SystemExit(run_step("phase0", phase0))
