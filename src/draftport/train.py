"""One training loop for every drafter: the source drafter, the Phase 1 fine-tune, the
from-scratch control and Phase 2.

AdamW, linear warmup + cosine decay, gradient clipping, the TTT loss. Periodic checkpoints hold
everything a resume needs (model, optimizer moments, step, RNG, history) in safetensors + JSON:
no pickle, even for our own files. The data order is a pure function of (seed, step), so a resume
continues with exactly the batch an uninterrupted run would have drawn: bit-exact on CPU.

Runs as one process or under torchrun (DDP, gloo on CPU, nccl on GPU); every rank takes a slice
of the same global batch and the loss is normalized by the global row count, so N processes
compute the same update as one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import atomic_write_text
from .data import FeatureSet, collate
from .drafter import Eagle3Drafter
from .errors import DraftportError
from .ttt import combine, compile_loss_kernels, stats_to_float, ttt_terms


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 8          # global batch, in samples
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ttt_steps: int = 3
    gamma: float = 0.8
    seed: int = 0
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    log_every: int = 10
    dtype: str = "auto"          # auto: float32 on CPU, bfloat16 autocast on CUDA
    train_lm_head: bool = True
    # reference: dense-mask attention and whole-tensor loss (the readable definition);
    # fused: flash attention + log-sum-exp merge, row-chunked fused soft-CE (same terms);
    # compiled: fused + torch.compile of the per-step regions; auto: compiled on CUDA.
    impl: str = "auto"

    @classmethod
    def from_dict(cls, d: dict, where="train") -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DraftportError(where, f"unknown training key(s): {', '.join(unknown)}")
        return cls(**d)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    t = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * t))


def batch_ids(step: int, n: int, batch: int, seed: int) -> list[int]:
    """Sample ids of global batch `step`: epochs of seeded permutations, concatenated."""
    out = []
    pos = step * batch
    while len(out) < batch:
        epoch, off = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        take = perm[off: off + batch - len(out)]
        out.extend(take)
        pos += len(take)
    return out


class Logger:
    """What the loop reports to; MLflow plugs in behind the same two methods."""

    def log_params(self, params: dict) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int) -> None:
        pass


class PrintLogger(Logger):
    def log_metrics(self, metrics, step):
        keys = ("loss", "acc_0", "lr")
        print(f"step {step}: " + " ".join(f"{k} {metrics[k]:.4g}" for k in keys if k in metrics), flush=True)


# ---- distributed helpers ---------------------------------------------------------------------
def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed():
    """Join the torchrun group when launched by torchrun (WORLD_SIZE > 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return dist_info()


# ---- checkpoints (safetensors + json, atomic) ------------------------------------------------
def trainable(drafter: Eagle3Drafter) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in drafter.named_parameters() if p.requires_grad}


