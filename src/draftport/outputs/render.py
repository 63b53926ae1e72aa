"""Rich renderings of the library's JSON reports, for humans at a terminal.

The JSON dicts stay the source of truth (`--json` prints them as they are); these functions only
lay them out. Imported lazily by the CLI commands that need it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

STATUS_STYLE = {"match": "green", "mismatch": "bold red", "missing_in_src": "yellow", "missing_in_dst": "yellow"}


def console() -> Console:
    # Piped output gets rich's 80 columns by default, which folds the weights table; give it room.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=150 if wide else None, highlight=False)


def _val(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return str(v)


def _tensor(shape, dtype) -> str:
    return "-" if shape is None else f"{list(shape)} {dtype.lower()}"


def _yes(flag) -> Text:
    if flag is None:
        return Text("-", style="dim")
    return Text("yes", style="green") if flag else Text("no", style="bold red")


def compare_renderables(rep: dict) -> list:
    f = rep["folders"]
    out: list = [
        Text.assemble(
            ("src ", "bold"),
            f"{f['src']['path']} ({f['src']['format']})\n",
            ("dst ", "bold"),
            f"{f['dst']['path']} ({f['dst']['format']})",
        )
    ]

    cfg = Table(title="config", box=box.SIMPLE_HEAD, title_justify="left", title_style="bold")
    for col in ("field", "src", "dst", "match", "note"):
        cfg.add_column(col)
    for r in rep["config"]:
        cfg.add_row(
            r["field"], escape(_val(r["src"])), escape(_val(r["dst"])), _yes(r["match"]), escape(r.get("note", ""))
        )
    out.append(cfg)

    # Notes go under the table as numbered footnotes: a note column would be squeezed to nothing
    # on a narrow terminal, and the notes (why embed_tokens may be missing) matter most.
    w = Table(title="weights", box=box.SIMPLE_HEAD, title_justify="left", title_style="bold")
    # On a narrow terminal, wrap "[shape] dtype" at its spaces rather than cut it with an ellipsis.
    w.add_column("tensor", overflow="fold")
    w.add_column("src", overflow="fold")
    w.add_column("dst", overflow="fold")
    w.add_column("status", no_wrap=True)
    notes: list[tuple[str, str]] = []
    for r in rep["weights"]:
        status = Text(r["status"], style=STATUS_STYLE[r["status"]])
        if r["note"]:
            notes.append((f"  [{len(notes) + 1}]", f"{r['name']}: {r['note']}"))
            status.append(f" [{len(notes)}]", style="dim")
        w.add_row(r["name"], _tensor(r["src_shape"], r["src_dtype"]), _tensor(r["dst_shape"], r["dst_dtype"]), status)
    out.append(w)
    if notes:
        out.append(_bullets(notes))
        out.append(Text(""))

    v = rep["vocab"]
    vt = Table(title="vocab", box=box.SIMPLE_HEAD, title_justify="left", title_style="bold")
    for col in ("", "src", "dst"):
        vt.add_column(col)
    for key in ("draft_vocab_size", "vocab_size", "d2t_present", "format", "t2d_consistent", "ids_out_of_range"):
        a, b = v[key]["src"], v[key]["dst"]
        cells = [_yes(x) if isinstance(x, bool) else _val(x) for x in (a, b)]
        vt.add_row(key, *cells)
    if v["overlap"] is not None:
        vt.add_section()
        vt.add_row("identical", _yes(v["identical"]), "")
        vt.add_row("positions differ", f"{v['positions_differ']} of {v['positions_compared']}", "")
        vt.add_row("overlap (shared ids)", str(v["overlap"]), "")
        vt.add_row("jaccard", f"{v['jaccard']:.4f}", "")
        vt.add_row("only in src / dst", str(v["src_only"]), str(v["dst_only"]))
        vt.add_row("positions: sorting artifact", _yes(v["positions_artifact_of_sorting"]), "")
    out.append(vt)
    out.append(Text(v["explanation"]))

    if "embedding" in rep:
        out.append(_embedding_table(rep["embedding"]))

    vd = rep["verdict"]
    out.append(
        Text.assemble(
            ("\nverdict: ", "bold"),
            ("compatible architecture", "bold green")
            if vd["compatible_architecture"]
            else ("INCOMPATIBLE architecture", "bold red"),
        )
    )
    out.append(
        _bullets(
            [("  -", r) for r in vd["reasons"]]
            + [(Text("  !", style="yellow"), Text(wl, style="yellow")) for wl in vd["warnings"]]
        )
    )
    out.append(_bullets([(Text("vocab action:", style="bold"), vd["vocab_action"])]))
    return out


def _sha(h) -> str:
    return "-" if h is None else h[:16]


def _embedding_table(emb: dict) -> Group:
    """embed_tokens of each drafter against the target's (`draftport compare --target`)."""
    any_side = emb["src"]
    t = Table(
        title=f"embedding (target {emb['target']}: {any_side['target_tensor']})",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        title_style="bold",
    )
    for col in ("", "embed_tokens", "sha256", "equal to the target's", "vLLM embeds with", "SGLang embeds with"):
        t.add_column(col, no_wrap=col == "sha256", overflow="fold")
    for side in ("src", "dst"):
        c = emb[side]
        same = c["equal"] if c["equal_values"] is None else c["equal_values"]
        t.add_row(
            side,
            _tensor(c["drafter_shape"], c["drafter_dtype"]) if c["carries_embed_tokens"] else "-",
            _sha(c["drafter_sha256"]),
            _yes(same) if c["carries_embed_tokens"] else Text("-", style="dim"),
            c["vllm"],
            c["sglang"],
        )
    t.add_row(
        "target",
        _tensor(any_side["target_shape"], any_side["target_dtype"]),
        _sha(emb["src"]["target_sha256"] or emb["dst"]["target_sha256"]),
        "",
        "",
        "",
    )
    notes = [(f"  {side}", emb[side]["note"]) for side in ("src", "dst")]
    return Group(t, _bullets(notes), Text(""))


