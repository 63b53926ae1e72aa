"""How to serve a drafter: the draft configuration with the highest projected tok/s at each batch
size, from the accept length at every depth and the engine's step time (rule R11).

An engine step at batch size b with k draft tokens a request takes step_ms(b, k): the target
verifies k + 1 tokens of every request and the drafter drafts k. Each request gains tau(k) tokens
a step, so a request decodes at tau(k) / step_ms(b, k) and the target alone at 1 / step_ms(b, 0).
A tree of N draft tokens (SGLang: steps, topk, num_draft_tokens) is charged a chain's step of N - 1
draft tokens: the verify reads the same tokens; the extra drafting of its branches is not charged.

step_ms comes from one of three sources, best first:
  - the user's measured table (serving.step_table: CSV `batch_size,k,step_ms`, k 0 the target
    alone; or `itl_ms` with `accept_length`, what `vllm bench` reports: step = ITL x tau);
  - derived from the target's size and GPUs (draftport.profile.estimate.serving_steps);
  - the seeds' cost model at batch 1: the target alone at baseline_tok_s, a verify cycle of
    verify_ms + k x draft_ms at eval.k, each draft token more or less costing ms_per_draft_token.

No torch here.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from draftport.errors import DraftportError


@dataclass
class StepTable:
    """step_ms by batch size and draft tokens: {batch_size: {k: ms}}; k 0 is the target alone."""

    ms: dict[int, dict[int, float]]
    source: str
    notes: list[str] = field(default_factory=list)

    def check(self, batch_sizes: list[int], where: str) -> None:
        for b in batch_sizes:
            row = self.ms.get(b)
            if row is None:
                have = sorted(self.ms)
                raise DraftportError(where, f"batch size {b} is served but {self.source} has only {have}")
            if 0 not in row or not any(k > 0 for k in row):
                raise DraftportError(where, f"{self.source}: batch size {b} needs a row at k 0 and one at k >= 1")

    def step_ms(self, b: int, k: int) -> tuple[float, bool]:
        """-> (ms, extrapolated): measured, else linear in k between the measured k around it, or
        past the largest measured k along the last two (extrapolated: True)."""
        row = self.ms[b]
        if k in row:
            return row[k], False
        ks = sorted(row)
        lower = [x for x in ks if x < k]
        upper = [x for x in ks if x > k]
        if lower and upper:
            k0, k1 = lower[-1], upper[0]
            return row[k0] + (row[k1] - row[k0]) * (k - k0) / (k1 - k0), False
        k0, k1 = ks[-2], ks[-1]  # past the table: the last slope (at least two rows: k 0 and one more)
        return row[k1] + (row[k1] - row[k0]) * (k - k1) / (k1 - k0), True

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "step_ms": {str(b): {str(k): v for k, v in r.items()} for b, r in self.ms.items()},
        }


def read_step_table(path) -> StepTable:
    """A CSV of measured engine steps: batch_size,k,step_ms, or batch_size,k,itl_ms,accept_length
    (step = ITL x accept length; the target alone: accept length 1)."""
    path = Path(path)
    if not path.is_file():
        raise DraftportError(path, "serving.step_table: no such file")
    ms: dict[int, dict[int, float]] = {}
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise DraftportError(path, "no rows (header batch_size,k,step_ms or batch_size,k,itl_ms,accept_length)")
    cols = set(rows[0])
    if not {"batch_size", "k"} <= cols or not ("step_ms" in cols or {"itl_ms", "accept_length"} <= cols):
        raise DraftportError(
            path, f"columns {sorted(cols)}: need batch_size, k and step_ms (or itl_ms and accept_length)"
        )
    for i, r in enumerate(rows, 2):
        try:
            b, k = int(r["batch_size"]), int(r["k"])
            v = (
                float(r["step_ms"])
                if r.get("step_ms") not in (None, "")
                else float(r["itl_ms"]) * float(r["accept_length"])
            )
        except (TypeError, ValueError):
            raise DraftportError(
                path, f"line {i}: batch_size and k must be integers and the times numbers: {r}"
            ) from None
        if b < 1 or k < 0 or not v > 0:
            raise DraftportError(path, f"line {i}: need batch_size >= 1, k >= 0 and a time > 0, got {b}, {k}, {v}")
        if k in ms.setdefault(b, {}):
            raise DraftportError(path, f"line {i}: batch size {b} at k {k} given twice")
        ms[b][k] = v
    return StepTable(ms, f"measured ({path.name})")


def seeds_table(costmodel: dict, k0: int, k_max: int, ms_per_draft_token: float) -> StepTable:
    """The seeds' cost model as a step table at batch 1 (its own k is k0)."""
    base = 1000.0 / float(costmodel["baseline_tok_s"])
    at_k0 = float(costmodel["verify_ms"]) + k0 * float(costmodel["draft_ms"])
    ms = {0: base}
    for k in range(1, k_max + 1):
        ms[k] = max(at_k0 + (k - k0) * ms_per_draft_token, base)  # a verify never beats a plain decode step
    note = (
        f"the cost model's {float(costmodel['baseline_tok_s']):g} tok/s and {at_k0:g} ms a cycle at k={k0}, "
        f"{ms_per_draft_token:g} ms a draft token more or less (serving.ms_per_draft_token)"
    )
    return StepTable({1: ms}, "the seeds' cost model", [note])


