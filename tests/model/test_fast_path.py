"""The fast path (draftport.model.fast) computes the reference's function: the fused attention,
unroll and loss against the reference, each lever of FastPath on against off (the same terms
and gradients in fp64), the compiled regions against the eager ones, and FastPath itself."""

import dataclasses
import importlib.util
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from toys import make_features, make_samples, toy_batch, toy_cfg, toy_drafter

from draftport.data.packing import pack
from draftport.data.shards import Batch
from draftport.model.drafter import Attention
from draftport.model.fast import attention as fast_attention
from draftport.model.fast import linear as fast_linear
from draftport.model.fast import loss as fast_loss
from draftport.model.fast import unroll as fast_unroll
from draftport.model.fast.attention import ttt_attention
from draftport.model.fast.path import FastPath
from draftport.training import loop
from draftport.training.loop import TrainConfig, train, train_step
from draftport.training.ttt import combine, ttt_terms

# the loss and target side in chunks of 5 rows: several chunks per row at the toy's lengths
CHUNK5 = FastPath(target_chunk=5, loss_chunk=5)


# ---- FastPath ----------------------------------------------------------------------------------
def test_fast_path_takes_known_names_and_picks_each_variant():
    """Its names are checked; packed_attention auto runs varlen under every attention, and
    segments is refused under cudnn (cuDNN rejects a one-token segment: s_q = s_kv = 1 on an
    H100); it is frozen; kernel() hands back the function itself, or one compiled version per
    (function, tuning) when the path compiles."""
    for attention in ("cudnn", "flash", "fa4"):
        assert FastPath(attention=attention).packed == "varlen"
    assert FastPath(attention="cudnn", packed_attention="varlen").packed == "varlen"
    assert FastPath(packed_attention="segments").packed == "segments"
    with pytest.raises(ValueError, match="one-token segments"):
        FastPath(attention="cudnn", packed_attention="segments")
    with pytest.raises(ValueError, match="auto, varlen or segments"):
        FastPath(packed_attention="ragged")
    with pytest.raises(ValueError, match="flash, cudnn or fa4"):
        FastPath(attention="math")
    with pytest.raises(dataclasses.FrozenInstanceError):
        FastPath().attention = "cudnn"
    fn = fast_linear.swiglu
    assert FastPath().kernel(fn) is fn
    tuned = FastPath(compile=True).kernel(fn)
    assert tuned is not fn and tuned is FastPath(compile=True, embed_once=False).kernel(fn)
    assert FastPath(compile=True, compile_tuning=False).kernel(fn) not in (fn, tuned)


def test_fa4_names_its_package_where_it_is_missing():
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    fast_attention._fa4.cache_clear()
    with pytest.raises(RuntimeError, match=r"^attention backend fa4: .*pip install --pre flash-attn-4"):
        fast_attention._fa4()


# ---- fused against the reference -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_diag", [0, 1, 3])
def test_fused_attention_matches_reference(dtype, n_diag):
    g = torch.Generator().manual_seed(n_diag)
    B, h, T, d = 2, 3, 17, 16

    def r():
        return torch.randn(B, h, T, d, dtype=dtype, generator=g).requires_grad_(True)

    q, ks, vs = r(), [r() for _ in range(n_diag + 1)], [r() for _ in range(n_diag + 1)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    bias = torch.zeros(1, 1, T, T, dtype=dtype).masked_fill(~causal, float("-inf"))

    class Cfg:
        head_dim = d

    ref = Attention.attend_core(Cfg(), q, ks, vs, bias)
    fast = ttt_attention(q, ks, vs, 1 / math.sqrt(d))
    go = torch.randn(ref.shape, dtype=dtype, generator=g)
    gr = torch.autograd.grad((ref * go).sum(), [q, *ks, *vs])
    gf = torch.autograd.grad((fast * go).sum(), [q, *ks, *vs])
    assert torch.allclose(fast, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(gf, gr):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("train_head", [False, True])
def test_fused_ttt_terms_match_reference(train_head):
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=3)
    d.lm_head.weight.requires_grad_(train_head)
    batch = toy_batch(cfg, B=2, T=12)  # row 1 right-padded by 3
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    out = []
    for fast in (None, CHUNK5):
        d.zero_grad(set_to_none=True)
        terms = ttt_terms(d, batch, head, 4, fast)
        loss, stats = combine(terms, 0.8)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
        out.append((float(loss.detach()), stats, grads))
    (l0, s0, g0), (l1, s1, g1) = out
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    assert s0.keys() == s1.keys() and all(abs(s0[k] - s1[k]) < 1e-5 * max(1, abs(s0[k])) for k in s0)
    assert g0.keys() == g1.keys() and ("lm_head.weight" in g0) == train_head
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-4), k