def _bullets(rows) -> Table:
    """Marker + text, with wrapped lines kept indented under their text."""
    g = Table.grid(padding=(0, 1))
    g.add_column(no_wrap=True)
    g.add_column()
    for marker, text in rows:
        g.add_row(marker, text)
    return g


def costmodel_renderables(rep: dict) -> list:
    k = rep["k"]
    chain = f"k = {k} draft steps" if k else "unbounded chain (tau = 1 / (1 - p))"
    head = Text.assemble(
        ("cost model: ", "bold"),
        f"baseline {rep['baseline_tok_s']:g} tok/s, verify {rep['verify_ms']:g} ms, "
        f"draft {rep['draft_ms']:g} ms/step, {chain}\n",
        ("break-even: ", "bold"),
        f"accept length {rep['break_even_accept_length']:.2f}"
        + (
            f" (conditional acceptance {rep['break_even_cond_acc']:.0%})"
            if rep["break_even_cond_acc"] is not None
            else ""
        ),
    )
    t = Table(box=box.SIMPLE_HEAD)
    for col in ("tok/s", "speed-up", "accept length needed", "cond. acceptance needed"):
        t.add_column(col, justify="right")
    for r in rep["targets"]:
        p = r["cond_acc"]
        t.add_row(
            f"{r['tok_s']:g}",
            f"{r['tok_s'] / rep['baseline_tok_s']:.2f}x",
            f"{r['accept_length']:.2f}",
            f"{p:.1%}" if p is not None else Text(f"unreachable with k = {k}", style="red"),
        )
    out: list = [head, t]
    if "best_k" in rep:
        b = rep["best_k"]
        out.append(
            Text.assemble(
                ("best k from measured acceptance: ", "bold"), f"k = {b['best_k']} ({b['best_tok_s']:.1f} tok/s)"
            )
        )
        bt = Table(box=box.SIMPLE_HEAD)
        for col in ("k", "accept length", "tok/s"):
            bt.add_column(col, justify="right")
        for r in b["by_k"]:
            bt.add_row(str(r["k"]), f"{r['accept_length']:.2f}", f"{r['tok_s']:.1f}")
        out.append(bt)
    return out


def inspect_renderables(rep: dict) -> list:
    head = Text.assemble(
        ("folder ", "bold"),
        f"{rep['folder']} ({rep['format']}, "
        f"{rep['trainable_params'] / 1e6:,.1f}M trainable params, "
        f"{rep['total_bytes'] / 1e9:.2f} GB)",
    )
    t = Table(title="tensors", box=box.SIMPLE_HEAD, title_justify="left", title_style="bold")
    for col in ("tensor", "shape", "dtype", "MB", "file"):
        t.add_column(col, no_wrap=True)
    for r in rep["tensors"]:
        t.add_row(r["name"], str(r["shape"]), r["dtype"].lower(), f"{r['nbytes'] / 1e6:,.1f}", r["file"])
    c = Table(title="config", box=box.SIMPLE_HEAD, title_justify="left", title_style="bold")
    c.add_column("field")
    c.add_column("value")
    for key, val in rep["config"].items():
        c.add_row(key, escape(_val(val)))
    out: list = [head, c, t]
    if rep["problems"]:
        out.append(Text("problems:\n" + "\n".join(f"  ! {p}" for p in rep["problems"]), style="yellow"))
    return out


