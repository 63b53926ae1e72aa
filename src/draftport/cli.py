"""`draftport` command line.

Adding a command: write a function decorated with `@app.command()`, import what it needs INSIDE
the function (torch, transformers and friends cost seconds; `draftport compare` must not pay for
them), raise DraftportError for bad input, and print JSON with `_print_json` under `--json`.
main() turns every DraftportError into one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import sys
from inspect import cleandoc
from pathlib import Path
from typing import Annotated

import typer

from draftport.errors import DraftportError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Port an EAGLE-3 drafter to a new version of its target model.",
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the report as JSON.")]


def _version(value: bool) -> None:
    if value:
        # the installed distribution's version: pyproject.toml is its one source
        from importlib.metadata import version

        sys.stdout.write(f"draftport {version('draftport')}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print draftport's version and exit.")
    ] = False,
):
    """Port an EAGLE-3 drafter to a new version of its target model."""


def _print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")


@app.command()
def compare(
    src: Annotated[Path, typer.Argument(help="Source drafter folder (config.json + *.safetensors).")],
    dst: Annotated[Path, typer.Argument(help="Drafter folder to compare against.")],
    target: Annotated[
        Path | None,
        typer.Option(
            "--target",
            help="Target folder: check each drafter's own embed_tokens against its embedding "
            "(sha256 of the tensor bytes; report key `embedding`).",
        ),
    ] = None,
    as_json: JsonFlag = False,
):
    """Config, weights and vocab maps of two drafters side by side, from headers only (with
    --target, also the bytes of embed_tokens where a drafter carries one)."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.outputs.compare import compare_drafters

    rep = compare_drafters(src, dst, target=target)
    if as_json:
        _print_json(rep)
    else:
        # lazy: rich's tables, for the text output only
        from draftport.outputs.render import compare_renderables, show

        show(compare_renderables(rep))


@app.command()
def costmodel(
    baseline_tok_s: Annotated[float, typer.Option(help="Target alone, tokens/s.")],
    verify_ms: Annotated[
        float, typer.Option(help="One verify cycle of the target, ms (drafting included when --draft-ms is 0).")
    ],
    draft_ms: Annotated[float, typer.Option(help="One draft step, ms (needs --k).")] = 0.0,
    k: Annotated[int | None, typer.Option("--k", help="Draft steps per cycle (default: unbounded chain).")] = None,
    target_tok_s: Annotated[list[float] | None, typer.Option(help="Throughput to reach (repeatable).")] = None,
    accept_rates: Annotated[
        str | None, typer.Option(help="Measured per-position acceptance, e.g. 0.8,0.6,0.4: picks the best k.")
    ] = None,
    as_json: JsonFlag = False,
):
    """Accept length and acceptance a drafter needs to pay off, and to reach target throughputs."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.evaluation.costmodel import CostModel, best_k

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
        # lazy: rich's tables, for the text output only
        from draftport.outputs.render import costmodel_renderables, show

        show(costmodel_renderables(rep))


@app.command()
def inspect(
    folder: Annotated[Path, typer.Argument(help="Drafter folder (config.json + *.safetensors).")],
    as_json: JsonFlag = False,
):
    """Tensor names, shapes, dtypes and the normalized config, from headers only."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.model.formats import inspect_report

    rep = inspect_report(folder)
    if as_json:
        _print_json(rep)
    else:
        # lazy: rich's tables, for the text output only
        from draftport.outputs.render import inspect_renderables, show

        show(inspect_renderables(rep))