def test_fused_path_refuses_left_padding():
    cfg = toy_cfg()
    d = toy_drafter(cfg)
    batch = toy_batch(cfg, B=2, T=12)
    batch.valid[0, :2] = False
    with pytest.raises(RuntimeError):
        ttt_terms(d, batch, torch.randn(cfg.vocab_size, cfg.hidden_size), 3, FastPath())


def test_train_fused_impl_follows_reference(tmp_path):
    fs, head = make_features(tmp_path)
    hist = {}
    for impl in ("reference", "fused"):
        cfg = TrainConfig(steps=4, batch_size=4, lr=3e-3, warmup_steps=1, checkpoint_every=100, log_every=1, impl=impl)
        hist[impl] = train(toy_drafter(seed=5), fs, head, tmp_path / impl, cfg, progress=False)["history"]
    for a, b in zip(hist["reference"], hist["fused"]):
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"])), (a, b)


def test_captured_target_argmax_needs_only_the_draft_rows_of_the_head():
    cfg = toy_cfg()
    d = toy_drafter(cfg, seed=4)
    batch = toy_batch(cfg, B=2, T=12)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    ref, _ = combine(ttt_terms(d, batch, head, 3), 0.8)
    batch.target_arg = (batch.final @ head.t()).argmax(-1)  # as a capture would store it
    rows = head[d.hot_ids]  # draft rows only, slot order
    fused, _ = combine(ttt_terms(d, batch, rows, 3, FastPath()), 0.8)
    assert abs(float(ref.detach()) - float(fused.detach())) < 1e-5 * abs(float(ref.detach()))


# ---- each lever on against off (fp64) ----------------------------------------------------------
def _train_steps(d, batch, head, fast, n=3):
    """n fast train steps -> (losses, the first step's gradients, the parameters after n)."""
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses, grads = [], None
    for _ in range(n):  # several steps: the in-place sums restart at each step
        loss, *_ = train_step(d, batch, head, opt, params, TrainConfig(ttt_steps=4), fast=fast)
        losses.append(float(loss.detach()))
        if grads is None:
            grads = {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}
    return losses, grads, [p.detach().clone() for p in params]


def _fp64_problem(cfg, packed: bool, seed: int):
    """A target head and a batch in fp64: two padded rows, or six samples packed into rows of 14."""
    head = torch.randn(
        cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    if packed:
        return head, pack(make_samples(cfg, (9, 5, 12, 3, 7, 2)), row_len=14, dtype=torch.float64)[0]
    b = toy_batch(cfg, B=2, T=12)
    return head, Batch(b.aux.double(), b.final.double(), b.tokens, b.loss_mask, b.valid)


def _fp64_terms_and_grads(cfg, batch, head, steps, train_head, fast):
    """One fast TTT loss and backward of a fresh fp64 toy drafter -> (loss, stats, gradients)."""
    d = toy_drafter(cfg, seed=7).double()
    d.lm_head.weight.requires_grad_(train_head)
    d.zero_grad(set_to_none=True)
    loss, stats = combine(ttt_terms(d, batch, head, steps, fast), 0.8)
    loss.backward()
    return float(loss), stats, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}


