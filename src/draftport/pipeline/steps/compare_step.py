"""The compare step: the fetched source drafter against the layout the team will train for the
new target (the source's architecture, the new target's vocab and draft map)."""

from __future__ import annotations

import json

from draftport.data.draftmap import read_vocab
from draftport.model.config import DrafterConfig, read_config, target_text_config
from draftport.model.fixtures import write_header_only_drafter
from draftport.model.formats import inspect_drafter
from draftport.outputs.compare import compare_drafters
from draftport.outputs.tables import compare_tables
from draftport.pipeline.runner import StepContext, art, write_json


def compare(s: StepContext) -> dict:
    """Config, weights, vocab, verdict. The layout is headers + maps only (weights are file holes),
    so this costs nothing at Kimi scale either."""
    src = s.input("source")
    cfg, _ = read_config(src)
    d2t, t2d = read_vocab(s.input("vocab"))
    tcfg = target_text_config(s.input("target"))
    layout = DrafterConfig(
        **{**cfg.__dict__, "draft_vocab_size": int(d2t.shape[0]), "vocab_size": int(tcfg["vocab_size"])}
    )
    dtype = inspect_drafter(src).tensors["fc.weight"].dtype
    write_header_only_drafter(s.path("new_layout"), layout, d2t, t2d, dtype=dtype)
    rep = compare_drafters(src, s.path("new_layout"), target=s.input("target"))  # + embed_tokens vs the target's
    # the report names new_layout where it will be once published, not in the build folder
    rep = json.loads(json.dumps(rep).replace(str(s.dir), art("compare")))
    write_json(s.path("compare.json"), rep)
    compare_tables(rep, s.dir)
    v, verdict = rep["vocab"], rep["verdict"]
    print(
        "compare:", "compatible" if verdict["compatible_architecture"] else "INCOMPATIBLE", "|", verdict["vocab_action"]
    )
    return {
        "compatible_architecture": int(verdict["compatible_architecture"]),
        "config_mismatches": sum(not r["match"] for r in rep["config"]),
        "weight_mismatches": sum(r["status"] != "match" for r in rep["weights"]),
        "warnings": len(verdict["warnings"]),
        "embedding_differs": int(rep["embedding"]["src"]["engines_agree"] is False),
        "vocab": {k: v[k] for k in ("overlap", "jaccard", "src_only", "dst_only", "positions_differ")},
    }
