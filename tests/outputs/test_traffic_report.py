"""The report's traffic section from a real decision (synthetic counts through decide): the table
per set, the charts and traffic.csv; nothing from a decision without a traffic block."""

import csv

import pytest

from draftport.outputs.traffic_report import traffic_section
from tests.evaluation.test_traffic import EDGES, LIMIT, run, sets_of


def test_a_table_and_charts_per_set_and_bucket(tmp_path):
    d = run(sets=sets_of(0.2), bucket_edges=EDGES, context_limit=LIMIT)
    parts = traffic_section(d, tmp_path)
    html = "".join(x for x in parts if isinstance(x, str))
    for name in ("sets.png", "curves_by_set.png", "buckets.png"):
        assert (tmp_path / name) in parts and (tmp_path / name).stat().st_size > 0
    assert "chat (80%, 150 prompts)" in html and "code (20%, 50 prompts)" in html and "traffic-weighted" in html
    assert "512-2K (past the source&#x27;s limit)" in html and "2K+" in html and "not measured" in html
    rows = list(csv.DictReader((tmp_path / "traffic.csv").open()))
    p1 = d["traffic"]["phases"]["phase1"]
    code = next(r for r in rows if r["phase"] == "phase1" and r["set"] == "code")
    assert float(code["accept_length"]) == pytest.approx(p1["sets"]["code"]["accept_length"], abs=1e-3)
    assert {r["set"] for r in rows} == {"chat", "code", "weighted"}


def test_no_traffic_block_no_section_and_no_stale_files(tmp_path):
    (tmp_path / "sets.png").write_bytes(b"stale")
    assert traffic_section(run(), tmp_path) == [] and traffic_section(None, tmp_path) == []
    assert not (tmp_path / "sets.png").exists()
