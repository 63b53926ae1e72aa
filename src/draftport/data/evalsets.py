"""The named held-out sets (targets.eval_sets) read and checked before any compute: each set's
JSONL, its first n prompts, a non-empty "user" in every row, and no prompt that training sees.

draftport.plan.params.resolved_eval_sets gives the sets (the default one included); the
features_eval step and `draftport init --eval-set` read them here, so both refuse the same files
with the same one-line problems.
"""

from __future__ import annotations

from pathlib import Path

from draftport.data.features import read_samples
from draftport.errors import DraftportError
from draftport.plan.params import eval_set_label


def _line_of(path: Path, index: int) -> int:
    """The file's line number of its index-th non-blank line (read_samples skips blank lines)."""
    seen = -1
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            seen += bool(line.strip())
            if seen == index:
                return lineno
    raise IndexError(index)  # pragma: no cover - index comes from the same file's rows


def _read_set(i: int, s: dict) -> list[dict]:
    """Set i's first n rows (all when n is None or the file holds fewer), each with a non-empty user."""
    label = eval_set_label(i, s)
    if not s.get("prompts"):
        raise DraftportError(label, "no prompts file (targets.prompts_eval_old is null for the old target)")
    path = Path(s["prompts"])
    if not path.is_file():
        raise DraftportError(label, f'{path}: no such file (JSONL, one {{"user": ...}} per line)')
    try:
        rows = read_samples(path)
    except DraftportError as e:
        if e.where == str(path):  # the file as a whole (no samples): the set, then its file
            raise DraftportError(label, f"{path}: {e.problem}") from None
        raise DraftportError(e.where, f"{label}: {e.problem}") from None  # a line: file:line, then the set
    for j, rec in enumerate(rows):
        if not rec["user"].strip():
            raise DraftportError(f"{path}:{_line_of(path, j)}", f"{label}: an empty 'user' prompt")
    return rows[: s["n"]] if s.get("n") is not None else rows


def _train_prompts(train_prompts: str | Path | None) -> set[str]:
    """The training prompts' user texts (none when the file is not given or not there yet)."""
    if train_prompts is None or not Path(train_prompts).is_file():
        return set()
    return {rec["user"] for rec in read_samples(train_prompts)}


def read_eval_sets(sets: list[dict], train_prompts: str | Path | None) -> list[tuple[dict, list[dict]]]:
    """Each set with its rows: [(set, its first n rows)]. A missing file, a bad line, an empty
    prompt or a prompt that targets.prompts_train also holds is one DraftportError naming the set
    (`targets.eval_sets[i] (name)`) and, for a row, its file:line."""
    train = _train_prompts(train_prompts)
    out = []
    for i, s in enumerate(sets):
        rows = _read_set(i, s)
        shared = [j for j, rec in enumerate(rows) if rec["user"] in train]
        if shared:
            path = Path(s["prompts"])
            raise DraftportError(
                f"{path}:{_line_of(path, shared[0])}",
                f"{eval_set_label(i, s)}: {len(shared)} of its {len(rows)} prompts are also training prompts "
                f"({train_prompts}): a held-out set must be disjoint from training",
            )
        out.append((s, rows))
    return out