# ---------------------------------------------------------------- the configurations


def _config_rows(taus: dict, trees: list[dict], table: StepTable, b: int) -> list[dict]:
    """Every configuration at batch size b with its projected tok/s a request (CI from tau's)."""
    rows = []
    for k, t in sorted(taus.items()):
        ms, ext = table.step_ms(b, k)
        rows.append(_row({"kind": "chain", "k": k, "num_draft_tokens": k}, t, ms, ext))
    for tr in trees:
        n = int(tr["num_draft_tokens"]) - 1  # SGLang counts the verified root among the draft tokens
        ms, ext = table.step_ms(b, n)
        shape = {"kind": "tree", "steps": tr["steps"], "topk": tr["topk"], "num_draft_tokens": tr["num_draft_tokens"]}
        rows.append(_row(shape | {"k": n}, tr, ms, ext))
    return rows


def _row(shape: dict, t: dict, ms: float, extrapolated: bool) -> dict:
    per_s = 1000.0 / ms
    return {
        **shape,
        "accept_length": t["accept_length"],
        "ci": t.get("ci"),
        "step_ms": ms,
        "step_extrapolated": extrapolated,
        "tok_s": t["accept_length"] * per_s,
        "tok_s_ci": [x * per_s for x in t["ci"]] if t.get("ci") else None,
    }


def best_per_batch(
    taus: dict, trees: list[dict], table: StepTable, batch_sizes: list[int], ttt_steps: int | None
) -> list[dict]:
    """Per batch size: every configuration, the best one by projected tok/s a request, the target
    alone, and whether speculation and trees pay. taus: {k: {accept_length, ci}}."""
    out = []
    for b in batch_sizes:
        rows = _config_rows(taus, trees, table, b)
        alone = 1000.0 / table.step_ms(b, 0)[0]
        best = max(rows, key=lambda r: r["tok_s"])
        chains = [r for r in rows if r["kind"] == "chain"]
        best_chain = max(chains, key=lambda r: r["tok_s"])
        tree_rows = [r for r in rows if r["kind"] == "tree"]
        out.append(
            {
                "batch_size": b,
                "target_alone_tok_s": alone,
                "best": best,
                "speculate": best["tok_s"] > alone,
                # the best's CI wholly above (or below) the target alone
                "significant": bool(best["tok_s_ci"]) and (best["tok_s_ci"][0] > alone or best["tok_s_ci"][1] < alone),
                "best_chain_k": best_chain["k"],
                "tree_beats_chain": (max(r["tok_s"] for r in tree_rows) > best_chain["tok_s"]) if tree_rows else None,
                "past_ttt": ttt_steps is not None and best["kind"] == "chain" and best["k"] > ttt_steps,
                "configs": rows,
            }
        )
    return out


# ---------------------------------------------------------------- what to paste into an engine


def vllm_config(model: str, per_batch: list[dict]) -> dict | None:
    """vLLM's speculative_config for these batch sizes (chains only: vLLM drafts EAGLE-3 as a chain).
    One K everywhere: num_speculative_tokens alone (a per-batch-size table makes vLLM capture fewer
    CUDA graphs); else the inclusive range table, each served size up to the next one's, K 0 where
    the target alone is faster. None: speculation off at every size."""
    ks = [(r["batch_size"], r["best_chain_k"] if _chain_pays(r) else 0) for r in per_batch]
    k_max = max(k for _, k in ks)
    if k_max == 0:
        return None
    cfg = {"method": "eagle3", "model": model, "num_speculative_tokens": k_max}
    if len({k for _, k in ks}) > 1:
        table = {}
        for i, (b, k) in enumerate(ks):
            hi = ks[i + 1][0] - 1 if i + 1 < len(ks) else b
            table[f"{b}-{hi}"] = k
        cfg["num_speculative_tokens_per_batch_size"] = table
    return cfg


