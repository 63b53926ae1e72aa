"""Fetch and compare at the real scale: a pre-populated hub cache of header-only (sparse)
Kimi-K2-shaped drafters, fetched by huggingface_hub offline and compared from headers."""

import json
import os
import subprocess
import sys

import pytest

from draftport.data.fetch import fetch, publish_to_cache
from draftport.errors import DraftportError
from draftport.model.fixtures import frequency_maps, kimi_k2_config, swap_hot_ids, write_header_only_drafter
from draftport.outputs.compare import compare_drafters

SRC_REPO = "AQ-MedAI/Kimi-K2-Instruct-eagle3"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    cfg = kimi_k2_config()
    d2t, t2d = frequency_maps(cfg, seed=1)
    write_header_only_drafter(root / "k2", cfg, d2t, t2d, with_embed=False)
    d2t_new, t2d_new = swap_hot_ids(d2t, cfg.vocab_size, 126, seed=2)
    write_header_only_drafter(root / "k25", cfg, d2t_new, t2d_new, with_embed=True)
    (root / "k2" / "pytorch_model.bin").write_bytes(b"pickle would run code")  # must never be fetched
    commit = publish_to_cache(root / "k2", root / "cache", SRC_REPO)
    return root, commit


def test_fetch_resolves_branch_to_commit_offline(hub, tmp_path, monkeypatch):
    root, commit = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lock = fetch(
        SRC_REPO, tmp_path / "src", revision="main", cache_dir=root / "cache", lock_file=tmp_path / "source.lock.json"
    )
    assert lock["commit"] == commit and len(commit) == 40
    assert sorted(lock["files"]) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "src" / "pytorch_model.bin").exists()
    assert (tmp_path / "src" / "model.safetensors").stat().st_size > 2_000_000_000
    # the same revision with a changed file fails loudly
    cfg_blob = (
        root / "cache" / f"models--{SRC_REPO.replace('/', '--')}" / "snapshots" / commit / "config.json"
    ).resolve()
    original = cfg_blob.read_text()
    try:
        cfg_blob.write_text(
            original.replace('"rope_theta"', '"rope_theta_x"', 1) if '"rope_theta"' in original else original + " "
        )
        with pytest.raises(DraftportError, match="changed at the same revision"):
            fetch(
                SRC_REPO,
                tmp_path / "src2",
                revision="main",
                cache_dir=root / "cache",
                lock_file=tmp_path / "source.lock.json",
            )
        assert not (tmp_path / "src2").exists()
    finally:
        cfg_blob.write_text(original)


def test_unknown_revision_is_one_line_error(hub, tmp_path, monkeypatch):
    root, _ = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DraftportError, match="not in the hub cache"):
        fetch(SRC_REPO, tmp_path / "x", revision="v9", cache_dir=root / "cache")


def test_seed_table_from_fetched_checkpoints(hub, tmp_path, monkeypatch):
    root, _ = hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fetch(SRC_REPO, tmp_path / "src", revision="main", cache_dir=root / "cache")
    rep = compare_drafters(tmp_path / "src", root / "k25")
    rows = {r["name"]: r for r in rep["weights"]}
    assert rows["fc.weight"]["src_shape"] == [7168, 21504] and rows["fc.weight"]["status"] == "match"
    assert rows["lm_head.weight"]["dst_shape"] == [32000, 7168]
    assert rows["embed_tokens.weight"]["status"] == "missing_in_src"
    assert rows["t2d"]["src_dtype"] == "BOOL" and rows["d2t"]["src_dtype"] == "I64"
    assert all(r["status"] == "match" for n, r in rows.items() if n != "embed_tokens.weight")
    v = rep["vocab"]
    assert v["positions_differ"] > 10_000 and v["overlap"] == 32000 - 126
    assert rep["verdict"]["compatible_architecture"] is True


def test_compare_cli_on_fetched_k2_is_fast_enough_to_be_interactive(hub, tmp_path):
    """Not a timing assertion: the command must run on 7 GB of checkpoints without loading them."""
    root, _ = hub
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [sys.executable, "-m", "draftport.cli", "compare", str(root / "k2"), str(root / "k25"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["vocab"]["src_only"] == 126