def _assert_same_fp64(out, train_head, stat_key):
    """The two sides of a lever: the same loss, stats (they pass through fp32) and gradients."""
    (l0, s0, g0), (l1, s1, g1) = out
    assert l0 == pytest.approx(l1, rel=1e-12) and l0 > 0
    assert s0 == pytest.approx(s1, rel=1e-6) and s0[stat_key] > 0
    assert g0.keys() == g1.keys() and ("lm_head.weight" in g0) == train_head
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-12, rtol=1e-9), k


def _addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kw):
    """FlopCounterMode's count for addmm_ (the input gradients summed inside their GEMMs; it
    counts no in-place GEMM by itself)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_embedding_half_once_per_unroll_matches_every_step(accumulate, packed):
    """embed_once (the embedding half of q/k/v as one table per unroll, each step a slice of it)
    gives the losses, gradients and updates of the 2H-wide GEMMs at every step (fp64), padded
    and packed (rows past a sample's end fed token 0), gradients summed in place or not."""
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=8)
    out = []
    for once in (False, True):
        d = toy_drafter(cfg, seed=6).double()
        out.append(_train_steps(d, batch, head, FastPath(embed_once=once, accumulate_wgrad=accumulate)))
    (l0, g0, p0), (l1, g1, p1) = out
    assert l0 == pytest.approx(l1, rel=1e-10)
    assert g0.keys() == g1.keys() and "midlayer.input_layernorm.weight" in g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-12, rtol=1e-9), k
    for a, b in zip(p0, p1):
        assert torch.allclose(a, b, atol=1e-6)  # AdamW divides by sqrt(v): rounding grows


def test_embedding_half_once_skips_exactly_its_repeated_gemms():
    """The FLOPs saved are the embedding half's forward, input grad and weight grad at every
    step but one (the table has T-1+steps rows instead of steps x T), counted by torch's
    FlopCounterMode over forward and backward."""
    cfg = toy_cfg()
    b = toy_batch(cfg, B=2, T=12)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    flops = {}
    for once in (False, True):
        d = toy_drafter(cfg, seed=6)
        fast = CHUNK5.replace(embed_once=once, skip_dead_rows=False)  # every row at every step: this lever alone
        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_inplace}) as fc:
            loss, _ = combine(ttt_terms(d, b, head, 4, fast), 0.8)
            loss.backward()
        flops[once] = fc.get_total_flops()
    B, T, S, H = 2, 12, 4, cfg.hidden_size
    n_out = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    saved = 3 * 2 * H * n_out * B * (S * T - (T - 1 + S))  # fwd, dgrad, wgrad of the half
    assert flops[False] - flops[True] == saved


@pytest.fixture
def step_rows(monkeypatch):
    """Every fast step's (rows it ran, the batch's (B, T) or None), in call order."""
    ran = []
    step = fast_unroll.step

    def record(d, path, tok, h, *args, **kw):
        ran.append((h.shape[0] * h.shape[1], kw.get("shape")))
        return step(d, path, tok, h, *args, **kw)

    monkeypatch.setattr(fast_unroll, "step", record)
    return ran


def test_steps_on_live_rows_skip_exactly_the_dropped_rows_gemms(step_rows):
    """skip_dead_rows saves, at each step j >= 1, the midlayer's GEMMs (q/k/v's hidden half, o,
    gate/up, down: forward, input grad and weight grad) over the rows it dropped, and nothing
    else (the attention and the lm_head run as before), counted by FlopCounterMode as the
    embedding-half test counts."""
    cfg = toy_cfg()
    b = toy_batch(cfg, B=2, T=12)
    b.loss_mask[:, :3] = False  # a prompt
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    flops, rows = {}, {}
    for on in (False, True):
        step_rows.clear()
        d = toy_drafter(cfg, seed=6)
        with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_inplace}) as fc:
            loss, _ = combine(ttt_terms(d, b, head, 4, CHUNK5.replace(skip_dead_rows=on)), 0.8)
            loss.backward()
        flops[on], rows[on] = fc.get_total_flops(), [n for n, _ in step_rows]
    H, I = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    n_out = q + 2 * cfg.num_key_value_heads * cfg.head_dim
    per_row = 3 * 2 * (H * n_out + q * H + 3 * H * I)  # fwd, dgrad, wgrad
    dropped = sum(n0 - n1 for n0, n1 in zip(rows[False][1:], rows[True][1:]))
    assert rows[False] == [24] * 4 and dropped > 0, rows
    assert flops[False] - flops[True] == dropped * per_row


