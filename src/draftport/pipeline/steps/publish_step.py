"""The publish step (opt-in: publish.enabled): the chosen drafter (the decision's, or
publish.phase) as a hub-ready folder artifacts/publish/<publish.folder>/ with its model card,
checked (draftport.outputs.publish); publish.json says what was published and why. It never uploads:
`draftport publish --push --repo-id X` does (docs/publish.md)."""

from __future__ import annotations

from draftport.outputs.publish import from_pipeline
from draftport.pipeline.runner import StepContext, write_json


def publish(s: StepContext) -> dict:
    rep = from_pipeline(s.p, s.inputs, s.path(s.p["publish"]["folder"]))
    rep["folder"] = s.p["publish"]["folder"]  # inside the step's folder (the building one is renamed)
    write_json(s.path("publish.json"), rep)
    print(
        f"publish: {rep['phase']} ({rep['why']}) -> artifacts/publish/{rep['folder']}/, "
        + ", ".join(f"tau {r['accept_length']:.3f} at k={r['k']}" for r in rep["taus"])
    )
    out = {"bytes": rep["bytes"], "phase_index": ("phase1_scratch", "phase1", "phase2").index(rep["phase"])}
    for r in rep["taus"]:
        out[f"accept_length_k{r['k']}"] = r["accept_length"]
    return out
