"""A published drafter: the chosen phase's drafter as a hub-ready folder (flat config.json,
model.safetensors with the new target's embed_tokens, a README.md model card), checked before it
is written and again before any upload.

Which drafter (`choose_phase`): a named phase (publish.phase), else the decision's: init scratch
(R1) -> phase1_scratch; otherwise (source, or either) Phase 2 when it helps (R3), else Phase 1.

The folder (`publish_drafter`): evaluation.online.for_vllm makes the export (SGLang-numbered aux
ids renumbered for vLLM; embed_tokens the new target's bit for bit, or none: publish.embed_tokens);
config.json names the new target as its `verifier`; every other tensor is the phase's drafter's,
bit for bit. It carries the new target's embedding by default because vLLM serves a drafter's own
embed_tokens (SGLang the target's: with the target's bytes both serve the same) and speculators
0.9.0 fills a missing one with uninitialized memory, without a warning. Before the folder gets its
final name, draftport's offline evaluator measures tau on it at every publish.k (the one at eval.k
must equal the phase's evaluation: same features, same weights), and `check_folder` runs: the
export checks (draftport.engines.export), draftport's loader, the card's metadata parsed back by
huggingface_hub (base_model = the config's verifier), nothing but the hub files. Written to a temp
folder and renamed: a failed check leaves no folder.

The card (`model_card`): huggingface_hub's ModelCard with ModelCardData (base_model, library_name,
tags, license); body: tau per k with its engine and definition, the training data counts, the
lineage source repo@commit -> phases -> this drafter, the aux-layer convention, vLLM / SGLang
serve commands, the speculators convert command, the decision's summary.

Upload (`push`): HfApi.create_repo + upload_folder, the token from HF_TOKEN; refused (one line,
before any network call) without a token, for a repo id or base_model that is not org/name, or
when check_folder fails. docs/publish.md has the commands.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, ModelCardData
from huggingface_hub.errors import HfHubHTTPError

from draftport.data.capture import target_identity
from draftport.engines.export import export_problems
from draftport.errors import DraftportError
from draftport.evaluation.accept import evaluate_drafter
from draftport.evaluation.costmodel import CostModel
from draftport.evaluation.decision import load_decision, render_text, tau_ci
from draftport.evaluation.online import for_vllm
from draftport.evaluation.roundtrip import convert_command
from draftport.evaluation.serving import describe
from draftport.files import atomic_dir, load_json
from draftport.model.config import read_config
from draftport.model.formats import find_target_embedding, load_drafter_state, read_header, tensor_sha256

PHASES = ("phase1_scratch", "phase1", "phase2")
HOW = {
    "phase1_scratch": "trained from a random init on the new target's own answers (Phase 1's control)",
    "phase1": "the source drafter fine-tuned on the new target's own answers (Phase 1)",
    "phase2": "Phase 1's fine-tuned drafter trained further on more of the new target's answers (Phase 2)",
}
CARD = "README.md"
INDEX = "model.safetensors.index.json"


def _hub_file(name: str) -> bool:
    """What a published folder holds: config.json, the weights (one file or shards + index), the card."""
    return name in ("config.json", INDEX, CARD) or name.endswith(".safetensors")


ENGINE_OFFLINE = "draftport offline evaluator"
TAU_DEFINITION = (
    "tau = 1 + accepted draft tokens / verify cycles: the bonus token counted (vLLM's \"Mean "
    "acceptance length\", SGLang's accept length). Greedy, one chain of k draft tokens per cycle "
    "(no tree); offline, the drafter drafts exactly as vLLM's EAGLE-3 proposer does (the target's "
    "states for the verified prefix, its own state for drafted tokens) and a draft counts when it "
    "equals the target's greedy token."
)


def _is_hub_id(v) -> bool:
    return (
        isinstance(v, str)
        and v.count("/") == 1
        and not v.startswith((".", "/"))
        and not v.endswith("/")
        and not Path(v).exists()
    )


# ---- which drafter ------------------------------------------------------------------------------
def choose_phase(decision: dict | None, phase: str | None = None) -> tuple[str, str]:
    """(phase, why): a named phase, else the decision's recommendation (module docstring)."""
    if phase is not None:
        if phase not in PHASES:
            raise DraftportError(
                "publish.phase", f"must be one of {', '.join(PHASES)} (or null: the decision's), got {phase!r}"
            )
        return phase, f"named: publish.phase = {phase}"
    if decision is None:
        raise DraftportError("publish.phase", "null (the decision's choice) but there is no decision.json")
    r = decision["recommendation"]
    if r["init"] == "scratch":
        return "phase1_scratch", "the decision's init is scratch (R1): Phase 1's from-scratch drafter"
    if r["phase2"] == "helps":
        return "phase2", f"the decision's init is {r['init']} (R1) and Phase 2 helps (R3): Phase 2's drafter"
    return "phase1", f"the decision's init is {r['init']} (R1), Phase 2: {r['phase2']} (R3): Phase 1's drafter"