@pytest.mark.parametrize("fill", [False, True])
def test_shifted_slices_sum_their_gradients_as_autograd_would(fill):
    """shifted_slices: the slices y[:, j:j+T] (and the last row) of the embedding half's table,
    their gradients summed in one pass, give autograd's gradient of plain slicing (fp64)."""
    B, T, S, n = 2, 9, 4, 5
    g = torch.Generator().manual_seed(3)
    y0 = torch.randn(B, T - 1 + S, n, generator=g, dtype=torch.float64)
    ws = [torch.randn(B, T, n, generator=g, dtype=torch.float64) for _ in range(S)]
    wf = torch.randn(B, 1, n, generator=g, dtype=torch.float64)
    grads = []
    for fused in (False, True):
        y = y0.clone().requires_grad_(True)
        parts = (
            list(fast_linear.shifted_slices(y, T, S, fill))
            if fused
            else [y[:, j : j + T] for j in range(S)] + ([y[:, -1:]] if fill else [])
        )
        assert all(torch.equal(p, y0[:, j : j + T]) for j, p in enumerate(parts[:S]))
        loss = sum((p * w).sum() for p, w in zip(parts, ws)) + ((parts[S] * wf).sum() if fill else 0)
        loss.backward()
        grads.append(y.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.slow
def test_compiled_shift_sum_equals_eager():
    """The compiled one-pass sum (the GPU path's) equals the eager function, in bf16 too."""
    fn = torch.compile(fast_linear.shift_sum, dynamic=None)
    g = torch.Generator().manual_seed(4)
    for dt in (torch.float32, torch.bfloat16):
        for T in (10, 13):  # a second length: the symbolic-length graph
            gs = [torch.randn(2, T, 6, generator=g).to(dt) for _ in range(4)]
            fg = torch.randn(2, 1, 6, generator=g).to(dt)
            for f in (None, fg):
                want, got = fast_linear.shift_sum(gs, f), fn(gs, f)
                assert got.dtype == dt and got.shape == (2, T + 3, 6)
                assert torch.allclose(got.float(), want.float(), rtol=1e-2 if dt == torch.bfloat16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_keys_gradients_summed_across_steps_equal_autograds_sums(packed):
    """kv_grad_sum: the keys' and values' gradients summed in one accumulator per unroll (each
    step's attention the last reader of its own keys) give autograd's gradients (fp64, padded
    and packed rows), and a backward pass that stops before step 0 (autograd.grad of a later
    step's output) leaves nothing behind for the next one."""
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=4)
    out = []
    for on in (False, True):
        d = toy_drafter(cfg, seed=5).double()
        d.zero_grad(set_to_none=True)
        terms = ttt_terms(d, batch, head, 5, CHUNK5.replace(kv_grad_sum=on))
        loss, _ = combine(terms, 0.8)
        # a partial pass first: the gradient of the last step's loss w.r.t. o_proj's weight
        # stops before reaching step 0's attention's backward
        part = torch.autograd.grad(terms[-1][0], [d.midlayer.self_attn.o_proj.weight], retain_graph=True)[0]
        loss.backward()
        out.append((part, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}))
    (p0, g0), (p1, g1) = out
    assert torch.allclose(p0, p1, atol=1e-12, rtol=1e-9)
    assert g0.keys() == g1.keys() and "midlayer.self_attn.k_proj.weight" in g0
    for k in g0:
        assert torch.allclose(g0[k], g1[k], atol=1e-12, rtol=1e-9), k


