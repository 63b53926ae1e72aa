"""One training loop for every drafter: the source drafter, the Phase 1 fine-tune, the
from-scratch control and Phase 2.

AdamW, linear warmup + cosine decay, gradient clipping, the TTT loss. Periodic checkpoints hold
everything a resume needs (model, optimizer moments, step, RNG, history) in safetensors + JSON:
no pickle, even for our own files. The data order is a pure function of (seed, step), so a resume
continues with exactly the batch an uninterrupted run would have drawn: bit-exact on CPU.

Runs as one process or under torchrun (gloo on CPU, nccl on GPU), data-parallel either way:
every rank takes a slice of the same global batch and the loss is normalized by the global row
count, so N processes compute the same update as one. `parallel: ddp` replicates the drafter;
`parallel: fsdp` shards its trainable weights, their gradients and the AdamW moments over the
ranks (FSDP2 `fully_shard`, one group: the drafter is a single layer unrolled K times, so every
weight is needed in every TTT step and finer groups would only gather the same weights again).
The frozen embed_tokens stays replicated: every step looks up arbitrary rows of it, so sharding
would gather all of it each step and save no peak memory. Checkpoints are the same flat files
either way (gathered to rank 0), so a run resumes under either mode or in one process.

Two port recipes (off by default, and then not a single operation differs): `freeze` keeps named
parts of the drafter at their initial weights (requires_grad off before DDP / FSDP wrap them: no
gradient, no all-reduce or reduce-scatter of one, no AdamW state), and `l2sp_lambda` anchors the
trained weights to w0, the weights train() was handed (a fine-tune's init): after backward and
before clipping each trained weight's gradient gains 2 * lambda * (w - w0), the gradient of
lambda * ||w - w0||^2, on each rank's own weights or shards (no communication). A resume rebuilds
w0 as the first run did (the caller builds the same init again: the checkpoint's `inputs` say
so) and checks it against the digest the checkpoint keeps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from draftport.data.shards import FeatureSet
from draftport.errors import DraftportError
from draftport.files import atomic_dir
from draftport.model.device import describe as describe_device
from draftport.model.device import out_of_memory, peak_tflops, process_age_s
from draftport.model.device import pick as pick_device
from draftport.model.drafter import Eagle3Drafter
from draftport.model.fast.path import FastPath, compile_count
from draftport.model.flops import sample_flops
from draftport.model.flops import shape_of as flops_shape
from draftport.plan.params import TrainConfig  # the train groups of params.yaml: a pydantic model
from draftport.progress import Logger
from draftport.training.batches import StepBatches, batch_ids  # noqa: F401 (batch_ids: the loop's public name)
from draftport.training.optim import AdamW
from draftport.training.ttt import combine, stats_to_float, ttt_terms


def lr_at(step: int, cfg: TrainConfig) -> float:
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(cfg.steps - cfg.warmup_steps, 1)
    t = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * t))


# ---- distributed helpers ---------------------------------------------------------------------
def dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed(device: str = "auto"):
    """Join the torchrun group when launched by torchrun (WORLD_SIZE > 1): NCCL when this
    process trains on its GPU (the device rule of `device`, a train.device value), gloo on the
    CPU (DDP over CPU tensors cannot run on NCCL)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dev = pick_device(device, "train.device")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return dist_info()


# ---- checkpoints (safetensors + json, atomic) ------------------------------------------------
def trainable(drafter: Eagle3Drafter) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in drafter.named_parameters() if p.requires_grad}


def set_trained_parts(drafter: Eagle3Drafter, cfg: TrainConfig) -> None:
    """requires_grad of every weight train() may train: lm_head as cfg.train_lm_head says, each
    part of TrainConfig.FREEZE_PARTS off when cfg.freeze names it, on otherwise (the embedding
    stays frozen: it is the target's)."""
    params = dict(drafter.named_parameters())
    drafter.lm_head.weight.requires_grad_(cfg.train_lm_head)
    for part, names in TrainConfig.FREEZE_PARTS.items():
        for n in names:
            params[n].requires_grad_(part not in cfg.freeze)