# ---- tau on the published folder ------------------------------------------------------------------
def tau_table(
    folder,
    target_dir,
    features_dir,
    ks,
    *,
    batch_size: int = 32,
    max_samples: int | None = None,
    boot: dict | None = None,
    costmodel: dict | None = None,
) -> list[dict]:
    """draftport's offline tau of `folder` at each k (its CI over prompts with boot = {n_boot, level,
    seed}; projected tok/s with costmodel = {baseline_tok_s, verify_ms, draft_ms}). One pass drafts
    max(ks) tokens: every shallower k follows from it exactly (evaluate_drafter's by_k)."""
    rows = []
    res = evaluate_drafter(
        folder, target_dir, features_dir, k=min(ks), k_max=max(ks), batch_size=batch_size, max_samples=max_samples
    )
    for k in ks:
        at = res["by_k"][k - 1]
        row = {
            "k": k,
            "engine": ENGINE_OFFLINE,
            "accept_length": at["accept_length"],
            "accept_rate_pos": [at[f"accept_rate_pos_{i}"] for i in range(k)],
            "num_cycles": at["num_cycles"],
            "prompts": res["eval_samples"],
        }
        if boot:
            ps = res["per_sample"]["by_k"][k - 1]
            row["ci"] = tau_ci(ps["accepted"], ps["cycles"], where=f"tau at k={k}", **boot)["ci"]
        if costmodel:
            row["projected_tok_s"] = CostModel(
                costmodel["baseline_tok_s"], costmodel["verify_ms"], costmodel["draft_ms"], k=k
            ).tok_s(at["accept_length"])
        rows.append(row)
    return rows


# ---- the card -------------------------------------------------------------------------------------
def _sglang_ids(ids: list[int]) -> list[int] | None:
    """SGLang's numbers for vLLM-numbered aux ids (SGLang's id k = the state leaving layer k)."""
    return None if any(i < 1 for i in ids) else [i - 1 for i in ids]


