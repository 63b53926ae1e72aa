"""`draftport init NAME`: a profile for a team's own model pair, from what the team has.

It reads headers only (config.json, safetensors headers; no weights loaded), checks the source
drafter against the new target (hidden size, vocab, aux-layer ids in the drafter's numbering,
context, embed_tokens, remote code), checks the prompt files (format, count, duplicates, the
held-out set disjoint from training), pins the revision, and writes configs/NAME.yaml with one
comment per key saying why it has that value. What is still missing before
`snakemake --configfile=configs/NAME.yaml --cores 8 decision` can run is listed, not guessed.

Two kinds of finding: a problem (the pair cannot work as given: no profile is written) and a gap
(the profile is written, the gap is named in it and printed: e.g. prompts not there yet).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from draftport.data.capture import check_aux_ids
from draftport.errors import DraftportError
from draftport.files import atomic_write_text, load_json
from draftport.model.config import DrafterConfig, parse_config
from draftport.model.formats import read_header, weight_files
from draftport.plan import params
from draftport.profile import estimate

# a flat config without draftport's marker: SpecForge / SGLang train most flat drafters (AQ-MedAI's
# too), and SGLang numbers an aux id k as the state leaving layer k
FLAT_DEFAULT_CONVENTION = "sglang"
GPU_BYTES = estimate.GPUS["H200"]["memory_bytes"]  # one H200's memory: how many GPUs the target's weights need
BATCH = 64  # global batch of the real-scale training (8 per GPU on a node)
TOKENS_PER_STEP = 16384  # the phases' packed row a GPU a step: 8 samples of 2048
EPOCHS = 2  # passes over the data per phase (the curves' budget rule too)
HEX40 = re.compile(r"[0-9a-f]{40}")


@dataclass
class Model:
    """A drafter or target as init found it: where, which commit, its config, its tensor names."""

    spec: str  # what the user gave: a folder or org/name[@revision]
    kind: str  # "source", "targets.new", "targets.old"
    repo_id: str | None = None  # hub id (None: a local folder)
    revision: str | None = None  # asked for
    commit: str | None = None  # resolved: 40 hex
    folder: Path | None = None  # where config.json lies
    config: dict = field(default_factory=dict)
    tensors: dict[str, list[int]] | None = None  # name -> shape (drafter only; None: headers unread)


@dataclass
class Findings:
    problems: list[tuple[str, str]] = field(default_factory=list)  # (file or key, what is wrong)
    gaps: list[tuple[str, str]] = field(default_factory=list)  # (key, what is still missing)
    notes: list[tuple[str, str]] = field(default_factory=list)  # (key, what was decided and why)

    def problem(self, where, what):
        self.problems.append((str(where), what))

    def gap(self, where, what):
        self.gaps.append((str(where), what))

    def note(self, where, what):
        self.notes.append((str(where), what))


def split_spec(spec: str) -> tuple[str, str | None]:
    """org/name@rev -> (org/name, rev); a folder -> (folder, None)."""
    if "@" in spec and not Path(spec).exists():
        repo, rev = spec.rsplit("@", 1)
        return repo, rev or None
    return spec, None


def locate(spec: str, kind: str, *, cache_dir=None, offline: bool = False, headers: bool = False) -> Model:
    """Find a model's config.json (and, with headers, its safetensors headers) without loading
    weights: a local folder, or a hub id through huggingface_hub (its cache first)."""
    name, rev = split_spec(spec)
    m = Model(spec=spec, kind=kind, revision=rev)
    local = Path(name)
    if local.exists() or name.startswith((".", "/")) or name.count("/") != 1:
        if not local.is_dir():
            raise DraftportError(kind, f"{name}: neither a model folder nor a hub id like org/name")
        m.folder = local
    else:
        m.repo_id = name
        pats = ["config.json", "*.safetensors.index.json", "tokenizer_config.json"]
        try:
            path = snapshot_download(
                repo_id=name, revision=rev or "main", cache_dir=cache_dir, allow_patterns=pats, local_files_only=offline
            )
        except LocalEntryNotFoundError:
            raise DraftportError(
                kind,
                f"{name}@{rev or 'main'} is not in the hub cache {cache_dir or '(default)'} and the hub is offline",
            ) from None
        except (HfHubHTTPError, OSError, ValueError) as e:
            raise DraftportError(kind, f"{name}@{rev or 'main'}: {str(e).splitlines()[0]}") from None
        m.folder = Path(path)
        m.commit = m.folder.name if HEX40.fullmatch(m.folder.name) else None
    raw = load_json(m.folder / "config.json", "no config.json", where=f"{kind} ({spec})")
    if not isinstance(raw, dict):
        raise DraftportError(m.folder / "config.json", "config is not a JSON object")
    m.config = raw
    if headers:
        m.tensors = _headers(m, cache_dir, offline)
    return m


def _headers(m: Model, cache_dir, offline: bool) -> dict[str, list[int]] | None:
    """Tensor name -> shape from the safetensors headers: the folder's files (a local folder, or
    the hub cache holding them), else the hub's header-only metadata (ranged reads)."""
    folder = m.folder
    if m.repo_id is not None and not list(folder.glob("*.safetensors")):
        try:
            folder = Path(
                snapshot_download(
                    repo_id=m.repo_id,
                    revision=m.commit or m.revision or "main",
                    cache_dir=cache_dir,
                    allow_patterns=["*.safetensors"],
                    local_files_only=True,
                )
            )
        except (LocalEntryNotFoundError, OSError, ValueError):
            folder = None
    if folder is not None and list(folder.glob("*.safetensors")):
        out = {}
        for f in weight_files(folder):
            out.update({n: list(t.shape) for n, t in read_header(f)[0].items()})
        return out
    if offline or m.repo_id is None:
        return None
    # lazy: only a hub drafter whose weights are not cached reads its headers over the network
    from huggingface_hub import get_safetensors_metadata

    try:
        meta = get_safetensors_metadata(m.repo_id, revision=m.commit or m.revision or "main")
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise DraftportError(
            "source", f"{m.repo_id}: cannot read its safetensors headers: {str(e).splitlines()[0]}"
        ) from None
    return {n: list(t.shape) for fm in meta.files_metadata.values() for n, t in fm.tensors.items()}


