"""AdamW with its update as one elementwise kernel per parameter (the GPU training path).

torch's fused AdamW (`fused=True`) runs every parameter through one multi-tensor kernel that reads
the parameter, its gradient and both moments and writes all four back: with a `grad_scale` (how
train_step clips: the kernel divides each gradient by it as it reads it) it also stores the
unscaled gradient, 16 bytes per bf16 parameter. Here the same arithmetic, in the same order and
in fp32 (torch's opmath), runs as two torch.compile'd functions per parameter: its scalars (the
bias corrections, once) and one pointwise pass over its flat view that reads the parameter, the
gradient and the moments and writes the parameter and the moments (14 bytes per bf16 parameter;
the gradient is left as it was): fewer bytes and nearer a plain copy's bandwidth on an H200
(benchmarks/results/2026-12-02-h200-probe-adamw.json). The step count, learning rate and
gradient scale are device tensors, so a step never syncs with the host and a new learning rate
never recompiles. The clipping norm (grad_norm) is one compiled reduction per gradient.

The state is torch.optim.AdamW's: per parameter `step` (a 0-dim fp32 tensor on the parameter's
device, as the fused AdamW keeps it), `exp_avg` and `exp_avg_sq` in the parameter's dtype, so
checkpoints are the same files and a run resumes under either optimizer.
"""

from __future__ import annotations

import torch

from draftport.model.fast.path import allow_recompiles


def adamw_scalars(step, lr, beta1: float, beta2: float, weight_decay: float):
    """step += 1; -> (lr / bias correction 1, sqrt(bias correction 2), lr * weight_decay) as 0-dim
    fp32 tensors. Apart from the pointwise part so that a compiled kernel computes them once, not
    once per element (two pow, a sqrt and a division each: on ~1B parameters that arithmetic,
    not the memory, would set the time)."""
    step.add_(1)
    bc1 = 1 - torch.pow(beta1, step)
    bc2_sqrt = torch.sqrt(1 - torch.pow(beta2, step))
    return lr / bc1, bc2_sqrt, lr * weight_decay


def adamw_pointwise(p, g, m, v, step_size, bc2_sqrt, lr_wd, scale, beta1: float, beta2: float, eps: float, decay: bool):
    """The elementwise part of one AdamW step, in place on p, m, v: torch's fused AdamW arithmetic
    in fp32 (ADAMW mode, no amsgrad, no maximize). scale: None, or a 0-dim tensor the gradient is
    divided by as it is read (clipping)."""
    gf = g.float()
    if scale is not None:
        gf = gf / scale
    pf = p.float()
    if decay:
        pf = pf - lr_wd * pf
    mf = beta1 * m.float() + (1 - beta1) * gf
    vf = beta2 * v.float() + (1 - beta2) * gf * gf
    denom = torch.sqrt(vf) / bc2_sqrt + eps
    pf = pf - step_size * mf / denom
    p.copy_(pf)
    m.copy_(mf)
    v.copy_(vf)


def adamw_update(
    p, g, m, v, step, lr, scale, beta1: float, beta2: float, eps: float, weight_decay: float, compiled: bool = False
):
    """One AdamW step of one parameter, in place (p, m, v; step += 1). compiled: both parts
    through torch.compile (two kernels: the scalars, then one pass over the parameter)."""
    if compiled:
        c = _compiled()
        sc, pw = c["scalars"], c["pointwise"]
    else:
        sc, pw = adamw_scalars, adamw_pointwise
    step_size, bc2_sqrt, lr_wd = sc(step, lr, beta1, beta2, weight_decay)
    pw(p, g, m, v, step_size, bc2_sqrt, lr_wd, scale, beta1, beta2, eps, weight_decay != 0)


def square_sum(g):
    """sum(g^2) in at least fp32 (one gradient's part of the clipping norm)."""
    return g.to(torch.promote_types(g.dtype, torch.float32)).pow(2).sum()


_COMPILED = {}


def _compiled():
    """The update's two parts and the clipping norm's reduction, compiled. The pointwise part
    is compiled per parameter size (a drafter has about six): with the size a constant it ran at
    4.2 TB/s on an H200, with sizes dynamic at 3.4 (benchmarks/results/2026-12-02-h200-probe-adamw.json). -> {"scalars",
    "pointwise", "norm"}."""
    if not _COMPILED:
        allow_recompiles()
        _COMPILED.update(
            scalars=torch.compile(adamw_scalars, fullgraph=True),
            pointwise=torch.compile(adamw_pointwise, dynamic=False, fullgraph=True),
            norm=torch.compile(square_sum, dynamic=False, fullgraph=True),
        )
    return _COMPILED


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update and state, one compiled pointwise kernel per parameter.

    compiled: run the update through torch.compile (default: on CUDA); off, the same function
    eagerly (a dozen kernels per parameter: for tests and the CPU). `grad_scale` (a 0-dim tensor,
    or None) divides every gradient as it is read, as the fused AdamW's does; train_step sets it
    to clip (`takes_grad_scale`)."""

    takes_grad_scale = True  # train_step clips through grad_scale (see train_step)
    step_on_device = True  # the step count lives on the parameter's device (checkpoint loading)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        compiled: bool | None = None,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"AdamW: lr {lr}, betas {betas}, eps {eps}, weight_decay {weight_decay} out of range")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.compiled = compiled
        self.grad_scale = None
        self._lr = {}  # per group: its learning rate as a device tensor (refilled when it changes)

    def grad_norm(self, grads) -> torch.Tensor:
        """The L2 norm of all these gradients (0-dim fp32, no host sync), as clip_grad_norm_
        computes it: on CUDA one compiled reduction per gradient, at the rate of a plain read
        (torch's _foreach_norm read the Kimi-size drafter's gradients at ~2.4 TB/s)."""
        parts = []
        for g in grads:
            flat = g.is_contiguous()
            compiled = (g.is_cuda if self.compiled is None else self.compiled) and flat
            fn = _compiled()["norm"] if compiled else square_sum
            parts.append(fn(g.view(-1) if flat else g).float())
        return torch.stack(parts).sum().sqrt()

    def _lr_tensor(self, i: int, group: dict, device) -> torch.Tensor:
        key = (i, str(device))
        t = self._lr.get(key)
        if t is None or t[1] != group["lr"]:
            buf = t[0] if t is not None else torch.empty((), dtype=torch.float32, device=device)
            buf.fill_(group["lr"])
            t = self._lr[key] = (buf, group["lr"])
        return t[0]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("draftport AdamW: sparse gradients are not supported")
                st = self.state[p]
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                compiled = p.is_cuda if self.compiled is None else self.compiled
                flat = all(t.is_contiguous() for t in (p, p.grad, st["exp_avg"], st["exp_avg_sq"]))
                args = (
                    (p, p.grad, st["exp_avg"], st["exp_avg_sq"])
                    if not flat
                    else (p.view(-1), p.grad.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1))
                )
                scale = self.grad_scale
                if scale is not None:
                    scale = scale.to(device=p.device, dtype=torch.float32)
                adamw_update(
                    *args,
                    st["step"],
                    self._lr_tensor(i, group, p.device),
                    scale,
                    float(beta1),
                    float(beta2),
                    float(group["eps"]),
                    float(group["weight_decay"]),
                    compiled=compiled and flat,
                )
        return loss
