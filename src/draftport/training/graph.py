"""A training step captured as one CUDA graph per batch shape and replayed (FastPath.cuda_graph).

At a small hidden size (H 2048) a step is ~850 kernels of a few tens of microseconds each, and
the host's Python (autograd, the compiled regions' guards, the launches) takes longer to queue them
than the GPU takes to run them: the step is launch-bound. Replaying a captured graph queues the
whole step in one call. What runs is the same kernels on the same data, so the step computes what
the eager step computes; what changes is only that the host no longer issues each launch.

StepGraph(fn, opt)(batch) runs fn(batch) -> outputs (tensors, or tuples / dicts of them):
- the first batch of a signature (its tensors' shapes, dtypes and devices, its host fields) runs
  eagerly on a side stream (the warm-up capture needs: libraries' handles, the compiled regions'
  first calls, the optimizer's state);
- the second is copied into static input buffers and fn is captured on them, then replayed;
- every later one is copied into those buffers and the graph replayed.
Each batch gets exactly one step, as eagerly. The outputs of a replay are the graph's own tensors,
overwritten by the next replay of that graph: read them before the next step.

What a capture cannot hold, the step skips by itself under capture: the fast loss's row counts
read back to the host (model.fast.loss.count_rows / live_rows: every row runs, at weight 0 where
not counted: the same terms). The learning rate lives in a device tensor that the optimizer
refreshes outside the graph before each replay (opt.refresh_lr, draftport's AdamW), so a schedule
still moves it. CUDA only; nothing here runs on the CPU path.
"""

from __future__ import annotations

import dataclasses

import torch


def _fields(batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)} if dataclasses.is_dataclass(batch) \
        else dict(vars(batch))


def detached(out):
    """out with every tensor detached (tuples, lists and dicts followed): a step's outputs must not
    keep its autograd graph alive, nor with it the parameters' gradient accumulators, which
    would then keep the stream they were made on (the warm-up's) for every later step."""
    if torch.is_tensor(out):
        return out.detach()
    if isinstance(out, (tuple, list)):
        return type(out)(detached(o) for o in out)
    if isinstance(out, dict):
        return {k: detached(v) for k, v in out.items()}
    return out


def signature(batch) -> tuple | None:
    """The batch's shape as a capture sees it: tensors by shape, dtype and device, host scalars by
    value; None (not capturable: run it eagerly) for any other host field (packed rows' segments)."""
    key = []
    for name, v in sorted(_fields(batch).items()):
        if torch.is_tensor(v):
            key.append((name, tuple(v.shape), v.dtype, str(v.device)))
        elif v is None or isinstance(v, (bool, int, float, str)):
            key.append((name, v))
        else:
            return None
    return tuple(key)


class StepGraph:
    """fn(batch) run through one CUDA graph per batch signature (see the module's docstring).
    opt: the optimizer fn steps (its refresh_lr, when it has one, runs before every step)."""

    def __init__(self, fn, opt=None):
        self.fn, self.opt = fn, opt
        self.seen, self.graphs = set(), {}
        self.captures = 0

    def _refresh(self):
        refresh = getattr(self.opt, "refresh_lr", None)
        if refresh is not None:
            refresh()

    def __call__(self, batch):
        key = signature(batch)
        self._refresh()
        if key is None:
            return detached(self.fn(batch))
        g = self.graphs.get(key)
        if g is not None:
            graph, static, out = g
            for name, v in _fields(batch).items():
                if torch.is_tensor(v):
                    static[name].copy_(v, non_blocking=True)
            graph.replay()
            return out
        if key not in self.seen:   # warm-up: eagerly, on a side stream
            self.seen.add(key)
            cur = torch.cuda.current_stream()
            s = torch.cuda.Stream()
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                out = detached(self.fn(batch))
            cur.wait_stream(s)
            return out
        fields = _fields(batch)
        static = {k: v.clone() for k, v in fields.items() if torch.is_tensor(v)}
        sb = dataclasses.replace(batch, **static) if dataclasses.is_dataclass(batch) else type(batch)(**{**fields, **static})
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = detached(self.fn(sb))
        self.graphs[key] = (graph, static, out)
        self.captures += 1
        graph.replay()
        return out