def _chain_pays(r: dict) -> bool:
    chain = next(c for c in r["configs"] if c["kind"] == "chain" and c["k"] == r["best_chain_k"])
    return chain["tok_s"] > r["target_alone_tok_s"]


def sglang_flags(model: str, r: dict) -> str | None:
    """SGLang's flags for one batch size's best configuration (None: serve without a drafter)."""
    if not r["speculate"]:
        return None
    best = r["best"]
    steps, topk, n = (
        (best["steps"], best["topk"], best["num_draft_tokens"])
        if best["kind"] == "tree"
        else (best["k"], 1, best["k"] + 1)
    )
    return (
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {model} "
        f"--speculative-num-steps {steps} --speculative-eagle-topk {topk} --speculative-num-draft-tokens {n}"
    )


def describe(r: dict) -> str:
    """One configuration in words: 'chain k=3' or 'tree 3/4/8'."""
    b = r["best"] if "best" in r else r
    if b["kind"] == "tree":
        return f"tree {b['steps']}/{b['topk']}/{b['num_draft_tokens']} (steps/topk/draft tokens)"
    return f"chain k={b['k']}"


def label(c: dict) -> str:
    """A configuration's short name in a table: 'k=3', 'tree 3/2'."""
    return f"k={c['k']}" if c["kind"] == "chain" else f"tree {c['steps']}/{c['topk']}"


def settings_json(cfg: dict | None) -> str:
    return json.dumps(cfg, separators=(", ", ": ")) if cfg else "none (the target alone is faster)"


# ---------------------------------------------------------------- rule R11


def depth_taus(ev: dict, counts, opts: dict, k: int, where: str) -> tuple[dict, list[dict]]:
    """A phase's accept length with its CI at every depth its evaluation measured (eval.k alone
    for an evaluation without per-depth counts), and its offline trees'."""
    from draftport.evaluation.bootstrap import tau_ci

    by_k = (ev.get("per_sample") or {}).get("by_k") or []  # [{k, accepted, cycles}]: each k's per-prompt counts
    taus = {int(c["k"]): tau_ci(c["accepted"], c["cycles"], where=f"{where} k={c['k']}", **opts) for c in by_k}
    taus = taus or {k: tau_ci(*counts, where=where, **opts)}
    trees = []
    for t in ev.get("trees") or []:
        ps = t.get("per_sample")
        if ps:
            shape = {key: int(t[key]) for key in ("steps", "topk", "num_draft_tokens")}
            trees.append(shape | tau_ci(ps["accepted"], ps["cycles"], where=f"{where} tree {shape}", **opts))
    return taus, trees


def serving_rule(
    phases: dict, counts: dict, opts: dict, serving: dict, rec_phase: str | None
) -> tuple[dict, str, list[str]]:
    """R11: for the recommended drafter and the source as-is, the best configuration at every
    served batch size -> (the decision's serving block, fired, sentences)."""
    table, sizes = serving["table"], list(serving["batch_sizes"])
    table.check(sizes, "serving.batch_sizes")
    block = {"step_table": table.as_dict(), "notes": list(table.notes), "batch_sizes": sizes, "drafters": {}}
    text, fired = [], []
    for role, ph in (("recommended", rec_phase), ("source", "phase0")):
        if ph is None or ph not in counts:
            continue
        taus, trees = depth_taus(phases[ph], counts[ph], opts, serving["k"], f"phases: {ph}")
        ttt = serving.get("ttt_steps", {}).get(role)
        per = best_per_batch(taus, trees, table, sizes, ttt)
        model = serving.get("models", {}).get(role) or f"<{ph} drafter folder>"
        block["drafters"][role] = {
            "phase": ph,
            "depths": sorted(taus),
            "trees": [{key: t[key] for key in ("steps", "topk", "num_draft_tokens")} for t in trees],
            "trees_offline": bool(trees),  # no engine serves EAGLE-3 trees on the CPU: measured offline only
            "per_batch": per,
            "vllm_speculative_config": vllm_config(model, per),
            "sglang_flags": {str(r["batch_size"]): sglang_flags(model, r) for r in per},
        }
        fired.append(
            f"{ph}: " + ", ".join(f"b{r['batch_size']} {describe(r) if r['speculate'] else 'off'}" for r in per)
        )
        text.append(_role_text(role, ph, per, ttt))
    return block, "; ".join(fired) or "no phase measured", text


