"""targets.eval_sets' files read before any compute (draftport.data.evalsets): each set's first n
prompts, and one line naming the set and file:line for a missing file, a bad row or a prompt that
training holds."""

import json
from pathlib import Path

import pytest

from draftport.data.evalsets import read_eval_sets
from draftport.errors import DraftportError


def jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def files(tmp_path):
    train = jsonl(tmp_path / "train.jsonl", [{"user": f"q{i}"} for i in range(10)])
    chat = jsonl(tmp_path / "chat.jsonl", [{"user": f"c{i}"} for i in range(5)])
    code = jsonl(tmp_path / "code.jsonl", [{"user": f"k{i}", "assistant": "x"} for i in range(3)])
    return (
        tmp_path,
        train,
        [
            {"name": "chat", "prompts": chat, "share": 0.7, "n": 2},
            {"name": "code", "prompts": code, "share": 0.3, "n": 100},
        ],
    )


def problem(sets, train) -> str:
    with pytest.raises(DraftportError) as e:
        read_eval_sets(sets, train)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_each_set_gives_its_first_n_prompts(files):
    _, train, sets = files
    got = read_eval_sets(sets, train)
    assert [s for s, _ in got] == sets
    assert [[r["user"] for r in rows] for _, rows in got] == [["c0", "c1"], ["k0", "k1", "k2"]]
    # n None: every prompt of the file; no training file yet: nothing to be disjoint from
    assert len(read_eval_sets([{**sets[0], "n": None}], None)[0][1]) == 5


def test_a_missing_file_names_the_set(files):
    tmp, train, sets = files
    sets[1]["prompts"] = str(tmp / "nope.jsonl")
    assert (
        problem(sets, train)
        == f'targets.eval_sets[1] (code): {tmp}/nope.jsonl: no such file (JSONL, one {{"user": ...}} per line)'
    )
    assert problem([{**sets[0], "prompts": None}], train).startswith("targets.eval_sets[0] (chat): no prompts file")


def test_a_bad_row_names_its_file_line_and_the_set(files):
    tmp, train, sets = files
    bad = jsonl(tmp / "bad.jsonl", [{"user": "a"}, "", {"prompt": "b"}])  # line 3: the blank line counts
    msg = problem([sets[0], {**sets[1], "prompts": bad}], train)
    assert msg == f"{bad}:3: targets.eval_sets[1] (code): each sample needs a string 'user' field"
    blank = jsonl(tmp / "blank.jsonl", [{"user": "a"}, "", "", {"user": "  "}])
    assert problem([{**sets[0], "prompts": blank}], train) == (
        f"{blank}:4: targets.eval_sets[0] (chat): an empty 'user' prompt"
    )
    empty = jsonl(tmp / "empty.jsonl", [])
    assert problem([{**sets[0], "prompts": empty}], train).startswith(
        f"targets.eval_sets[0] (chat): {empty}: no samples"
    )


def test_a_prompt_training_sees_is_refused(files):
    tmp, train, sets = files
    jsonl(Path(sets[1]["prompts"]), [{"user": "k0"}, {"user": "q4"}, {"user": "q7"}])
    msg = problem(sets, train)
    assert msg.startswith(f"{sets[1]['prompts']}:2: targets.eval_sets[1] (code): 2 of its 3 prompts are also training")
    # only the prompts the set takes count: n = 1 keeps k0 alone
    assert read_eval_sets([{**sets[1], "n": 1}], train)[0][1] == [{"user": "k0"}]
