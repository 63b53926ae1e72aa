"""Regenerate the docs' generated blocks from the code: `python tools/docgen.py` rewrites them in
place, `python tools/docgen.py --check` exits 1 naming each block that differs (a test runs it).

A generated block sits between `<!-- generated: NAME -->` and `<!-- end: NAME -->`; everything
around it is hand-written and left as it is. The blocks: `steps` (the step registry) and `modules`
(every module's first paragraph) in docs/architecture.md; `params` (every key of params.yaml from
its pydantic schema, with params.yaml's values) in docs/configuration.md; `cli` (every command of
the live typer app, its arguments and options) in docs/cli.md."""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
sys.path.insert(0, str(SRC))

import typer.main  # noqa: E402
import yaml  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from draftport.plan import params, registry  # noqa: E402  (after the path: works from a bare checkout)


def modules() -> list[tuple[str, Path]]:
    """Every module of the package, dotted, with its file (packages by their __init__)."""
    out = []
    for p in sorted((SRC / "draftport").rglob("*.py")):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        out.append((name, p))
    return sorted(out)


def first_paragraph(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def module_table() -> str:
    rows = ["| module | holds |", "|---|---|"]
    rows += [f"| `{name}` | {first_paragraph(p).replace('|', '/')} |" for name, p in modules()]
    return "\n".join(rows) + "\n"


# ---- params: docs/configuration.md ------------------------------------------------------------
TRAIN_GROUPS = ("phase1.train", "phase2.train", "curves.train", "world.source_drafter.train")


def _cell(text: str) -> str:
    """Prose for a table cell: no raw HTML (<profile> would vanish), no emphasis, no cell break;
    code spans stay as written (a backslash would show there)."""
    parts = " ".join(str(text).split()).split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*").replace("|", "\\|")
    return "`".join(parts)


def _value(v) -> str:
    """A params.yaml value as YAML writes it in flow style."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _code(v) -> str:
    return f"`{_value(v)}`"


def _split(ann):
    """(the annotation without Annotated, its metadata)."""
    if typing.get_origin(ann) is typing.Annotated:
        base, *meta = typing.get_args(ann)
        return base, list(meta)
    return ann, []


def _type(field) -> str:
    return _type_of(field.annotation, list(field.metadata))


def _type_of(ann, meta) -> str:
    ann, more = _split(ann)
    meta = meta + more
    origin = typing.get_origin(ann)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        inner = " or ".join(_type_of(a, meta) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(ann)) else inner
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(ann))
    if origin is list:
        (item,) = typing.get_args(ann)
        return f"list of {_type_of(item, []).removeprefix('one of ')}"
    funcs = {getattr(m, "func", None) for m in meta}
    if params._hub_id in funcs:
        return "hub id (org/name)"
    if params._folder_name in funcs:
        return "folder name"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "group"
    return {int: "integer", float: "number", bool: "true / false", str: "string"}.get(ann, str(ann))


def _range(field) -> str:
    out = []
    metas = list(field.metadata)
    ann, more = _split(field.annotation)
    for a in typing.get_args(ann) or ():
        metas += _split(a)[1]
    for m in metas + more:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(m, attr, None) is not None and type(m).__name__ in ("Ge", "Gt", "Le", "Lt", "Interval"):
                out.append(f"{op} {getattr(m, attr)}")
        func = getattr(m, "func", None)
        if func is not None and func.__qualname__.startswith("_int_list"):  # entries and length
            bounds = inspect.getclosurevars(func).nonlocals
            if bounds.get("min_entry") is not None:
                out.append(f"entries >= {bounds['min_entry']}")
            if bounds.get("max_len") is not None:
                out.append(f"at most {bounds['max_len']} entries")
            out.append("not empty")
        if func is params._non_empty:
            out.append("not empty")
    return ", ".join(dict.fromkeys(out)) or "-"


def _sub_model(field):
    ann, _ = _split(field.annotation)
    args = (
        [a for a in typing.get_args(ann) if a is not type(None)]
        if typing.get_origin(ann) in (typing.Union, types.UnionType)
        else [ann]
    )
    model = args[0] if len(args) == 1 else None
    nullable = typing.get_origin(ann) in (typing.Union, types.UnionType)
    return (model if isinstance(model, type) and issubclass(model, BaseModel) else None), nullable


_MISSING = object()


def _at(cfg, dotted: str):
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def _default(field, key: str, cfg) -> str:
    """params.yaml's value (what a profile that leaves the key out gets), else the schema's."""
    v = _at(cfg, key)
    if v is not _MISSING:
        return _code(v)
    if field.is_required():
        return "-"
    d = field.get_default(call_default_factory=True)
    return "left out: derived" if d is None and not _sub_model(field)[1] and key.count(".") else _code(d)


def _first_paragraph(doc: str | None) -> str:
    return " ".join((inspect.cleandoc(doc or "")).split("\n\n")[0].split())


def _rows(model, prefix: str, cfg) -> list[str]:
    """One row per key under model (nested groups flattened; a train group points to its section)."""
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub, nullable = _sub_model(field)
        if sub is params.TrainConfig:
            rows.append(
                f"| `{key}.*` | group | - | - | {_cell(field.description)}: the keys under "
                f"[training groups](#training-groups) |"
            )
            continue
        if sub is not None:
            if nullable:
                rows.append(
                    f"| `{key}` | group or null | - | {_default(field, key, cfg)} | {_cell(field.description)} |"
                )
            rows += _rows(sub, key + ".", cfg)
            continue
        rows.append(
            f"| `{key}` | {_type(field)} | {_cell(_range(field))} | {_default(field, key, cfg)} | "
            f"{_cell(field.description)} |"
        )
        rows += _entry_rows(field, key)
    return rows


def _entry_rows(field, key: str) -> list[str]:
    """A list of groups (targets.eval_sets): one row per key of an entry, as `key[].name`."""
    ann, _ = _split(field.annotation)
    args = [a for a in typing.get_args(ann) if a is not type(None)] if typing.get_origin(ann) else [ann]
    lists = [a for a in args if typing.get_origin(a) is list]
    item = typing.get_args(lists[0])[0] if lists else None
    if not (isinstance(item, type) and issubclass(item, BaseModel)):
        return []
    return [
        f"| `{key}[].{k}` | {_type(f)} | {_cell(_range(f))} | "
        f"{'-' if f.is_required() else _code(f.get_default(call_default_factory=True))} | {_cell(f.description)} |"
        for k, f in item.model_fields.items()
    ]


HEAD = ["| key | type | range | default | description |", "|---|---|---|---|---|"]


def params_reference() -> str:
    """Every key of params.yaml: one section per top-level group, the training groups once."""
    cfg = yaml.safe_load((ROOT / params.PARAMS_FILE).read_text())
    out = []
    for name, field in params.Params.model_fields.items():
        sub, _ = _sub_model(field)
        if sub is None:
            out += [
                f"### `{name}`",
                "",
                _cell(field.description),
                "",
                *HEAD,
                f"| `{name}` | {_type(field)} | {_cell(_range(field))} | {_default(field, name, cfg)} | "
                f"{_cell(field.description)} |",
                "",
            ]
            continue
        out += [f"### `{name}`", "", _cell(_first_paragraph(sub.__doc__)), ""]
        if sub is params.ResourcesParams:
            dflt = params.ResourcesParams.model_fields["default"]
            rows = _rows(params.ResourceDefault, "resources.default.", cfg)
            rows += [
                f"| `resources.<step>.{k}` | {_type(f)} | {_cell(_range(f))} | `resources.default.{k}` | "
                f"{_cell(f.description)} |"
                for k, f in params.ResourceOverride.model_fields.items()
            ]
            over = {k: v for k, v in (cfg.get("resources") or {}).items() if k != "default"}
            out += [
                *HEAD,
                *rows,
                "",
                f"`default`: {_cell(dflt.description)}. `<step>`: any step of the registry ("
                + ", ".join(f"`{s}`" for s in registry.STEP_NAMES)
                + "). params.yaml's overrides: "
                + (", ".join(f"`{k}: {_value(v)}`" for k, v in over.items()) or "none")
                + ".",
                "",
            ]
            continue
        out += [*HEAD, *_rows(sub, name + ".", cfg), ""]
    # the training groups: one schema, four groups
    out += [
        "### Training groups",
        "",
        "The training loop's keys (`draftport.training.loop`), the same in "
        + ", ".join(f"`{g}`" for g in TRAIN_GROUPS)
        + ". The default is the schema's, taken where a "
        "group leaves the key out; params.yaml writes every one out (its values: the second table).",
        "",
        *HEAD,
    ]
    for key, field in _train_fields():
        out.append(
            f"| `{key}` | {_type(field)} | {_cell(_range(field))} "
            f"| {_code(field.get_default(call_default_factory=True))} "
            f"| {_cell(field.description)} |"
        )
    out += [
        "",
        "params.yaml's values:",
        "",
        "| key | " + " | ".join(f"`{g}`" for g in TRAIN_GROUPS) + " |",
        "|---" * (len(TRAIN_GROUPS) + 1) + "|",
    ]
    for key, _ in _train_fields():
        vals = [_at(cfg, f"{g}.{key}") for g in TRAIN_GROUPS]
        out.append(f"| `{key}` | " + " | ".join("-" if v is _MISSING else _code(v) for v in vals) + " |")
    return "\n".join(out) + "\n"


def _train_fields():
    """(key inside a train group, field) of every training key, `fast.*` included."""
    for name, field in params.TrainConfig.model_fields.items():
        sub, _ = _sub_model(field)
        if sub is None:
            yield name, field
        else:
            for k, f in sub.model_fields.items():
                yield f"{name}.{k}", f


# ---- cli: docs/cli.md ------------------------------------------------------------------------
def _help(text: str | None) -> str:
    return _cell(" ".join((text or "").split()))


def _param_row(p, ctx) -> str:
    is_arg = p.param_type_name == "argument"
    names = ", ".join(f"`{o}`" for o in ([p.name.upper()] if is_arg else [*p.opts, *p.secondary_opts]))
    if getattr(p, "is_flag", False):
        value = "flag"
    else:
        try:
            value = str(p.display_type(ctx)).strip("<>")
        except AttributeError:  # a plain click parameter
            value = p.type.name
        value = "`" + re.sub(r"^list\[(.*)\]$", r"\1", value).lower() + "`"  # a repeatable option: its item
    if getattr(p, "multiple", False):
        value += ", repeatable"
    if p.required:
        default = "required"
    elif p.default is None or (getattr(p, "is_flag", False) and p.default is False) or p.default == ():
        default = "-"
    else:
        default = _code(str(p.default) if not isinstance(p.default, (bool, int, float)) else p.default)
    return f"| {names} | {value} | {default} | {_help(getattr(p, 'help', None))} |"


def cli_reference() -> str:
    """Every command of `draftport` (the live typer app), its usage, arguments and options."""
    from draftport.cli import app

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="draftport")
    out = [
        "```text",
        group.get_usage(root).removeprefix("Usage: "),
        "```",
        "",
        _help(group.help),
        "",
        "| option | value | default | description |",
        "|---|---|---|---|",
    ]
    out += [_param_row(p, root) for p in group.params]
    out += ["| `--help` | flag | - | Show the help and exit. |", ""]
    for name, cmd in group.commands.items():
        ctx = cmd.context_class(cmd, info_name=name, parent=root)
        doc = inspect.cleandoc(cmd.help or "").split("\n\n")
        out += [
            f"### `draftport {name}`",
            "",
            *[p for para in doc for p in (_help(para), "")],
            "```text",
            cmd.get_usage(ctx).removeprefix("Usage: "),
            "```",
            "",
            "| argument / option | value | default | description |",
            "|---|---|---|---|",
        ]
        out += [_param_row(p, ctx) for p in cmd.params]
        out += ["| `--help` | flag | - | Show the help and exit. |", ""]
    return "\n".join(out)


def kimi_estimate() -> str:
    """`draftport estimate --configfile configs/kimi-k2.5.yaml` as printed (the committed benchmarks)."""
    from draftport.plan import params
    from draftport.profile import estimate  # torch via data.storage: only this block needs it

    cwd = Path.cwd()
    try:  # the profile's relative paths (params.yaml, benchmark files) are the repository's
        os.chdir(ROOT)
        text = estimate.render(estimate.estimate(params.load(ROOT / "configs" / "kimi-k2.5.yaml")))
    finally:
        os.chdir(cwd)
    return "```text\n" + text + "\n```\n"


GENERATORS = {
    "steps": registry.table_markdown,
    "modules": module_table,
    "params": params_reference,
    "cli": cli_reference,
    "kimi_estimate": kimi_estimate,
}
# the files that hold generated blocks
FILES = (
    ROOT / "docs" / "architecture.md",
    ROOT / "docs" / "configuration.md",
    ROOT / "docs" / "cli.md",
    ROOT / "docs" / "estimate.md",
)
BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end: \2 -->)", re.S)


def render(text: str) -> str:
    def fill(m: re.Match) -> str:
        if m.group(2) not in GENERATORS:
            raise SystemExit(f"unknown generated block {m.group(2)!r} (known: {', '.join(GENERATORS)})")
        return m.group(1) + GENERATORS[m.group(2)]() + m.group(4)

    return BLOCK.sub(fill, text)


def rate_table() -> str:
    """src/draftport/profile/rates.json: the estimate's figures from benchmarks/results, shipped
    with the package (an installed draftport has no benchmarks/ folder)."""
    from draftport.profile import rates as train_rates

    return json.dumps(train_rates.packaged_table(), indent=1, default=str) + "\n"


def packaged_params() -> str:
    """src/draftport/plan/defaults.yaml: params.yaml as it ships with the package, the base an
    installed `draftport estimate` layers a profile on outside a checkout."""
    return (
        "# generated from params.yaml by tools/docgen.py (do not edit): the base of `draftport estimate`\n"
        "# where no params.yaml is at hand (an installed draftport)\n" + (ROOT / "params.yaml").read_text()
    )


# whole generated files: path -> what writes it
WHOLE = {
    ROOT / "src" / "draftport" / "profile" / "rates.json": rate_table,
    ROOT / "src" / "draftport" / "plan" / "defaults.yaml": packaged_params,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated block is out of date")
    a = ap.parse_args(argv)
    stale = []
    outputs = [(f, f.read_text(), render(f.read_text())) for f in FILES]
    outputs += [(f, f.read_text() if f.is_file() else "", make()) for f, make in WHOLE.items()]
    for f, text, new in outputs:
        if new == text:
            continue
        if a.check:
            stale.append(f.relative_to(ROOT))
        else:
            tmp = f.with_suffix(f.suffix + ".tmp")
            tmp.write_text(new)
            tmp.replace(f)
            print(f"wrote {f.relative_to(ROOT)}")
    if stale:
        print("out of date (run `python tools/docgen.py`): " + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
