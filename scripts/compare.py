"""Step compare: the fetched source drafter against the layout the team will train for the new
target (the source's architecture, the new target's vocab and draft map): config, weights,
vocab, verdict. The layout is headers + maps only (weights are file holes), so this costs
nothing at Kimi scale either."""

from draftport import plan
from draftport.checkpoint import inspect_drafter
from draftport.compare import compare_drafters
from draftport.config import DrafterConfig, read_config
from draftport.fixtures import write_header_only_drafter
from draftport.pipeline import art, run_step, source_dir, target_config, target_dir, write_json
from draftport.report import compare_tables


def compare(s):
    src = source_dir()
    cfg, _ = read_config(src)
    d2t, t2d = plan.read_vocab(art("vocab_new", "vocab.safetensors"))
    tcfg = target_config(target_dir(s.p["targets"]["new"]))
    layout = DrafterConfig(**{**cfg.__dict__, "draft_vocab_size": int(d2t.shape[0]),
                              "vocab_size": int(tcfg["vocab_size"])})
    dtype = inspect_drafter(src).tensors["fc.weight"].dtype
    write_header_only_drafter(s.path("new_layout"), layout, d2t, t2d, dtype=dtype)
    rep = compare_drafters(src, s.path("new_layout"))
    write_json(s.path("compare.json"), rep)
    compare_tables(rep, s.dir)
    v, verdict = rep["vocab"], rep["verdict"]
    print("compare:", "compatible" if verdict["compatible_architecture"] else "INCOMPATIBLE",
          "|", verdict["vocab_action"])
    return {"compatible_architecture": int(verdict["compatible_architecture"]),
            "config_mismatches": sum(not r["match"] for r in rep["config"]),
            "weight_mismatches": sum(r["status"] != "match" for r in rep["weights"]),
            "warnings": len(verdict["warnings"]),
            "vocab": {k: v[k] for k in ("overlap", "jaccard", "src_only", "dst_only", "positions_differ")}}


if __name__ == "__main__":
    raise SystemExit(run_step("compare", compare))
