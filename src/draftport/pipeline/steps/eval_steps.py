"""The evaluation steps: a phase's drafter measured on the new target's held-out set (offline
accept length drafted as an engine drafts, per position, the cost model's projected tok/s),
logged to the phase's MLflow run. They never train: changing eval.* or costmodel.* reruns these
steps only."""

from __future__ import annotations

from draftport.data.capture import trusted
from draftport.evaluation.accept import evaluate_drafter
from draftport.model.config import context_limit
from draftport.model.device import describe as describe_device
from draftport.model.device import pick as pick_device
from draftport.pipeline.runner import StepContext, read_json, write_json

# tau (bonus token counted, as vLLM and SGLang), SpecForge's simulated_acc_len, vLLM's acceptance rate
EVAL_KEYS = (
    "accept_length",
    "simulated_acc_len",
    "acceptance_rate",
    "accept_length_all_positions",
    "num_cycles",
    "eval_samples",
)


def cost_metrics(accept_length: float, costmodel: dict, k: int) -> dict:
    # lazy (registry): the drift step runs this module without evaluation.costmodel
    from draftport.evaluation.costmodel import CostModel

    cm = CostModel(costmodel["baseline_tok_s"], costmodel["verify_ms"], costmodel["draft_ms"], k=k)
    tok_s = cm.tok_s(accept_length)
    return {
        "projected_tok_s": tok_s,
        "break_even_accept_length": cm.break_even_accept_length,
        "speedup_vs_baseline": tok_s / costmodel["baseline_tok_s"],
    }


def phase_metrics(res: dict, p: dict) -> dict:
    """The metric names every phase shares (MLflow compare view, DVC metrics, the report)."""
    k = p["eval"]["k"]
    out = {key: res[key] for key in EVAL_KEYS}
    for i in range(k):
        out[f"accept_rate_pos_{i}"] = res[f"accept_rate_pos_{i}"]
        out[f"cond_acc_{i}"] = res[f"cond_acc_{i}"]
    out.update(cost_metrics(res["accept_length"], p["costmodel"], k))
    # MLflow and DVC: each eval set's accept length (the headline: their traffic-weighted figure)
    for name, fig in (res.get("by_set") or {}).items():
        if fig["accept_length"] is not None:
            out[f"accept_length/{name}"] = fig["accept_length"]
    if "accept_length_pooled" in res:
        out["accept_length_pooled"] = res["accept_length_pooled"]
    # every k up to eval.k_max (one pass) and each tree (offline only), beside the figures at k
    for row in res.get("by_k", []):
        out[f"accept_length_k{row['k']}"] = row["accept_length"]
    if res.get("by_k"):
        out |= best_k_metrics(res["by_k"], p["costmodel"], k, p["serving"]["ms_per_draft_token"])
    for t in res.get("trees", []):
        out[f"accept_length_tree_{t['steps']}_{t['topk']}_{t['num_draft_tokens']}"] = t["accept_length"]
    return out


def best_k_metrics(by_k: list[dict], costmodel: dict, k0: int, ms_per_draft_token: float) -> dict:
    """The best k at batch 1 over the measured tau of every k, step times as rule R11 reads the
    cost model without a step table (evaluation.serving.seeds_table)."""
    from draftport.evaluation.serving import seeds_table

    table = seeds_table(costmodel, k0, by_k[-1]["k"], ms_per_draft_token)
    rows = [(row["k"], row["accept_length"] * 1000.0 / table.step_ms(1, row["k"])[0]) for row in by_k]
    k, tok_s = max(rows, key=lambda r: r[1])
    return {"best_k": k, "best_k_projected_tok_s": tok_s}


def evaluate_on(s: StepContext, drafter, target, features, name: str = "eval.json", extra: dict | None = None) -> dict:
    """Offline accept length of a drafter on a feature set; the full result (and `extra`) in <name>."""
    e = s.p["eval"]
    pick_device(e["device"], "eval.device")  # cuda without a GPU: refused before any work, by its key
    res = evaluate_drafter(
        drafter,
        target,
        features,
        k=e["k"],
        batch_size=e["batch_size"],
        max_samples=e["max_samples"],
        device=e["device"],
        buckets=e.get("context_buckets"),
        k_max=e["k_max"],
        trees=e["trees"],
    )
    res.pop("eval_seconds", None)  # outputs stay byte-identical between identical runs
    s.record_run("eval" if name == "eval.json" else name.removesuffix(".json"), res.pop("run", None))
    write_json(s.path(name), {**res, **(extra or {})})
    return res


