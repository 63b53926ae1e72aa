"""Draft vocab maps: build, validate, compare by overlap, remap lm_head rows by target id."""

import numpy as np
import pytest
import torch

from draftport.errors import DraftportError
from draftport.model.fixtures import swap_hot_ids, zipf_counts
from draftport.model.vocab import (
    build_maps,
    check_maps,
    compare_maps,
    d2t_format,
    hot_ids,
    remap_lm_head,
    t2d_consistent,
)

V, N = 163840, 32000  # Kimi-K2 vocab and draft vocab


def test_build_maps_is_top_n_sorted_by_id_with_delta():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_maps(counts, 4)
    # top 4 by count: ids 2, 3 (9), 5 (7), 0 (5) -> sorted by id
    assert hot_ids(d2t).tolist() == [0, 2, 3, 5]
    assert d2t.tolist() == [0, 1, 1, 2]  # id_i - i
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert np.nonzero(t2d)[0].tolist() == [0, 2, 3, 5]
    # ties go to the lower id, so the map is deterministic
    d2t, _ = build_maps(np.array([1, 3, 3, 3]), 2)
    assert hot_ids(d2t).tolist() == [1, 2]
    with pytest.raises(DraftportError):
        build_maps(counts, 9)


def test_check_maps_catches_what_breaks_an_engine():
    d2t, t2d = build_maps(zipf_counts(1000, 1), 200)
    assert check_maps(d2t, t2d, 1000, 200)["sorted"]
    with pytest.raises(DraftportError, match=r"expected \[200\]"):
        check_maps(d2t[:-1], t2d, 1000, 200)
    far = d2t.copy()
    far[-1] += 5000
    with pytest.raises(DraftportError, match="outside the vocab of 1000"):
        check_maps(far, None, 1000, 200)
    dup = d2t.copy()
    dup[1] = dup[0] - 1  # slot 1 -> same id as slot 0
    with pytest.raises(DraftportError, match="same target id"):
        check_maps(dup, None, 1000, 200)
    off = t2d.copy()
    off[np.nonzero(~t2d)[0][0]] = True
    with pytest.raises(DraftportError, match="t2d disagrees with d2t"):
        check_maps(d2t, off, 1000, 200)
    assert not t2d_consistent(d2t, off)


def test_d2t_format_delta_absolute_invalid():
    d2t, t2d = build_maps(zipf_counts(V, 0), N)
    ids = hot_ids(d2t)
    assert d2t_format(d2t, V) == "delta"
    assert d2t_format(ids, V) == "absolute"  # ids stored directly
    assert d2t_format(ids + V, V) == "invalid"
    # a small map without adjacent ids looks absolute to the heuristic; t2d settles it
    sparse_ids = np.array([1, 4, 9, 20])
    delta = sparse_ids - np.arange(4)
    t2d_small = np.zeros(30, dtype=bool)
    t2d_small[sparse_ids] = True
    assert d2t_format(delta, 30) == "absolute"
    assert d2t_format(delta, 30, t2d_small) == "delta"
    assert d2t_format(sparse_ids, 30, t2d_small) == "absolute"


def test_sorted_maps_differing_by_a_few_hundred_tokens_differ_almost_everywhere_by_position():
    d2t, _ = build_maps(zipf_counts(V, 0), N)
    d2t_b, t2d_b = swap_hot_ids(d2t, V, 250, seed=1)
    assert t2d_consistent(d2t_b, t2d_b)
    cm = compare_maps(d2t, d2t_b)
    assert cm["src_only"] == cm["dst_only"] == 250
    assert cm["overlap"] == N - 250
    assert cm["positions_differ"] > 10_000  # tens of thousands of slots "differ" ...
    assert cm["overlap_frac_of_src"] > 0.95 and cm["jaccard"] > 0.95  # ... for 250 swapped tokens
    assert cm["positions_artifact_of_sorting"] and cm["sorted"]


def test_compare_maps_identical_and_different_sizes():
    d2t, _ = build_maps(zipf_counts(5000, 3), 1000)
    cm = compare_maps(d2t, d2t)
    assert cm["positions_differ"] == 0 and cm["jaccard"] == 1.0 and cm["first_differing_slot"] is None
    small, _ = build_maps(zipf_counts(5000, 3), 800)
    cm = compare_maps(d2t, small)
    assert cm["src_only"] == 200 and cm["dst_only"] == 0 and cm["overlap"] == 800


def _maps(ids):
    ids = np.sort(np.asarray(ids))
    return ids - np.arange(ids.size)


def test_remap_lm_head_moves_rows_by_target_id():
    vocab, H = 50, 8
    src_ids = [1, 3, 5, 7, 9, 11]
    dst_ids = [0, 3, 5, 6, 9, 11, 13]  # lost 1 and 7, gained 0, 6, 13
    src_d2t, dst_d2t = _maps(src_ids), _maps(dst_ids)
    head = torch.arange(len(src_ids) * H, dtype=torch.float32).view(len(src_ids), H) + 1.0
    target_head = torch.randn(vocab, H)
    out, d2t, stats = remap_lm_head(head, src_d2t, dst_d2t, target_head)
    assert out.shape == (7, H)
    assert np.array_equal(d2t, dst_d2t)
    assert stats == {"policy": "remap", "kept_rows": 4, "new_rows": 3, "init": "target_lm_head"}
    for j, tid in enumerate(dst_ids):
        if tid in src_ids:  # the trained row for this target id, wherever its slot went
            torch.testing.assert_close(out[j], head[src_ids.index(tid)])
        else:  # the target's own row for that id, rescaled to the drafter's row norm
            cos = torch.nn.functional.cosine_similarity(out[j], target_head[tid], dim=0)
            assert cos > 0.9999
    new_norm = out[[0, 3, 6]].norm(dim=1).mean()
    torch.testing.assert_close(new_norm, head.norm(dim=1).mean(), rtol=1e-4, atol=1e-4)
    assert not out.requires_grad


def test_remap_without_init_rows_uses_mean_row_and_keep_policy_changes_nothing():
    src_d2t, dst_d2t = _maps([1, 2, 3]), _maps([2, 3, 4])
    head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    out, _, stats = remap_lm_head(head, src_d2t, dst_d2t)
    torch.testing.assert_close(out[:2], head[1:])
    torch.testing.assert_close(out[2], head.mean(0))
    assert stats["init"] == "mean_row"
    kept, d2t, stats = remap_lm_head(head, src_d2t, dst_d2t, policy="keep")
    assert kept is head and np.array_equal(d2t, src_d2t) and stats["new_rows"] == 0
    with pytest.raises(DraftportError, match="unknown vocab policy"):
        remap_lm_head(head, src_d2t, dst_d2t, policy="rebuild")