def anchor_digest(w0: dict[str, torch.Tensor]) -> str:
    """sha256 of the anchor weights (names, dtypes, shapes, bytes): a resume's rebuilt w0 must be
    the first run's to the bit."""
    h = hashlib.sha256()
    for n in sorted(w0):
        t = w0[n].detach().cpu().contiguous()
        h.update(f"{n}:{t.dtype}:{list(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def add_l2sp_grad(params: list, w0: list, lam: float) -> torch.Tensor:
    """The L2-SP anchor's gradient, in place: grad += 2 * lam * (w - w0) for each trained weight
    (under FSDP: this rank's shard of w, of w0 and of the gradient). -> sum ||w - w0||^2 over them
    (0-dim fp32, this rank's part: under FSDP the ranks' parts add up; no host sync)."""
    sq = None
    for p, a in zip(params, w0):
        sharded = _is_dtensor(p)
        w = p.to_local() if sharded else p
        d = w.detach() - a
        s = torch.linalg.vector_norm(d, dtype=torch.float32).square()
        sq = s if sq is None else sq + s
        if p.grad is None:
            if sharded:  # unused this step (never in an EAGLE-3 step): AdamW skips it anyway
                continue
            p.grad = torch.zeros_like(p)
        g = p.grad.to_local() if sharded else p.grad
        g.add_(d.to(g.dtype), alpha=2 * lam)
    return sq if sq is not None else torch.zeros((), dtype=torch.float32)


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    drafter,
    opt,
    history,
    cfg: TrainConfig,
    sharded=None,
    inputs: dict | None = None,
    data_position: int | None = None,
    anchor: str | None = None,
) -> Path | None:
    """sharded: the FSDP module of train() under parallel: fsdp. Then every rank must call: the
    full state is gathered to rank 0, which alone writes (the same files as one process).
    inputs: what the run was trained on (train()'s `inputs`), kept so a resume can check it.
    data_position: the positions of the run's consumption order read so far (online features:
    where their capture restarts; step x batch size). anchor: the digest of the L2-SP anchor
    (anchor_digest; None without one).
    A full disk is a DraftportError; the previous checkpoints stay as they were."""
    from draftport.files import disk_full_error
    from draftport.model.formats import save_safetensors

    if sharded is not None:
        model, moments, steps = _gather_full_state(sharded, opt)
        if dist.get_rank() != 0:
            return None
    else:
        model = {k: v.detach().cpu().contiguous() for k, v in drafter.export_state().items()}
        params = trainable(drafter)
        name_of = {id(p): n for n, p in params.items()}
        moments, steps = {}, {}
        for p, st in opt.state.items():
            n = name_of[id(p)]
            moments[f"{n}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
            moments[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
            steps[n] = float(st["step"])
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:07d}"
    try:
        with atomic_dir(final) as tmp:
            save_safetensors(model, tmp / "model.safetensors")
            moments["rng.torch"] = torch.get_rng_state()
            save_safetensors(moments, tmp / "optimizer.safetensors")
            state = {
                "step": step,
                "adam_steps": steps,
                "history": history,
                "config": cfg.model_dump(),
                "inputs": inputs,
                "data_position": data_position if data_position is not None else step * cfg.batch_size,
            }
            if anchor is not None:
                state["anchor"] = anchor
            (tmp / "state.json").write_text(json.dumps(state) + "\n")
    except Exception as e:
        err = disk_full_error(e, final)
        if err is None:
            raise
        prev = latest_checkpoint(ckpt_root)
        raise DraftportError(
            final,
            f"{err}; checkpoint not written, the last good one is kept: {prev if prev is not None else 'none yet'}",
        ) from None
    olds = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir())
    for old in olds[: -cfg.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    done = sorted(p for p in ckpt_root.glob("step_*") if (p / "state.json").is_file())
    return done[-1] if done else None


def resumable(path: Path, cfg: TrainConfig, inputs: dict | None = None, anchor: str | None = None) -> bool:
    """A checkpoint continues this run only if everything but the logging cadence matches, the
    inputs (train()'s `inputs`: data, vocab, init) and the L2-SP anchor's digest included."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if state.get("inputs") != inputs or state.get("anchor") != anchor:
        return False
    saved = {
        "eval_every": 0,
        "patience": 0,
        "packing": False,
        "tokens_per_step": 0,
        "l2sp_lambda": 0.0,
        "freeze": [],
        **state.get("config", {}),
    }  # older checkpoints predate them
    # parallel: ddp and fsdp make the same updates, and so does the fast path under any of its
    # params or another device (up to the kernels' rounding); older checkpoints predate those
    # keys (or name the attention kernel `attention`)
    cadence = {"log_every", "checkpoint_every", "keep_checkpoints", "parallel", "fast", "attention", "device"}
    now = cfg.model_dump()
    return {k: v for k, v in saved.items() if k not in cadence} == {k: v for k, v in now.items() if k not in cadence}


def load_model_state(path: Path, drafter) -> None:
    """The weights of a checkpoint into an unsharded drafter (train() loads them before
    sharding, so FSDP shards what was saved)."""
    from safetensors.torch import load_file

    drafter.load_flat_state(load_file(str(path / "model.safetensors")))


def load_optimizer_state(path: Path, drafter, opt) -> tuple[int, list]:
    """AdamW moments and the RNG; under FSDP each rank keeps its shard of the saved moments.
    -> (step, history)."""
    from safetensors.torch import load_file

    moments = load_file(str(path / "optimizer.safetensors"))
    state = json.loads((path / "state.json").read_text())
    params = trainable(drafter)
    # fused (and capturable) AdamW keep the step count on the parameter's device
    step_on_device = bool(
        getattr(opt, "step_on_device", False) or opt.defaults.get("fused") or opt.defaults.get("capturable")
    )
    for n, p in params.items():
        if f"{n}.exp_avg" in moments:
            opt.state[p] = {
                "step": torch.tensor(
                    float(state["adam_steps"][n]), dtype=torch.float32, device=p.device if step_on_device else "cpu"
                ),
                "exp_avg": _like(moments[f"{n}.exp_avg"], p),
                "exp_avg_sq": _like(moments[f"{n}.exp_avg_sq"], p),
            }
    torch.set_rng_state(moments["rng.torch"])
    return state["step"], state["history"]


# ---- DDP / FSDP -------------------------------------------------------------------------------
def wrap_parallel(drafter: Eagle3Drafter, parallel: str, device):
    """What train_step runs: the drafter itself ("none"), its DDP view ("ddp"), or the FSDP module
    holding it ("fsdp": the drafter's parameters become this rank's shards, so build the optimizer
    after this). The last two need an initialized process group (of any size, 1 included)."""
    if parallel == "none":
        return drafter
    if parallel == "ddp":
        # DDP's gradient hooks must see the call, so under torchrun the unroll goes through it.
        return _DDPView(torch.nn.parallel.DistributedDataParallel(drafter))
    if parallel == "fsdp":
        return shard_fsdp(drafter, device)
    raise DraftportError("train.parallel", f"{parallel!r} is not one of ddp, fsdp")


class _FSDPTerms(torch.nn.Module):
    """The FSDP2 root: holds the drafter so that the whole TTT loss, the drafter's lm_head that
    the fused loss applies itself included, runs inside one forward. FSDP gathers the weights in
    its pre-forward hook and reduce-scatters (averages) the gradients once backward has finished
    (no forward input needs a gradient, so its final callback does it; the fused path's in-place
    gradient sums are complete by then)."""

    def __init__(self, drafter: Eagle3Drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, target_head, steps: int, fast: FastPath | None):
        return ttt_terms(self.drafter, batch, target_head, steps, fast)


def shard_fsdp(drafter: Eagle3Drafter, device) -> _FSDPTerms:
    """Shard the drafter's parameters over the process group in place (embed_tokens excepted:
    see the module docstring); -> the module that train_step runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _, world = dist_info()
    net = _FSDPTerms(drafter)
    # one group, the root: it keeps the weights gathered from forward through backward anyway
    fully_shard(
        net,
        mesh=init_device_mesh(torch.device(device).type, (world,)),
        reshard_after_forward=False,
        ignored_params={drafter.embed_tokens.weight},
    )
    return net


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _like(full: torch.Tensor, p) -> torch.Tensor:
    """A saved full tensor placed like parameter p (this rank's shard under FSDP)."""
    if _is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(full.to(device=p.device, dtype=p.dtype), p.device_mesh, p.placements)
    return full.to(p.device)


