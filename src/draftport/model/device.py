"""The device rule of every step that computes with a drafter (training, evaluation, the held-out
monitor, the drift probe's evaluations, the curves and the budget's rounds).

`pick(choice, key)`: auto is cuda:LOCAL_RANK when CUDA is there and the CPU otherwise; cuda asks
for a GPU and is refused in one line when there is none; cpu is the CPU whatever the machine.
Under torchrun each process takes the GPU of its LOCAL_RANK, so one rule serves one process,
DDP and FSDP. `describe` says what ran (the step's record and MLflow), `out_of_memory` turns a
CUDA out-of-memory error into one line naming the knob that lowers the memory.
"""

from __future__ import annotations

import contextlib
import os

import torch

from draftport.errors import DraftportError

CHOICES = ("auto", "cuda", "cpu")


def local_rank() -> int:
    """This process's GPU index on its node: torchrun's LOCAL_RANK, else 0."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def pick(choice: str, key: str) -> torch.device:
    """The torch device a step computes on, by the rule above. key: the param that chose it
    (named in the error)."""
    if choice not in CHOICES:
        raise DraftportError(key, f"{choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DraftportError(
            key,
            "cuda asked for, but torch sees no CUDA device on this machine "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
            "use auto or cpu",
        )
    n = torch.cuda.device_count()
    rank = local_rank()
    if rank >= n:
        raise DraftportError(key, f"LOCAL_RANK {rank} but only {n} GPU(s) are visible: one process per GPU")
    return torch.device("cuda", rank)


def describe(device: torch.device, processes: int = 1) -> dict:
    """What a step ran on: {"device", "gpu" (its name, None on the CPU), "processes"}."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    return {"device": device.type, "gpu": gpu, "processes": processes}


# The dense bf16 rate MFU is counted against, as the training benchmark counts it (its
# --peak-tflops default: an 8192^3 bf16 GEMM measured 788-798 TFLOP/s on both cards).
PEAK_TFLOPS = {"H100": 790.0, "H200": 790.0}


def peak_tflops(gpu: str | None) -> float | None:
    """The MFU denominator for a GPU name (None: not a card with a measured peak, MFU unreported)."""
    if not gpu:
        return None
    return next((v for k, v in PEAK_TFLOPS.items() if k in gpu.upper()), None)


@contextlib.contextmanager
def out_of_memory(where: str, knob: str):
    """A CUDA out-of-memory error inside becomes one DraftportError naming `knob`, the param that
    lowers the memory; the caller's checkpoints stay as they were (the rerun resumes)."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory"
        raise DraftportError(
            where,
            f"out of GPU memory ({first[:160]}); lower {knob} and run again: "
            "the last checkpoint is kept and the rerun resumes from it",
        ) from None


def process_age_s() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere): a training's start-up
    (interpreter, imports, loading) before its first step."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
