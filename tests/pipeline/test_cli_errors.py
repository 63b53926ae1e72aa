"""Bad input through the real CLI: exit status 2, one line on stderr naming file and problem,
no traceback, nothing written."""

import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from draftport.cli import app
from draftport.model.fixtures import frequency_maps, small_config, write_header_only_drafter


def good(folder):
    cfg = small_config()
    return write_header_only_drafter(folder, cfg, *frequency_maps(cfg))


def bad_truncated(folder):
    f = good(folder) / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    return f, "truncated"


def bad_garbage(folder):
    f = good(folder) / "model.safetensors"
    f.write_bytes(np.random.default_rng(0).bytes(10_000))
    return f, "not a safetensors file"


def bad_lying_header(folder):
    f = good(folder) / "model.safetensors"
    raw = f.read_bytes()
    # same byte length, so only the claim changes: fc [64, 192] -> [64, 191]
    f.write_bytes(raw.replace(b'"shape":[64,192]', b'"shape":[64,191]', 1))
    return f, "header lies about tensor 'fc.weight'"


def bad_d2t_length(folder):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    write_header_only_drafter(folder, cfg, d2t[:150], t2d)
    return folder / "model.safetensors", "tensor d2t has shape [150]"


def bad_d2t_range(folder):
    cfg = small_config()
    d2t, _ = frequency_maps(cfg)
    d2t = d2t.copy()
    d2t[-3:] += 5000
    write_header_only_drafter(folder, cfg, d2t, None)
    return folder / "model.safetensors", "outside the vocab of 1000 (3 slots out of range)"


def bad_t2d(folder):
    cfg = small_config()
    d2t, t2d = frequency_maps(cfg)
    t2d = t2d.copy()
    t2d[np.nonzero(t2d)[0][:5]] = False
    write_header_only_drafter(folder, cfg, d2t, t2d)
    return folder / "model.safetensors", "t2d disagrees with d2t"


def bad_config_no_hidden(folder):
    cfg = small_config()
    write_header_only_drafter(folder, cfg, *frequency_maps(cfg), config_patch={"hidden_size": None})
    return folder / "config.json", "config is missing hidden_size"


def bad_config_json(folder):
    good(folder)
    (folder / "config.json").write_text('{"hidden_size": 64,')
    return folder / "config.json", "not valid JSON"


def bad_q_proj(folder):
    cfg = small_config()
    write_header_only_drafter(folder, cfg, *frequency_maps(cfg), config_patch={"head_dim": 16})
    return folder / "model.safetensors", "num_attention_heads 4 x head_dim 16 = 64"


def bad_bin_folder(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(small_config().to_flat_dict()))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04pickle that must never be opened")
    return folder / "pytorch_model.bin", "pickle checkpoints are refused"


def bad_pt_file(folder):
    folder.mkdir(parents=True)
    f = folder / "drafter.pt"
    f.write_bytes(b"\x80\x04pickle")
    return f, "pickle checkpoints are refused"


def bad_missing_folder(folder):
    return folder, "no such drafter folder"


CASES = [
    bad_truncated,
    bad_garbage,
    bad_lying_header,
    bad_d2t_length,
    bad_d2t_range,
    bad_t2d,
    bad_config_no_hidden,
    bad_config_json,
    bad_q_proj,
    bad_bin_folder,
    bad_pt_file,
    bad_missing_folder,
]


def snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


def run_cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "draftport.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd
    )


def assert_one_line_error(res, where, problem):
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr
    assert res.stdout == ""
    assert res.stderr.endswith("\n") and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"draftport: error: {where}: "), res.stderr
    assert problem in res.stderr, res.stderr


# --json must fail the same way; a few cases suffice (each run is a fresh interpreter).
PAIRS = [(c, False) for c in CASES] + [(c, True) for c in (bad_garbage, bad_d2t_range, bad_q_proj)]


@pytest.mark.parametrize("make_bad,json_flag", PAIRS, ids=[c.__name__[4:] + ("-json" if j else "") for c, j in PAIRS])
def test_compare_bad_input_is_one_line(tmp_path, make_bad, json_flag):
    src = good(tmp_path / "src")
    bad = tmp_path / "dst"
    where, problem = make_bad(bad)
    target = where if make_bad is bad_pt_file else bad
    before = snapshot(tmp_path)
    res = run_cli("compare", src, target, *(["--json"] if json_flag else []), cwd=tmp_path)
    assert_one_line_error(res, where, problem)
    assert snapshot(tmp_path) == before  # nothing written, nothing touched


def test_bad_source_is_named_too(tmp_path):
    dst = good(tmp_path / "dst")
    where, problem = bad_garbage(tmp_path / "src")
    assert_one_line_error(run_cli("compare", tmp_path / "src", dst, cwd=tmp_path), where, problem)


def test_inspect_bad_input_is_one_line(tmp_path):
    where, problem = bad_truncated(tmp_path / "d")
    assert_one_line_error(run_cli("inspect", tmp_path / "d", cwd=tmp_path), where, problem)


def test_costmodel_bad_input_is_one_line(tmp_path):
    res = run_cli("costmodel", "--baseline-tok-s", "82", "--verify-ms", "30", "--accept-rates", "0.8,x", cwd=tmp_path)
    assert_one_line_error(res, "--accept-rates", "comma-separated numbers")
    res = run_cli("costmodel", "--baseline-tok-s", "82", "--verify-ms", "30", "--draft-ms", "2", cwd=tmp_path)
    assert (
        res.returncode == 2
        and res.stderr == "draftport: error: draft_ms needs k (the number of draft steps per cycle)\n"
    )


def test_compare_success_json_and_no_torch(tmp_path):
    a, b = good(tmp_path / "a"), good(tmp_path / "b")
    res = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "draftport.cli", "compare", a, b, "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["verdict"]["compatible_architecture"] is True and rep["vocab"]["identical"] is True
    imported = {line.split("|")[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")}
    assert "numpy" in imported  # the importtime listing really is there ...
    assert not {m for m in imported if m.split(".")[0] in ("torch", "transformers")}  # ... without torch


def test_human_tables_render(tmp_path):
    a, b = good(tmp_path / "a"), good(tmp_path / "b")
    res = run_cli("compare", a, b, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    for text in ("config", "weights", "vocab", "verdict: compatible architecture", "fc.weight", "vocab action"):
        assert text in res.stdout
    res = run_cli("inspect", a, cwd=tmp_path)
    assert res.returncode == 0 and "midlayer.self_attn.q_proj.weight" in res.stdout


def test_help_lists_each_command_with_its_summary_on_one_line(tmp_path):
    """`draftport --help` shows each command's first docstring paragraph joined: typer's rich mode
    would keep the docstring's line breaks there, ending lines mid-sentence. A wide terminal so
    that nothing wraps: each summary must stand whole on the command's line."""
    env = dict(os.environ, COLUMNS="400", TERMINAL_WIDTH="400")
    res = subprocess.run(
        [sys.executable, "-m", "draftport.cli", "--help"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    for info in app.registered_commands:
        name = info.name or info.callback.__name__.replace("_", "-")
        summary = " ".join(inspect.cleandoc(info.callback.__doc__).split("\n\n")[0].split())
        line = next((ln for ln in lines if ln.strip(" │").startswith(name + " ")), None)
        assert line is not None, f"{name} missing from --help:\n{res.stdout}"
        assert summary in line, f"{name}: {line!r}"