def _fmt(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _card_intro(f: dict, base: str, src: dict) -> list[str]:
    """The card's title and what the drafter is."""
    return [
        f"# {f['repo_id'] or f['folder']}",
        "",
        f"An EAGLE-3 draft model for speculative decoding with [{base}]({_link(base)}): {HOW[f['phase']]}. "
        f"Ported by draftport from [{src['repo_id']}]({_link(src['repo_id'])}) at revision `{src['commit']}`.",
        "",
    ]


def _card_accept_length(f: dict, k: int) -> list[str]:
    """## Accept length: tau per k with its CI, engine and counts, then how it was measured."""
    lines = [
        "## Accept length",
        "",
        "| k | tau | CI | engine | prompts | verify cycles | accepted at position 0..k-1 | projected tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in f["taus"]:
        ci = f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]" if r.get("ci") else "-"
        rates = ", ".join(f"{x:.3f}" for x in r["accept_rate_pos"]) if r.get("accept_rate_pos") else "-"
        lines.append(
            f"| {r['k']} | {r['accept_length']:.3f} | {ci} | {r['engine']} | {r.get('prompts', '-')} | "
            f"{r.get('num_cycles', '-')} | {rates} | {_fmt(r.get('projected_tok_s'), 1)} |"
        )
    ev = f["evaluation"]
    return lines + [
        "",
        TAU_DEFINITION,
        "",
        f"Measured on {ev['prompts']} held-out prompts answered by {ev['target']} itself (greedy), on this "
        f"folder as published; the phase's own evaluation (k = {k}) gave the same tau. CIs: "
        f"{100 * ev['level']:g}% percentile bootstrap over prompts ({ev['n_boot']} draws). Projected tok/s: "
        f"tau / (verify + k x draft time) at {ev['costmodel']['baseline_tok_s']:g} tok/s and "
        f"{ev['costmodel']['verify_ms']:g} ms per verify without a drafter (break-even tau "
        f"{ev['break_even']:.2f} at k = {k}): a model, not a measurement of this drafter's speed.",
        "",
    ]


def _card_training_data(f: dict, ids: list[int]) -> list[str]:
    """## Training data: each phase's samples and tokens, then each phase's training."""
    lines = ["## Training data", ""]
    for d in f["data"]:
        lines.append(
            f"- {d['phase']}: {d['samples']} samples, {d['tokens']} tokens: the new target's "
            f"{'own greedy answers' if d.get('regenerated') else 'answers (teacher-forced)'} to the prompts "
            f"of `{d['prompts']}` from line {d['offset'] + 1}, with its hidden states at aux layers {ids}."
        )
    for t in f["training"]:
        extra = ""
        if t.get("lm_head_rows_kept") is not None:
            extra = (
                f"; lm_head moved onto the new draft map by target id ({t['lm_head_rows_kept']} rows kept, "
                f"{t['lm_head_rows_new']} new)"
            )
        lines.append(
            f"- {t['phase']} training: init {t['init']}, {t['train_steps']} steps, final loss "
            f"{_fmt(t.get('final_loss'))}{extra}."
        )
    return lines + [""]


def _card_lineage(f: dict, base: str, src: dict, ids: list[int]) -> list[str]:
    """## Lineage (source repo@commit -> phases -> this drafter) and ## Aux layers (both numberings)."""
    asked = f" (requested revision `{src['requested_revision']}`)" if src.get("requested_revision") else ""
    home = f"`{src['verifier']}`" if src.get("verifier") else "the old target"
    return [
        "## Lineage",
        "",
        f"`{src['repo_id']}@{src['commit']}`{asked}, trained for {home} -> "
        + " -> ".join(f["chain"])
        + f" -> this drafter, for `{base}` (as draftport found it: `{f['target']['id']}` revision "
        f"`{f['target']['revision']}`).",
        "",
        f"model.safetensors holds the phase's tensors bit for bit, plus {f['embed_note']}.",
        "",
        "## Aux layers",
        "",
        f"`eagle_config.eagle_aux_hidden_state_layer_ids` = {ids}, in vLLM's numbering (config.json "
        "`draftport_aux_convention: vllm`): id i is the hidden state entering decoder layer i "
        "(transformers' `hidden_states[i]`). SGLang numbers the state leaving layer i, so the same states "
        + (
            f"are {_sglang_ids(ids)} in SGLang's numbering: serve SGLang a copy whose config lists those."
            if _sglang_ids(ids)
            else "include the embedding output (id 0), which SGLang cannot read as an aux "
            "state: serve this drafter with vLLM."
        ),
        "",
    ]


def serving_flags(repo: str, k: int) -> str:
    """SGLang's flags for a chain of k draft tokens."""
    return (
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {repo} --speculative-num-steps {k} "
        f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}"
    )


def srv_model(flags: str) -> str:
    """The draft model path in SGLang's flags."""
    parts = flags.split()
    return parts[parts.index("--speculative-draft-model-path") + 1]


def _card_serving(f: dict, base: str, repo: str, k: int) -> list[str]:
    """## Serving and the speculators convert command."""
    return serve_lines(f, base, repo, k) + speculators_lines(f, base, repo)