# init's arguments and options that do not fit one line of its signature (help and defaults as typer shows them)
InitName = Annotated[
    str,
    typer.Argument(help="The profile's name: writes configs/NAME.yaml (and the MLflow experiment draftport-NAME)."),
]
InitTargetOld = Annotated[
    str | None, typer.Option(help="The old target (the source's home): Phase 0 on it and the drift probe.")
]
InitPrompts = Annotated[
    Path | None,
    typer.Option(help='Training prompts, JSONL ({"user": ...} per line; default data/NAME/train.jsonl).'),
]
InitPromptsEval = Annotated[
    Path | None, typer.Option(help="Held-out prompts, disjoint from --prompts (default data/NAME/heldout.jsonl).")
]
InitRegenerate = Annotated[
    str,
    typer.Option(help="Who writes the new target's answers: local (the capture step) or openai (a served target)."),
]
InitServedModel = Annotated[
    str | None,
    typer.Option(help="With --regenerate openai: the model name the server knows (default: the target's id)."),
]
InitOffline = Annotated[bool, typer.Option("--offline", help="Read the hub cache only (also HF_HUB_OFFLINE=1).")]
InitTrustRemoteCode = Annotated[
    bool,
    typer.Option(
        "--trust-remote-code",
        help="Let the target's own code (auto_map) run; names it in targets.trust_remote_code.",
    ),
]
InitLike = Annotated[
    Path | None,
    typer.Option(
        help="Take training, eval and resources settings from this profile (e.g. configs/micro.yaml) "
        "instead of the GPU-node defaults."
    ),
]
InitPhase1Samples = Annotated[
    int | None, typer.Option(help="Phase 1's samples (default: a fifth of Phase 2's, at most 37,000).")
]
InitPhase2Samples = Annotated[
    int | None, typer.Option(help="Phase 2's samples (default: every training prompt but the monitor's).")
]
InitBaselineTokS = Annotated[float | None, typer.Option(help="Your target's tok/s without a drafter (measured).")]
InitVerifyMs = Annotated[
    float | None,
    typer.Option(help="One verify cycle of your deployment, ms (measured; drafting included when --draft-ms is 0)."),
]
InitReference = Annotated[
    str | None,
    typer.Option(help="A drafter already trained for the new target (hub id[@revision]): Phase 0's upper bound."),
]
InitEvalSet = Annotated[
    list[str] | None,
    typer.Option(
        "--eval-set",
        help="A named held-out set NAME=PATH:SHARE, e.g. code=data/code.jsonl:0.3: its prompts, "
        "disjoint from --prompts, and its share of the served traffic; the shares add up to 1 "
        "(targets.eval_sets; without it: one set, --prompts-eval).",
    ),
]
InitPin = Annotated[
    bool,
    typer.Option(
        "--pin/--no-pin",
        help="Pin the source to the commit its revision resolves to (--no-pin: keep the branch; an example profile).",
    ),
]


def _init_refuse(rep: dict) -> None:
    """init's problems, one line each on stderr, then exit 2: nothing is written."""
    if rep["problems"]:
        for where, what in rep["problems"]:
            sys.stderr.write(f"draftport: error: {where}: {what}\n")
        sys.stderr.write(f"draftport: error: {len(rep['problems'])} problem(s): {rep['path']} not written\n")
        raise typer.Exit(2)


def _init_estimate(rep: dict) -> dict | None:
    """The written profile's estimate (None, named a gap, while it needs what is still missing)."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.profile.estimate import estimate as estimate_profile

    est = None
    try:
        est = estimate_profile(rep["profile"], target_config_path=rep["target_config"])
    except DraftportError as e:  # the profile stands; the estimate needs what is missing
        rep["gaps"].append(("estimate", str(e)))
    return est


def _init_print(rep: dict, path: Path, est: dict | None) -> None:
    """init's text output: the file written, its notes, the estimate and what is still missing."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.profile.estimate import render as render_estimate

    sys.stdout.write(f"wrote {path}\n")
    for where, what in rep["notes"]:
        sys.stdout.write(f"  note  {where}: {what}\n")
    if est is not None:
        sys.stdout.write(render_estimate(est) + "\n")
    if rep["gaps"]:
        sys.stdout.write(f"still missing before `snakemake --configfile={path} --cores 8 decision`:\n")
        for where, what in rep["gaps"]:
            sys.stdout.write(f"  - {where}: {what}\n")
    else:
        sys.stdout.write(f"nothing missing: snakemake --configfile={path} --cores 8 -n decision\n")