def _adaptive_line(a: dict) -> tuple:
    """The adaptive data budget's saving, if the curve flattened as the embedded world's did."""
    where = (
        f"the cap phase2.n_samples {a['instead_of']:,} comes first: nothing saved"
        if a["cap_first"]
        else f"Phase 2's data {a['n_samples']:,} samples in all instead of {a['instead_of']:,}: saves "
        f"{a['data_hours_saved']:.2f} h of regeneration and capture"
    )
    return (
        "\n",
        ("adaptive data budget", "bold"),
        f" ({'the profile' if a['profile_mode'] == 'adaptive' else 'data.budget: adaptive'}; "
        f"if the curve flattens as the embedded world's, after {a['stop_round']} rounds of x{a['factor']:g}): "
        f"{where}; costs {a['rounds_train_hours']:.2f} h of the "
        f"rounds' trainings ({a['seeds']} seeds x {len(a['rounds_n'])} rounds, {a['rounds_steps']:,} steps on "
        f"{a['gpus_training']} of the step's {a['gpus_held']} GPUs): net {a['net_hours_saved']:+.2f} h",
    )


def _serve_source(rep: dict) -> str:
    """Where the regeneration's tok/s comes from: an option, the profile's measured figure, or
    estimate.serve_rate's derivation with its inputs and its check on the published figure."""
    s = rep.get("serve") or {"source": rep["serve_source"]}
    if s["source"] == "features.serve_tok_s":
        return "measured: features.serve_tok_s"
    if s["source"] != "derived":
        return f"stated: {s['source']}"
    experts = (
        f" ({s['experts_read']:.0f} of {s['experts']} routed experts per layer at that concurrency)" if s["moe"] else ""
    )
    c = s["calibration"]
    fits = (
        ""
        if s["fits"]
        else (
            f"; NOT reachable: weights + KV {(s['weights_total_bytes'] + s['kv_bytes']) / 1e9:,.0f} "
            f"GB exceed {s['tp']} x {s['memory_bytes'] / 1e9:.0f} GB"
        )
    )
    return (
        f"derived for the {'MoE' if s['moe'] else 'dense'} target: {s['instances']} instance(s) of TP{s['tp']} on "
        f"{s['gpu']}, {s['concurrency']} requests in flight each at a mean context of {s['context']:,.0f} tokens; "
        f"a decode step reads {s['weight_bytes'] / 1e9:,.1f} GB of {s['format']} weights{experts} + "
        f"{s['kv_bytes'] / 1e9:,.1f} GB of KV cache at {s['util']:g} of {s['hbm_bytes_s'] / 1e12:g} TB/s per GPU: "
        f"{s['bound']}-bound, {s['tok_s_per_gpu']:,.0f} tok/s/GPU{fits}; the same model gives "
        f"{c['model']:.1f} tok/s/GPU at {c['concurrency']} concurrent where {c['source']} measured "
        f"{c['published']}; features.serve_tok_s or --serve-tok-s overrides"
    )


