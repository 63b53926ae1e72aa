"""The online steps: a phase's drafter served by vLLM's EAGLE-3 speculative decoding next to the
offline evaluator on the same sequences (draftport.engines.vllm). Snakemake-only: DVC has no
stage for them, so `dvc repro` never needs the vLLM venv."""

from __future__ import annotations

import json
from pathlib import Path

from draftport.errors import DraftportError
from draftport.evaluation import online as online_check
from draftport.pipeline.runner import StepContext, read_json, run_file
from draftport.pipeline.tracking import PhaseRun


def _online(s: StepContext, phase: str) -> dict:
    """The figures go to metrics.json, next to the phase's own offline accept_length, and into the
    phase's MLflow run. Fails (after writing online.json and logging both figures) when the two
    tau differ by more than online.tolerance."""
    o, k = s.p["online"], s.p["eval"]["k"]
    ran = read_json(s.input("phase"))
    rec = run_file(f"eval_{phase}")
    if not rec.is_file():
        raise DraftportError(
            rec, f"missing: the MLflow run of {phase} (rerun eval_{phase}: snakemake --forcerun eval_{phase} online)"
        )
    run = PhaseRun.attach(json.loads(rec.read_text())["run_id"], where=rec)  # before compute
    drafter, how = online_check.for_vllm(
        s.input("drafter"),
        s.path("export"),
        s.p["features"]["aux_convention"],
        embed_tokens=o["embed_tokens"],
        target_dir=s.input("target"),
    )
    print(f"{s.name}: {drafter}: {how}")
    prompts, n_prompts, sets = _prompts(s)
    m = online_check.run_step(
        s.input("target"),
        drafter,
        prompts,
        s.dir,
        n_prompts=n_prompts,
        sets=sets,
        k=k,
        max_new_tokens=o["max_new_tokens"],
        tol=o["tolerance"],
        vllm_python_path=o["vllm_python"],
        max_num_seqs=o["max_num_seqs"],
        dtype=o["dtype"],
        tensor_parallel_size=o["tensor_parallel_size"],
        embed_tokens=o["embed_tokens"],
        check=False,
        # beside the step's log: it outlives a failed step, whose folder is dropped
        log_path=Path("logs", f"{s.name}.vllm.log"),
    )
    out = {"accept_length": ran["accept_length"], **{key: v for key, v in m.items() if not isinstance(v, str)}}
    set_rows = _set_rows(m, sets)
    agree = abs(m["online_offline_difference"]) <= o["tolerance"] and all(
        abs(row["difference"]) <= o["tolerance"] for row in set_rows.values()
    )
    run.log_metrics({key: v for key, v in out.items() if key != "accept_length"}, step=int(ran.get("train_steps", 0)))
    run.set_tags({"draftport.online": "agrees" if agree else "DISAGREES", "draftport.vllm": m.get("vllm_version")})
    print(
        f"{s.name}: vLLM tau {m['online_accept_length']:.4f} ({m['online_seconds']:.0f} s) vs offline on the "
        f"same sequences {m['offline_same_prompts_accept_length']:.4f} "
        f"({m['offline_same_prompts_seconds']:.0f} s); the phase's offline tau {ran['accept_length']:.4f}; "
        f"logged to MLflow run {run.run_id}"
    )
    for name, row in set_rows.items():
        print(f"{s.name}: eval set {name}: vLLM - offline {row['difference']:+.4f}")
    if not agree:
        online_check.set_agreement_check(set_rows, o["tolerance"])
        online_check.agreement_check(
            m,
            {
                "accept_length": m["offline_same_prompts_accept_length"],
                "k": k,
                **{f"accept_rate_pos_{i}": m[f"offline_same_prompts_accept_rate_pos_{i}"] for i in range(k)},
            },
            o["tolerance"],
        )
    return out


def _set_rows(m: dict, sets: list[dict] | None) -> dict:
    """Each eval set's vLLM and offline figures (run_step's <metric>/<set> metrics) and their difference."""
    out = {}
    for x in sets or []:
        on, off = m.get(f"online_accept_length/{x['name']}"), m.get(f"offline_same_prompts_accept_length/{x['name']}")
        if on is not None and off is not None:
            out[x["name"]] = {"vllm": on, "offline": off, "difference": on - off, "requests": x["count"]}
    return out


def _prompts(s: StepContext) -> tuple:
    """(prompts file, how many, sets): today's held-out file, or with named eval sets the first
    online.n_prompts of each set (at most its n) written to one file, with each set's range of the requests."""
    n = s.p["online"]["n_prompts"]
    if not s.p["targets"].get("eval_sets"):
        return s.p["targets"]["prompts_eval_new"], n, None
    # lazy (registry): only the online steps with eval sets read them here
    from draftport.data.evalsets import read_eval_sets
    from draftport.files import atomic_write_text
    from draftport.plan.params import resolved_eval_sets

    chosen = [{**x, "n": min(n, x["n"]) if x["n"] else n} for x in resolved_eval_sets(s.p, "new")]
    lines, sets = [], []
    for x, rows in read_eval_sets(chosen, s.p["targets"]["prompts_train"]):
        sets.append({"name": x["name"], "start": len(lines), "count": len(rows)})
        lines.extend(json.dumps({"user": r["user"]}, ensure_ascii=False) for r in rows)
    path = s.path("prompts_online.jsonl")
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path, len(lines), sets


def online_phase0(s: StepContext) -> dict:
    return _online(s, "phase0")


def online_phase1(s: StepContext) -> dict:
    return _online(s, "phase1")