def test_swiglu_gradient_kernel_hands_back_the_forward_product():
    """swiglu_grads_act: the down projection's weight gradient reads silu(g) * u from the kernel
    that computes dg and du; it is bitwise the product the forward computed (swiglu), and dg, du
    are swiglu_grads' (bf16, as on the GPU path)."""
    g = torch.Generator().manual_seed(0)
    da, gg, u = (torch.randn(3, 5, 40, generator=g).to(torch.bfloat16) for _ in range(3))
    dg, du, act = fast_linear.swiglu_grads_act(da, gg, u)
    assert torch.equal(act, fast_linear.swiglu(gg, u))
    dg2, du2 = fast_linear.swiglu_grads(da, gg, u)
    assert torch.equal(dg, dg2) and torch.equal(du, du2)
    ref_g, ref_u = gg.double().requires_grad_(), u.double().requires_grad_()
    (torch.nn.functional.silu(ref_g) * ref_u * da.double()).sum().backward()
    assert torch.allclose(dg.double(), ref_g.grad, rtol=2e-2, atol=1e-2)
    assert torch.allclose(du.double(), ref_u.grad, rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("train_head,accumulate", [(False, False), (True, False), (True, True)])
def test_skipping_uncounted_rows_gives_every_row_s_terms_and_gradients(packed, train_head, accumulate, monkeypatch):
    """skip_uncounted: the per-step lm_head and soft-CE on the rows the loss counts only give
    the losses, stats and gradients of every row's (fp64; padded rows with a prompt, packed
    samples; lm_head frozen or trained, summed in place or returned). The path each side ran is
    counted: off, none took the counted rows; on, every step did."""
    ran = []
    counted = fast_loss._step_loss_counted

    def count(xn, w, t_prob, ok, idx, j, *rest):
        ran.append((j, int(idx.numel()), int(ok.sum())))
        return counted(xn, w, t_prob, ok, idx, j, *rest)

    monkeypatch.setattr(fast_loss, "_step_loss_counted", count)
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=11)
    if not packed:
        batch.loss_mask[:, :4] = False  # a prompt
    out = []
    for on in (False, True):
        fast = CHUNK5.replace(skip_uncounted=on, accumulate_wgrad=accumulate)
        out.append(_fp64_terms_and_grads(cfg, batch, head, 5, train_head, fast))
        if not on:
            assert ran == []
    rows = batch.tokens.numel()
    assert [j for j, _, _ in ran] == list(range(5))
    for j, n_idx, n_ok in ran:
        assert n_idx == max(n_ok, 1) and n_ok <= (1 - fast_loss.SKIP_MIN) * rows, (j, n_idx, n_ok)
    _assert_same_fp64(out, train_head, "n_0")


def test_counted_rows_leave_dense_steps_alone_and_keep_a_row_for_empty_ones():
    """count_rows: a step whose uncounted rows are fewer than SKIP_MIN runs every row (None);
    one with none counted runs row 0 (at weight 0); otherwise the counted rows, in order."""
    full = torch.ones(2, 32, dtype=torch.bool)
    few_off = full.clone()
    few_off[0, :3] = False  # 3 of 64 < 64 / 16
    half = full.clone()
    half[:, 16:] = False
    none = torch.zeros(2, 32, dtype=torch.bool)
    idx = fast_loss.count_rows([full, few_off, half, none]).rows_to_run()
    assert idx[0] is None and idx[1] is None
    assert idx[2].tolist() == list(range(16)) + list(range(32, 48))
    assert idx[3].tolist() == [0]
    assert fast_loss.count_rows([]) is None