def save_checkpoint(ckpt_root: Path, step: int, drafter, opt, history, cfg: TrainConfig) -> Path:
    from safetensors.torch import save_file

    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:07d}.", dir=ckpt_root))
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in drafter.export_state().items()},
                  str(tmp / "model.safetensors"))
        params = trainable(drafter)
        name_of = {id(p): n for n, p in params.items()}
        moments, steps = {}, {}
        for p, st in opt.state.items():
            n = name_of[id(p)]
            moments[f"{n}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
            moments[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
            steps[n] = float(st["step"])
        moments["rng.torch"] = torch.get_rng_state()
        save_file(moments, str(tmp / "optimizer.safetensors"))
        state = {"step": step, "adam_steps": steps, "history": history, "config": asdict(cfg)}
        (tmp / "state.json").write_text(json.dumps(state) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    olds = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in olds[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(p for p in ckpt_root.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def resumable(path: Path, cfg: TrainConfig) -> bool:
    """A checkpoint continues this run only if everything but the logging cadence matches."""
    try:
        saved = json.loads((path / "state.json").read_text()).get("config", {})
    except (OSError, json.JSONDecodeError):
        return False
    cadence = {"log_every", "checkpoint_every", "keep_checkpoints"}
    now = asdict(cfg)
    return {k: v for k, v in saved.items() if k not in cadence} == {k: v for k, v in now.items() if k not in cadence}


def load_checkpoint(path: Path, drafter, opt) -> tuple[int, list]:
    from safetensors.torch import load_file

    model = load_file(str(path / "model.safetensors"))
    drafter.load_flat_state(model)
    moments = load_file(str(path / "optimizer.safetensors"))
    state = json.loads((path / "state.json").read_text())
    params = trainable(drafter)
    for n, p in params.items():
        if f"{n}.exp_avg" in moments:
            opt.state[p] = {"step": torch.tensor(state["adam_steps"][n]),
                            "exp_avg": moments[f"{n}.exp_avg"].to(p.device),
                            "exp_avg_sq": moments[f"{n}.exp_avg_sq"].to(p.device)}
    torch.set_rng_state(moments["rng.torch"])
    return state["step"], state["history"]


# ---- the loop ----------------------------------------------------------------------------------
def train(drafter: Eagle3Drafter, features: FeatureSet, target_head: torch.Tensor, out_dir,
          cfg: TrainConfig, logger: Logger | None = None, progress: bool = True,
          stop_after: int | None = None) -> dict:
    """Train in place; checkpoints under out_dir/checkpoints, resumed automatically.

    Returns {"history": [...per logged step...], "final": {...last step metrics...}}.
    stop_after: return after this many steps of this call (tests interrupt a run with it).
    """
    logger = logger or Logger()
    rank, world = dist_info()
    if cfg.batch_size % world:
        raise DraftportError("train.batch_size", f"{cfg.batch_size} is not divisible by {world} processes")
    device = target_head.device
    use_bf16 = cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")
    impl = cfg.impl if cfg.impl != "auto" else ("compiled" if device.type == "cuda" else "reference")
    if impl not in ("reference", "fused", "compiled"):
        raise DraftportError("train.impl", f"{cfg.impl!r} is not one of auto, reference, fused, compiled")
    if impl == "compiled":
        drafter.compile_regions()
        compile_loss_kernels()
    # sum weight gradients in place across TTT steps; DDP needs them to pass through autograd
    drafter.accumulate_wgrad = impl != "reference" and world == 1
    drafter.lm_head.weight.requires_grad_(cfg.train_lm_head)
    params = trainable(drafter)
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(0.9, 0.95), fused=device.type == "cuda")
    # DDP's gradient hooks must see the call, so under torchrun the unroll goes through it.
    net = _DDPView(torch.nn.parallel.DistributedDataParallel(drafter)) if world > 1 else drafter

    out_dir = Path(out_dir)
    ckpt_root = out_dir / "checkpoints"
    step, history = 0, []
    last = latest_checkpoint(ckpt_root)
    if last is not None and not resumable(last, cfg):
        # A checkpoint of another configuration (edited params.yaml) must not be continued:
        # that would mix two runs. Its folder is set aside, never deleted.
        aside = ckpt_root.with_name(f"checkpoints.stale-{int(time.time())}")
        if rank == 0:
            os.replace(ckpt_root, aside)
            print(f"checkpoints in {ckpt_root} belong to another training configuration; moved to {aside}", flush=True)
        if world > 1:
            dist.barrier()
        last = None
    if last is not None:
        step, history = load_checkpoint(last, drafter, opt)
        if rank == 0:
            print(f"resuming from {last} (step {step})", flush=True)
    torch.manual_seed(cfg.seed + step)

    bar = None
    if progress and rank == 0:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step", dynamic_ncols=True)
    n = len(features)
    done_this_call = 0
    t0 = time.time()
    # The host reads the device only at log / checkpoint steps, so the CPU can queue the next
    # step while the GPU runs this one; a non-finite loss is remembered and raised there,
    # before any checkpoint could save it.
    bad = torch.zeros((), dtype=torch.bool, device=device)
    while step < cfg.steps:
        ids = batch_ids(step, n, cfg.batch_size, cfg.seed)
        mine = ids[rank::world]
        batch, _ = collate([features.sample(i) for i in mine])
        batch = batch.to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss, terms, counts, stats_t, gnorm = train_step(net, batch, target_head, opt, list(params.values()),
                                                         cfg, impl=impl, use_bf16=use_bf16, world=world)
        bad |= ~torch.isfinite(loss.detach())
        step += 1
        done_this_call += 1
        last = stop_after is not None and done_this_call >= stop_after
        log_now = step % cfg.log_every == 0 or step == cfg.steps
        ckpt_now = step % cfg.checkpoint_every == 0 or step == cfg.steps
        if log_now or ckpt_now or last:
            if bool(bad):
                raise DraftportError(f"train step {step}", f"loss is not finite (at or before this step); "
                                     f"last good checkpoint kept in {ckpt_root}")
            stats = _reduce_stats(terms, counts) if world > 1 else stats_to_float(stats_t)
            stats.update(loss=sum(cfg.gamma ** j * stats[f"loss_{j}"] for j in range(cfg.ttt_steps)),
                         lr=opt.param_groups[0]["lr"], grad_norm=float(gnorm))
            if log_now:
                rec = {"step": step, **{k: round(v, 6) for k, v in stats.items()}}
                history.append(rec)
                if rank == 0:
                    logger.log_metrics({k: v for k, v in stats.items() if not k.startswith("n_")}, step)
            if bar is not None:
                bar.set_postfix(loss=f"{stats['loss']:.3f}", acc0=f"{stats['acc_0']:.3f}")
        if bar is not None:
            bar.update(1)
        if rank == 0 and ckpt_now:
            save_checkpoint(ckpt_root, step, drafter, opt, history, cfg)
        if world > 1:
            dist.barrier()
        if last:
            break
    if bar is not None:
        bar.close()
    return {"history": history, "final": history[-1] if history else {}, "steps": step,
            "seconds": time.time() - t0}


def train_step(net, batch, target_head: torch.Tensor, opt, params: list, cfg: TrainConfig, *,
               impl: str = "reference", use_bf16: bool = False, world: int = 1,
               clip_in_optimizer: bool | None = None):
    """One optimizer step (TTT loss, backward, clipping, AdamW) with no host sync, so the CPU
    can queue the next step while this one runs (under DDP the row counts are all-reduced).

    clip_in_optimizer (default: when the optimizer is fused AdamW) applies the gradient
    clipping inside the optimizer's kernel. Returns (loss, terms, global counts or None, stats as
    0-dim tensors, grad norm before clipping)."""
    device = target_head.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
        terms = ttt_terms(net, batch, target_head, cfg.ttt_steps, fused=impl != "reference")
    counts = None
    if world > 1:
        counts = torch.stack([t[1] for t in terms]).float()
        dist.all_reduce(counts)
        counts = list(counts)
    loss, stats = combine(terms, cfg.gamma, counts, scale=float(world), sync=False)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip_in_optimizer is None:
        clip_in_optimizer = bool(opt.defaults.get("fused"))
    if clip_in_optimizer:
        # fused AdamW divides every gradient by `grad_scale` as it reads it: clipping there
        # saves clip_grad_norm_'s in-place pass over all gradients
        grads = [p.grad for p in params if p.grad is not None]
        gnorm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        opt.grad_scale = ((gnorm + 1e-6) / cfg.grad_clip).clamp_min(1.0)
    else:
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return loss, terms, counts, stats, gnorm


class _DDPView:
    """Lets ttt_terms call unroll() through DistributedDataParallel.forward."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.module = ddp.module      # the fused loss applies lm_head itself
        self.hot_ids = ddp.module.hot_ids
        self.t2d = ddp.module.t2d

    def unroll(self, *args, **kw):
        return self.ddp(*args, **kw)


def _reduce_stats(terms, counts):
    sums = torch.stack([torch.stack([t[0].detach().float(), t[2].float()]) for t in terms])
    dist.all_reduce(sums)
    stats = {}
    for j, c in enumerate(counts):
        c = c.clamp_min(1)
        stats[f"loss_{j}"] = float(sums[j, 0] / c)
        stats[f"acc_{j}"] = float(sums[j, 1] / c)
        stats[f"n_{j}"] = float(c)
    return stats