def serve_lines(f: dict, base: str, repo: str, k: int) -> list[str]:
    """## Serving: vLLM's and SGLang's commands at the decision's best configuration per batch size
    (R11) when it served this drafter, else at eval.k."""
    srv = f.get("serving")
    spec = {"method": "eagle3", "model": repo, "num_speculative_tokens": k}
    sglang = {"": serving_flags(repo, k)}
    lines = ["## Serving", ""]
    if srv is not None:
        spec = srv["vllm_speculative_config"] and {**srv["vllm_speculative_config"], "model": repo}
        sglang = {
            f" at batch {b}": flags and flags.replace(srv_model(flags), repo)
            for b, flags in srv["sglang_flags"].items()
        }
        lines += [
            "The decision's best configuration at each batch size served (rule R11; tau, projected tok/s a request):",
            "",
            "| batch | target alone tok/s | best | tau | tok/s | every k: tau / tok/s |",
            "|---|---|---|---|---|---|",
        ]
        for r in srv["per_batch"]:
            b = r["best"]
            cells = ", ".join(
                f"{c['k']}: {c['accept_length']:.2f} / {c['tok_s']:.0f}" for c in r["configs"] if c["kind"] == "chain"
            )
            best = describe(r) if r["speculate"] else "off"
            head = f"| {r['batch_size']} | {r['target_alone_tok_s']:.1f} | {best} "
            lines.append(head + f"| {b['accept_length']:.3f} | {b['tok_s']:.1f} | {cells} |")
        lines.append("")
    lines += ["vLLM:", "", "```bash"]
    lines.append(
        f"vllm serve {base} --speculative-config '{json.dumps(spec)}'"
        if spec
        else f"vllm serve {base}  # the target alone is faster"
    )
    lines += ["```", ""]
    for where, flags in sglang.items():
        lines += [f"SGLang{where} (see Aux layers):", "", "```bash"]
        lines.append(
            f"python -m sglang.launch_server --model-path {base} {flags}"
            if flags
            else f"python -m sglang.launch_server --model-path {base}"
        )
        lines += ["```", ""]
    return lines


def speculators_lines(f: dict, base: str, repo: str) -> list[str]:
    return [
        "## Taking it further with speculators",
        "",
        "speculators 0.9.0 converts this folder without loss (every tensor renamed, bit for bit). Its "
        "converter ignores `eagle_config` (the aux ids must be passed, else it takes the verifier's default "
        "layers) and defaults norm_before_residual to false, so pass both:",
        "",
        "```bash",
        convert_command(repo, base, f"{f['folder']}-speculators", f["cfg"]),
        "```",
        "",
    ]


def _card_why_and_files(f: dict, base: str) -> list[str]:
    """## Why this drafter (with the decision's summary) and ## Files."""
    lines = [
        "## Why this drafter",
        "",
        f"{f['why'][:1].upper()}{f['why'][1:]}.",
        "",
    ]
    if f.get("decision"):
        lines += ["```", *f["decision"], "```", ""]
    return lines + [
        "## Files",
        "",
        "- `config.json`: the flat EAGLE-3 layout vLLM and SGLang load (`LlamaForCausalLMEagle3`), "
        f"`verifier: {base}`.",
        f"- `model.safetensors`: {', '.join(f['tensors'])}.",
        "",
    ]


def model_card(facts: dict) -> str:
    """README.md: huggingface_hub ModelCard (metadata + body) from the facts publish_drafter gathers."""
    f = facts
    repo = f["repo_id"] or f"./{f['folder']}"
    base, k, ids = f["base_model"], f["k"], f["aux"]["ids"]
    data = ModelCardData(
        base_model=base, library_name=f["library_name"], tags=list(f["tags"]), license=f.get("license")
    )
    src = f["source"]
    lines = [
        *_card_intro(f, base, src),
        *_card_accept_length(f, k),
        *_card_training_data(f, ids),
        *_card_lineage(f, base, src, ids),
        *_card_serving(f, base, repo, k),
        *_card_why_and_files(f, base),
    ]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def _link(repo: str) -> str:
    return f"https://huggingface.co/{repo}" if _is_hub_id(repo) else repo