def text_config(m: Model) -> dict:
    """The text decoder's config (a multimodal wrapper's text_config)."""
    c = m.config
    if isinstance(c.get("text_config"), dict) and "num_hidden_layers" not in c:
        return c["text_config"]
    return c


def needs_remote_code(m: Model) -> bool:
    """The model or its tokenizer is code in the repo (auto_map), not a transformers class."""
    if m.config.get("auto_map"):
        return True
    tok = m.folder / "tokenizer_config.json" if m.folder else None
    if tok is not None and tok.is_file():
        try:
            return bool(json.loads(tok.read_text()).get("auto_map"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return False
    return False


# ---- checks -------------------------------------------------------------------------------------
def _target_sizes(tc: dict, twhere: str, f: Findings) -> tuple[int, int, int] | None:
    """The new target's hidden size, vocab and layer count (None, a problem noted, when it lacks one)."""
    try:
        return int(tc["hidden_size"]), int(tc["vocab_size"]), int(tc["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as e:
        f.problem(twhere, f"lacks {e}")
        return None


def _check_drafter_fits(src: Model, cfg: DrafterConfig, hidden: int, vocab: int, where: str, f: Findings) -> None:
    """The drafter's hidden size and vocab against the target's; its vocab maps and embed_tokens (headers)."""
    reads = cfg.target_hidden_size or cfg.hidden_size
    if reads != hidden:
        f.problem(
            where, f"the drafter reads hidden states of size {reads} but the new target's hidden_size is {hidden}"
        )
    if cfg.vocab_size != vocab:
        f.problem(
            where, f"vocab_size {cfg.vocab_size} but the new target's is {vocab} (d2t maps into the target vocab)"
        )
    if src.tensors is not None:
        if cfg.draft_vocab_size < cfg.vocab_size and not {"d2t", "t2d"} <= set(src.tensors):
            f.problem(
                where.replace("config.json", "*.safetensors"), "no d2t/t2d vocab maps but draft_vocab_size < vocab_size"
            )
        embed = any(n.endswith("embed_tokens.weight") for n in src.tensors)
        f.note(
            "source",
            "carries embed_tokens: the new target's embedding replaces it wherever it is served or published"
            if embed
            else "no embed_tokens: the drafter is served with the target's embedding (vLLM and SGLang share it)",
        )
    else:
        f.gap(
            "source",
            "its safetensors headers were not read (offline, weights not in the cache): "
            "the fetch step checks the tensors",
        )


def _aux_convention(cfg: DrafterConfig) -> tuple[str, str]:
    """How the drafter numbers its aux layer ids, and why that numbering is assumed."""
    if cfg.aux_convention:
        return cfg.aux_convention, "the drafter's config says so (draftport_aux_convention)"
    if cfg.format == "speculators":
        return "vllm", "a speculators-format drafter: trained on vLLM's hidden states"
    return (
        FLAT_DEFAULT_CONVENTION,
        (
            "a flat config without a convention marker: SpecForge/SGLang's numbering "
            "assumed (id k = the state leaving layer k); set vllm if it was trained "
            "on vLLM's hidden states"
        ),
    )


def _check_aux_layers(ids, layers: int, conv: str, where: str, f: Findings) -> None:
    """The layers the drafter reads exist in the new target (in the drafter's numbering)."""
    if not ids:
        f.problem(where, "no eagle_aux_hidden_state_layer_ids: the layers the drafter reads are unknown")
    else:
        try:
            check_aux_ids(ids, layers, conv, where)
        except DraftportError as e:
            f.problem(where, str(e).split(": ", 1)[-1])


def check_pair(src: Model, new: Model, old: Model | None, f: Findings) -> dict:
    """The drafter against the new target; -> what the profile takes from them."""
    where = f"source ({src.spec})/config.json"
    try:
        cfg: DrafterConfig = parse_config(src.config, where)
    except DraftportError as e:
        f.problem(where, str(e).split(": ", 1)[-1])
        return {}
    tc = text_config(new)
    sizes = _target_sizes(tc, f"targets.new ({new.spec})/config.json", f)
    if sizes is None:
        return {}
    hidden, vocab, layers = sizes
    ctx = int(tc.get("max_position_embeddings") or 0)
    _check_drafter_fits(src, cfg, hidden, vocab, where, f)
    conv, why = _aux_convention(cfg)
    ids = cfg.aux_layer_ids
    _check_aux_layers(ids, layers, conv, where, f)
    if ctx and cfg.max_position_embeddings < ctx:
        f.note(
            "features.max_new_tokens",
            f"the drafter's context is {cfg.max_position_embeddings} tokens, the "
            f"target's {ctx}: answers are kept within the drafter's",
        )
    if old is not None:
        otc = text_config(old)
        if int(otc.get("hidden_size", -1)) != hidden or int(otc.get("vocab_size", -1)) != vocab:
            f.problem(
                f"targets.old ({old.spec})/config.json",
                "hidden_size / vocab_size differ from the new target's: the drift probe compares states token by token",
            )
    return {
        "cfg": cfg,
        "convention": conv,
        "convention_why": why,
        "aux_ids": list(ids or []),
        "hidden": hidden,
        "vocab": vocab,
        "layers": layers,
        "ctx": ctx,
        "target_config": tc,
    }


def check_prompts(train: Path | None, heldout: Path | None, f: Findings) -> dict:
    """Format, count, duplicates; the held-out set disjoint from training."""
    out: dict[str, Any] = {"train": 0, "heldout": 0, "train_answers": 0}
    recs = {}
    for key, path in (("targets.prompts_train", train), ("targets.prompts_eval_new", heldout)):
        if path is None:
            continue
        if not path.is_file():
            f.gap(key, f'{path}: no such file yet (JSONL, one {{"user": "..."}} per line)')
            continue
        rows = []
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    f.problem(f"{path}:{lineno}", "not a JSON line")
                    return out
                if not isinstance(rec, dict) or not isinstance(rec.get("user"), str) or not rec["user"].strip():
                    f.problem(f"{path}:{lineno}", "each line needs a non-empty string 'user' field")
                    return out
                rows.append((lineno, rec["user"]))
                if key == "targets.prompts_train" and isinstance(rec.get("assistant"), str):
                    out["train_answers"] += 1
        seen: dict[str, int] = {}
        dups = []
        for lineno, u in rows:
            if u in seen:
                dups.append((seen[u], lineno))
            seen.setdefault(u, lineno)
        if dups:
            f.note(
                key,
                f"{len(dups)} duplicate prompts (first: line {dups[0][1]} repeats line {dups[0][0]}); "
                "they count as samples twice",
            )
        recs[key] = seen
        out["train" if key.endswith("train") else "heldout"] = len(rows)
    if len(recs) == 2:
        both = set(recs["targets.prompts_train"]) & set(recs["targets.prompts_eval_new"])
        if both:
            first = min(recs["targets.prompts_eval_new"][u] for u in both)
            f.problem(
                f"{heldout}:{first}",
                f"{len(both)} held-out prompts are also training prompts (the held-out set must be disjoint)",
            )
    return out


def parse_eval_set(spec: str) -> dict:
    """`--eval-set NAME=PATH:SHARE` -> {name, prompts, share, n: None} (the share follows the last ':')."""
    name, eq, rest = spec.partition("=")
    path, colon, share = rest.rpartition(":")
    try:
        value = float(share)
    except ValueError:
        value = None
    if not (eq and colon and name and path) or value is None:
        raise DraftportError("--eval-set", f"{spec!r}: expected NAME=PATH:SHARE (e.g. code=data/code.jsonl:0.3)")
    return {"name": name, "prompts": path, "share": value, "n": None}


def check_eval_sets(specs: tuple[str, ...], train: Path | None, f: Findings) -> list[tuple[dict, list[dict]]]:
    """The --eval-set options: parsed, checked as targets.eval_sets (names, shares adding up to 1)
    and read (format, disjoint from the training prompts). -> [(set, its rows)]; [] on a problem (noted)."""
    # lazy: the sets' reader runs only when sets are given
    from draftport.data.evalsets import read_eval_sets

    try:
        sets = params.check_eval_sets([parse_eval_set(x) for x in specs])
        return read_eval_sets(sets, train)
    except DraftportError as e:
        f.problem(e.where, e.problem)
        return []


# ---- the profile --------------------------------------------------------------------------------
@dataclass
class Line:
    """One key of the profile: its dotted path, value and why."""

    key: str
    value: Any
    why: str = ""


def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, float):  # PyYAML reads 5e-05 as a string: positional digits only
        r = repr(v)
        if "e" not in r:
            return r
        digits = format(v, ".15f").rstrip("0")
        return digits + "0" if digits.endswith(".") else digits
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_scalar(x)}" for k, x in v.items()) + "}"
    s = str(v)
    return (
        json.dumps(s)
        if (
            not s
            or re.search(r"[:#{}\[\],&*?|<>=!%@`'\"]|^\s|\s$", s)
            or s.lower() in ("null", "true", "false", "yes", "no", "on", "off")
        )
        else s
    )


def render_yaml(header: list[str], lines: list[Line]) -> str:
    """YAML with one comment per key: a key is `group` or `group.key` (a deeper value is written
    inline, as `{a: 1, b: 2}`), grouped by its first part in the order the lines come."""
    out = [f"# {h}" if h else "#" for h in header]
    groups: dict[str, list[Line]] = {}
    for ln in lines:
        assert ln.key.count(".") <= 1, ln.key
        groups.setdefault(ln.key.split(".", 1)[0], []).append(ln)
    for g, lns in groups.items():
        if len(lns) == 1 and "." not in lns[0].key:
            ln = lns[0]
            out.append(f"{g}: {_scalar(ln.value)}" + (f"   # {ln.why}" if ln.why else ""))
            continue
        out.append(f"{g}:")
        for ln in lns:
            out.append(f"  {ln.key.split('.', 1)[1]}: {_scalar(ln.value)}" + (f"   # {ln.why}" if ln.why else ""))
    return "\n".join(out) + "\n"


def _steps(n: int, batch: int = BATCH, epochs: int = EPOCHS) -> int:
    """EPOCHS passes over n samples, rounded up to 100 steps."""
    return max(100, int(math.ceil(epochs * n / batch / 100.0)) * 100)


def nice(x: float) -> int:
    """x rounded to 1, 2, 2.5 or 5 x 10^k (curve points a reader can say)."""
    if x < 1:
        return 1
    k = 10 ** math.floor(math.log10(x))
    return int(min((m * k for m in (1, 2, 2.5, 5, 10)), key=lambda v: abs(v - x)))


def real_scale(n1: int, n2: int, gpus: int, tp: int, counts: dict | None = None) -> list[Line]:
    """Batch sizes, training, monitor, curves, the online check and publish for a GPU node (what
    the Kimi profile runs). counts: check_prompts' (whether the prompts carry their own answers)."""
    per = "one process per GPU under torchrun; 8 samples per GPU at seq 2048"
    train = lambda steps, lr, every, ck, budget=True: {  # noqa: E731  (one place the three groups share)
        "steps": steps,
        "batch_size": BATCH,
        # the phases' steps in tokens: one shape a step, 8 samples of 2048 a GPU (more when shorter)
        **({"tokens_per_step": TOKENS_PER_STEP} if budget else {}),
        "lr": lr,
        "warmup_steps": 60,
        "ttt_steps": 7,
        "dtype": "bfloat16",
        "log_every": 10,
        "checkpoint_every": ck,
        "parallel": "ddp",
        "eval_every": every,
        "packing": True,
        "fast": {"attention": "cudnn"},
    }
    s1, s2 = _steps(n1), _steps(n2)
    curve_ns = sorted({nice(n1 / 8), nice(n1 / 4), n1, nice((n1 + n2) / 2), n2})
    return [
        Line("features.batch_size", 8, "prompts per capture batch (sequences up to 2048 tokens)"),
        Line("eval.batch_size", 8, "samples per evaluation batch"),
        Line("eval.context_buckets", REAL_BUCKETS, "lower edges of the verify position's buckets (tokens)"),
        Line(
            "phase1.train",
            train(s1, 0.0001, 100, 200),
            f"{EPOCHS} epochs of {n1:,} at batch {BATCH} ({per}); packed rows of {TOKENS_PER_STEP:,} tokens a GPU; "
            "cuDNN attention",
        ),
        Line(
            "phase2.train",
            {**train(s2, 0.00005, 500, 500), "warmup_steps": 100},
            f"{EPOCHS} epochs of {n2:,}, half Phase 1's learning rate (it continues Phase 1's drafter)",
        ),
        Line(
            "monitor",
            {"n_samples": 512, "k": 7, "batch_size": 16},
            "held-out tau during training: the training file's last 512 prompts, k = the TTT depth",
        ),
        Line("curves.n_samples", curve_ns, "from 1/8 of Phase 1's data to Phase 2's: where fine-tune and scratch meet"),
        Line("curves.seeds", [0, 1, 2], "three seeds per point: the decision's CIs"),
        Line("curves.epochs", EPOCHS, "the budget rule: the same epochs at every n"),
        Line("curves.min_steps", 100, "at least this many steps at the smallest n"),
        Line(
            "curves.arms_n_samples",
            [curve_ns[1], n1] if curve_ns[1] < n1 else [n1],
            "the arms (dataset answers, recipes) at a quarter of Phase 1's n and at Phase 1's",
        ),
        _answers_line(counts or {}),
        Line(
            "curves.recipes",
            {"l2sp": {"l2sp_lambda": 0.0001}, "lr_low": {"lr": 0.000025}, "frozen": {"freeze": ["fc", "input_norms"]}},
            "port recipes beside plain fine-tuning: an L2-SP anchor, a quarter of the lr, fc + input norms kept",
        ),
        Line(
            "curves.train",
            # in samples: a point's steps follow from its n and the epochs (the budget rule)
            train(math.ceil(EPOCHS * n2 / BATCH), 0.0001, 250, 200, budget=False),
            "as phase1.train; steps: the budget rule's at the largest n",
        ),
        Line(
            "online",
            {
                "n_prompts": 256,
                "max_new_tokens": 512,
                "max_num_seqs": 64,
                "dtype": "bfloat16",
                "tensor_parallel_size": tp,
            },
            "vLLM serving the drafter next to the offline evaluator (steps online_*; opt-in: online.enabled)",
        ),
        Line("publish.k", [1, 2, 3, 4, 5, 6, 7], "the model card's accept lengths, up to the TTT depth"),
    ]


def _answers_line(counts: dict) -> Line:
    """curves.answers: on unless the training prompts are there without their own answers."""
    n, with_answers = counts.get("train", 0), counts.get("train_answers", 0)
    if not n:
        return Line(
            "curves.answers",
            True,
            "regenerate or not (R7): needs an 'assistant' answer per training "
            "prompt, the dataset's own (set false when the prompts have none)",
        )
    if with_answers < n:
        return Line(
            "curves.answers",
            False,
            f"only {with_answers:,} of the {n:,} training prompts carry an "
            "'assistant' answer: no regenerate-or-not arm",
        )
    return Line("curves.answers", True, f"regenerate or not (R7): the {n:,} prompts carry their own answers")


def resources(tp: int, gpus: int) -> list[Line]:
    node = f"{gpus} GPUs (one node)"
    feat = {"gpu": tp, "mem_mb": 800000 if tp > 1 else 128000, "threads": 32 if tp > 1 else 8}
    train = {"gpu": gpus, "mem_mb": 400000, "threads": 32, "torchrun": True}
    ev = {"gpu": 1, "mem_mb": 128000, "runtime": 240, "threads": 8}
    return [
        Line(
            "resources.default",
            {"gpu": 0, "mem_mb": 16000, "runtime": 60, "threads": 4, "torchrun": False},
            "steps without a GPU",
        ),
        Line("resources.fetch", {"mem_mb": 16000, "runtime": 600, "threads": 8}, "the target's weights"),
        Line("resources.features_new", {**feat, "runtime": 2880}, f"the capture holds the target's {tp} GPU(s)"),
        Line("resources.features_eval", {**feat, "runtime": 600}, ""),
        Line("resources.features_monitor", {**feat, "runtime": 120}, ""),
        Line("resources.features_phase2", {**feat, "runtime": 10080}, ""),
        Line("resources.features_dataset", {**feat, "runtime": 600}, "the dataset's answers: a prefill each"),
        Line(
            "resources.budget",
            {**feat, "torchrun": True, "runtime": 20160},
            "data.budget adaptive: the capture's GPUs; each round's trainings under torchrun over them",
        ),
        Line("resources.vocab_new", {"mem_mb": 64000, "runtime": 600, "threads": 8}, ""),
        Line("resources.eval_phase0", ev, "one GPU evaluates a drafter"),
        Line("resources.train_phase1_scratch", {**train, "runtime": 720}, node),
        Line("resources.eval_phase1_scratch", ev, ""),
        Line("resources.train_phase1", {**train, "runtime": 720}, node),
        Line("resources.eval_phase1", ev, ""),
        Line("resources.train_phase2", {**train, "runtime": 2880}, node),
        Line("resources.eval_phase2", ev, ""),
        Line("resources.train_curves", {**train, "runtime": 20160}, node + ": one point at a time"),
        Line("resources.eval_curves", {**ev, "runtime": 600}, ""),
        Line(
            "resources.online_phase0",
            {"gpu": tp, "mem_mb": 800000, "runtime": 240, "threads": 16},
            "vLLM holds the target's GPUs",
        ),
        Line("resources.online_phase1", {"gpu": tp, "mem_mb": 800000, "runtime": 240, "threads": 16}, ""),
    ]


LIKE_GROUPS = (
    "vocab_new",
    "eval",
    "costmodel",
    "drift",
    "monitor",
    "phase1",
    "phase2",
    "curves",
    "decision",
    "publish",
    "online",
    "resources",
)


def like_lines(like: Path, n1: int, n2: int) -> list[Line]:
    """The training-side settings of an existing profile (e.g. configs/micro.yaml), sample counts
    excepted (they come from the prompts)."""
    raw = params.read_yaml(like)
    out = []
    kept = params.load(like)["curves"]["n_samples"]
    for g in LIKE_GROUPS:
        v = raw.get(g)
        if not isinstance(v, dict):
            continue
        for k, x in v.items():
            if g in ("phase1", "phase2") and k == "n_samples":
                continue
            if g == "curves" and k == "n_samples":
                x = [n for n in x if n <= n2] or [n1]
                kept = x
            if g == "curves" and k == "arms_n_samples":  # the arms' n must stay among the curves' n
                x = [n for n in x if n in kept]
            out.append(Line(f"{g}.{k}", x, f"as {like}"))
    f = params.load(like)["features"]  # with params.yaml's defaults under it: where the capture runs
    for k in ("max_new_tokens", "eval_samples", "batch_size", "dtype", "device", "engine", "tensor_parallel_size"):
        out.append(Line(f"features.{k}", f[k], f"as {like}"))
    return out


@dataclass(frozen=True)
class InitRequest:
    """What `draftport init` is asked: the pair (a source drafter, the new target, the old one),
    its prompt files, how the answers are made, the deployment's measured figures, the profile to
    copy training settings from (`like`), and where to write."""

    name: str
    source: str
    target_new: str
    target_old: str | None = None
    prompts: Path | None = None
    prompts_eval: Path | None = None
    regenerate: str = "local"
    base_url: str | None = None
    served_model: str | None = None
    cache_dir: str | Path | None = None
    offline: bool = False
    trust_remote_code: bool = False
    like: Path | None = None
    gpus: int = 8
    phase1_samples: int | None = None
    phase2_samples: int | None = None
    baseline_tok_s: float | None = None
    verify_ms: float | None = None
    draft_ms: float | None = None
    reference: str | None = None
    eval_sets: tuple[str, ...] = ()  # --eval-set NAME=PATH:SHARE, each
    pin: bool = True
    read_offline: bool | None = None
    out: Path | None = None
    force: bool = False


def _profile_path(req: InitRequest) -> Path:
    """The request's name and answer source checked; -> where the profile goes (never over one without force)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", req.name):
        raise DraftportError(
            "NAME",
            f"{req.name!r}: letters, digits, '.', '_' and '-' only "
            "(it names configs/NAME.yaml and the MLflow experiment)",
        )
    if req.regenerate not in ("local", "openai"):
        raise DraftportError("--regenerate", f"{req.regenerate!r}: local or openai")
    if req.regenerate == "openai" and not req.base_url:
        raise DraftportError("--base-url", "needed with --regenerate openai (the served target's /v1 address)")
    path = req.out or Path("configs") / f"{req.name}.yaml"
    if path.exists() and not req.force:
        raise DraftportError(
            path, "exists: pass --force to replace it (the old file is kept until the new one is whole)"
        )
    return path


def _read_pair(req: InitRequest, f: Findings) -> tuple[Model, Model, Model | None, dict]:
    """The drafter (with its headers) and the targets located; -> (source, new, old, check_pair's)."""
    # offline: what the profile's fetch does; read_offline: how init itself reads (HF_HUB_OFFLINE too)
    ro = req.offline if req.read_offline is None else req.read_offline
    src = locate(req.source, "source", cache_dir=req.cache_dir, offline=ro, headers=True)
    if not req.pin:  # an example profile: the branch stays, the commit is named a gap (_closing_gaps)
        src.commit = None
    new = locate(req.target_new, "targets.new", cache_dir=req.cache_dir, offline=ro)
    old = locate(req.target_old, "targets.old", cache_dir=req.cache_dir, offline=ro) if req.target_old else None
    return src, new, old, check_pair(src, new, old, f)


def _target_gpus(pair: dict, new: Model, f: Findings) -> tuple[float, int]:
    """The target's bf16 weight bytes (0: unknown) and the GPUs they are sharded over."""
    try:
        shape = estimate.target_shape(pair["target_config"], f"targets.new ({new.spec})/config.json")
    except DraftportError as e:
        shape = None
        f.note("features.engine", f"parameter count unknown ({str(e).split(': ', 1)[-1]}): transformers engine")
    weight_bytes = 2 * shape["total_params"] if shape else 0
    tp = 1
    while tp < 8 and weight_bytes > 0.8 * GPU_BYTES * tp:
        tp *= 2
    return weight_bytes, tp


def _phase_samples(req: InitRequest, counts: dict, train_path: Path, f: Findings) -> tuple[int, int] | None:
    """Phase 1's and Phase 2's sample counts (None, a problem noted, when the prompts cannot give them)."""
    n_train = counts["train"]
    mon = 512 if req.like is None else int((params.read_yaml(req.like).get("monitor") or {}).get("n_samples", 64))
    usable = max(0, n_train - mon)
    # Phase 2 takes every usable prompt (200K while the file is not there yet); Phase 1 a fifth,
    # at most the 37K of the Kimi case
    if n_train and usable < 2 and not f.problems:
        f.problem(
            train_path,
            f"{n_train} prompts: the training monitor holds back {mon} of them (monitor.n_samples), "
            "which leaves too few for Phase 1 and Phase 2",
        )
        return None
    n2 = req.phase2_samples or (usable if n_train else 200000)
    n1 = req.phase1_samples or min(37000, max(1, n2 // 5))
    if n_train and n2 > usable:
        f.problem(
            "--phase2-samples",
            f"{n2} but {train_path} holds {n_train} prompts, {mon} of them held out for the training monitor",
        )
    if n1 >= n2:
        f.problem("--phase1-samples", f"{n1} must be below Phase 2's {n2} (Phase 2 scales the data)")
    if f.problems:
        return None
    if not n_train:  # say how many the plan needs where the missing file is named
        f.gaps[:] = [
            (w, f"{what}; the plan needs {n2 + mon:,}: Phase 2's {n2:,} and the monitor's {mon}")
            if w == "targets.prompts_train"
            else (w, what)
            for w, what in f.gaps
        ]
    return n1, n2


def _source_lines(req: InitRequest, src: Model) -> list[Line]:
    """The profile's name, no world, and the source drafter: where, which commit, how it is fetched."""
    return [
        Line("profile", req.name, "the MLflow experiment is draftport-<profile>"),
        Line("world.build", False, "a real pair: no embedded world"),
        Line("source.repo_id", src.repo_id or _as_path(src.folder), "the drafter trained for the old target"),
        Line(
            "source.revision",
            src.commit or (src.revision or "main"),
            f"pinned: the commit {src.revision or 'main'} resolved to"
            if src.commit
            else "local folder: its files are hashed into the lock file"
            if src.repo_id is None
            else "NOT PINNED: run init again without --no-pin (online, or with the repo in the cache) to pin it",
        ),
        Line(
            "source.cache_dir",
            str(req.cache_dir) if req.cache_dir else None,
            "the hub cache init read" if req.cache_dir else "the default HF cache (HF_HOME)",
        ),
        Line("source.offline", bool(req.offline), "only the cache" if req.offline else "the hub may be reached"),
        Line(
            "source.lock_file", f"configs/{req.name}.source.lock.json", "every file's sha256: a later fetch must match"
        ),
    ]


def _target_lines(
    req: InitRequest,
    new: Model,
    old: Model | None,
    pair: dict,
    paths: tuple[Path, Path],
    counts: dict,
    remote: bool,
) -> list[Line]:
    """The targets, the reference drafter (when given), the prompt files and the remote code allowed."""
    ref = split_spec(req.reference) if req.reference else None
    (train_path, eval_path), n_train, n_eval = paths, counts["train"], counts["heldout"]
    return [
        Line("targets.new", new.repo_id or str(new.folder), _target_why(new, pair, req.pin)),
        *(
            [
                Line(
                    "reference.repo_id",
                    ref[0],
                    "an upper bound for Phase 0: a drafter trained for the new "
                    "target itself, evaluated next to the source",
                ),
                Line("reference.revision", ref[1] or "main", "as given"),
                Line("reference.note", f"trained for {new.spec} (upper bound)", "shown in the report"),
            ]
            if ref
            else []
        ),
        Line(
            "targets.old",
            (old.repo_id or str(old.folder)) if old else None,
            "the old target: the source's home (Phase 0 on it, the drift probe)"
            if old
            else "not given: no source-on-old reference, no drift probe",
        ),
        Line("targets.prompts_train", str(train_path), f"{n_train:,} prompts" if n_train else "not there yet"),
        Line(
            "targets.prompts_eval_new",
            str(eval_path),
            f"{n_eval:,} held-out prompts"
            + (
                ": the first eval set's (targets.eval_sets holds them all)"
                if req.eval_sets and not req.prompts_eval
                else ""
            )
            if n_eval
            else "not there yet",
        ),
        Line("targets.prompts_eval_old", None, "the old target's held-out set: optional"),
        Line(
            "targets.trust_remote_code",
            [x for x in (new.repo_id, old.repo_id if old else None) if x] if remote and req.trust_remote_code else [],
            "its own code (auto_map) runs: you said --trust-remote-code"
            if remote and req.trust_remote_code
            else "the target needs its own code (auto_map): run init with --trust-remote-code if you trust it"
            if remote
            else "transformers' own classes: no repo code runs",
        ),
    ]


REAL_BUCKETS = [0, 512, 2048, 8192]  # verify positions at serving scale: short chat, documents, long context


def _eval_set_lines(sets: list[tuple[dict, list[dict]]]) -> list[Line]:
    """targets.eval_sets from --eval-set, written null without it (one held-out set: the embedded
    profile's sets are its world's files)."""
    if not sets:
        why = "one held-out set, targets.prompts_eval_new (--eval-set NAME=PATH:SHARE: sets by kind of traffic)"
        return [Line("targets.eval_sets", None, why)]
    why = ", ".join(f"{s['name']} {s['share']:g} of the traffic ({len(rows):,} prompts)" for s, rows in sets)
    return [Line("targets.eval_sets", [s for s, _ in sets], f"the held-out sets by kind: {why}")]


def _feature_lines(req: InitRequest, new: Model, pair: dict, weight_bytes: float, tp: int, n_eval: int) -> list[Line]:
    """The capture: which layers in which numbering, the engine and its GPUs, who writes the answers."""
    big = weight_bytes > 0.8 * GPU_BYTES
    return [
        Line(
            "features.aux_layer_ids",
            pair["aux_ids"],
            f"the drafter's eagle_aux_hidden_state_layer_ids ({pair['layers']}-layer target)",
        ),
        Line("features.aux_convention", pair["convention"], pair["convention_why"]),
        Line(
            "features.max_new_tokens",
            min(2048, pair["cfg"].max_position_embeddings),
            "answers up to this many tokens (within the drafter's context)",
        ),
        Line("features.dtype", "bfloat16", "the hidden states on disk"),
        Line("features.device", "cuda", "the capture runs on GPUs"),
        Line(
            "features.engine",
            "vllm" if big else "transformers",
            f"~{weight_bytes / 1e9:,.0f} GB of bf16 weights: vLLM extract_hidden_states over {tp} GPUs"
            if big
            else "the target fits one GPU: transformers in-process",
        ),
        Line("features.tensor_parallel_size", tp, "GPUs the target is sharded over"),
        Line(
            "features.regenerate",
            req.regenerate,
            "the answers from the target served at base_url (another job or node)"
            if req.regenerate == "openai"
            else "the answers are generated in the capture step itself",
        ),
        Line(
            "features.base_url",
            req.base_url,
            "the served target (OpenAI-compatible: vLLM or SGLang)" if req.base_url else "not used (regenerate local)",
        ),
        Line(
            "features.served_model",
            req.served_model or (new.repo_id if req.regenerate == "openai" else None),
            "the model name the server knows the target by" if req.regenerate == "openai" else "not used",
        ),
        Line("features.eval_samples", min(1000, n_eval) if n_eval else 1000, "held-out prompts per eval set"),
    ]


def _plan_lines(req: InitRequest, cfg: DrafterConfig, old: Model | None, n1: int, n2: int) -> list[Line]:
    """The draft vocab, eval k, the drift probe, the cost model's figures and the phases' sample counts."""
    return [
        Line("vocab_new.draft_vocab_size", cfg.draft_vocab_size, "the source's draft vocab: lm_head keeps its shape"),
        Line(
            "eval.k", 3, "draft tokens per verify cycle (set your engine's: SGLang steps, vLLM num_speculative_tokens)"
        ),
        Line(
            "drift.enabled",
            old is not None,
            "needs the old target" if old is None else "the old and new targets on the same tokens",
        ),
        Line(
            "costmodel.baseline_tok_s",
            req.baseline_tok_s if req.baseline_tok_s else 82.0,
            "measured (--baseline-tok-s)"
            if req.baseline_tok_s
            else "PLACEHOLDER: your target's tok/s without a drafter",
        ),
        Line(
            "costmodel.verify_ms",
            req.verify_ms if req.verify_ms else 30.0,
            "measured (--verify-ms)" if req.verify_ms else "PLACEHOLDER: one verify step of your deployment, ms",
        ),
        Line(
            "costmodel.draft_ms",
            req.draft_ms if req.draft_ms is not None else 0.0,
            "measured (--draft-ms)" if req.draft_ms is not None else "0: drafting counted inside verify_ms",
        ),
        Line("phase1.n_samples", n1, "new-target samples of Phase 1 (and of the control)"),
        Line("phase2.n_samples", n2, "Phase 2's total, Phase 1's included"),
    ]


def serving_lines(tp: int) -> list[Line]:
    """Rule R11's serving: the batch sizes served and, without a measured step table, what the step
    times are derived for."""
    return [
        Line("serving.batch_sizes", [1, 8, 32, 64], "PLACEHOLDER: the batch sizes you serve at (R11: best k at each)"),
        Line(
            "serving.step_table",
            None,
            "null: derived from the target's config; a CSV measured on your engine is better",
        ),
        Line("serving.tensor_parallel", tp, "the GPUs one serving instance spans (the capture's)"),
    ]


def _training_setup(lines: list[Line], req: InitRequest, n1: int, n2: int, tp: int, counts: dict) -> list[Line]:
    """The training side: --like's profile (its held-out samples capped by the file), else a GPU node's."""
    n_eval = counts["heldout"]
    if req.like is not None:
        have = {ln.key for ln in lines}
        lines += [ln for ln in like_lines(req.like, n1, n2) if ln.key not in have or ln.key.startswith("features.")]
        lines = _dedupe(lines)
        if n_eval:  # never more held-out samples than the held-out file holds
            lines = [
                Line(ln.key, min(ln.value, n_eval), f"{ln.why}, at most the {n_eval} held-out prompts")
                if ln.key == "features.eval_samples"
                else ln
                for ln in lines
            ]
    else:
        lines += real_scale(n1, n2, req.gpus, tp, counts) + resources(tp, req.gpus)
    return lines


def _closing_gaps(req: InitRequest, src: Model, new: Model, remote: bool, f: Findings) -> None:
    """What the user still has to do: measure the cost model, allow remote code, pin, serve the target."""
    pin_src = src.commit or ("local folder" if src.repo_id is None else None)
    if not (req.baseline_tok_s and req.verify_ms):
        f.gap(
            "costmodel",
            "baseline_tok_s / verify_ms are placeholders: measure them on your deployment "
            "(docs: your own model pair) or pass --baseline-tok-s / --verify-ms",
        )
    if remote and not req.trust_remote_code:
        f.gap(
            "targets.trust_remote_code", f"{new.spec} needs its own code (auto_map): run init with --trust-remote-code"
        )
    if pin_src is None:
        f.gap(
            "source.revision",
            f"{src.revision or 'main'} is a branch, not a commit: run init again without --no-pin to pin it",
        )
    if req.regenerate == "openai":
        f.gap("features.base_url", f"{req.base_url}: serve the new target there before the feature steps run")


def build(req: InitRequest) -> dict:
    """Check the pair and write configs/NAME.yaml (atomically; nothing when a problem is found).
    -> {"path", "problems", "gaps", "notes", "profile" (the validated params), "text"}."""
    path = _profile_path(req)
    f = Findings()
    src, new, old, pair = _read_pair(req, f)
    data_dir = Path("data") / req.name
    train_path = req.prompts or data_dir / "train.jsonl"
    sets = check_eval_sets(req.eval_sets, train_path, f) if req.eval_sets else []
    # named sets and no --prompts-eval: prompts_eval_new is the first set's file (not a file still missing)
    eval_path = req.prompts_eval or (Path(sets[0][0]["prompts"]) if sets else data_dir / "heldout.jsonl")
    counts = check_prompts(train_path, eval_path, f)
    rep = {
        "path": str(path),
        "problems": f.problems,
        "gaps": f.gaps,
        "notes": f.notes,
        "target_config": str(new.folder / "config.json"),
    }
    if f.problems or not pair:
        return rep

    # sizes: the target's weights decide the engine and its GPUs
    weight_bytes, tp = _target_gpus(pair, new, f)
    samples = _phase_samples(req, counts, train_path, f)
    if samples is None:
        return rep
    n1, n2 = samples

    remote = needs_remote_code(new) or needs_remote_code(src)
    # features.eval_samples: prompts per set, so the largest named set bounds it
    n_eval = max(len(rows) for _, rows in sets) if sets else counts["heldout"]
    lines = [
        *_source_lines(req, src),
        *_target_lines(req, new, old, pair, (train_path, eval_path), counts, remote),
        *_eval_set_lines(sets),
        *_feature_lines(req, new, pair, weight_bytes, tp, n_eval),
        *_plan_lines(req, pair["cfg"], old, n1, n2),
        *serving_lines(tp),
    ]
    lines = _training_setup(lines, req, n1, n2, tp, {**counts, "heldout": n_eval})
    _closing_gaps(req, src, new, remote, f)

    header = [
        f"{req.name}: {src.spec} (drafter) -> {new.spec} (new target), written by `draftport init`.",
        f"  snakemake --configfile=configs/{req.name}.yaml --cores 8 decision",
        "Each value says why it is there; edit freely, then `snakemake -n` shows what reruns.",
    ]
    text = render_yaml(header, lines)
    profile = params.validate(params.merge(params.read_yaml(params.PARAMS_FILE), yaml.safe_load(text)))
    rep.update(profile=profile, text=text)
    return rep


def _as_path(p: Path) -> str:
    """A folder as params take it: absolute, or relative with ./ (org/name would read as a hub id)."""
    s = str(p)
    return s if s.startswith(("/", "./", "../")) else "./" + s


def _target_why(m: Model, pair: dict, pin: bool = True) -> str:
    tc = pair["target_config"]
    pin = f" at {m.commit[:12]}" if m.commit and pin else ""
    wrapper = " (a multimodal wrapper: its text decoder, text_config)" if tc is not m.config else ""
    return (
        f"{tc.get('model_type', '?')}, {pair['layers']} layers, hidden {pair['hidden']}, vocab {pair['vocab']}"
        f"{pin}{wrapper}"
    )


def _dedupe(lines: list[Line]) -> list[Line]:
    """Later lines win (a --like value over init's default), first position kept."""
    last = {ln.key: ln for ln in lines}
    seen, out = set(), []
    for ln in lines:
        if ln.key in seen:
            continue
        seen.add(ln.key)
        out.append(last[ln.key])
    # a key and its parent cannot both stand (curves.train vs curves)
    keys = {ln.key for ln in out}
    return [ln for ln in out if not any(k != ln.key and ln.key.startswith(k + ".") for k in keys)]


def write(rep: dict, force: bool = False) -> Path:
    path = Path(rep["path"])
    if path.exists() and not force:
        raise DraftportError(
            path, "exists: pass --force to replace it (the old file is kept until the new one is whole)"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, rep["text"])
    return path


def env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
