"""A switch lever of the training step, on against off, in the whole training step
(train.train_step, as bench_train_h200.py runs it): the Kimi-size drafter, TTT 7, bf16, the
greedy choice stored (mask "stored") and computed, lm_head frozen and trained, at each --seqs
length. --lever wgrad_stream (default): the weight-gradient GEMMs on a second CUDA stream
(kernels.set_wgrad_stream) against one stream; --lever kv_sum: the keys' and values' gradients
summed across TTT steps in one accumulator per unroll (kernels.set_kv_grad_sum) against
autograd's adds; --lever stacked_head: the TTT steps' lm_head GEMMs and soft-CE taken stacked
(ttt.set_stacked_head, one GEMM each way over S*T rows) against one LinearSoftCE per step;
--lever skip_uncounted: the per-step lm_head and soft-CE on the rows the loss counts only
(ttt.set_skip_uncounted) against every row; --lever packed_segments: packed rows' causal
attention by the dense kernel (--attn-backend's) once per segment (kernels.set_packed_attention)
against flash varlen over all segments (only the mix's packed rows differ); --lever dead_rows:
TTT steps >= 1 on the rows a later step scores only (ttt.set_skip_dead_rows: a prompt's rows
then run step 0 alone) against every row; --lever rope_apart: the rope's cos/sin once per step in
a region of their own (drafter.set_rope_apart) against inside the q/k rope; --lever tuning:
every compiled region and kernel with inductor's coordinate-descent tuning (its block sizes
searched per kernel, kernels.set_compile_options) against inductor's defaults; --lever fa4: the
causal attention through FlashAttention-4 (kernels.set_attention_backend("fa4"), packed rows
through its varlen kernel; flash-attn-4 installed) against --attn-backend's kernel (cuDNN, packed
rows once per segment). --prompt-share F
[F ...]: each fixed length also with its first F of the rows a prompt (no loss there), as chat
data has.

Per configuration: first the gradients of one step from the same state with the lever off,
off again and on (the largest absolute difference over all trainable tensors, and how many
tensors differ at all, on vs off beside off vs off: the step is not bitwise repeatable by
itself); then --rounds rounds of (off, on) blocks, alternated so that a drift of the card's
clocks falls on both sides: a block is --iters steps at a fixed length, or one pass over the
bench's length mix (--mix samples, packed into rows of <= 8192 tokens as train() packs them);
the figure is real tokens over the median block of each side. With --profile-dir, a profile of
two steps at each fixed length and of the mix's first step twice (the --profile-sets; kernel
time by kind and the kernel table) with the lever on and/or off (--profile-stream on off), and
with --profile-shapes one step's ops by input shape with the levers at their defaults (which
add, mul or copy is which).

Prints figures and writes --json; asserts nothing.

    python benchmarks/probe_wgrad_stream_h200.py [--lever kv_sum] [--seqs 2048 4096] [--rounds 3] [--iters 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import bench_train_h200 as bench  # noqa: E402
from draftport.model import drafter as drafter_mod  # noqa: E402
from draftport.model.fast import kernels
from draftport.training import optim  # noqa: E402
from draftport.training import ttt as ttt_mod  # noqa: E402
from draftport.training.loop import TrainConfig, train_step  # noqa: E402


LEVERS = {"wgrad_stream": kernels.set_wgrad_stream, "kv_sum": kernels.set_kv_grad_sum,
          "stacked_head": ttt_mod.set_stacked_head, "skip_uncounted": ttt_mod.set_skip_uncounted,
          "packed_segments": lambda on: kernels.set_packed_attention("segments" if on else "varlen"),
          "dead_rows": ttt_mod.set_skip_dead_rows, "rope_apart": drafter_mod.set_rope_apart,
          "tuning": lambda on: _use_compiled(on), "fa4": lambda on: _use_fa4(on)}
_ATTN = ["cudnn"]   # --attn-backend's kernel: what --lever fa4 switches back to


def _use_fa4(on: bool) -> None:
    kernels.set_attention_backend("fa4" if on else _ATTN[0])
LEVER = [kernels.set_wgrad_stream]
# lever tuning: every compiled region and kernel twice, with inductor's defaults (off) and with
# the library's default options (on); the lever swaps which set the step calls
TUNING = dict(kernels.DEFAULT_COMPILE_OPTIONS)
_COMPILED = {}


def _use_compiled(on: bool) -> None:
    if on not in _COMPILED:   # before the sets exist (the lever's default at start)
        return
    regions, kern, loss = _COMPILED[on]
    _COMPILED["drafter"].__dict__["_compiled"] = dict(regions)
    kernels._KERNELS.update(kern)
    ttt_mod._LOSS_KERNELS.update(loss)


def _compile_both(d) -> None:
    """The two compiled sets of lever tuning (each compiles lazily at its first step)."""
    _COMPILED["drafter"] = d
    before = dict(kernels._COMPILE_OPTIONS)
    for on in (False, True):
        kernels.set_compile_options(TUNING if on else None)
        d.compile_regions()
        ttt_mod.compile_loss_kernels()
        _COMPILED[on] = (dict(d.__dict__["_compiled"]), dict(kernels._KERNELS), dict(ttt_mod._LOSS_KERNELS))
    kernels.set_compile_options(before)
    _use_compiled(False)
DEFAULTS = {"wgrad_stream": kernels._WGRAD["on"], "kv_sum": kernels._KVSUM["on"],
            "stacked_head": ttt_mod._STACKED["on"], "skip_uncounted": ttt_mod._SKIP["on"],
            "packed_segments": None,   # as imported; packed_segments: set after the dense backend
            "dead_rows": ttt_mod._LIVE["on"], "rope_apart": drafter_mod._ROPE_APART["on"],
            "tuning": kernels._COMPILE_OPTIONS == TUNING}


def set_lever(on: bool) -> None:
    LEVER[0](on)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="*", default=[2048, 4096], help="fixed lengths (none: the mix only)")
    ap.add_argument("--size", default="kimi")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--sets", nargs="+", default=["trainable_stored", "frozen_stored", "trainable_computed"])
    ap.add_argument("--attn-backend", default="cudnn")
    ap.add_argument("--mix", type=int, default=20, help="samples in the bench's length mix, packed (0: none)")
    ap.add_argument("--mix-layouts", nargs="+", choices=["packed", "padded"], default=["packed"],
                    help="the mix as train() packs it and/or padded in groups of 4 samples")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--profile-stream", nargs="+", type=lambda v: v == "on", default=[True],
                    help="profile with the stream on and/or off (on off)")
    ap.add_argument("--profile-shapes", action="store_true", help="also the ops by input shape (the defaults)")
    ap.add_argument("--profile-sets", nargs="+", default=["trainable_stored"], help="the sets profiled")
    ap.add_argument("--json", default=None)
    ap.add_argument("--prompt-share", type=float, nargs="+", default=[0.0],
                    help="fixed-length cases with this share of each row's first tokens a prompt (no loss)")
    ap.add_argument("--mix-prompt-share", type=float, nargs="+", default=[0.0],
                    help="the mix also with this share of each sample's first tokens a prompt (0: the "
                         "bench's 16-token prompts)")
    ap.add_argument("--lever", choices=sorted(LEVERS), default="wgrad_stream",
                    help="what on/off switches: the weight-gradient stream (default), the keys' "
                         "gradients summed across TTT steps (kv_sum), or the lm_head stacked over the "
                         "TTT steps (stacked_head), or the lm_head on counted rows only (skip_uncounted), "
                         "or packed rows' attention by the dense kernel once per segment (packed_segments; "
                         "a mix case only), or steps >= 1 on the rows a later step scores (dead_rows), or "
                         "the rope's cos/sin in a region of their own (rope_apart), or inductor's "
                         "coordinate-descent tuning of every compiled kernel (tuning), or "
                         "FlashAttention-4 against --attn-backend's kernel (fa4)")
    a = ap.parse_args(argv)
    LEVER[0] = LEVERS[a.lever]
    if not torch.cuda.is_available():
        sys.exit("probe_wgrad_stream_h200.py needs a CUDA device")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    t_start = time.perf_counter()
    cfg, d, head = bench.build(a.size, dev, dtype)
    hot = d.hot_ids
    rows = head.index_select(0, hot).contiguous()
    if a.lever == "tuning":
        _compile_both(d)
    else:
        d.compile_regions()
        ttt_mod.compile_loss_kernels()
    d.accumulate_wgrad = True
    kernels.set_attention_backend(a.attn_backend)
    _ATTN[0] = a.attn_backend
    DEFAULTS["fa4"] = a.attn_backend == "fa4"
    DEFAULTS["packed_segments"] = kernels.packed_attention() == "segments"
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "seqs": a.seqs,
           "rounds": a.rounds, "iters": a.iters, "attention": a.attn_backend, "results": {}}

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    cases = []
    for T in a.seqs:
        for share in a.prompt_share:
            b = bench.make_batch(cfg, 1, T, dev, dtype)
            b.loss_mask[:, :int(round(share * T))] = False
            b.loss_share = float(b.loss_mask.float().mean())   # what Batch.to() reads on the host
            cases.append((f"T{T}" + (f"_prompt{share:g}" if share else ""), [b] * a.iters))
    out["prompt_share"] = a.prompt_share
    out["lever"] = a.lever
    if a.mix:   # the bench's length mix, packed as train() packs it (or padded in groups of 4): one pass per block
        for share in a.mix_prompt_share:
            samples = bench.mix_samples(cfg, bench.mix_lengths(a.mix, 2048, 1), dev, dtype, prompt_share=share)
            (packed, _), (padded, _) = bench.layout_mix(samples, 8192, 4, dtype)
            for layout, bs in (("packed", packed), ("padded", padded)):
                if layout in a.mix_layouts:
                    cases.append((f"mix_{layout}" + (f"_prompt{share:g}" if share else ""), [b.to(dev) for b in bs]))
    out["mix_prompt_share"] = a.mix_prompt_share
    for label, batches in cases:
        stored = bench.with_stored_mask([copy.copy(b) for b in batches[:len(set(map(id, batches)))]], head, hot, 2048)
        stored = stored * (len(batches) // len(stored))
        tokens = sum(int(b.valid.sum()) for b in batches)
        for name in a.sets:
            lh, mask = name.split("_")
            bs, hd = (stored, rows) if mask == "stored" else (batches, head)
            d.lm_head.weight.requires_grad_(lh == "trainable")
            params = [p for p in d.parameters() if p.requires_grad]
            tcfg = TrainConfig(ttt_steps=a.ttt, gamma=0.8, grad_clip=1.0, train_lm_head=lh == "trainable")

            def step(b):
                train_step(d, b, hd, opt, params, tcfg, impl="fused", use_bf16=True)

            # the same gradients either way (from the same state: no optimizer step between),
            # twice with the stream off first: what the step's own nondeterminism gives (the
            # attention backward's atomics), against which the on/off difference is read
            grads = {}
            for key, on in (("off", False), ("off_again", False), ("on", True)):
                set_lever(on)
                d.zero_grad(set_to_none=True)
                terms = ttt_mod.ttt_terms(d, bs[0], hd, a.ttt, fused=True)
                loss, _ = ttt_mod.combine(terms, 0.8, sync=False)
                loss.backward()
                torch.cuda.synchronize()
                grads[key] = [p.grad.detach().clone() for p in params]

            def compare(other):
                diffs = [float((x.float() - y.float()).abs().max()) for x, y in zip(grads["off"], grads[other])]
                n = sum(1 for x, y in zip(grads["off"], grads[other]) if not torch.equal(x, y))
                return max(diffs), n
            diff_on, n_diff = compare("on")
            diff_base, n_base = compare("off_again")
            del grads
            d.zero_grad(set_to_none=True)

            opt = optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95))
            for on in (False, True, False, True):     # warm both (compiles, allocator)
                set_lever(on)
                for b in bs[:len(set(map(id, bs)))]:
                    step(b)
            blocks = {False: [], True: []}
            for r in range(a.rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    set_lever(on)
                    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                    torch.cuda.synchronize()
                    ev[0].record()
                    for b in bs:
                        step(b)
                    ev[1].record()
                    torch.cuda.synchronize()
                    blocks[on].append(ev[0].elapsed_time(ev[1]) / 1e3)
            peak = {}
            for on in (True, False):
                torch.cuda.reset_peak_memory_stats()
                set_lever(on)
                for b in bs[:len(set(map(id, bs)))]:
                    step(b)
                torch.cuda.synchronize()
                peak[on] = torch.cuda.max_memory_allocated() / 2**30
            med = {k: statistics.median(v) for k, v in blocks.items()}
            rec = {"counted_share": bench.counted_share(stored[:len(set(map(id, stored)))], d.t2d, a.ttt), "grad_max_abs_diff": diff_on, "grad_tensors_differing": n_diff, "tensors": len(params),
                   "grad_max_abs_diff_off_vs_off": diff_base, "grad_tensors_differing_off_vs_off": n_base,
                   "steps_per_block": len(bs), "real_tokens_per_block": tokens,
                   "block_s_off": blocks[False], "block_s_on": blocks[True],
                   "tok_s_off": tokens / med[False], "tok_s_on": tokens / med[True],
                   "gain": med[False] / med[True], "peak_gib_off": peak[False], "peak_gib_on": peak[True]}
            out["results"][f"{label}_{name}"] = rec
            log(f"{label} {name:20s} off {rec['tok_s_off']:8.0f} tok/s  on {rec['tok_s_on']:8.0f} tok/s  "
                f"gain {rec['gain']:.4f}  grads on vs off differ in {n_diff}/{len(params)} (max {diff_on:.3g}; "
                f"off vs off {n_base}, max {diff_base:.3g})  peak {peak[False]:.2f} / {peak[True]:.2f} GiB")
            if a.profile_dir and name in a.profile_sets:   # a mix: its first step (a packed row of 8,192)
                for on in a.profile_stream:
                    set_lever(on)
                    tag = (a.lever if on else "off") if a.lever != "wgrad_stream" else (
                        "wgrad_stream" if on else "one_stream")
                    rec[f"profile_{tag}"] = bench.profile(
                        lambda: step(bs[0]), Path(a.profile_dir) / f"profile_{label}_{name}_{tag}.txt", log)
                if a.profile_shapes:   # the eager ops by input shape (which add, mul, copy is which)
                    from torch.profiler import ProfilerActivity, profile as tprof
                    set_lever(DEFAULTS[a.lever])   # the defaults
                    with tprof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                        step(bs[0])
                        torch.cuda.synchronize()
                    tab = prof.key_averages(group_by_input_shape=True).table(
                        sort_by="self_device_time_total", row_limit=80, max_name_column_width=40,
                        max_shapes_column_width=110)
                    (Path(a.profile_dir) / f"shapes_{label}_{name}_defaults.txt").write_text(tab)
            del opt
            d.zero_grad(set_to_none=True)
            set_lever(DEFAULTS[a.lever])   # the lever back to its default
            torch.cuda.empty_cache()
            if a.json:
                Path(a.json).write_text(json.dumps(out, indent=1))
    out["wall_s"] = time.perf_counter() - t_start
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