# ---- the folder -----------------------------------------------------------------------------------
def check_folder(folder, target_dir, *, embed_tokens: str | None = "target", drafter_dir=None) -> dict:
    """What a peer will rely on, checked on the folder alone (plus, with drafter_dir, that every
    tensor but embed_tokens is that drafter's, bit for bit). Raises DraftportError listing every
    problem; returns a summary."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DraftportError(folder, "no such folder to publish")
    problems = list(export_problems(folder, target_dir, embed_tokens=embed_tokens))
    others = sorted(p.name for p in folder.iterdir() if not (p.is_file() and _hub_file(p.name)))
    if others:
        problems.append(f"files other than config.json, *.safetensors, {INDEX} and {CARD}: {', '.join(others)}")
    card_path = folder / CARD
    base = None
    if not card_path.is_file():
        problems.append(f"{CARD} (the model card) is missing")
    else:
        try:
            meta = ModelCard.load(card_path).data.to_dict()
        except Exception as e:  # huggingface_hub raises ValueError / yaml errors on a broken header
            meta = {}
            problems.append(f"{CARD}: huggingface_hub cannot parse its metadata ({str(e).splitlines()[0][:200]})")
        base = meta.get("base_model")
        if not base:
            problems.append(f"{CARD}: no base_model in its metadata")
    if not problems:
        cfg, raw = read_config(folder)
        if raw.get("verifier") != base:
            problems.append(f"config.json names verifier {raw.get('verifier')!r}, the card's base_model is {base!r}")
        load_drafter_state(folder)  # keys, shapes and the vocab maps, as every draftport step reads a drafter
        if drafter_dir is not None:

            def table(d):
                out = {}
                for f in sorted(Path(d).glob("*.safetensors")):
                    out.update(read_header(f)[0])
                return out

            mine, theirs = table(folder), table(drafter_dir)
            theirs.pop("embed_tokens.weight", None)
            names = set(mine) - {"embed_tokens.weight"}
            if names != set(theirs):
                problems.append(f"tensors {sorted(names ^ set(theirs))} differ between the folder and {drafter_dir}")
            else:

                def same(n):
                    a, b = mine[n], theirs[n]
                    return (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)) and tensor_sha256(a) == tensor_sha256(
                        b
                    )

                bad = sorted(n for n in names if not same(n))
                if bad:
                    problems.append(f"tensors not bit-identical to {drafter_dir}'s: {', '.join(bad)}")
    if problems:
        raise DraftportError(folder, "not publishable: " + "; ".join(problems))
    files = sorted(p.name for p in folder.iterdir())
    return {"base_model": base, "files": files, "bytes": sum((folder / n).stat().st_size for n in files)}


def _stage_hub_files(drafter_dir, target_dir, tmp: Path, embed_tokens: str, base: str):
    """for_vllm's export of the drafter into tmp: its weights, and config.json naming base as its
    verifier; -> what for_vllm did."""
    staged, done = for_vllm(drafter_dir, tmp / ".staged", None, embed_tokens, target_dir=target_dir)
    staged = Path(staged)
    for f in staged.iterdir():
        if not (f.is_file() and _hub_file(f.name)) or f.name in (CARD, "config.json"):
            continue
        if staged == tmp / ".staged":
            os.replace(f, tmp / f.name)  # for_vllm's copy: moved, never copied twice
        else:  # the drafter's own file (nothing to change): linked, copied across devices
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    raw = json.loads((staged / "config.json").read_text())
    raw["verifier"] = base
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    shutil.rmtree(tmp / ".staged", ignore_errors=True)
    return done


def _check_expected_tau(out_dir: Path, taus: list[dict], expected: dict) -> None:
    """The folder's tau at the phase's k must be the phase's evaluation: else the export changed the drafter."""
    got = next((r["accept_length"] for r in taus if r["k"] == expected["k"]), None)
    if got is None or abs(got - expected["accept_length"]) > 1e-9:
        raise DraftportError(
            out_dir,
            f"the published folder's tau at k={expected['k']} is {got}, the phase's "
            f"evaluation measured {expected['accept_length']}: the export changed the drafter",
        )


