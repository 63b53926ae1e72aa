"""FastPath: how the fast path computes a training step, as one frozen value passed down.

Every choice the fused and compiled paths make (which attention kernel, whether the elementwise
regions run compiled, which of the equality-preserving levers are on, how many rows a loss chunk
holds) is a field here; nothing in draftport.model.fast reads a process-global switch. A
training builds its FastPath from its params (draftport.training.loop), tests and benchmarks
build theirs. Each lever kept is on by default and computes the same terms and gradients as off
(tests/model/test_fast_path.py); their measurements are in benchmarks/README.md and benchmarks/results/.

Compiled kernels are made once per (function, compile options) for the process and reused by
every step (a cache: which variant runs is decided by the FastPath a call is given).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Literal

import torch

ATTENTION = ("flash", "cudnn", "fa4")
PACKED_ATTENTION = ("auto", "varlen", "segments")
# inductor's options with compile_tuning: each Triton kernel's block sizes searched as it compiles
COMPILE_TUNING = types.MappingProxyType({"coordinate_descent_tuning": True})


@dataclasses.dataclass(frozen=True)
class FastPath:
    """How the fast path computes a step (the reference: draftport.model.drafter, training.ttt)."""

    # the CUDA kernel of the step-0 causal attention (the CPU runs torch's CPU flash kernel):
    # flash (FlashAttention 2 in torch), cudnn (cuDNN's fused attention), fa4 (FlashAttention-4,
    # package flash-attn-4, Hopper/Blackwell)
    attention: Literal["flash", "cudnn", "fa4"] = "flash"
    # packed rows on CUDA: varlen (flash's variable-length kernel, one call for all samples),
    # segments (the dense kernel once per sample; not under cudnn), auto (varlen)
    packed_attention: Literal["auto", "varlen", "segments"] = "auto"
    # the elementwise regions and kernels through torch.compile (impl: compiled)
    compile: bool = False
    # compiled with COMPILE_TUNING (False: inductor's defaults)
    compile_tuning: bool = True
    # compiled with every dim symbolic from the first call: one graph per region, where automatic
    # dynamic compiles each region static first and again symbolic at the second length
    compile_dynamic: bool = True
    # the rope's cos/sin [B, T, hd] once per step in a region of their own (off: inside the q/k
    # rope region, per element of every head)
    rope_apart: bool = True
    # with teacher tokens, the embedding half of q/k/v once per unroll as one table (off: the
    # 2H-wide GEMMs at every step)
    embed_once: bool = True
    # the keys' and values' gradients summed across TTT steps in one accumulator per unroll (off:
    # one autograd add per reading step)
    kv_grad_sum: bool = True
    # the per-step lm_head and soft-CE on the rows the loss counts only
    skip_uncounted: bool = True
    # TTT steps >= 1 run their GEMMs on the rows a later step still scores only
    skip_dead_rows: bool = True
    # weight gradients summed in place across TTT steps (single process or FSDP; DDP needs them
    # through autograd): set from the run, not a lever
    accumulate_wgrad: bool = False
    # rows per chunk: the target's full-vocab logits (fp32 [chunk, V] at a time) and the loss's
    # draft-vocab logits (whole rows up to this many tokens: one GEMM pair per step)
    target_chunk: int = 1024
    loss_chunk: int = 4096

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r}: flash, cudnn or fa4")
        if self.packed_attention not in PACKED_ATTENTION:
            raise ValueError(f"packed attention {self.packed_attention!r}: auto, varlen or segments")
        if self.attention == "cudnn" and self.packed_attention == "segments":
            raise ValueError("packed attention segments under cudnn: cuDNN refuses one-token segments")
        if self.target_chunk < 1 or self.loss_chunk < 1:
            raise ValueError(f"chunks must hold a row at least: {self.target_chunk}, {self.loss_chunk}")

    @property
    def packed(self) -> str:
        """varlen or segments: how packed rows' causal part runs on CUDA."""
        return "varlen" if self.packed_attention == "auto" else self.packed_attention

    def kernel(self, fn):
        """fn, or its compiled version when this path compiles."""
        return compiled(fn, self.compile_tuning, self.compile_dynamic) if self.compile else fn

    def replace(self, **changes) -> "FastPath":
        return dataclasses.replace(self, **changes)


@functools.cache
def compiled(fn, tuning: bool = True, dynamic: bool = True):
    """torch.compile(fn), made once per (fn, tuning, dynamic). dynamic: symbolic sizes from the
    first call (the rows a step counts change every step); False: the first shape compiles
    static and a second length makes it symbolic (one more compile per region)."""
    allow_recompiles()
    return torch.compile(fn, dynamic=True if dynamic else None, options=dict(COMPILE_TUNING) if tuning else None)


def allow_recompiles(n: int = 64) -> None:
    """Let a compiled function hold up to n graphs (one per number of diagonal keys, per
    parameter size, ...) before dynamo gives up on it (its default is 8)."""
    import torch._dynamo  # here, not at the top: it adds ~1 s to every import of the reference path

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))
    # two sizes equal by chance become one symbol under duck sizing, and the first step where
    # they differ recompiles (a CPU probe: a loss slice's offset and a logits width)
    import torch._inductor.config as inductor_cfg
    import torch.fx.experimental._config as fx_cfg

    fx_cfg.use_duck_shape = False
    # its fusion test guards each graph on 1280 <= rows < 8192 (H100: a TTT step's live rows
    # crossing 1280 recompiled at step 19); it fuses only at rows >= 8192 anyway
    if hasattr(inductor_cfg.triton, "mix_order_reduction"):
        inductor_cfg.triton.mix_order_reduction = False


def compile_count() -> int:
    """Graphs torch.compile has made in this process so far (dynamo's own counter; 0 before any
    compile, and when dynamo was never imported: importing it costs ~1 s)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
