"""A published drafter taken further by a peer with speculators: `speculators convert` (in its
venv) turns the flat folder into speculators' format, and speculators' Eagle3DraftModel computes
the same teacher-forced forward as draftport on the same features.

`convert_args` is the one place the convert command is spelled (docs, the model card, the test):
speculators 0.9.0's converter ignores the flat config's `eagle_config.eagle_aux_hidden_state_layer_ids`
(it takes them from --algorithm-kwargs only, else the verifier's default layers) and defaults
norm_before_residual to false, so both are always passed. The verifier must be something
transformers' AutoConfig can read (a hub id or a local folder): speculators reads its layer count,
and its embed_tokens when the drafter carries none.

`roundtrip` runs the whole check: convert, every tensor bit-identical under its new name, the
forward of both on the first sequences of a feature set (max |diff| of the logits of each TTT
step, argmax agreement over the rows whose step input is a real token), and draftport's own
loader on the converted folder. `python -m draftport.evaluation.roundtrip` prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftport.data.shards import FeatureSet
from draftport.engines import require_interpreter
from draftport.engines.speculators import RUNNERS
from draftport.engines.vllm.venv import run_in_vllm_venv
from draftport.errors import DraftportError
from draftport.model.bind import drafter_for_target
from draftport.model.config import read_config
from draftport.model.formats import (
    find_target_embedding,
    load_drafter_state,
    read_header,
    read_tensor_np,
    tensor_sha256,
    to_flat_name,
)

VENV_DIR = ".venv-speculators"


def default_speculators_python() -> Path:
    """$DRAFTPORT_SPECULATORS_PYTHON, else .venv-speculators/bin/python under the current directory."""
    env = os.environ.get("DRAFTPORT_SPECULATORS_PYTHON")
    return Path(env) if env else Path.cwd() / VENV_DIR / "bin" / "python"


def speculators_python(path: str | os.PathLike | None = None) -> Path:
    return require_interpreter(
        Path(path) if path else default_speculators_python(), "DRAFTPORT_SPECULATORS_PYTHON", VENV_DIR, "speculators"
    )


def convert_kwargs(cfg) -> dict:
    """--algorithm-kwargs for a drafter (DrafterConfig): its aux ids and norm_before_residual,
    which speculators 0.9.0's converter does not read from the flat config."""
    if not cfg.aux_layer_ids:
        raise DraftportError(
            "config.json",
            "no eagle_aux_hidden_state_layer_ids: speculators would fall back to the verifier's default layers",
        )
    return {
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": bool(cfg.norm_before_residual),
    }


def convert_args(drafter: str, verifier: str, output: str, cfg) -> list[str]:
    """`speculators` arguments converting a flat EAGLE-3 drafter (a folder or a hub id)."""
    return [
        "convert",
        str(drafter),
        "--algorithm",
        "eagle3",
        "--verifier",
        str(verifier),
        "--output-path",
        str(output),
        "--algorithm-kwargs",
        json.dumps(convert_kwargs(cfg)),
    ]


def convert_command(drafter: str, verifier: str, output: str, cfg) -> str:
    """The shell command a peer types (model card, docs/publish.md)."""
    return shlex.join(["speculators", *convert_args(drafter, verifier, output, cfg)])


def _run(cmd: list[str], log_path, result: Path, *, where, what: str, timeout: float | None) -> float:
    # the vLLM venv's runner is generic: any venv's interpreter, its log, one-line errors
    return run_in_vllm_venv(cmd, log_path, result, where=where, what=what, timeout=timeout)


def convert(drafter_dir, verifier, out_dir, *, python=None, log_path=None, timeout: float | None = 1800) -> Path:
    """`speculators convert` on a flat drafter folder -> out_dir (speculators' format)."""
    cfg, raw = read_config(drafter_dir)
    if cfg.format != "flat":
        raise DraftportError(
            drafter_dir, "speculators convert takes the flat format (this folder is already in speculators' format)"
        )
    v = Path(verifier)
    if v.exists() and not (v / "config.json").is_file():
        # speculators 0.9.0 converts anyway and writes a folder its own loader then refuses
        raise DraftportError(v, "the verifier is not a model folder (no config.json)")
    out_dir = Path(out_dir)
    cmd = [str(speculators_python(python)), "-m", "speculators", *convert_args(drafter_dir, verifier, out_dir, cfg)]
    _run(
        cmd,
        log_path or out_dir.with_name(out_dir.name + ".log"),
        out_dir / "config.json",
        where=drafter_dir,
        what="speculators convert",
        timeout=timeout,
    )
    return out_dir