def _estimate_head(rep: dict) -> Text:
    """The inputs: the measured training rate, the target, the capture's FLOPs and rate, the answers'
    rate and the stated assumptions."""
    b, tg, fl, ce = rep["bench"], rep["target"], rep["flops_per_token"], rep["capture_efficiency"]
    tps, g = rep["tokens_per_sample"], rep["data"][0]["gpus"]
    moe = tg["moe"]
    arch = (
        f"MoE {moe['top_k']} of {moe['experts']} experts + {moe['shared']} shared, {moe['dense_layers']} dense layer(s)"
        if moe
        else "dense"
    )
    if ce["source"] == "measured":
        eff_src = f"measured {ce['file']} ({ce['device']}, {ce['date']}), shape {ce['shape']}" + (
            "" if ce["capture_measured"] else "; online at capture+write's (no capture-only figure)"
        )
    else:
        eff_src = f"stated: {ce['note']}"
    eff = (
        f"{ce['capture_write']:.4g}"
        if ce["capture_write"] == ce["capture"]
        else f"{ce['capture_write']:.4g} with the write, {ce['capture']:.4g} without (online)"
    )
    return Text.assemble(
        ("measured: ", "bold"),
        f"training {b['device']} ({b['date']}), seq {b['seq']}, TTT {b['ttt_steps']}, bf16, one GPU, {b['rate']}\n",
        ("target: ", "bold"),
        f"{tg['id']} ({tg['config']}): {tg['layers']} layers, H {tg['hidden_size']}, {arch}: "
        f"{tg['active_params'] / 1e9:.2f}B active params per token of {tg['total_params'] / 1e9:,.1f}B\n",
        ("capture FLOPs/token: ", "bold"),
        f"2 x {tg['active_params_no_embed'] / 1e9:.2f}B (active, input embedding "
        f"excluded) + attention 2 x {tg['layers']} x {tg['heads']} x ({tg['qk_head_dim']} + {tg['v_head_dim']}) x "
        f"{tps}/2 = {fl['matmul'] / 1e9:.2f} + {fl['attention'] / 1e9:.2f} = {fl['total'] / 1e9:.2f} GFLOP\n",
        ("capture rate: ", "bold"),
        f"{rep['peak_tflops']:g} TFLOP/s x {g} GPUs x {eff} of roofline / "
        f"{fl['total'] / 1e9:.2f} GFLOP = {rep['capture_tok_s']['capture_write']:,.0f} tok/s"
        + (f" ({rep['capture_tok_s']['capture']:,.0f} online)" if ce["capture_write"] != ce["capture"] else "")
        + f"; fraction {eff_src}\n",
        ("regenerate: ", "bold"),
        f"{rep['serve_tok_s']:,.0f} output tok/s of the serving deployment "
        f"({_serve_source(rep)}), {rep['answer_tokens']} answer tokens per sample\n",
        ("assumed: ", "bold"),
        f"{tps} tokens per sample (every sample a full sequence, every answer at "
        f"{rep['answer_tokens']} tokens), scaling efficiency {rep['efficiency']:.2f} over the training GPUs; the "
        + (
            f"one-GPU dense capture fraction holds for the MoE target over {g} GPUs (tensor parallel, "
            "active params per token)"
            if moe
            else f"one-GPU capture fraction (a dense target's) holds for this dense target "
            f"on {g} GPU{'s' if g > 1 else ''}" + (" (tensor parallel)" if g > 1 else "")
        ),
    )


def _rules_table(rep: dict) -> Table:
    """One row per training rule: steps, batch, epochs, tokens, lm_head, rate, GPUs, hours."""
    # no cell padding (the box's column divider is a space): the nine columns fit an 80-column
    # terminal without cutting a figure (the rows' layout goes on the line below the table)
    t = Table(box=box.SIMPLE_HEAD, padding=0)
    t.add_column("rule", no_wrap=True)
    for col in ("steps", "batch", "epochs", "tokens", "lm_head", "tok/s/GPU", "GPUs", "hours"):
        t.add_column(col, justify="right", no_wrap=True)
    for r in rep["rows"]:
        t.add_row(
            r["rule"],
            str(r["steps"]),
            str(r["batch_size"]),
            f"{r['epochs']:.2f}",
            _si(r["tokens"]),
            r["lm_head"],
            f"{r['tok_s_per_gpu']:,}",
            str(r["gpus"]),
            f"{r['hours']:.2f}",
        )
    return t


def _training_totals(rep: dict) -> Text:
    """Below the rules: each rule's rows layout, the phases' training hours, the curves', what not
    regenerating saves and the adaptive budget."""
    layout = {k: [r["rule"] for r in rep["rows"] if r["rows"] == k] for k in ("packed", "padded")}
    rows_line = Text.assemble(
        ("rows: ", "bold"),
        ";  ".join(f"{k} ({', '.join(v)})" for k, v in layout.items() if v),
        " as each rule's train.packing says\n",
    )
    return Text.assemble(
        rows_line,
        ("Phase 1 (control + fine-tune): ", "bold"),
        f"{rep['phase1_hours']:.2f} h;  ",
        ("Phase 2: ", "bold"),
        f"{rep['phase2_hours']:.2f} h (training only)",
        *(
            (
                "\n",
                ("learning curves: ", "bold"),
                f"{rep['curves_hours']:.2f} h ({next(r['points'] for r in rep['rows'] if r['rule'] == 'curves')} "
                "trainings, the arms included; training only)"
                + (
                    f"\n  + {rep['curves_data_hours']:.2f} h capturing the dataset's own answers"
                    if rep.get("curves_data_hours")
                    else ""
                ),
            )
            if rep.get("curves_hours")
            else ()
        ),
        *(
            (
                "\n",
                ("not regenerating (R7) saves: ", "bold"),
                f"{sum(rep['regenerate_hours'].values()):.2f} h (Phase 1 "
                f"{rep['regenerate_hours']['phase1']:.2f}, Phase 2 {rep['regenerate_hours']['phase2']:.2f})",
            )
            if rep.get("curves_data_hours")
            else ()
        ),
        *(_adaptive_line(rep["adaptive"]) if rep.get("adaptive") else ()),
    )