def test_host_loss_share_spares_the_count_when_few_rows_are_out(monkeypatch):
    """Batch.to() reads the share of loss rows on the host; when fewer than SKIP_MIN of the rows
    are out of the loss, the fast loss neither counts the rows on the device nor waits for them
    (every row runs); with a prompt it counts and skips; a batch without the share counts."""
    cfg = toy_cfg()
    head, b = _fp64_problem(cfg, False, seed=12)
    full = b.to("cpu")
    assert full.loss_share == pytest.approx(float((b.loss_mask & b.valid).sum()) / b.loss_mask.numel())
    calls = []
    real = fast_loss.count_rows
    monkeypatch.setattr(fast_loss, "count_rows", lambda oks, fixed=False: calls.append(len(oks)) or real(oks, fixed))
    d = toy_drafter(cfg, seed=7).double()
    for loss_share, counted in ((1.0, False), (0.5, True), (None, True)):
        calls.clear()
        full.loss_share = loss_share
        combine(ttt_terms(d, full, head, 3, CHUNK5), 0.8)
        assert bool(calls) == counted, loss_share
    assert b.to("cpu").host_loss_share() == b.to("cpu").loss_share


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("train_head,accumulate", [(False, False), (True, False), (True, True)])
def test_steps_on_the_rows_later_steps_score_give_every_row_s_terms_and_gradients(
    packed, train_head, accumulate, step_rows
):
    """skip_dead_rows: TTT steps >= 1 running their GEMMs on the rows a later step scores only
    give the losses, stats and gradients of every row's (fp64; two padded rows with a prompt,
    or six samples packed into three rows; lm_head frozen or trained, summed in place or
    returned). The rows each step ran are recorded: off, every step every row; on, step 0 every
    row, then fewer, never more than the step before, and never fewer than the step scores."""
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, packed, seed=11)
    if not packed:
        batch.loss_mask[:, :4] = False  # a prompt
    rows = batch.tokens.numel()
    out, runs = [], {}
    for on in (False, True):
        step_rows.clear()
        fast = CHUNK5.replace(skip_dead_rows=on, accumulate_wgrad=accumulate)
        out.append(_fp64_terms_and_grads(cfg, batch, head, 5, train_head, fast))
        runs[on] = [n for n, _ in step_rows]
    assert runs[False] == [rows] * 5
    on = runs[True]
    assert on[0] == rows and on[-1] < rows and on == sorted(on, reverse=True), on
    (_, stats, _) = out[1]
    for j in range(5):
        assert on[j] >= stats[f"n_{j}"] > 0, (on, stats)
    _assert_same_fp64(out, train_head, "n_0")


def test_live_rows_are_nested_prefixes_rounded_up_and_spare_dense_batches():
    """LiveRows: rows ordered by the last step that scores them (latest first, ties in row
    order), step j's rows a prefix of step j-1's, counts rounded up to the multiple (at least one
    multiple), None where too few rows could go; live_rows counts nothing for a batch whose
    host-side share leaves fewer than SKIP_MIN of the rows out, or for one step."""
    N = 32
    oks = [torch.zeros(1, N, dtype=torch.bool) for _ in range(4)]
    oks[0][0, :] = True  # step 0 scores every row
    oks[1][0, 4:30] = True
    oks[2][0, 8:20] = True
    oks[3][0, 10:12] = True
    oks[2][0, 1] = True  # row 1: last scored at step 2
    live = fast_loss.LiveRows(oks, multiple=1)
    assert live.order.tolist() == (
        [10, 11]
        + [1, 8, 9]
        + list(range(12, 20))  # last scored at 3, 2
        + [4, 5, 6, 7]
        + list(range(20, 30))
        + [0, 2, 3, 30, 31]
    )  # at 1, 0
    assert live.rows(1) is not None and live.rows(1).numel() == 27  # 4..29 and row 1
    r1, r2, r3 = live.rows(1), live.rows(2), live.rows(3)
    assert torch.equal(r2, r1[: r2.numel()]) and torch.equal(r3, r2[: r3.numel()])
    assert sorted(r2.tolist()) == [1] + list(range(8, 20)) and sorted(r3.tolist()) == [10, 11]
    assert fast_loss.LiveRows(oks, multiple=8).rows(3).numel() == 8  # 2 rows, rounded up to 8
    assert fast_loss.LiveRows(oks, multiple=8).rows(1) is None  # 27 -> 32: nothing to spare
    few = [torch.ones(1, N, dtype=torch.bool), torch.ones(1, N, dtype=torch.bool)]
    few[1][0, :1] = False  # 1 of 32 < 32 / 16
    assert fast_loss.LiveRows(few, multiple=1).rows(1) is None
    assert fast_loss.live_rows(oks, None) is not None and fast_loss.live_rows(oks, 0.5) is not None
    assert fast_loss.live_rows(oks, 1.0) is None and fast_loss.live_rows(oks[:1], None) is None


