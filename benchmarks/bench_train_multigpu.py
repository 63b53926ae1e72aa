"""Multi-GPU scaling of the Kimi-K2-size training step: 1 GPU, then DDP and FSDP under torchrun.

One invocation runs, each in a fresh process (clean memory, clean peak counters):
  1. single: one process, one GPU, per-GPU batch B: the 1-GPU step timing (as
     bench_train_h200.py's "main lm_head frozen": compiled impl, in-place weight-gradient sums,
     clipping inside fused AdamW); then, on a freshly built model, the loss reference: K steps
     over the global batch of N GPUs in ONE step of batch N*B (no gradient accumulation: the same
     rows, one process; train.py's normalization makes N ranks equal one process on it), the
     same global batch at every step (the drafter fits it: the loss falls, the check is sharp).
  2. torchrun --nproc_per_node=N, parallel=ddp, then parallel=fsdp (train.wrap_parallel, as
     train() runs them): the same K loss steps from the same initial weights on the same global
     batch (rank r takes rows r*B..r*B+B-1), then the step timing at per-GPU batch B.
Prints tokens/s per GPU (slowest rank), scaling efficiency against the 1-GPU figure of the same
invocation, peak memory per GPU, and the per-step losses against the 1-process reference
(max relative difference; "match" under --tol, bf16 rounding differs with the batch split).

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 in this process and every child): on the shared hosts it can put the
GPUs out of service.

    python benchmarks/bench_train_multigpu.py --nproc 2 --json out.json --log out.log   # CUDA
    python benchmarks/bench_train_multigpu.py --size toy --device cpu --nproc 2          # gloo

Never asserts timings: it prints figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(SAFE_ENV)  # before torch (and NCCL) load

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from bench_train_h200 import SIZES, build, flops_per_token, make_batch  # noqa: E402

from draftport.data.shards import Batch  # noqa: E402
from draftport.training.loop import TrainConfig, fast_path, train_step, trainable, wrap_parallel  # noqa: E402


# ---- data: row i of global step s is a pure function of (s, i), wherever it is built ----------
def rows(cfg, step: int, ids: list[int], T: int, dev, dtype) -> Batch:
    parts = [make_batch(cfg, 1, T, dev, dtype, seed=1_000_003 * (step + 1) + i) for i in ids]
    cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
    return Batch(cat("aux"), cat("final"), cat("tokens"), cat("loss_mask"), cat("valid"))


def make_opt(params, cuda: bool, lr: float):
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        fused=cuda,
    )


def setup(a, dev, dtype, parallel: str):
    """A fresh model (seed 0: the same initial weights in every process), wrapped, + optimizer,
    + the training config and how its steps are computed (as train(): in-place weight-gradient
    sums except under DDP, whose hooks need autograd)."""
    cfg, d, head = build(a.size, dev, dtype, seed=0)
    d.lm_head.weight.requires_grad_(False)  # the single-GPU run's main figure: frozen
    net = wrap_parallel(d, parallel, dev)
    params = list(trainable(d).values())
    opt = make_opt(params, dev.type == "cuda", a.lr)
    tcfg = TrainConfig(ttt_steps=a.ttt, gamma=a.gamma, grad_clip=1.0, train_lm_head=False)
    fast = fast_path(tcfg, a.impl, accumulate_wgrad=parallel != "ddp")
    return cfg, d, head, net, params, opt, tcfg, fast


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def global_loss(loss: torch.Tensor, world: int) -> float:
    """train_step's loss is this rank's share times `world`; the global loss is their mean."""
    x = loss.detach().float().clone()
    if world > 1:
        dist.all_reduce(x)
    return float(x) / world


def loss_run(a, dev, dtype, parallel, rank, world, log) -> list[float]:
    """K steps from the seed-0 weights on one fixed global batch of a.nproc * a.batch rows: the
    drafter fits it, so the loss falls steeply and the comparison is sharp (fresh random rows
    each step would leave the loss almost flat)."""
    cfg, d, head, net, params, opt, tcfg, fast = setup(a, dev, dtype, parallel)
    G = a.nproc * a.batch
    per = G // world
    mine = list(range(rank * per, (rank + 1) * per))
    batch = rows(cfg, 0, mine, a.seq, dev, dtype)
    losses = []
    for _ in range(a.loss_steps):
        loss, *_ = train_step(net, batch, head, opt, params, tcfg, fast=fast, use_bf16=dev.type == "cuda", world=world)
        losses.append(global_loss(loss, world))
    log(f"[{parallel}] loss steps (global batch {G}, {per} rows/process): " + " ".join(f"{x:.5f}" for x in losses))
    return losses


def time_run(a, dev, dtype, parallel, rank, world, log) -> dict:
    """Warm up, then time a.iters steps at per-GPU batch a.batch (a fixed batch, as the single-GPU
    benchmark). -> per-GPU figures, slowest rank."""
    cfg, d, head, net, params, opt, tcfg, fast = setup(a, dev, dtype, parallel)
    batch = rows(cfg, 10_000, list(range(rank * a.batch, (rank + 1) * a.batch)), a.seq, dev, dtype)
    cuda = dev.type == "cuda"

    def step():
        return train_step(net, batch, head, opt, params, tcfg, fast=fast, use_bf16=cuda, world=world)

    t_c = time.perf_counter()
    for _ in range(a.warmup):
        step()
    sync(dev)
    if world > 1:
        dist.barrier()
    warm_s = time.perf_counter() - t_c
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(a.iters):
        loss, *_ = step()
    sync(dev)
    dt = torch.tensor((time.perf_counter() - t0) / a.iters, dtype=torch.float64, device=dev)
    peak = torch.tensor(torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else 0.0, dtype=torch.float64, device=dev)
    if world > 1:
        peaks = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(peaks, peak)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        peaks = [float(p) for p in peaks]
    else:
        peaks = [float(peak)]
    step_s = float(dt)
    tok = a.batch * a.seq
    fl = flops_per_token(cfg, a.seq, a.ttt, False)["train"]
    res = {
        "parallel": parallel,
        "world": world,
        "step_s": step_s,
        "tokens_per_s_per_gpu": tok / step_s,
        "tokens_per_s_total": tok * world / step_s,
        "mfu": fl * tok / step_s / (a.peak_tflops * 1e12),
        "peak_mem_gib_per_gpu": peaks if cuda else None,
        "warmup_s": warm_s,
        "trainable_params": sum(p.numel() for p in params),
        "local_trainable_elems_rank0": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params),
    }
    log(
        f"[{parallel}] x{world}: {res['tokens_per_s_per_gpu']:.0f} tok/s per GPU "
        f"({res['tokens_per_s_total']:.0f} total)  step {step_s * 1e3:.1f} ms  mfu {res['mfu']:.3f}  "
        f"peak/GPU {['%.2f' % p for p in peaks] if cuda else '-'} GiB  warmup {warm_s:.1f}s"
    )
    return res


def worker(a):
    """One process of a stage: 'single' (no process group) or a torchrun rank."""
    cuda = a.device == "cuda"
    launched = "RANK" in os.environ
    if launched and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if launched else (0, 1)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    parallel = a.parallel if launched else "none"
    out = {"parallel": parallel, "world": world}
    if parallel == "none":
        out["timing"] = time_run(a, dev, dtype, parallel, rank, world, log)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        out["losses"] = loss_run(a, dev, dtype, parallel, rank, world, log)
    else:
        out["losses"] = loss_run(a, dev, dtype, parallel, rank, world, log)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        out["timing"] = time_run(a, dev, dtype, parallel, rank, world, log)
    if rank == 0:
        Path(a.worker_out).write_text(json.dumps(out) + "\n")
    if launched:
        dist.barrier()
        dist.destroy_process_group()


# ---- the launcher ----------------------------------------------------------------------------
def versions():
    out = {"torch": torch.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    return out


def stage_cmd(a, parallel: str | None, out: Path) -> list[str]:
    common = [
        "--worker",
        "--worker-out",
        str(out),
        "--size",
        a.size,
        "--device",
        a.device,
        "--seq",
        str(a.seq),
        "--batch",
        str(a.batch),
        "--ttt",
        str(a.ttt),
        "--gamma",
        str(a.gamma),
        "--iters",
        str(a.iters),
        "--warmup",
        str(a.warmup),
        "--loss-steps",
        str(a.loss_steps),
        "--n-gpus",
        str(a.nproc),
        "--impl",
        a.impl,
        "--lr",
        str(a.lr),
        "--peak-tflops",
        str(a.peak_tflops),
    ]
    me = str(Path(__file__).resolve())
    if parallel is None:
        return [sys.executable, me, *common]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={a.nproc}",
        me,
        *common,
        "--parallel",
        parallel,
    ]


def run_stage(a, name, cmd, out: Path, log) -> dict | None:
    env = dict(os.environ, **SAFE_ENV, PYTHONUNBUFFERED="1")
    if a.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    log(f"[{name}] " + " ".join(cmd[1:4] if "torch.distributed.run" in cmd else cmd[1:2]) + " ...")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.stage_timeout)
    except subprocess.TimeoutExpired as e:
        log(
            f"[{name}] timed out after {a.stage_timeout}s\n"
            f"{(e.stderr or '')[-3000:] if isinstance(e.stderr, str) else ''}"
        )
        return None
    for ln in r.stdout.splitlines():
        log(f"  {ln}")
    if r.returncode != 0 or not out.is_file():
        log(f"[{name}] failed (rc {r.returncode}):\n{r.stderr[-6000:]}")
        return None
    res = json.loads(out.read_text())
    res["wall_s"] = time.perf_counter() - t0
    log(f"[{name}] done in {res['wall_s']:.0f}s")
    return res


def compare(ref: list[float], got: list[float]) -> dict:
    """Per-step relative differences; also the final difference as a share of how far the
    reference loss moved (a check is only as sharp as the loss moves)."""
    rel = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(ref, got)]
    moved = abs(ref[0] - ref[-1]) if ref else 0.0
    return {
        "losses": got,
        "rel_diff": rel,
        "max_rel_diff": max(rel) if rel else None,
        "final_loss": got[-1] if got else None,
        "final_rel_diff": rel[-1] if rel else None,
        "reference_loss_moved": moved,
        "final_diff_over_moved": abs(ref[-1] - got[-1]) / moved if ref and got and moved else None,
    }


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--size", choices=sorted(SIZES), default=None, help="kimi on CUDA, toy on CPU")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None)
    # (--n-gpus: the spelling handed to workers; torchrun would take --nproc for its own option)
    ap.add_argument(
        "--nproc",
        "--n-gpus",
        dest="nproc",
        type=int,
        default=None,
        help="GPUs (processes) for DDP/FSDP; default: all GPUs",
    )
    ap.add_argument("--modes", nargs="+", default=["ddp", "fsdp"], choices=["ddp", "fsdp"])
    ap.add_argument("--seq", type=int, default=None, help="2048 (kimi/small), 64 (toy)")
    ap.add_argument("--batch", type=int, default=1, help="per-GPU batch (the single-GPU run's: 1)")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--loss-steps", type=int, default=6)
    ap.add_argument("--lr", type=float, default=None, help="1e-4 (the single-GPU benchmark's); toy: 1e-3")
    ap.add_argument(
        "--impl",
        choices=["compiled", "fused", "reference"],
        default=None,
        help="compiled on CUDA (as the single-GPU benchmark), fused on CPU",
    )
    ap.add_argument("--tol", type=float, default=None, help="loss match tolerance (relative): 1e-2 bf16, 1e-4 fp32")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--stage-timeout", type=int, default=400)
    ap.add_argument("--json", default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--parallel", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.size = a.size or ("kimi" if a.device == "cuda" else "toy")
    a.seq = a.seq or (64 if a.size == "toy" else 2048)
    a.impl = a.impl or ("compiled" if a.device == "cuda" else "fused")
    a.nproc = a.nproc or (torch.cuda.device_count() if a.device == "cuda" else 2)
    a.tol = a.tol if a.tol is not None else (1e-2 if a.device == "cuda" else 1e-4)
    a.lr = a.lr or (1e-3 if a.size == "toy" else 1e-4)
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    if a.worker:
        worker(a)
        return {}
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)
        if a.log:
            Path(a.log).parent.mkdir(parents=True, exist_ok=True)
            Path(a.log).write_text("\n".join(lines) + "\n")

    cuda = a.device == "cuda"
    gpus = torch.cuda.device_count() if cuda else 0
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    log(f"device {name} x{gpus}; {versions()}; multicast off: {SAFE_ENV}")
    if cuda and a.nproc > gpus:
        log(f"only {gpus} GPU(s): --nproc {a.nproc} cannot run")
        raise SystemExit(2)
    log(
        f"size {a.size}: {SIZES[a.size]}; seq {a.seq} TTT {a.ttt} impl {a.impl} "
        f"{'bf16' if cuda else 'fp32'}; per-GPU batch {a.batch}; N {a.nproc}; global batch {a.nproc * a.batch}; "
        f"loss check over {a.loss_steps} steps (1-process reference: one step of batch {a.nproc * a.batch}, "
        f"no gradient accumulation)"
    )
    res = {}
    with tempfile.TemporaryDirectory(prefix="bench_mgpu.") as tmp:
        stages = [("single", None)] + [(m, m) for m in a.modes]
        for nm, par in stages:
            out = Path(tmp) / f"{nm}.json"
            res[nm] = run_stage(a, nm, stage_cmd(a, par, out), out, log)

    single = res.get("single")
    base = single["timing"]["tokens_per_s_per_gpu"] if single else None
    ref = single["losses"] if single else None
    summary = {}
    for m in a.modes:
        r = res.get(m)
        if r is None:
            summary[m] = None
            continue
        t = r["timing"]
        s = {
            "world": r["world"],
            "tokens_per_s_per_gpu": t["tokens_per_s_per_gpu"],
            "tokens_per_s_total": t["tokens_per_s_total"],
            "step_s": t["step_s"],
            "mfu": t["mfu"],
            "scaling_efficiency": t["tokens_per_s_per_gpu"] / base if base else None,
            "peak_mem_gib_per_gpu": t["peak_mem_gib_per_gpu"],
            "local_trainable_elems_rank0": t["local_trainable_elems_rank0"],
        }
        if ref is not None:
            s["loss_check"] = compare(ref, r["losses"])
            s["loss_check"]["match"] = s["loss_check"]["max_rel_diff"] <= a.tol
        summary[m] = s
        eff = f"{s['scaling_efficiency']:.3f}" if s["scaling_efficiency"] else "-"
        lc = s.get("loss_check") or {}
        log(
            f"[result] {m} x{r['world']}: {s['tokens_per_s_per_gpu']:.0f} tok/s per GPU, scaling efficiency {eff} "
            f"vs 1 GPU ({base or 0:.0f} tok/s); peak/GPU "
            f"{['%.2f' % p for p in s['peak_mem_gib_per_gpu']] if s['peak_mem_gib_per_gpu'] else '-'} GiB; "
            f"loss after {a.loss_steps} steps {lc.get('final_loss') or 0:.5f} vs 1 process {(ref or [0])[-1]:.5f} "
            f"(max rel diff {lc.get('max_rel_diff') or 0:.2e}, match {lc.get('match')}; the reference moved "
            f"{lc.get('reference_loss_moved') or 0:.4f}, final diff {lc.get('final_diff_over_moved') or 0:.2e} of that)"
        )
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "device": name,
        "gpus_visible": gpus,
        "versions": versions(),
        "multicast_env": SAFE_ENV,
        "config": {
            "size": a.size,
            **SIZES[a.size],
            "seq": a.seq,
            "per_gpu_batch": a.batch,
            "nproc": a.nproc,
            "global_batch": a.nproc * a.batch,
            "ttt_steps": a.ttt,
            "gamma": a.gamma,
            "dtype": "bfloat16" if cuda else "float32",
            "params_dtype": "bfloat16" if cuda else "float32",
            "impl": a.impl,
            "lm_head": "frozen",
            "iters": a.iters,
            "warmup": a.warmup,
            "loss_steps": a.loss_steps,
            "lr": a.lr,
            "tol": a.tol,
            "peak_tflops": a.peak_tflops,
            "loss_reference": "one process, one GPU, one step of batch nproc*batch per step (the same "
            "global batch; no gradient accumulation)",
            "single_gpu_timing": "one process, per-GPU batch, in-place wgrad sums, clip in fused AdamW",
            "ddp": "torch DDP (gradients bucketed and all-reduced during backward), clip in fused AdamW",
            "fsdp": "FSDP2 fully_shard, one group, embed_tokens replicated; clip on local shards",
        },
        "single": single["timing"] if single else None,
        "single_losses": ref,
        "tokens_per_s_1gpu": base,
        **{m: summary.get(m) for m in a.modes},
        "raw": res,
    }
    log(
        "summary: "
        + json.dumps(
            {
                "tokens_per_s_1gpu": base,
                **{
                    m: (
                        None
                        if summary.get(m) is None
                        else {
                            k: summary[m][k]
                            for k in ("tokens_per_s_per_gpu", "scaling_efficiency", "peak_mem_gib_per_gpu")
                        }
                        | {
                            "loss_match": (summary[m].get("loss_check") or {}).get("match"),
                            "loss_max_rel_diff": (summary[m].get("loss_check") or {}).get("max_rel_diff"),
                        }
                    )
                    for m in a.modes
                },
            }
        )
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