# ---- forwards ---------------------------------------------------------------------------------
def sequences_from_features(features_dir, n: int) -> list[tuple]:
    """The first n samples of a feature folder as (aux [T, 3H] float32, tokens [T] int64)."""
    fs = FeatureSet(features_dir)
    return [(s["aux"].float(), s["tokens"].long()) for s in (fs.sample(i) for i in range(min(n, len(fs))))]


def draftport_forward(drafter_dir, target_dir, sequences, steps: int) -> list:
    """draftport's teacher-forced logits of each TTT step, rows of all sequences one after another."""
    cfg, state = load_drafter_state(drafter_dir)
    d = drafter_for_target(cfg, target_dir, state).eval()
    out: list[list] = [[] for _ in range(steps)]
    with torch.no_grad():
        for aux, tok in sequences:
            for j, lg in enumerate(d.unroll(aux[None], tok[None], steps, teacher_tokens=True)):
                out[j].append(lg[0].float())
    return [torch.cat(rows) for rows in out]


def speculators_forward(
    model_dir,
    sequences,
    steps: int,
    *,
    python=None,
    attn: str | None = None,
    work_dir=None,
    dump_embedding: bool = False,
    timeout: float | None = 1800,
):
    """speculators' logits of each TTT step (runners/forward_speculators.py in its venv); ->
    (logits per step, meta, embed_tokens as loaded or None)."""
    script = RUNNERS / "forward_speculators.py"
    lengths = [len(t) for _, t in sequences]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    with tempfile.TemporaryDirectory(prefix="draftport-speculators-", dir=work_dir) as tmp:
        tmp = Path(tmp)
        save_file(
            {
                "aux": torch.cat([a for a, _ in sequences]).contiguous(),
                "tokens": torch.cat([t for _, t in sequences]).contiguous(),
                "offsets": offsets,
            },
            str(tmp / "inputs.safetensors"),
        )
        cmd = [
            str(speculators_python(python)),
            str(script),
            "--model",
            str(model_dir),
            "--inputs",
            str(tmp / "inputs.safetensors"),
            "--steps",
            str(steps),
            "--out",
            str(tmp / "out.safetensors"),
            "--meta",
            str(tmp / "meta.json"),
        ]
        if attn:
            cmd += ["--attn", attn]
        if dump_embedding:
            cmd.append("--dump-embedding")
        log = Path(work_dir or tempfile.gettempdir()) / "speculators_forward.log"  # kept: the error names it
        _run(cmd, log, tmp / "meta.json", where=model_dir, what="speculators forward", timeout=timeout)
        out = load_file(str(tmp / "out.safetensors"))
        meta = json.loads((tmp / "meta.json").read_text())
    return [out[f"logits_{j}"] for j in range(steps)], meta, out.get("embed_tokens")


def compare_logits(ours: list, theirs: list, lengths: list[int]) -> dict:
    """Per TTT step j: max |diff| over every row, and argmax agreement over the rows whose step-j
    input token is real (row p of a T-long sequence: p + 1 + j < T; later rows embed the fill 0
    in both). Plus the totals over all steps."""
    rows, total = [], {"max_abs_diff": 0.0, "argmax_agree": 0, "rows": 0}
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a.shape != b.shape:
            raise DraftportError(
                "speculators", f"step {j}: logits of shape {list(b.shape)}, draftport's {list(a.shape)}"
            )
        keep = torch.cat([torch.arange(T) + 1 + j < T for T in lengths])
        diff = float((a - b).abs().max())
        agree = int((a.argmax(-1) == b.argmax(-1))[keep].sum())
        n = int(keep.sum())
        rows.append(
            {"step": j, "max_abs_diff": diff, "argmax_agree": agree, "rows": n, "max_abs_logit": float(a.abs().max())}
        )
        total["max_abs_diff"] = max(total["max_abs_diff"], diff)
        total["argmax_agree"] += agree
        total["rows"] += n
    return {"steps": rows, **total}