def test_compiled_paths_select_rows_at_every_step_whatever_the_batch():
    """fixed (FastPath.compile): the counted and live rows are selected at every step, dense
    batches too, so the first batch past SKIP_MIN compiles no second set of graphs mid-training
    (an H100's trainings did at steps 19 and 26); the counts round up to the multiple."""
    N = 32
    full = torch.ones(1, N, dtype=torch.bool)
    few_off = full.clone()
    few_off[0, :1] = False  # 1 of 32 < 32 / 16: unfixed, every row
    none = torch.zeros(1, N, dtype=torch.bool)
    idx = fast_loss.count_rows([full, few_off, none], fixed=True).rows_to_run()
    assert idx[0].tolist() == list(range(N)) and idx[1].tolist() == list(range(1, N))
    assert idx[2].tolist() == [0]
    counts = fast_loss.count_rows([few_off], fixed=True)
    counts.multiple = 8
    assert counts.rows_to_run()[0].numel() == N  # 31 -> 32
    assert fast_loss.count_rows([few_off]).rows_to_run() == [None]
    assert fast_loss.LiveRows([full, few_off], multiple=1, fixed=True).rows(1).numel() == N - 1
    assert fast_loss.LiveRows([full, few_off], multiple=1).rows(1) is None
    assert fast_loss.live_rows([full, few_off], 1.0, fixed=True) is not None


def test_compiled_regions_give_the_eager_regions_terms_and_gradients(step_rows, monkeypatch):
    """FastPath(compile=True) (what train() and the benchmark run on the GPU, the rope's cos/sin
    a region of their own) on the CPU: the fast TTT loss and gradients of the eager regions (fp64
    data; six samples packed, TTT 3, so token fills, the per-sample positions and the dead rows'
    reduced steps all run compiled). rope_apart off computes the same bits eagerly; inductor's
    fp32 cos/sin may differ from eager's in the last bits."""
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, True, seed=11)
    # the selected rows rounded up as on CUDA (the rows past a step's count weigh 0)
    monkeypatch.setattr(fast_loss, "row_multiple", lambda t: 8)
    out = []
    for compile_, apart in ((False, True), (False, False), (True, True)):
        d = toy_drafter(cfg, seed=7).double()
        step_rows.clear()
        fast = CHUNK5.replace(compile=compile_, rope_apart=apart, accumulate_wgrad=True)
        loss, stats = combine(ttt_terms(d, batch, head, 3, fast), 0.8)
        loss.backward()
        out.append((loss.item(), stats, {k: p.grad.clone() for k, p in d.named_parameters() if p.grad is not None}))
    assert any(n < shape[0] * shape[1] for n, shape in step_rows)  # the compiled run's reduced steps
    assert out[1][0] == out[0][0] and all(torch.equal(out[0][2][k], out[1][2][k]) for k in out[0][2])
    (l0, s0, g0), (l1, s1, g1) = out[0], out[2]
    assert l0 == pytest.approx(l1, rel=1e-6) and s0 == pytest.approx(s1, rel=1e-6)
    assert g0.keys() == g1.keys() and "midlayer.self_attn.q_proj.weight" in g0
    for k in g0:  # against each gradient's largest entry (the fp32 cos/sin's rounding spreads)
        assert float((g0[k] - g1[k]).abs().max()) <= 1e-5 * float(g0[k].abs().max()), k