def _embed_note(tensors: dict, target_dir, base: str) -> str:
    """What the card says of the folder's embed_tokens (the target's bytes, or none)."""
    if "embed_tokens.weight" in tensors:
        theirs = find_target_embedding(target_dir)
        return (
            f"embed_tokens: {base}'s `{theirs.name}` ({theirs.dtype} {list(theirs.shape)}, sha256 "
            f"{tensor_sha256(theirs)[:16]}...), bit for bit: vLLM embeds with a drafter's own copy, "
            "SGLang with the target's, both the same bytes; speculators 0.9.0 would fill a missing one "
            "with uninitialized memory"
        )
    return (
        "no embed_tokens: vLLM and SGLang embed with the target's; speculators 0.9.0 would fill it "
        "with uninitialized memory (publish.embed_tokens: target avoids it)"
    )


def publish_drafter(
    drafter_dir,
    target_dir,
    out_dir,
    facts: dict,
    *,
    features_dir,
    ks,
    embed_tokens: str = "target",
    eval_opts: dict | None = None,
    expected: dict | None = None,
) -> dict:
    """Write the hub folder out_dir (atomically) from a phase's drafter; -> its summary.

    facts: what the card states (from_pipeline gathers it; `taus`, `tensors`, `embed_note` and
    `cfg` are filled in here). ks: the k of the tau table. eval_opts: batch_size, max_samples,
    boot, costmodel (tau_table). expected: {"k", "accept_length"}: the phase's evaluation, which
    the folder's tau at that k must equal."""
    out_dir = Path(out_dir)
    base = facts["base_model"]
    with atomic_dir(out_dir) as tmp:
        done = _stage_hub_files(drafter_dir, target_dir, tmp, embed_tokens, base)
        taus = tau_table(tmp, target_dir, features_dir, ks, **(eval_opts or {}))
        if expected is not None:
            _check_expected_tau(out_dir, taus, expected)
        cfg, _ = read_config(tmp)
        tensors = {}
        for f in sorted(tmp.glob("*.safetensors")):
            tensors.update(read_header(f)[0])
        facts = {
            **facts,
            "taus": [*taus, *facts.get("online", [])],
            "embed_note": _embed_note(tensors, target_dir, base),
            "cfg": cfg,
            "tensors": [f"`{n}` {t.dtype} {list(t.shape)}" for n, t in sorted(tensors.items())],
        }
        (tmp / CARD).write_text(model_card(facts))
        summary = check_folder(tmp, target_dir, embed_tokens=embed_tokens, drafter_dir=drafter_dir)
    return {
        "folder": str(out_dir),
        "phase": facts["phase"],
        "why": facts["why"],
        "base_model": base,
        "repo_id": facts["repo_id"],
        "export": done,
        "taus": taus,
        "files": summary["files"],
        "bytes": summary["bytes"],
    }


# ---- from the pipeline's artifacts -----------------------------------------------------------------
def _index(path) -> dict:
    return load_json(path, "missing (has the features step run?)")


def _input(inputs: dict, name: str) -> Path:
    """The step's named input (registry row `publish`); a missing one is said in one line."""
    if name not in inputs:
        raise DraftportError("publish", f"no input {name!r} (the step's registry row lists it)")
    return Path(inputs[name])


def _target_id(target: Path) -> dict:
    """The new target as the card names it: a hub fetch's repo and commit, else its folder's identity."""
    tlock = target / "fetch.lock.json"  # a target fetched from the hub: its repo and commit
    if tlock.is_file():
        t = load_json(tlock, "missing")
        return {"id": t.get("source"), "revision": t.get("commit")}
    return target_identity(target)


