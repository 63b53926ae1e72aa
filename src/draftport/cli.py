"""`draftport` command line.

Adding a command: write a function decorated with `@app.command()`, import what it needs INSIDE
the function (torch, transformers and friends cost seconds; `draftport compare` must not pay for
them), raise DraftportError for bad input, and print JSON with `_print_json` under `--json`.
main() turns every DraftportError into one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from .errors import DraftportError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Port an EAGLE-3 drafter to a new version of its target model.")

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


@app.command()
def compare(
    src: Annotated[Path, typer.Argument(help="Source drafter folder (config.json + *.safetensors).")],
    dst: Annotated[Path, typer.Argument(help="Drafter folder to compare against.")],
    target: Annotated[Path | None, typer.Option(
        "--target", help="Target folder: check each drafter's own embed_tokens against its embedding "
                         "(sha256 of the tensor bytes; report key `embedding`).")] = None,
    as_json: JsonFlag = False,
):
    """Config, weights and vocab maps of two drafters side by side, from headers only (with
    --target, also the bytes of embed_tokens where a drafter carries one)."""
    from .compare import compare_drafters

    rep = compare_drafters(src, dst, target=target)
    if as_json:
        _print_json(rep)
    else:
        from .render import compare_renderables, show

        show(compare_renderables(rep))


@app.command()
def costmodel(
    baseline_tok_s: Annotated[float, typer.Option(help="Target alone, tokens/s.")],
    verify_ms: Annotated[float, typer.Option(help="One target verify step, ms.")],
    draft_ms: Annotated[float, typer.Option(help="One draft step, ms (needs --k).")] = 0.0,
    k: Annotated[int | None, typer.Option("--k", help="Draft steps per cycle (default: unbounded chain).")] = None,
    target_tok_s: Annotated[list[float] | None, typer.Option(help="Throughput to reach (repeatable).")] = None,
    accept_rates: Annotated[str | None, typer.Option(
        help="Measured per-position acceptance, e.g. 0.8,0.6,0.4: picks the best k.")] = None,
    as_json: JsonFlag = False,
):
    """Accept length and acceptance a drafter needs to pay off, and to reach target throughputs."""
    from .costmodel import CostModel, best_k

    cm = CostModel(baseline_tok_s, verify_ms, draft_ms, k)
    rep = cm.table(tuple(target_tok_s) if target_tok_s else (100.0, 150.0, 200.0))
    if accept_rates is not None:
        try:
            rates = [float(x) for x in accept_rates.split(",") if x.strip()]
        except ValueError:
            raise DraftportError("--accept-rates", f"expected comma-separated numbers, got {accept_rates!r}") from None
        rep["best_k"] = best_k(rates, cm)
    if as_json:
        _print_json(rep)
    else:
        from .render import costmodel_renderables, show

        show(costmodel_renderables(rep))


@app.command()
def inspect(
    folder: Annotated[Path, typer.Argument(help="Drafter folder (config.json + *.safetensors).")],
    as_json: JsonFlag = False,
):
    """Tensor names, shapes, dtypes and the normalized config, from headers only."""
    from .checkpoint import inspect_report

    rep = inspect_report(folder)
    if as_json:
        _print_json(rep)
    else:
        from .render import inspect_renderables, show

        show(inspect_renderables(rep))


@app.command()
def estimate(
    profile: Annotated[list[Path], typer.Option("--profile", help="Profile(s) layered on params.yaml.")],
    params: Annotated[Path, typer.Option(help="The base parameter file.")] = Path("params.yaml"),
    tokens_per_sample: Annotated[int | None, typer.Option(help="Default: the benchmark's sequence length.")] = None,
    gpus: Annotated[int | None, typer.Option(help="Default: each rule's resources gpu.")] = None,
    efficiency: Annotated[float, typer.Option(help="Scaling efficiency over the GPUs (assumed).")] = 0.9,
    bench: Annotated[Path | None, typer.Option(help="A benchmarks/results/*.json of bench_train_h200.")] = None,
    as_json: JsonFlag = False,
):
    """Training wall time of a profile's phases on its GPUs, from the measured one-GPU throughput."""
    from . import estimate as E
    from .params import load

    rep = E.estimate(load(*profile, base=params), tokens_per_sample=tokens_per_sample, gpus=gpus,
                     efficiency=efficiency, bench=bench or E.DEFAULT_BENCH)
    if as_json:
        _print_json(rep)
    else:
        from .render import estimate_renderables, show

        show(estimate_renderables(rep))


@app.command()
def decide(
    path: Annotated[Path, typer.Argument(help="A decision.json (the decision step's output).")] = Path(
        "artifacts/decision/decision.json"),
    as_json: JsonFlag = False,
):
    """The decision: which init, how much data, whether Phase 2 pays (CIs and rules: docs/decision.md)."""
    from .decision import load_decision, render_text

    rep = load_decision(path)
    if as_json:
        _print_json(rep)
    else:
        sys.stdout.write(render_text(rep))


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, prog_name="draftport")
    except DraftportError as e:
        # One line, no traceback: the user's input is wrong, not the program.
        msg = str(e).replace("\r", " ").replace("\n", " ")
        sys.stderr.write(f"draftport: error: {msg}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