def _gather_full_state(sharded: _FSDPTerms, opt):
    """Collective: the flat model state (export_state's keys) and AdamW moments as full CPU
    tensors on rank 0 (empty elsewhere). -> (model, moments, adam steps)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(sharded, options=o)
    osd = get_optimizer_state_dict(sharded, opt, options=o)
    pre = "drafter."
    model = {
        k[len(pre) :]: v.detach().contiguous() for k, v in msd.items() if not k[len(pre) :].startswith("embed_tokens")
    }
    moments, steps = {}, {}
    for fqn, st in osd.get("state", {}).items():
        n = fqn[len(pre) :]
        moments[f"{n}.exp_avg"] = st["exp_avg"].detach().contiguous()
        moments[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].detach().contiguous()
        steps[n] = float(st["step"])
    return model, moments, steps


def unshard_fsdp(drafter: Eagle3Drafter) -> None:
    """Collective: replace the sharded parameters by full ones on every rank, so that train()
    hands back the drafter as DDP or one process would (export, evaluation, another train())."""
    for mod in drafter.modules():
        for name, p in list(mod._parameters.items()):
            if _is_dtensor(p):
                full = p.full_tensor().detach().clone()
                mod._parameters[name] = torch.nn.Parameter(full, requires_grad=p.requires_grad)


def _sharded_grad_norm(local_grads: list[torch.Tensor], device) -> torch.Tensor:
    """The global 2-norm of gradients sharded without overlap over the ranks."""
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local_grads:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
    dist.all_reduce(sq)
    return sq.sqrt()


# ---- the loop ----------------------------------------------------------------------------------
def train(
    drafter: Eagle3Drafter,
    features: FeatureSet,
    target_head: torch.Tensor,
    out_dir,
    cfg: TrainConfig,
    logger: Logger | None = None,
    progress: bool = True,
    stop_after: int | None = None,
    ckpt_dir=None,
    inputs: dict | None = None,
    monitor: Callable[[Eagle3Drafter], float] | None = None,
) -> dict:
    """Train in place; checkpoints under ckpt_dir (default out_dir/checkpoints), resumed
    automatically when they were made with the same config and the same `inputs` (a JSON-able
    fingerprint of the data, vocab and init: a rerun on other data must not continue them).

    monitor: the held-out accept length of the drafter as it is (offline tau on a fixed set),
    called every cfg.eval_every steps and at the last one; its value joins that step's history
    record and the logger as `accept_length`. cfg.patience > 0: training stops once that many
    evaluations in a row brought no better tau than the best so far (the record of the stop says
    `early_stop`; a resume of a stopped run trains no further). The weights at the stop are kept.

    Returns {"history": [...per logged step...], "final": {...last step metrics...},
    "steps", "seconds", "resumed_from" (the checkpoint's step, 0 for a fresh start),
    "curve" ([{step, accept_length}] of the monitor), "stopped_early", "run" (where it ran, its rate)}.
    stop_after: return after this many steps of this call (tests interrupt a run with it).
    """
    logger = logger or Logger()
    run = _setup(drafter, target_head, out_dir, cfg, ckpt_dir, inputs, monitor)
    step, history = _resume(run, drafter, features, cfg, logger)
    resumed_from = step
    stopped = bool(history and history[-1].get("early_stop"))  # a stopped run stays stopped
    scores = [r["accept_length"] for r in history if "accept_length" in r]
    bar = _bar(cfg, step) if progress and run.rank == 0 else None
    batches = StepBatches(features, cfg, run.rank, run.world, run.device)
    t0 = time.time()
    rate = _Rate(drafter, cfg, run.device, run.world)
    # The host reads the device only at log / checkpoint steps, so the CPU can queue the next
    # step while the GPU runs this one; a non-finite loss is remembered and raised there,
    # before any checkpoint could save it.
    bad = torch.zeros((), dtype=torch.bool, device=run.device)
    while step < cfg.steps and not stopped:
        out = _draw_and_step(run, batches, rate, step, cfg)
        bad |= ~torch.isfinite(out[0].detach())
        step += 1
        rate.stepped(step)
        last = stop_after is not None and step - resumed_from >= stop_after  # steps of this call
        eval_now, log_now, ckpt_now = _due(step, cfg)
        if log_now or ckpt_now or last:
            _check_finite(bad, step, run.ckpt_root)
            stats = run.stats(out, cfg)
            rate.sync_point(step)
            if eval_now:  # every rank: the same drafter, the same set, the same stop
                stopped = _watch(monitor, drafter, step, rate, stats, scores, cfg.patience)
            if log_now:
                ckpt_now = _record(run, logger, history, step, stats, stopped, scores, cfg) or ckpt_now
            if bar is not None:
                bar.set_postfix(loss=f"{stats['loss']:.3f}", acc0=f"{stats['acc_0']:.3f}")
        if bar is not None:
            bar.update(1)
        if ckpt_now:
            position = getattr(features, "position", None)  # online features count their own
            position = batches.position(step) if position is None else position
            run.checkpoint(step, drafter, history, cfg, inputs, position, rate)
        if run.world > 1:
            dist.barrier()
        if last:
            break
    batches.close()
    if bar is not None:
        bar.close()
    if run.fsdp:
        unshard_fsdp(drafter)
    return _result(history, step, t0, resumed_from, stopped, rate)


def _draw_and_step(run: "_Run", batches: StepBatches, rate: "_Rate", step: int, cfg: TrainConfig):
    """This rank's part of global batch `step`, counted in the rate, and one optimizer step on it
    (train_step's outputs)."""
    with out_of_memory(f"train step {step + 1}: its batch", oom_knob(cfg)):
        lengths, batch = batches.get(step)
    rate.count(lengths)
    return run.step(batch, step, cfg)


def _due(step: int, cfg: TrainConfig) -> tuple[bool, bool, bool]:
    """What the loop does after `step` steps: (held-out tau, a logged record, a checkpoint)."""
    eval_now = bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)
    log_now = step % cfg.log_every == 0 or step == cfg.steps or eval_now
    ckpt_now = step % cfg.checkpoint_every == 0 or step == cfg.steps
    return eval_now, log_now, ckpt_now


def _check_finite(bad: torch.Tensor, step: int, ckpt_root: Path) -> None:
    """Raise if any loss since the last sync point was not finite (reads the device)."""
    if bool(bad):
        raise DraftportError(
            f"train step {step}",
            f"loss is not finite (at or before this step); last good checkpoint kept in {ckpt_root}",
        )


def _watch(monitor, drafter, step: int, rate: "_Rate", stats: dict, scores: list, patience: int) -> bool:
    """The held-out tau into this step's stats and the scores; -> whether training stops (plateaued)."""
    stats["accept_length"] = _held_out(monitor, drafter, step, rate)
    scores.append(stats["accept_length"])
    return plateaued(scores, patience)


def _result(history: list, step: int, t0: float, resumed_from: int, stopped: bool, rate: "_Rate") -> dict:
    """train()'s return value (see its docstring)."""
    curve = [{"step": r["step"], "accept_length": r["accept_length"]} for r in history if "accept_length" in r]
    return {
        "history": history,
        "final": history[-1] if history else {},
        "steps": step,
        "seconds": time.time() - t0,
        "resumed_from": resumed_from,
        "curve": curve,
        "stopped_early": stopped,
        "run": rate.summary(),
    }


def _held_out(monitor, drafter, step: int, rate: "_Rate") -> float:
    """The monitor's held-out tau, its time kept out of the training's rate."""
    rate.pause()
    with out_of_memory(f"train step {step}: held-out tau", "monitor.batch_size"):
        tau = float(monitor(drafter))
    rate.resume()
    return tau


def plateaued(scores: list[float], patience: int) -> bool:
    """cfg.patience > 0: the last `patience` held-out evaluations brought no better tau than the best before."""
    return bool(patience) and len(scores) > patience and max(scores[-patience:]) <= max(scores[:-patience])


def _record(
    run: "_Run", logger: Logger, history: list, step: int, stats: dict, stopped: bool, scores: list, cfg: TrainConfig
) -> bool:
    """A logged step's record in the history and the logger; -> whether it must checkpoint (a stop)."""
    rec = {"step": step, **{k: round(v, 6) for k, v in stats.items()}}
    if stopped:
        rec["early_stop"] = 1
    history.append(rec)
    if run.rank == 0:
        logger.log_metrics({k: v for k, v in stats.items() if not k.startswith("n_")}, step)
        if stopped:
            print(
                f"early stop at step {step}: held-out tau {stats['accept_length']:.3f}, best "
                f"{max(scores):.3f}, none better in the last {cfg.patience} evaluations",
                flush=True,
            )
    return stopped


def _bar(cfg: TrainConfig, step: int):
    from draftport.progress import progress as progress_bar

    return progress_bar(cfg.steps, "train", "step", initial=step)


class _Run:
    """What a training's steps run with: the device and its precision, the fast path, the drafter
    as the step sees it (DDP / FSDP), its trained weights, the optimizer, the L2-SP anchor, the
    checkpoints' folder and the checkpoint to resume from."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def step(self, batch, step: int, cfg: TrainConfig):
        """One optimizer step at its scheduled learning rate (train_step's outputs)."""
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        with out_of_memory(f"train step {step + 1}", oom_knob(cfg)):
            return train_step(
                self.net,
                batch,
                self.head,
                self.opt,
                self.params,
                cfg,
                fast=self.fast,
                use_bf16=self.use_bf16,
                world=self.world,
                l2sp=self.l2sp,
            )

    def checkpoint(self, step: int, drafter, history: list, cfg: TrainConfig, inputs, data_position, rate) -> None:
        """The checkpointer: rank 0 writes (under FSDP every rank joins the gather), its time kept
        out of the training's rate."""
        if self.rank != 0 and not self.fsdp:
            return
        rate.pause()
        save_checkpoint(
            self.ckpt_root,
            step,
            drafter,
            self.opt,
            history,
            cfg,
            sharded=self.net if self.fsdp else None,
            inputs=inputs,
            data_position=data_position,
            anchor=self.anchor,
        )
        rate.resume()

    def stats(self, out, cfg: TrainConfig) -> dict:
        """A logged step's figures as floats: per-TTT-step loss and accuracy, the weighted loss,
        lr, the gradient norm, and with L2-SP the penalty and the distance to the anchor."""
        loss, terms, counts, stats_t, gnorm = out
        stats = _reduce_stats(terms, counts) if self.world > 1 else stats_to_float(stats_t)
        if self.l2sp is not None:
            sq = stats_t["anchor_sq"].float()
            if self.fsdp:  # each rank holds its shards' part
                sq = sq.clone()
                dist.all_reduce(sq)
            sq = float(sq)
            stats.pop("anchor_sq", None)
            stats.update(l2sp_penalty=cfg.l2sp_lambda * sq, anchor_distance=math.sqrt(sq))
        stats.update(
            loss=sum(cfg.gamma**j * stats[f"loss_{j}"] for j in range(cfg.ttt_steps)),
            lr=self.opt.param_groups[0]["lr"],
            grad_norm=float(gnorm),
        )
        return stats


def _check(cfg: TrainConfig, world: int, monitor, device: torch.device) -> tuple[str, bool]:
    """A training's settings checked together (one line naming the key); -> (impl, fsdp)."""
    if cfg.batch_size % world:
        raise DraftportError("train.batch_size", f"{cfg.batch_size} is not divisible by {world} processes")
    # impl and parallel are TrainConfig's Literals: params validation refused any other value
    impl = cfg.impl if cfg.impl != "auto" else ("compiled" if device.type == "cuda" else "reference")
    fsdp = cfg.parallel == "fsdp" and world > 1
    if cfg.patience and not cfg.eval_every:
        raise DraftportError(
            "train.patience", f"{cfg.patience} needs train.eval_every > 0 (the held-out tau it watches)"
        )
    if cfg.eval_every and monitor is None:
        raise DraftportError("train.eval_every", f"{cfg.eval_every} but this run has no held-out monitor set")
    if cfg.eval_every and fsdp:
        raise DraftportError(
            "train.eval_every",
            "held-out tau during training runs on a whole drafter: use parallel ddp (or eval_every 0) under fsdp",
        )
    return impl, fsdp


def _setup(drafter, target_head, out_dir, cfg: TrainConfig, ckpt_dir, inputs, monitor) -> _Run:
    """The drafter and the head on the device rule's device, the trained parts set, the anchor taken,
    a stale checkpoint set aside and a resumable one's weights loaded, DDP / FSDP wrapped, the
    optimizer built."""
    rank, world = dist_info()
    device = pick_device(cfg.device, "train.device")
    drafter.to(device)  # the drafter, its frozen embedding and maps; the optimizer's state follows
    head = target_head.to(device)
    impl, fsdp = _check(cfg, world, monitor, device)
    fast = fast_path(cfg, impl, accumulate_wgrad=world == 1 or fsdp)
    set_trained_parts(drafter, cfg)  # before DDP / FSDP see the parameters
    w0, anchor = None, None
    if cfg.l2sp_lambda:
        # the anchor: the weights handed in (the init, rebuilt the same way by a resume), taken
        # before a checkpoint's weights are loaded
        w0 = {n: p.detach().clone() for n, p in trainable(drafter).items()}
        anchor = anchor_digest(w0)
    ckpt_root = Path(ckpt_dir) if ckpt_dir is not None else Path(out_dir) / "checkpoints"
    last = _resume_point(ckpt_root, cfg, inputs, anchor, rank, world)
    if last is not None:
        load_model_state(last, drafter)  # before sharding: FSDP shards the saved weights
    net = wrap_parallel(drafter, cfg.parallel if world > 1 else "none", device)
    params = trainable(drafter)  # under FSDP: this rank's shards
    l2sp = None
    if w0 is not None:  # (weights, their anchors): under FSDP the anchors' shards of this rank
        l2sp = (
            list(params.values()),
            [_like(w0[n], p).to_local() if _is_dtensor(p) else w0[n] for n, p in params.items()],
            cfg.l2sp_lambda,
        )
    return _Run(
        rank=rank,
        world=world,
        device=device,
        head=head,
        fsdp=fsdp,
        fast=fast,
        net=net,
        params=list(params.values()),
        opt=_optimizer(params, cfg, device, fsdp),
        l2sp=l2sp,
        anchor=anchor,
        ckpt_root=ckpt_root,
        last=last,
        use_bf16=cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda"),
    )


def _resume_point(ckpt_root: Path, cfg: TrainConfig, inputs, anchor, rank: int, world: int) -> Path | None:
    """The last checkpoint if it continues this run. One of another configuration (edited
    params.yaml) or of other inputs (new features, another init, another anchor) must not be
    continued: that would mix two runs. Its folder is set aside, never deleted."""
    last = latest_checkpoint(ckpt_root)
    if last is None or resumable(last, cfg, inputs, anchor):
        return last
    aside = ckpt_root.with_name(f"{ckpt_root.name}.stale-{int(time.time())}")
    if rank == 0:
        os.replace(ckpt_root, aside)
        print(
            f"checkpoints in {ckpt_root} belong to another training configuration or other inputs; moved to {aside}",
            flush=True,
        )
    if world > 1:
        dist.barrier()
    return None


def _optimizer(params: dict, cfg: TrainConfig, device: torch.device, fsdp: bool):
    decay = [p for p in params.values() if p.ndim >= 2]
    no_decay = [p for p in params.values() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if device.type == "cuda" and not fsdp:
        # torch's AdamW arithmetic as one compiled kernel per parameter (draftport.training.optim): the
        # fused AdamW's pass over ~1B parameters moves 16 bytes each, this one 14
        return AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    # CPU (the embedded runs), and FSDP's sharded parameters: torch's own
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def _resume(run: _Run, drafter, features, cfg: TrainConfig, logger: Logger) -> tuple[int, list]:
    """(step, history) to continue from: the checkpoint's optimizer state and RNG loaded, its
    curve given to a new tracking run, online features begun at its data position; the seed
    set for the first step."""
    step, history = 0, []
    if run.last is not None:
        step, history = load_optimizer_state(run.last, drafter, run.opt)
        if run.rank == 0:
            print(f"resuming from {run.last} (step {step})", flush=True)
            for rec in history:  # a new tracking run: give it the curve up to the checkpoint
                logger.log_metrics(
                    {k: v for k, v in rec.items() if k != "step" and not k.startswith("n_")}, rec["step"]
                )
    begin = getattr(features, "begin", None)
    if begin is not None:  # online features (draftport.training.spool): their capture starts at this data position
        pos = json.loads((run.last / "state.json").read_text()).get("data_position") if step else None
        begin(step, cfg, pos)
    torch.manual_seed(cfg.seed + step)
    return step, history


# what lowers a training step's memory, named when the GPU runs out of it
OOM_KNOB = "train.batch_size (with train.packing: the samples, hence the tokens, a row packs)"
OOM_KNOB_TOKENS = "train.tokens_per_step (the tokens a step's row packs)"


def oom_knob(cfg: TrainConfig) -> str:
    return OOM_KNOB_TOKENS if cfg.tokens_per_step else OOM_KNOB


class _Rate:
    """The loop's own throughput: real (unpadded) tokens per second of step time, the time spent in
    held-out evaluations and checkpoints left out, and MFU by the training benchmark's FLOP count
    (draftport.model.flops) against the GPU's peak (None on the CPU). The clock is read at the
    host's sync points only (log and checkpoint steps), so the rate costs the GPU nothing."""

    def __init__(self, drafter, cfg: TrainConfig, device: torch.device, world: int):
        self.shape = flops_shape(drafter.cfg)
        self.cfg, self.device, self.world = cfg, device, world
        self.tokens, self.flops, self.seconds, self.steps = 0, 0.0, 0.0, 0
        self.t = None
        # the steady rate: from the first sync point past the warm-up (compiles, allocator growth)
        self.warm, self.mark = min(10, cfg.steps // 5), None
        self.start_s = process_age_s()  # the process's start to the training's first step (imports, loading)
        self.compiles0 = self.compiles = compile_count()
        self.last_compile_step = 0

    def _active(self) -> float:
        return self.seconds + (time.perf_counter() - self.t if self.t is not None else 0.0)

    def sync_point(self, step: int) -> None:
        """At a step where the host has just read the device: start the steady clock past the warm-up."""
        if self.mark is None and step >= self.warm and self.steps:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.mark = (self._active(), self.tokens, self.flops, self.steps)

    def stepped(self, step: int) -> None:
        """After `step` steps: a step that made new compiled graphs is remembered (a read of a
        host counter; the device is not waited on)."""
        n = compile_count()
        if n != self.compiles:
            self.compiles, self.last_compile_step = n, step
            self.mark = None  # a compile past the mark: the steady clock starts again at the next sync point

    def count(self, lengths: list[int]) -> None:
        """A step of samples of these real (unpadded) lengths."""
        if self.t is None:
            self.resume()
        self.tokens += sum(lengths) * self.world  # every rank takes an equal share of the global batch
        self.flops += sample_flops(self.shape, lengths, self.cfg.ttt_steps, self.cfg.train_lm_head) * self.world
        self.steps += 1

    def pause(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.t is not None:
            self.seconds += time.perf_counter() - self.t
            self.t = None

    def resume(self) -> None:
        self.t = time.perf_counter()

    def summary(self) -> dict:
        self.pause()
        info = describe_device(self.device, self.world)
        peak = peak_tflops(info["gpu"])
        tok_s = self.tokens / self.seconds if self.seconds > 0 else None
        mfu = self.flops / self.seconds / (peak * 1e12 * self.world) if peak and self.seconds > 0 else None
        out = {
            **info,
            "steps": self.steps,
            "tokens": self.tokens,
            "step_seconds": round(self.seconds, 3),
            "tokens_per_s": tok_s,
            "mfu": mfu,
        }
        out.update(
            start_s=round(self.start_s, 1) if self.start_s is not None else None,
            compiles=self.compiles - self.compiles0,  # graphs this training compiled (dynamo's count)
            last_compile_step=self.last_compile_step,
        )
        if self.mark is not None and self.seconds > self.mark[0]:  # past the warm-up: what the bench compares with
            dt = self.seconds - self.mark[0]
            out["steady_tokens_per_s"] = (self.tokens - self.mark[1]) / dt
            out["steady_mfu"] = (self.flops - self.mark[2]) / dt / (peak * 1e12 * self.world) if peak else None
            # the first steps' seconds beyond what they cost at the steady rate: compiles, the
            # allocator's growth, cuDNN's plans
            per_step = dt / max(1, self.steps - self.mark[3])
            out["warmup_s"] = round(max(0.0, self.mark[0] - self.mark[3] * per_step), 2)
        return out


def fast_path(cfg: TrainConfig, impl: str, accumulate_wgrad: bool) -> FastPath | None:
    """How a training's steps are computed: None for impl reference, else the fast path its
    params describe (compiled for impl compiled). accumulate_wgrad: weight gradients summed in
    place across TTT steps (one process or FSDP, which reads .grad once backward has finished;
    DDP needs them to pass through autograd)."""
    if impl == "reference":
        return None
    return FastPath(
        attention=cfg.fast.attention,
        packed_attention=cfg.fast.packed_attention,
        compile=impl == "compiled",
        # tuning pays back over many steps only: a short training compiles with inductor's defaults
        compile_tuning=cfg.fast.compile_tuning and cfg.steps >= cfg.fast.tune_min_steps,
        accumulate_wgrad=accumulate_wgrad,
    )


def train_step(
    net,
    batch,
    target_head: torch.Tensor,
    opt,
    params: list,
    cfg: TrainConfig,
    *,
    fast: FastPath | None = None,
    use_bf16: bool = False,
    world: int = 1,
    clip_in_optimizer: bool | None = None,
    l2sp: tuple | None = None,
):
    """One optimizer step (TTT loss, backward, clipping, AdamW) with no host sync, so the CPU
    can queue the next step while this one runs (under DDP/FSDP the row counts are all-reduced).

    net: the drafter, its DDP view, or the FSDP module of shard_fsdp (params then hold this rank's
    shards). fast: the fast path (None: the reference loss). clip_in_optimizer (default: when the
    optimizer is fused AdamW or draftport's, and the parameters are not sharded) applies the
    gradient clipping inside the optimizer's kernel. l2sp: (params, their anchors w0, lambda): the
    L2-SP anchor's gradient is added before the clipping (add_l2sp_grad); stats then hold
    `anchor_sq`, sum ||w - w0||^2 before this step's update (this rank's part under FSDP).
    Returns (loss, terms, global counts or None, stats as 0-dim tensors, grad norm before
    clipping, the anchor's gradient included)."""
    device = target_head.device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
        if isinstance(net, _FSDPTerms):
            terms = net(batch, target_head, cfg.ttt_steps, fast)
        else:
            terms = ttt_terms(net, batch, target_head, cfg.ttt_steps, fast)
    counts = None
    if world > 1:
        counts = torch.stack([t[1] for t in terms]).float()
        dist.all_reduce(counts)
        counts = list(counts)
    loss, stats = combine(terms, cfg.gamma, counts, scale=float(world), sync=False)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if l2sp is not None:
        stats["anchor_sq"] = add_l2sp_grad(*l2sp)
    sharded = bool(params) and _is_dtensor(params[0])
    if clip_in_optimizer is None:
        takes_scale = bool(opt.defaults.get("fused")) or getattr(opt, "takes_grad_scale", False)
        clip_in_optimizer = takes_scale and not sharded
    if sharded:
        # FSDP: the norm over this rank's gradient shards, summed over the ranks; the same
        # coefficient as clip_grad_norm_, applied to the local shards
        with torch.no_grad():
            grads = [p.grad.to_local() for p in params if p.grad is not None]
            gnorm = _sharded_grad_norm(grads, device)
            if clip_in_optimizer:
                opt.grad_scale = ((gnorm + 1e-6) / cfg.grad_clip).clamp_min(1.0)
            elif grads:
                torch._foreach_mul_(grads, (cfg.grad_clip / (gnorm + 1e-6)).clamp_max(1.0))
    elif clip_in_optimizer:
        # fused AdamW (and draftport's) divides every gradient by `grad_scale` as it reads it:
        # clipping there saves clip_grad_norm_'s in-place pass over all gradients
        grads = [p.grad for p in params if p.grad is not None]
        if hasattr(opt, "grad_norm"):  # draftport's AdamW: one compiled reduction per gradient
            gnorm = opt.grad_norm(grads)
        else:
            gnorm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
        opt.grad_scale = ((gnorm + 1e-6) / cfg.grad_clip).clamp_min(1.0)
    else:
        gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    return loss, terms, counts, stats, gnorm


class _DDPView:
    """Lets ttt_terms run the drafter's unroll (the reference one, or the fast path's through the
    drafter's forward) through DistributedDataParallel.forward."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.module = ddp.module  # the fast loss applies lm_head itself
        self.hot_ids = ddp.module.hot_ids
        self.t2d = ddp.module.t2d

    def __call__(self, *args, **kw):
        return self.ddp(*args, **kw)

    unroll = __call__


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