def _data_and_training(inputs: dict, chain: list[str]) -> tuple[list[dict], list[dict]]:
    """For each phase of the chain: its training data (the features' index) and its training (metrics)."""
    datas, training = [], []
    for step in chain:
        data = "data_phase1" if step != "phase2" else "data_phase2" if "data_phase2" in inputs else "data_phase2_chain"
        ix = _index(_input(inputs, data))
        datas.append(
            {
                "phase": step,
                "samples": ix["samples"],
                "tokens": ix["tokens"],
                "prompts": ix.get("samples_file"),
                "offset": ix.get("offset", 0),
                "regenerated": ix.get("regenerated"),
            }
        )
        tm = load_json(_input(inputs, f"train_{step}"), "missing (has the training step run?)")
        training.append(
            {
                "phase": step,
                "init": {"phase1_scratch": "random", "phase1": "the source drafter", "phase2": "Phase 1's drafter"}[
                    step
                ],
                **{k: tm.get(k) for k in ("train_steps", "final_loss", "lm_head_rows_kept", "lm_head_rows_new")},
            }
        )
    return datas, training


def _online_taus(inputs: dict, ph: str) -> list[dict]:
    """vLLM's own tau for the card's table: Phase 1's, when the online step ran."""
    online = []
    if ph == "phase1" and "online_phase1" in inputs:
        om = load_json(_input(inputs, "online_phase1"), "missing (has the online step run?)")
        engine = (
            f"vLLM {om['vllm_version']} (its own counters)" if om.get("vllm_version") else "vLLM (its own counters)"
        )
        online.append(
            {
                "k": om["online_k"],
                "engine": engine,
                "accept_length": om["online_accept_length"],
                "prompts": om.get("online_num_prompts"),
                "num_cycles": om.get("online_num_drafts"),
                "accept_rate_pos": [om[f"online_accept_rate_pos_{i}"] for i in range(om["online_k"])],
            }
        )
    return online


def _source_facts(lock: dict, src_cfg) -> dict:
    """The source drafter as fetched: repo, requested revision, commit, the target it was trained for."""
    return {
        "repo_id": lock.get("source"),
        "requested_revision": lock.get("requested_revision"),
        "commit": lock.get("commit"),
        "verifier": src_cfg.extra.get("verifier"),
    }


def _evaluation_facts(ev: dict, base: str, d: dict, cm: dict, k: int) -> dict:
    """How the card's tau was measured: prompts, CI level and draws, the cost model and its break-even."""
    return {
        "prompts": ev.get("eval_samples"),
        "target": base,
        "level": d["level"],
        "n_boot": d["n_boot"],
        "costmodel": cm,
        "break_even": CostModel(cm["baseline_tok_s"], cm["verify_ms"], cm["draft_ms"], k=k).break_even_accept_length,
    }


def _serving_facts(decision: dict | None, ph: str) -> dict | None:
    """The decision's serving rule (R11) for the drafter published, when it is the one R11 served."""
    rec = ((decision or {}).get("serving") or {}).get("drafters", {}).get("recommended")
    return rec if rec is not None and rec["phase"] == ph else None


