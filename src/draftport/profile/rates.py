"""The one-GPU training rate of a profile's own drafter shape, from the training benchmark's results
(benchmarks/results/<date>-h200-train-<shape>.json of bench_train_h200.py --shape): measured when
a result of that shape exists, else interpolated between the measured shapes around it, or the
nearest one's outside their range; each figure says which (draftport.profile.estimate bills the
trainings with it).

The drafter's shape of a profile (`drafter_shape`): the embedded world's source drafter
(world.source_drafter.arch on world.model, derived as the world builds it) when world.build;
else the source drafter's config.json when source.repo_id is a folder; else its config.json in the
hub cache the params name (source.cache_dir; source.revision), found offline by the pipeline's own
resolution (draftport.data.fetch.resolve: config.json and *.safetensors only, no code, no pickle);
else the published shape of a known hub id (KNOWN_DRAFTERS); else unknown, and the Kimi-K2 result
stands in, said so.

The rule (`rates_for`), per figure (packed or padded rows, lm_head trained or frozen, the
greedy choice stored, real tokens of the benchmark's length mix):
- measured: a result whose drafter has the profile's H, I, heads, kv heads, head_dim and draft
  vocab (the newest date when several): its figures as they are;
- interpolated: the model-FLOPs MFU of the measured shapes on either side in hidden size,
  linear in log H, turned into tokens/s by the profile's drafter's own FLOPs per token on the
  same length mix (bench_train_h200.flops_per_token's count);
- nearest: below the smallest or above the largest measured H, that shape's MFU (never
  extrapolated), turned into tokens/s the same way.
`draftport estimate` reads headers and JSON only (a hub id's lookup imports the fetch module, which
imports torch; no weights are read).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from draftport.errors import DraftportError
from draftport.files import load_json

# the benchmark's count (tests/profile/test_rates.py) and the sizes that set a training's rate (the full
# vocab only matters to a mask computed in the step; the pipeline stores it with the features)
from draftport.model.flops import SHAPE_KEYS, flops_per_token

ROOT = Path(__file__).resolve().parents[3]  # the repository (src/draftport/profile/rates.py)
RESULTS = ROOT / "benchmarks" / "results"
# estimate's figure name -> the benchmark's mix result it reads
FIGURES = {
    "lm_head_trainable": "packed_trainable_stored",
    "lm_head_frozen": "packed_frozen_stored",
    "padded_lm_head_trainable": "padded_trainable_stored",
    "padded_lm_head_frozen": "padded_frozen_stored",
}
# <date>-h200-train-<shape>.json, or -<shape>-<round>.json for a later round of the same date (a
# shape's name never ends in -<digits>: bench_train_h200.shape_name)
NAMED = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2})-h200-train-(?P<shape>.+?)(?:-(?P<round>\d+))?\.json$")

# The published drafters a profile may name as source.repo_id, with their config.json's sizes.
KIMI_K2_DRAFTER = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "draft_vocab_size": 32000,
    "vocab_size": 163840,
}
KNOWN_DRAFTERS = {"AQ-MedAI/Kimi-K2-Instruct-eagle3": KIMI_K2_DRAFTER, "AQ-MedAI/Kimi-K25-eagle3": KIMI_K2_DRAFTER}
DEFAULT_SHAPE = "kimi"  # the result that stands in when the drafter's shape is not known


def describe(shape: dict) -> str:
    return (
        f"H {shape['hidden_size']}, I {shape['intermediate_size']}, {shape['num_attention_heads']}/"
        f"{shape['num_key_value_heads']} heads of {shape['head_dim']}, draft vocab {shape['draft_vocab_size']}"
    )


# ---- the profile's drafter ------------------------------------------------------------------------
def drafter_shape(cfg: dict, root: Path = ROOT) -> tuple[dict | None, str]:
    """(the profile's source drafter's sizes, where they came from); (None, why) when not known."""
    w = cfg.get("world") or {}
    if w.get("build"):
        m, sd = w["model"], w["source_drafter"]
        arch, H, V = sd.get("arch") or {}, int(m["hidden_size"]), int(w["vocab_size"])
        heads = int(arch.get("num_attention_heads") or 4)  # draftport.model.bind.new_drafter_config
        return (
            {
                "hidden_size": H,
                "intermediate_size": int(arch.get("intermediate_size") or 3 * H),
                "num_attention_heads": heads,
                "num_key_value_heads": int(arch.get("num_key_value_heads") or heads),
                "head_dim": int(arch.get("head_dim") or H // heads),
                "draft_vocab_size": max(8, int(round(V * float(sd["draft_vocab_ratio"])))),
                "vocab_size": V,
            },
            "the embedded world's source drafter (world.source_drafter.arch on world.model)",
        )
    from draftport.model.config import read_config  # torch-free; the drafter's own config

    src = cfg.get("source") or {}
    repo = str(src.get("repo_id") or "")
    folder = Path(repo) if Path(repo).is_absolute() else root / repo
    if repo and (folder / "config.json").is_file():
        c, _ = read_config(folder)
        return ({k: getattr(c, k) for k in (*SHAPE_KEYS, "vocab_size")}, f"{repo}/config.json")
    cached, where = hub_cached(src, root) if repo else (None, "")
    if cached is not None:
        c, _ = read_config(cached)
        return {k: getattr(c, k) for k in (*SHAPE_KEYS, "vocab_size")}, where
    if repo in KNOWN_DRAFTERS:
        return dict(KNOWN_DRAFTERS[repo]), f"{repo}: its published config.json (built in)"
    return None, f"source.repo_id {repo or '?'}: no config.json here, {where} and no built-in shape"


def hub_cached(src: dict, root: Path = ROOT) -> tuple[Path | None, str]:
    """(the snapshot folder holding the source drafter's config.json, where) in the hub cache
    source.cache_dir names (relative: to the repository, where the pipeline runs; null: HF's
    default), at source.revision, resolved offline as the pipeline's fetch resolves it; (None, why
    not) when it is not there."""
    # lazy: fetch imports torch (for allow_pickle's conversion, never run here)
    from draftport.data.fetch import DRAFTER_PATTERNS, resolve

    repo, rev, cache = str(src["repo_id"]), src.get("revision"), src.get("cache_dir")
    cache_dir = None if not cache else Path(cache) if Path(cache).is_absolute() else root / cache
    shown = f"the hub cache {cache or '(default)'}"
    try:
        folder, commit = resolve(repo, rev, cache_dir, DRAFTER_PATTERNS, offline=True)
    except DraftportError:  # not there (or not a hub id): the built-in shapes come next
        return None, f"not in {shown} at {rev or 'main'}"
    if not (folder / "config.json").is_file():
        return None, f"no config.json in {shown} at {rev or 'main'}"
    if commit == "local":  # a folder where the command runs (fetch takes it as it is)
        return folder, f"{repo}/config.json"
    return folder, f"{repo}@{commit[:12]} in {shown}: its config.json"


# ---- the benchmark's results ----------------------------------------------------------------------
def mix_flops_per_token(shape: dict, lengths: list[int], steps: int, lm_head_trainable: bool) -> float:
    """Model FLOPs per real token over a length mix (each sample at its own length's count)."""
    return sum(L * flops_per_token(shape, L, steps, lm_head_trainable) for L in lengths) / sum(lengths)


def read_result(path: Path) -> dict | None:
    """A result named by its shape with the four mix figures: its sizes, MFUs and rates; None for
    any other file (numbered rounds, probes, results without a length mix)."""
    m = NAMED.match(path.name)
    if not m:
        return None
    try:
        d = json.loads(path.read_text())
        c, mix, res = d["config"], d["mix"], d["mix_results"]
        if c.get("shape") != m["shape"]:
            return None
        figs = {
            k: {"rate": float(res[v]["real_tokens_per_s"]), "mfu": float(res[v]["mfu"])} for k, v in FIGURES.items()
        }
        return {
            "file": path,
            "date": d["date"],
            "round": int(m["round"] or 1),
            "device": d["device"],
            "seq": c["seq"],
            "ttt_steps": int(c["ttt_steps"]),
            "peak_tflops": float(c.get("peak_tflops") or 790.0),
            "name": m["shape"],
            "shape": {k: int(c[k]) for k in SHAPE_KEYS},
            "lengths": [int(x) for x in mix["lengths"]],
            "mix": {k: mix.get(k) for k in ("n", "mean", "max", "pad_batch")},
            "figures": figs,
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None


# The newest result per shape and the newest capture result, shipped with the package, so that an
# installed draftport estimates without the repository (`python tools/docgen.py` rewrites it from
# benchmarks/results; tests/profile/test_rates.py checks that they agree).
PACKAGED = Path(__file__).with_name("rates.json")


def packaged_table(results: Path = RESULTS) -> dict:
    """What PACKAGED holds, read from the results folder: {"train": measured's records, "capture":
    the newest capture result's figures}."""
    cap = newest_capture_bench(results)
    return {
        "train": [{**r, "file": _shown(r["file"])} for r in measured(results)],
        "capture": capture_bench(cap) if cap is not None else None,
    }


# ---- the capture benchmark's result (the estimate's capture rate) ---------------------------------
def newest_capture_bench(results=RESULTS) -> Path | None:
    if not Path(results).is_dir():
        return None
    files = sorted(Path(results).glob("*-h200-capture.json"))
    return files[-1] if files else None


def _first(d: dict, names: tuple[str, ...]):
    return next((d[n] for n in names if isinstance(d, dict) and d.get(n) is not None), None)


def _fraction(m, roofline_tok_s) -> float | None:
    if isinstance(m, (int, float)):
        return float(m)
    if not isinstance(m, dict):
        return None
    f = _first(m, ("fraction_of_roofline", "roofline_fraction", "fraction"))
    if f is None and roofline_tok_s:
        t = _first(m, ("tok_s", "tokens_per_s"))
        f = t / roofline_tok_s if t else None
    return None if f is None else float(f)


def capture_bench(path) -> dict:
    """A capture benchmark result: per shape, tok/s and fraction of roofline for forward / capture /
    capture+write. Read: the shape with the most FLOPs per token (the nearest to a 1T MoE's 32B
    active), its capture+write fraction (disk modes) and capture fraction (online; capture+write
    when absent). Accepted layout: {"date", "device", "shapes": {name: {"roofline_tok_s",
    "forward" | "capture" | "capture_write": {"tok_s", "fraction_of_roofline"}}}} (shapes may be a
    list of such dicts with a "name")."""
    path = Path(path)
    d = load_json(path, "no such capture benchmark result")
    shapes = d.get("shapes") if isinstance(d, dict) else None
    if isinstance(shapes, list):
        shapes = {str(s.get("name", i)): s for i, s in enumerate(shapes) if isinstance(s, dict)}
    if not isinstance(shapes, dict) or not shapes:
        raise DraftportError(path, "capture benchmark result lacks 'shapes'")

    def size(item):
        s = item[1]
        roof = _first(s, ("roofline_tok_s", "roofline_tokens_per_s"))
        return -roof if roof else float(_first(s, ("params", "flops_per_token")) or 0)

    name, s = max(shapes.items(), key=size)
    roof = _first(s, ("roofline_tok_s", "roofline_tokens_per_s"))
    write = _fraction(_first(s, ("capture_write", "capture+write", "capture_and_write")), roof)
    cap = _fraction(_first(s, ("capture",)), roof)
    if write is None:
        raise DraftportError(path, f"shape {name}: no capture+write fraction of roofline")
    for f in (write, cap):
        if f is not None and not 0 < f <= 1:
            raise DraftportError(path, f"shape {name}: fraction of roofline {f} is not in (0, 1]")
    shown = _shown(path)
    return {
        "source": "measured",
        "file": str(shown),
        "date": d.get("date"),
        "device": d.get("device"),
        "shape": name,
        "capture_write": write,
        "capture": cap if cap is not None else write,
        "capture_measured": cap is not None,
    }


def _packaged() -> dict:
    try:
        return json.loads(PACKAGED.read_text())
    except (OSError, ValueError):
        raise DraftportError(
            PACKAGED, "the packaged rate table is missing or unreadable: reinstall draftport"
        ) from None


def measured(results: Path = RESULTS) -> list[dict]:
    """Per drafter shape, its newest result (read_result: the latest date, then the latest round
    of that date), ordered by hidden size. Without the repository's results folder (an installed
    draftport), the packaged table's."""
    if Path(results) == RESULTS and not RESULTS.is_dir():
        return _packaged()["train"]
    best: dict[tuple, dict] = {}
    for p in sorted(Path(results).glob("*-h200-train-*.json")):
        r = read_result(p)
        if r is None:
            continue
        key = tuple(r["shape"][k] for k in SHAPE_KEYS)
        if key not in best or (r["date"], r["round"]) >= (best[key]["date"], best[key]["round"]):
            best[key] = r
    return sorted(best.values(), key=lambda r: (r["shape"]["hidden_size"], r["name"]))


def _shown(path: Path) -> str:
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)


def rates_for(shape: dict, results: Path = RESULTS) -> dict:
    """The training figures of a drafter of this shape (the module's rule): each estimate figure
    (FIGURES) in real tokens/s, with how it was found (`source`: measured / interpolated /
    nearest) and from which results."""
    rs = measured(results)
    if not rs:
        raise DraftportError(
            results,
            "no training benchmark result named by its shape "
            "(<date>-h200-train-<shape>.json of bench_train_h200.py --shape)",
        )
    key = tuple(shape[k] for k in SHAPE_KEYS)
    same = [r for r in rs if tuple(r["shape"][k] for k in SHAPE_KEYS) == key]
    if same:
        r = same[0]
        return {
            "source": "measured",
            "from": [r],
            "weights": [1.0],
            "figures": {k: v["rate"] for k, v in r["figures"].items()},
        }
    H = shape["hidden_size"]
    below = [r for r in rs if r["shape"]["hidden_size"] <= H]
    above = [r for r in rs if r["shape"]["hidden_size"] > H]
    if below and above:
        lo, hi = below[-1], above[0]
        x = (math.log(H) - math.log(lo["shape"]["hidden_size"])) / (
            math.log(hi["shape"]["hidden_size"]) - math.log(lo["shape"]["hidden_size"])
        )
        src, used, weights = "interpolated", [lo, hi], [1 - x, x]
    else:
        src, used, weights = "nearest", [below[-1] if below else above[0]], [1.0]
    ref = max(zip(weights, used), key=lambda t: t[0])[1]  # the nearer result's mix and TTT depth
    figures = {}
    for k in FIGURES:
        mfu = sum(w * r["figures"][k]["mfu"] for w, r in zip(weights, used))
        fpt = mix_flops_per_token(shape, ref["lengths"], ref["ttt_steps"], k.endswith("trainable"))
        figures[k] = mfu * ref["peak_tflops"] * 1e12 / fpt
    return {"source": src, "from": used, "weights": weights, "figures": figures}


def for_profile(cfg: dict, results: Path = RESULTS, root: Path = ROOT) -> dict:
    """What bench_throughput returns (device, date, seq, ttt_steps, the four rates, rate: how
    they were measured), for the profile's own drafter shape, plus `drafter` (its sizes and where
    they came from) and `shape_source` (measured / interpolated / nearest / default) with
    `shape_note` saying from which results."""
    shape, where = drafter_shape(cfg, root)
    if shape is None:
        rs = [r for r in measured(results) if r["name"] == DEFAULT_SHAPE]
        if not rs:
            raise DraftportError("source.repo_id", f"{where}, and no {DEFAULT_SHAPE} result to stand in")
        got = {
            "source": "default",
            "from": rs,
            "weights": [1.0],
            "figures": {k: v["rate"] for k, v in rs[0]["figures"].items()},
        }
    else:
        got = rates_for(shape, results)
    used = got["from"]
    files = ", ".join(_shown(r["file"]) for r in used)
    if got["source"] == "measured":
        note = f"measured: {files}"
    elif got["source"] == "interpolated":
        note = (
            "interpolated in log H between "
            + " and ".join(
                f"{r['name']} (H {r['shape']['hidden_size']}, weight {w:.2f})" for r, w in zip(used, got["weights"])
            )
            + f": model-FLOPs MFU of {files}, "
            "at this drafter's FLOPs per token"
        )
    elif got["source"] == "nearest":
        note = (
            f"nearest measured shape {used[0]['name']} (H {used[0]['shape']['hidden_size']}): its model-FLOPs MFU "
            f"({files}) at this drafter's FLOPs per token, not extrapolated"
        )
    else:
        note = f"the drafter's shape is not known ({where}): the {DEFAULT_SHAPE} result stands in ({files})"
    first = used[0]
    mix = first["mix"]
    drafter = f"{describe(shape)} ({where})" if shape else where
    return {
        "device": first["device"],
        "date": " / ".join(dict.fromkeys(r["date"] for r in used)),
        "seq": first["seq"],
        "ttt_steps": first["ttt_steps"],
        **got["figures"],
        "rate": (
            f"real tokens of a length mix ({mix.get('n', '?')} samples, mean {mix.get('mean', '?')}, max "
            f"{mix.get('max', '?')} tokens), packed rows or padded groups of {mix.get('pad_batch', '?')} as "
            f"train.packing says; drafter {drafter}: {note}"
        ),
        "drafter": {"shape": shape, "from": where},
        "shape_source": got["source"],
        "shape_note": note,
        "files": [_shown(r["file"]) for r in used],
    }