def tensors_renamed_equal(flat_dir, spec_dir) -> dict:
    """Every tensor of the flat folder under its speculators name in the other, bit for bit
    (sha256 of the stored bytes, dtype and shape); names present on one side only."""

    def table(folder):
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            t, _ = read_header(f)
            out.update({to_flat_name(n): i for n, i in t.items()})
        return out

    a, b = table(flat_dir), table(spec_dir)
    same = sorted(
        n
        for n in set(a) & set(b)
        if (a[n].dtype, tuple(a[n].shape)) == (b[n].dtype, tuple(b[n].shape))
        and tensor_sha256(a[n]) == tensor_sha256(b[n])
    )
    return {
        "identical": same,
        "differ": sorted(set(a) & set(b) - set(same)),
        "only_flat": sorted(set(a) - set(b)),
        "only_speculators": sorted(set(b) - set(a)),
    }


def roundtrip(
    published_dir,
    target_dir,
    features_dir,
    work_dir,
    *,
    n_samples: int = 8,
    steps: int = 3,
    verifier=None,
    python=None,
    attn: str | None = None,
) -> dict:
    """Convert the published folder with speculators and compare (see the module docstring).
    verifier: what `--verifier` names (default target_dir: AutoConfig must be able to read it)."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    conv = convert(
        published_dir,
        verifier or target_dir,
        work_dir / "speculators",
        python=python,
        log_path=work_dir / "convert.log",
    )
    seqs = sequences_from_features(features_dir, n_samples)
    lengths = [len(t) for _, t in seqs]
    ours = draftport_forward(published_dir, target_dir, seqs, steps)
    theirs, meta, embed = speculators_forward(
        conv, seqs, steps, python=python, attn=attn, work_dir=work_dir, dump_embedding=True
    )
    target_embed = torch.from_numpy(read_tensor_np(find_target_embedding(target_dir)).copy())
    back = draftport_forward(conv, target_dir, seqs, steps)  # draftport's loader on speculators' folder
    return {
        "speculators": meta,
        "convert": " ".join(convert_args(published_dir, verifier or target_dir, conv, _cfg(published_dir))),
        "tensors": tensors_renamed_equal(published_dir, conv),
        "embed_tokens_equal_target": bool(
            embed is not None and embed.shape == target_embed.shape and torch.equal(embed.float(), target_embed.float())
        ),
        "forward": compare_logits(ours, theirs, lengths),
        "draftport_on_converted": compare_logits(ours, back, lengths),
        "sequences": len(seqs),
        "tokens": sum(lengths),
    }


def _cfg(folder):
    return read_config(folder)[0]


def main(argv=None) -> int:
    """python -m draftport.evaluation.roundtrip PUBLISHED TARGET FEATURES [--n 8] [--steps 3]"""
    ap = argparse.ArgumentParser(description="speculators convert + forward next to draftport's")
    ap.add_argument("published")
    ap.add_argument("target")
    ap.add_argument("features")
    ap.add_argument("--n", type=int, default=8, help="sequences of the feature set compared")
    ap.add_argument("--steps", type=int, default=3, help="TTT steps")
    ap.add_argument("--work", default=None, help="where the converted folder goes (default: a temp dir)")
    ap.add_argument("--verifier", default=None, help="--verifier for speculators convert (default: TARGET)")
    ap.add_argument("--attn", default=None, help="speculators' attention (default: its own, flex attention)")
    a = ap.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory(prefix="draftport-roundtrip-") as tmp:
            rep = roundtrip(
                a.published,
                a.target,
                a.features,
                a.work or tmp,
                n_samples=a.n,
                steps=a.steps,
                verifier=a.verifier,
                attn=a.attn,
            )
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