def write_plot_tables(s: StepContext, out: dict) -> dict:
    """tau.csv (the phase's tau beside break-even) and positions.csv (acceptance by draft
    position): what `dvc plots show/diff` draws per phase and between experiments."""
    phase, k = s.row.run, s.p["eval"]["k"]
    s.path("tau.csv").write_text(
        "phase,accept_length,break_even_accept_length\n"
        f"{phase},{out['accept_length']:.6f},{out['break_even_accept_length']:.6f}\n"
    )
    s.path("positions.csv").write_text(
        "phase,position,accept_rate,cond_acc\n"
        + "".join(f"{phase},{i + 1},{out[f'accept_rate_pos_{i}']:.6f},{out[f'cond_acc_{i}']:.6f}\n" for i in range(k))
    )
    return out


def eval_phase0(s: StepContext) -> dict:
    """Phase 0 (probe): the source drafter as fetched, its own map, on the new target's held-out
    set; and on the old target's, the number it was built for; and the profile's reference
    drafter (one trained for the new target itself), the upper bound, on the same set."""
    limit = context_limit(s.input("drafter"), s.input("target"))  # what the decision's R10 reads
    res = evaluate_on(s, s.input("drafter"), s.input("target"), s.input("features"), extra={"context_limit": limit})
    out = phase_metrics(res, s.p)
    if limit["limited"]:
        print(
            f"eval_phase0: the source drafter serves {limit['source_limit']} positions, the new target "
            f"{limit['serving_length']}: past {limit['source_limit']} it cannot be served as-is (RoPE clamped)"
        )
    if "target_old" in s.inputs:
        old = evaluate_on(s, s.input("drafter"), s.input("target_old"), s.input("features_old"), "eval_old.json")
        out["source_on_old_accept_length"] = old["accept_length"]
        if len(old["sets"]) > 1:  # per eval set too: the same prompts answered by the old target
            out |= {
                f"source_on_old_accept_length/{n}": v["accept_length"]
                for n, v in old["by_set"].items()
                if v["accept_length"] is not None
            }
    if "reference" in s.inputs:  # the upper bound: a drafter trained for the new target itself
        ref = evaluate_on(s, s.input("reference"), s.input("target"), s.input("features"), "eval_reference.json")
        out["reference_accept_length"] = ref["accept_length"]
        print(
            f"eval_phase0: reference {s.p['reference']['repo_id']}: accept length {ref['accept_length']:.3f} "
            f"(source {res['accept_length']:.3f})"
        )
    return write_plot_tables(s, out)


def eval_trained(s: StepContext) -> dict:
    """A trained phase (phase1_scratch, phase1, phase2): its drafter on the new target's held-out
    set, with its training figures beside and its gain over the phases it must beat."""
    res = evaluate_on(s, s.input("drafter"), s.input("target"), s.input("features"))
    trained = read_json(s.input("trained"))
    out = {**phase_metrics(res, s.p), "train_steps": trained["train_steps"]}
    if trained.get("final_loss") is not None:
        out["final_loss"] = trained["final_loss"]
    for ref in ("phase0", "phase1_scratch", "phase1"):
        if ref in s.inputs:
            out[f"gain_vs_{ref}"] = out["accept_length"] - read_json(s.input(ref))["accept_length"]
    return write_plot_tables(s, out)


def drift(s: StepContext) -> dict:
    """The drift probe (draftport.evaluation.drift): the old target run over the new target's held-out
    answers; how far the hidden states moved per aux layer and at the final state, the targets'
    greedy agreement, and the source drafter's tau on each target's states of the same tokens."""
    # lazy (registry): only the drift step runs evaluation.drift
    from draftport.evaluation.drift import drift_probe

    e, f = s.p["eval"], s.p["features"]
    s.record_run("eval", describe_device(pick_device(e["device"], "eval.device")))  # the source drafter's evaluations
    old = s.input("target_old")
    out = drift_probe(
        s.input("drafter"),
        old,
        s.input("target"),
        s.input("features"),
        s.dir,
        k=e["k"],
        batch_size=e["batch_size"],
        max_samples=e["max_samples"],
        feature_batch_size=f["batch_size"],
        dtype=f["dtype"],
        device=f["device"],
        trust_remote_code=trusted(old, s.p["targets"]["trust_remote_code"]),
        engine=f["engine"],
        tensor_parallel_size=f["tensor_parallel_size"],
        max_tokens=s.p["drift"]["max_tokens"],
        eval_device=e["device"],
    )
    phase0 = read_json(s.input("phase0"))
    if "source_on_old_accept_length" in phase0:  # the source on the old target's own answers
        out["tau_source_on_old_answers"] = phase0["source_on_old_accept_length"]
    print(
        f"drift: cos final {out['cos_final']:.3f}, CKA final {out['cka_final']:.3f}, greedy agreement "
        f"{out['greedy_agreement']:.3f}; source tau on the old target's states {out['tau_source_old_features']:.3f} "
        f"vs the new target's {out['tau_source_new_features']:.3f} (same tokens)"
    )
    return out