@app.command()
def init(
    name: InitName,
    source: Annotated[str, typer.Option(help="The source drafter: a hub id[@revision] or a folder.")],
    target_new: Annotated[str, typer.Option(help="The new target: a hub id[@revision] or a folder.")],
    target_old: InitTargetOld = None,
    prompts: InitPrompts = None,
    prompts_eval: InitPromptsEval = None,
    regenerate: InitRegenerate = "local",
    base_url: Annotated[str | None, typer.Option(help="With --regenerate openai: the server's /v1 address.")] = None,
    served_model: InitServedModel = None,
    cache_dir: Annotated[Path | None, typer.Option(help="The hub cache to read (default: HF_HOME's).")] = None,
    offline: InitOffline = False,
    trust_remote_code: InitTrustRemoteCode = False,
    like: InitLike = None,
    gpus: Annotated[int, typer.Option(help="GPUs of one training node.")] = 8,
    phase1_samples: InitPhase1Samples = None,
    phase2_samples: InitPhase2Samples = None,
    baseline_tok_s: InitBaselineTokS = None,
    verify_ms: InitVerifyMs = None,
    draft_ms: Annotated[float | None, typer.Option(help="One draft step, ms (0: inside verify_ms).")] = None,
    reference: InitReference = None,
    eval_set: InitEvalSet = None,
    pin: InitPin = True,
    out: Annotated[Path | None, typer.Option(help="Where to write the profile (default configs/NAME.yaml).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing profile.")] = False,
    as_json: JsonFlag = False,
):
    """A profile for your own pair: checks the source drafter against the new target and the prompt
    files from headers only, pins the revision, writes configs/NAME.yaml (a comment per key), prints
    the estimate and what is still missing before `snakemake --configfile=configs/NAME.yaml --cores 8 decision`."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.profile import init as init_profile

    rep = init_profile.build(
        init_profile.InitRequest(
            name,
            source=source,
            target_new=target_new,
            target_old=target_old,
            prompts=prompts,
            prompts_eval=prompts_eval,
            regenerate=regenerate,
            base_url=base_url,
            served_model=served_model,
            cache_dir=cache_dir,
            offline=offline,
            read_offline=offline or init_profile.env_offline(),
            trust_remote_code=trust_remote_code,
            like=like,
            gpus=gpus,
            phase1_samples=phase1_samples,
            phase2_samples=phase2_samples,
            baseline_tok_s=baseline_tok_s,
            verify_ms=verify_ms,
            draft_ms=draft_ms,
            reference=reference,
            eval_sets=tuple(eval_set or ()),
            pin=pin,
            out=out,
            force=force,
        )
    )
    _init_refuse(rep)
    path = init_profile.write(rep, force=force)
    est = _init_estimate(rep)
    if as_json:
        _print_json({k: v for k, v in rep.items() if k not in ("text", "profile")} | {"estimate": est})
        return
    _init_print(rep, path, est)


@app.command()
def estimate(
    configfile: Annotated[
        list[Path], typer.Option("--configfile", help="Profile(s) layered on params.yaml, as given to snakemake.")
    ],
    params: Annotated[Path, typer.Option(help="The base parameter file.")] = Path("params.yaml"),
    tokens_per_sample: Annotated[int | None, typer.Option(help="Default: the benchmark's sequence length.")] = None,
    gpus: Annotated[int | None, typer.Option(help="Default: each rule's resources gpu (training and capture).")] = None,
    efficiency: Annotated[float, typer.Option(help="Scaling efficiency over the GPUs (assumed).")] = 0.9,
    bench: Annotated[Path | None, typer.Option(help="A benchmarks/results/*.json of bench_train_h200.")] = None,
    capture_bench: Annotated[
        Path | None,
        typer.Option(
            help="A capture benchmark result (default: newest benchmarks/results/*-h200-capture.json, if any)."
        ),
    ] = None,
    capture_efficiency: Annotated[
        float | None,
        typer.Option(help="Stated fraction of the prefill roofline for the capture (overrides any benchmark file)."),
    ] = None,
    serve_tok_s: Annotated[
        float | None,
        typer.Option(
            help="Output tok/s of the deployment serving the target's answers (default: features.serve_tok_s, else "
            "derived from the target and the GPUs: docs/estimate.md)."
        ),
    ] = None,
    answer_tokens: Annotated[
        int | None,
        typer.Option(help="Answer tokens per sample (default: features.max_new_tokens, at most tokens per sample)."),
    ] = None,
    target_config: Annotated[
        Path | None,
        typer.Option(
            help="The new target's config.json or folder (default: targets.new's, or a built-in published shape)."
        ),
    ] = None,
    spool_gb: Annotated[float | None, typer.Option(help="Online spool bound, GB (default: features.spool_gb).")] = None,
    peak_tflops: Annotated[float | None, typer.Option(help="Peak dense bf16 TFLOP/s per GPU (default: H200).")] = None,
    as_json: JsonFlag = False,
):
    """Wall time and disk of a profile's phases: regenerating the answers, capturing the hidden
    states and training, per storage mode (disk bf16 / fp8, online), every input printed."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.plan.params import load
    from draftport.profile import estimate as estimating

    if params == Path("params.yaml") and not params.is_file():  # outside a checkout: params.yaml as shipped
        params = Path(estimating.__file__).resolve().parents[1] / "plan" / "defaults.yaml"
    rep = estimating.estimate(
        load(*configfile, base=params),
        tokens_per_sample=tokens_per_sample,
        gpus=gpus,
        efficiency=efficiency,
        bench=bench or estimating.DEFAULT_BENCH,
        capture_bench_path=capture_bench,
        capture_eff=capture_efficiency,
        serve_tok_s=serve_tok_s,
        answer_tokens=answer_tokens,
        target_config_path=target_config,
        spool_gb=spool_gb,
        peak_tflops=estimating.PEAK_TFLOPS if peak_tflops is None else peak_tflops,
    )
    if as_json:
        _print_json(rep)
    else:
        # lazy: rich's tables, for the text output only
        from draftport.outputs.render import estimate_renderables, show

        show(estimate_renderables(rep))