def _data_table(rep: dict) -> Table:
    """One row per feature step: samples, the answers regenerated and the capture."""
    d = Table(box=box.SIMPLE_HEAD, padding=0)
    d.add_column("data step", no_wrap=True)
    for col in ("samples", "answer tok", "regen h", "capture tok", "GPUs", "capture h"):
        d.add_column(col, justify="right", no_wrap=True)
    for r in rep["data"]:
        d.add_row(
            r["step"],
            f"{r['samples']:,}",
            f"{r['answer_tokens']:,}",
            f"{r['regenerate_hours']:.2f}",
            f"{r['capture_tokens']:,}",
            str(r["gpus"]),
            f"{r['capture_hours']:.2f}",
        )
    return d


def _modes_table(rep: dict, human) -> Table:
    """One row per phase and storage mode: the hours (data + training) and the disk (human: its bytes' format)."""
    p = Table(box=box.SIMPLE_HEAD, padding=0)
    p.add_column("phase", no_wrap=True)
    p.add_column("storage", no_wrap=True)
    for col in ("regen h", "capture h", "train h", "total h", "disk"):
        p.add_column(col, justify="right", no_wrap=True)
    for r in rep["phases"]:
        mode = f"disk {r['dtype']}" if r["mode"] == "disk" else "online"
        p.add_row(
            r["phase"],
            mode + (" *" if r["profile"] else ""),
            f"{r['regenerate_hours']:.2f}",
            f"{r['capture_hours']:.2f}",
            f"{r['train_hours']:.2f}",
            f"{r['total_hours']:.2f}",
            human(r["disk_bytes"]),
        )
    return p


def _estimate_foot(rep: dict) -> Text:
    """How the disk and online figures are made, the hybrid rule, the profile's mark and what is not estimated."""
    tps = rep["tokens_per_sample"]
    ho, ptb = rep["held_out"], rep["per_token_bytes"]
    held = ho["eval"] + ho["monitor"]
    n1, n2 = rep["samples"]["phase1"], rep["samples"]["phase2"]
    rec = {r["phase"]: r["recompute_tokens"] for r in rep["phases"] if r["mode"] == "online"}
    dt = next(r["dtype"] for r in rep["phases"] if r["mode"] == "online")
    return Text.assemble(
        ("disk: ", "bold"),
        f"(samples + {held:,} held-out: {ho['eval']:,} eval + {ho['monitor']:,} monitor) x {tps} "
        "tokens x B/token: "
        + ", ".join(f"{k} {v['bytes']:,} ({v['how']})" for k, v in ptb.items())
        + f"; Phase 1 {n1:,} samples, Phase 2 {n2:,} (Phase 1's kept)\n",
        ("online: ", "bold"),
        f"spool min({rep['spool_gb']:g} GB ({rep['spool_from']}), the phase's states) + "
        f"samples x {tps} x 5 B (answers as ids) + the held-out sets at {dt}; capture = the held-out sets once + "
        f"every training token recomputed in the training steps "
        f"(Phase 1 {rec['phase1']:,}, Phase 2 {rec['phase2']:,}), "
        "billed as not overlapped with training\n",
        ("hybrid: ", "bold"),
        "disk's hours and bytes when the first epoch's cache fits, else online's;  ",
        ("* ", "bold"),
        f"the profile's features.storage ({rep['storage_mode']}) and dtype\n",
        ("not estimated: ", "bold"),
        "the learning curves' evaluations, the drift probe, the online steps, fetching the target's weights",
    )


def estimate_renderables(rep: dict) -> list:
    """`draftport estimate`: the inputs, the per-rule training table, the data steps, and per
    phase and storage mode the hours (data + training) and the disk."""
    # lazy: data.shards imports torch; compare and inspect render from headers, torch-free
    from draftport.data.shards import human

    return [
        _estimate_head(rep),
        _rules_table(rep),
        _training_totals(rep),
        _data_table(rep),
        _modes_table(rep, human),
        _estimate_foot(rep),
    ]


def _si(n: int) -> str:
    """A count in at most 7 characters (157.3M, 11.54B): the rule table fits 80 columns."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.4g}{unit}"
    return str(n)


def show(renderables: list) -> None:
    console().print(Group(*renderables))
