"""The draft map file (vocab.safetensors: d2t, t2d, token counts): built from a target's own
answers, read back checked. The maps themselves (build, check, compare, remap) are draftport.model.vocab."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from draftport.errors import DraftportError
from draftport.model.vocab import build_maps, check_maps


def count_tokens(features, vocab_size: int) -> np.ndarray:
    """Frequency of each target id over assistant tokens (the tokens a drafter must propose)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(features)):
        s = features.sample(i)
        toks = s["tokens"][s["loss_mask"]].numpy()
        counts += np.bincount(toks, minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab(features_dir, out_path, *, draft_vocab_size: int, vocab_size: int) -> dict:
    """d2t/t2d from the target's own generations; written as one small safetensors file."""
    from draftport.data.shards import open_set
    from draftport.model.formats import save_safetensors

    fs = open_set(features_dir)  # the tokens are all it reads: a sequences folder (storage online) serves too
    counts = count_tokens(fs, vocab_size)
    d2t, t2d = build_maps(counts, draft_vocab_size)
    covered = counts[t2d].sum() / max(counts.sum(), 1)
    save_safetensors({"d2t": d2t, "t2d": t2d, "counts": counts}, out_path)  # mkdirs, temp + rename
    return {
        "draft_vocab_size": draft_vocab_size,
        "coverage": float(covered),
        "distinct_tokens_seen": int((counts > 0).sum()),
    }


def read_vocab(path, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) of a draft map file, checked before any use: a safetensors file holding both,
    maps that agree with each other and point inside the vocab (vocab_size, else t2d's length).
    A broken map would otherwise surface as an index error deep in training, or be blamed on
    a file written from it."""
    from draftport.model.formats import read_header, read_tensor_np

    path = Path(path)
    if not path.is_file():
        raise DraftportError(path, "missing (has the step that writes it run?)")
    table, _ = read_header(path)
    for name, dtypes in (("d2t", ("I64", "I32")), ("t2d", ("BOOL", "U8"))):
        t = table.get(name)
        if t is None:
            raise DraftportError(path, f"no {name} tensor in the draft map file")
        if t.dtype not in dtypes or len(t.shape) != 1:
            raise DraftportError(
                path, f"{name} must be a 1-D {' or '.join(dtypes)} tensor, got {t.dtype}{list(t.shape)}"
            )
    d2t = read_tensor_np(table["d2t"]).astype(np.int64)
    t2d = read_tensor_np(table["t2d"]).astype(bool)
    check_maps(d2t, t2d, vocab_size or t2d.shape[0], d2t.shape[0], where=path)
    return d2t, t2d


def cfg_d2t(folder) -> np.ndarray:
    from draftport.model.formats import inspect_drafter

    return inspect_drafter(folder).read_small("d2t")