def from_pipeline(p: dict, inputs: dict, out_dir, *, phase: str | None = None, repo_id: str | None = None) -> dict:
    """The publish step (and `draftport publish`): p = its params (publish, targets.new, eval,
    costmodel, decision), inputs = its named inputs (registry row `publish`)."""
    pp = p["publish"]
    decision = load_decision(_input(inputs, "decision")) if "decision" in inputs else None
    ph, why = choose_phase(decision, phase if phase is not None else pp["phase"])
    drafter, target = _input(inputs, f"drafter_{ph}"), _input(inputs, "target")
    base = pp["base_model"] or p["targets"]["new"]
    cfg, _ = read_config(drafter)
    lock = load_json(_input(inputs, "source"), "missing (has the fetch step run?)")
    src_cfg, _ = read_config(_input(inputs, "source").parent)  # the source drafter as fetched: the target it names
    tid = _target_id(target)
    chain = {"phase1_scratch": ["phase1_scratch"], "phase1": ["phase1"], "phase2": ["phase1", "phase2"]}[ph]
    datas, training = _data_and_training(inputs, chain)
    ev = load_json(_input(inputs, f"eval_{ph}"), "missing (has the evaluation step run?)")
    k = int(p["eval"]["k"])
    d = p["decision"]
    cm = p["costmodel"]
    online = _online_taus(inputs, ph)
    facts = {
        "phase": ph,
        "why": why,
        "base_model": base,
        "repo_id": repo_id or pp["repo_id"],
        "folder": Path(out_dir).name,
        "library_name": pp["library_name"],
        "tags": pp["tags"],
        "license": pp["license"],
        "k": k,
        "source": _source_facts(lock, src_cfg),
        "target": tid,
        "aux": {"ids": list(cfg.aux_layer_ids or []), "convention": cfg.aux_convention},
        "data": datas,
        "training": training,
        "chain": [
            {"phase1_scratch": "a random init", "phase1": "Phase 1 (fine-tuned)", "phase2": "Phase 2"}[s] for s in chain
        ],
        "online": online,
        "evaluation": _evaluation_facts(ev, base, d, cm, k),
        "decision": render_text(decision).rstrip("\n").splitlines() if decision is not None else None,
        "serving": _serving_facts(decision, ph),
    }
    ks = sorted(set(pp["k"]) | {k})
    eval_opts = {
        "batch_size": p["eval"]["batch_size"],
        "max_samples": p["eval"]["max_samples"],
        "boot": {"n_boot": d["n_boot"], "level": d["level"], "seed": d["seed"]},
        "costmodel": cm,
    }
    return publish_drafter(
        drafter,
        target,
        out_dir,
        facts,
        features_dir=_input(inputs, "features"),
        ks=ks,
        embed_tokens=pp["embed_tokens"],
        eval_opts=eval_opts,
        expected={"k": k, "accept_length": ev["accept_length"]},
    )


# ---- upload -------------------------------------------------------------------------------------------
def hub_token(token: str | None = None) -> str:
    """The upload's token: given, else $HF_TOKEN; one line when there is none."""
    token = token or os.environ.get("HF_TOKEN")
    if not token:
        raise DraftportError(
            "HF_TOKEN", "not set: the upload needs a hub token with write access (export HF_TOKEN=...)"
        )
    return token


def push_preflight(repo_id, base_model=None, token: str | None = None) -> str:
    """The token, once repo_id (and base_model, when given) are hub ids; one-line errors, no network."""
    token = hub_token(token)
    if not _is_hub_id(repo_id or ""):
        raise DraftportError("--repo-id", f"expected a hub repo id like org/name, got {repo_id!r}")
    if base_model is not None and not _is_hub_id(base_model):
        raise DraftportError(
            "publish.base_model",
            f"{base_model!r} is not a hub id (org/name): the card's base_model "
            "must name the target on the hub (set publish.base_model)",
        )
    return token


def push(
    folder,
    repo_id: str,
    target_dir,
    *,
    embed_tokens: str | None = "target",
    private: bool = False,
    token: str | None = None,
    message: str | None = None,
) -> dict:
    """Upload a published folder to the hub (HfApi.create_repo + upload_folder), after
    push_preflight and check_folder pass; nothing leaves the machine otherwise."""
    token = push_preflight(repo_id, token=token)
    summary = check_folder(folder, target_dir, embed_tokens=embed_tokens)
    push_preflight(repo_id, summary["base_model"], token)
    card = (Path(folder) / CARD).read_text()
    if repo_id not in card:
        raise DraftportError(
            Path(folder) / CARD,
            f"the card's commands do not name {repo_id}: rebuild it with `draftport publish --repo-id {repo_id}`",
        )
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=message or f"draftport publish: EAGLE-3 drafter for {summary['base_model']}",
        )
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise DraftportError(repo_id, f"upload failed: {str(e).splitlines()[0][:300]}") from None
    return {"repo_id": repo_id, "commit_url": str(getattr(info, "commit_url", "") or ""), **summary}