@app.command()
def decide(
    path: Annotated[Path, typer.Argument(help="A decision.json (the decision step's output).")] = Path(
        "artifacts/decision/decision.json"
    ),
    as_json: JsonFlag = False,
):
    """The decision: which init, how much data, whether Phase 2 pays (CIs and rules: docs/decision.md)."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.evaluation.decision import load_decision, render_text

    rep = load_decision(path)
    if as_json:
        _print_json(rep)
    else:
        sys.stdout.write(render_text(rep))


@app.command()
def ui(
    configfile: Annotated[
        list[Path] | None,
        typer.Option(
            "--configfile", help="Profile(s) layered on params.yaml, as given to snakemake (the experiment's name)."
        ),
    ] = None,
    params: Annotated[Path, typer.Option(help="The base parameter file.")] = Path("params.yaml"),
    host: Annotated[str, typer.Option(help="Address the UI listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port the UI listens on.")] = 5000,
    print_urls: Annotated[
        bool, typer.Option("--print-urls", "--no-serve", help="Only print the addresses; start no server.")
    ] = False,
    log: Annotated[Path, typer.Option(help="The server's output.")] = Path("logs/mlflow_ui.log"),
    as_json: JsonFlag = False,
):
    """The MLflow UI on the tracking store: starts `mlflow server` and prints the addresses of the
    phase runs' compare view, their tau by training step and the runs table (Ctrl-C stops it)."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.ui import main as ui_main

    raise typer.Exit(ui_main(configfile or [], params, host, port, print_urls, as_json, log))


@app.command()
def publish(
    phase: Annotated[
        str | None,
        typer.Option(help="phase1_scratch, phase1 or phase2 (default: publish.phase, else the decision's choice)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="The hub folder to write (default: published/<publish.folder>).")
    ] = None,
    repo_id: Annotated[
        str | None,
        typer.Option(
            "--repo-id", help="The hub repo (org/name) the card names and --push uploads to (default: publish.repo_id)."
        ),
    ] = None,
    push: Annotated[
        bool,
        typer.Option(
            "--push", help="Upload the folder with huggingface_hub (token: HF_TOKEN) once every check passes."
        ),
    ] = False,
    private: Annotated[bool, typer.Option("--private", help="Create the hub repo private.")] = False,
    configfile: Annotated[
        list[Path] | None,
        typer.Option("--configfile", help="Profile(s) layered on params.yaml, as given to snakemake."),
    ] = None,
    params: Annotated[Path, typer.Option(help="The base parameter file.")] = Path("params.yaml"),
    as_json: JsonFlag = False,
):
    """The chosen drafter as a hub-ready folder (flat config.json, model.safetensors with the new
    target's embed_tokens, a README.md model card) from the pipeline's artifacts, checked; with
    --push, uploaded (docs/publish.md)."""
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.outputs import publish as PUB

    if push:  # no token: one line, before anything is read or built
        PUB.hub_token()
    # lazy: a command imports what it runs when it runs (see the module docstring)
    from draftport.plan import registry
    from draftport.plan.params import load

    cfg = load(*(configfile or []), base=params)
    pp = cfg["publish"]
    repo = repo_id or pp["repo_id"]
    if push:
        PUB.push_preflight(repo, pp["base_model"] or cfg["targets"]["new"])
    inputs = registry.inputs(registry.BY_NAME["publish"], cfg)
    folder = out or Path("published") / pp["folder"]
    rep = PUB.from_pipeline(registry.step_params(cfg, "publish"), inputs, folder, phase=phase, repo_id=repo)
    if push:
        rep["push"] = PUB.push(folder, repo, inputs["target"], embed_tokens=pp["embed_tokens"], private=private)
    if as_json:
        _print_json(rep)
        return
    taus = ", ".join(f"tau {r['accept_length']:.3f} at k={r['k']}" for r in rep["taus"])
    sys.stdout.write(f"{rep['phase']} ({rep['why']}) -> {folder}/ ({rep['bytes'] / 1e6:.1f} MB): {taus}\n")
    if push:
        sys.stdout.write(f"uploaded to https://huggingface.co/{repo} {rep['push']['commit_url']}\n")


def _one_line_summaries() -> None:
    """`draftport --help` lists each command with its docstring's first paragraph, and typer's rich
    mode keeps that paragraph's line breaks there (the line ends mid-sentence in the panel): hand
    each command the paragraph as one line (its own --help still shows the docstring whole)."""
    for info in app.registered_commands:
        doc = cleandoc(info.callback.__doc__ or "") if info.callback else ""
        if doc and info.short_help is None:
            info.short_help = " ".join(doc.split("\n\n")[0].split())


_one_line_summaries()  # after every @app.command() above


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