def test_a_reduced_step_must_be_followed_by_reduced_ones():
    """The fast unroll refuses a `live` whose rows widen back to every row after a reduced step
    (the state no longer holds the other rows)."""
    cfg = toy_cfg()
    head, batch = _fp64_problem(cfg, False, seed=13)
    d = toy_drafter(cfg, seed=7).double()

    class Widening:
        def rows(self, j):
            return torch.arange(5) if j == 1 else None

    with pytest.raises(ValueError, match="after a reduced one"):
        fast_unroll.unroll(
            d, batch.aux, batch.tokens, 3, fast=FastPath(), valid=batch.valid, return_normed=True, live=Widening()
        )
    assert FastPath().skip_dead_rows  # the default


def test_train_with_prompts_follows_every_row_s_run(tmp_path, step_rows, monkeypatch):
    """train() (fused, packed, fp32, the toy features' prompts and out-of-draft rows) with the
    dead rows skipped gives every row's losses, and its steps did skip rows (only with it on)."""
    fs, head = make_features(tmp_path)
    made = loop.fast_path
    hist, reduced = {}, {}
    for on in (False, True):
        monkeypatch.setattr(loop, "fast_path", lambda *a, on=on, **kw: made(*a, **kw).replace(skip_dead_rows=on))
        step_rows.clear()
        cfg = TrainConfig(
            steps=3,
            batch_size=4,
            lr=3e-3,
            warmup_steps=1,
            checkpoint_every=100,
            log_every=1,
            impl="fused",
            packing=True,
        )
        hist[on] = train(toy_drafter(seed=5), fs, head, tmp_path / str(on), cfg, progress=False)["history"]
        reduced[on] = sum(n < shape[0] * shape[1] for n, shape in step_rows if shape)
    assert reduced[False] == 0 and reduced[True] > 0, reduced
    for a, b in zip(hist[False], hist[True]):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (a, b)
        assert a["n_0"] == b["n_0"]


@pytest.mark.slow
def test_compiled_softce_at_gathered_targets_equals_eager():
    """The compiled soft-CE that reads its targets through an index (the counted rows' path on
    the GPU) gives the eager kernel's loss, gradient and argmax on the gathered rows, bf16 too."""
    fn = torch.compile(fast_loss.softce_rows_at, dynamic=None)
    g = torch.Generator().manual_seed(6)
    for dt in (torch.float32, torch.bfloat16):
        lg = torch.randn(5, 40, generator=g).to(dt)
        t = torch.softmax(torch.randn(9, 40, generator=g), -1)
        idx = torch.tensor([7, 0, 3, 8, 2])
        w = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5])
        got, ref = fn(lg, t, idx, w), fast_loss.softce_rows(lg, t[idx], w)
        assert torch.allclose(got[0], ref[0], rtol=1e-5, atol=1e-6)
        assert torch.allclose(got[1].float(), ref[1].float(), rtol=1e-2 if dt == torch.bfloat16 else 1e-5, atol=1e-6)
        assert torch.equal(got[2], ref[2])


def test_cudnn_stats_and_a_segment_s_lse_get_standard_strides_even_for_one_token():
    """cuDNN's backward reads its Stats strides literally (the last must be 1): a one-token segment's
    log-sum-exp, a transposed view, keeps odd strides through reshape and contiguous(), which the
    GPU profile's first backward refused. _cudnn_stats spells the strides out."""
    h = 4
    lse_tok = torch.randn(7, h)  # token-major [N, h]
    odd = lse_tok[3:4].t()[None]  # [1, h, 1]: the view _seg_bwd took of a one-token segment
    assert odd.is_contiguous() and odd.contiguous().reshape(1, h, 1, 1).stride()[-1] != 1
    stats = fast_attention._cudnn_stats(odd, (1, h, 1, 1))
    assert stats.stride() == (h, 1, 1, 1) and torch.equal(stats.flatten(), lse_tok[3])
    wide = fast_attention._cudnn_stats(lse_tok.t()[None].contiguous(), (1, h, 7, 1))
    assert wide.stride() == (h * 7, 7, 1, 1) and torch.equal(wide[0, :, :, 0], lse_tok.t())