def _role_text(role: str, ph: str, per: list[dict], ttt: int | None) -> str:
    who = "the recommended drafter" if role == "recommended" else "the source as-is"
    parts = []
    for r in per:
        b = r["best"]
        if r["speculate"]:
            parts.append(
                f"batch {r['batch_size']}: {describe(r)}, {b['tok_s']:.1f} tok/s a request (CI {_ci(b['tok_s_ci'])}) "
                f"against {r['target_alone_tok_s']:.1f} for the target alone"
            )
        else:
            parts.append(
                f"batch {r['batch_size']}: speculation off (the target alone, {r['target_alone_tok_s']:.1f} tok/s, "
                f"beats its best, {describe(r)} at {b['tok_s']:.1f})"
            )
    s = f"Serving {who} ({ph}): " + "; ".join(parts) + "."
    trees = [r for r in per if r["tree_beats_chain"] is not None]
    if trees:
        won = [r["batch_size"] for r in trees if r["tree_beats_chain"]]
        s += (
            f" A tree beats the best chain at batch {', '.join(map(str, won))} (offline: no engine here serves "
            "EAGLE-3 trees; vLLM drafts chains only)."
            if won
            else " No tree beats the best chain (trees measured offline)."
        )
    past = sorted({r["best"]["k"] for r in per if r["past_ttt"]})
    if past:
        ks = ", ".join(map(str, past))
        s += f" k={ks} is past the {ttt} steps the drafter was trained to unroll (train.ttt_steps)."
    if any(r["best"]["step_extrapolated"] for r in per):
        s += " Some step times are extrapolated past the table's largest k."
    return s


def _ci(ci) -> str:
    return f"[{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "n/a"


def deploy_source(block: dict) -> tuple[bool, str, str] | None:
    """R4 at the source's best configuration at the smallest served batch size -> (deploy,
    fired, sentence); None when Phase 0 was not measured."""
    src = block["drafters"].get("source")
    if src is None:
        return None
    r = src["per_batch"][0]
    b = r["best"]
    fig = f"{describe(r)} at batch {r['batch_size']}: {b['tok_s']:.1f} tok/s a request (CI {_ci(b['tok_s_ci'])})"
    alone = f"the target alone's {r['target_alone_tok_s']:.1f}"
    fired = f"phase0 best {fig} vs {alone}"
    if r["speculate"] and b["tok_s_ci"] and b["tok_s_ci"][0] > r["target_alone_tok_s"]:
        return True, fired, f"Deploy the source drafter now: at its best configuration ({fig}) it beats {alone}."
    where = "below" if b["tok_s_ci"] and b["tok_s_ci"][1] < r["target_alone_tok_s"] else "not clearly above"
    return (
        False,
        fired,
        f"Do not deploy the source drafter as fetched: at its best configuration ({fig}) it is {where} {alone}.",
    )


def render(block: dict | None) -> list[str]:
    """The terminal's lines of the serving block: tau and tok/s against depth per drafter, then the
    engine settings of the recommended one."""
    if not block:
        return []
    out = [f"Serving (step times: {block['step_table']['source']}; {'; '.join(block['notes']) or 'measured'}):"]
    for role, dr in block["drafters"].items():
        for r in dr["per_batch"]:
            cells = "  ".join(f"{label(c)} {c['accept_length']:.2f}/{c['tok_s']:.0f}" for c in r["configs"])
            best = describe(r) if r["speculate"] else "off"
            out.append(
                f"  {role:<11} ({dr['phase']}) batch {r['batch_size']:<4} alone {r['target_alone_tok_s']:.0f} tok/s | "
                f"tau/tok-s {cells} | best: {best}"
            )
    rec = block["drafters"].get("recommended")
    if rec is not None:
        out.append(f"  vLLM: --speculative-config '{settings_json(rec['vllm_speculative_config'])}'")
        for b, flags in rec["sglang_flags"].items():
            out.append(f"  SGLang at batch {b}: {flags or 'no speculative flags (the target alone is faster)'}")
    return out
