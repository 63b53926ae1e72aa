"""training.graph (the CUDA-graph step): what the CPU can check. The capture itself runs on CUDA
only (benchmarks/bench_train_h200.py --graph, results in benchmarks/results/)."""

import torch

from draftport.data.shards import Batch
from draftport.model.fast.path import GRAPH_BELOW_HIDDEN, FastPath
from draftport.training.graph import StepGraph, signature
from draftport.training.optim import AdamW


def _batch(T=8, share=1.0):
    ones = torch.ones(1, T, dtype=torch.bool)
    return Batch(aux=torch.randn(1, T, 12), final=torch.randn(1, T, 4), tokens=torch.zeros(1, T, dtype=torch.long),
                 loss_mask=ones, valid=ones.clone(), loss_share=share)


def test_graphs_step_is_a_function_of_the_shape():
    auto = FastPath()
    assert auto.cuda_graph == "auto"
    assert auto.graphs_step(2048) and not auto.graphs_step(GRAPH_BELOW_HIDDEN) and not auto.graphs_step(7168)
    assert not auto.graphs_step(2048, "cpu")                      # never off CUDA
    assert FastPath(cuda_graph="on").graphs_step(8192)
    assert not FastPath(cuda_graph="off").graphs_step(2048)
    try:
        FastPath(cuda_graph="yes")
    except ValueError:
        pass
    else:
        raise AssertionError("cuda_graph 'yes' accepted")


def test_signature_keys_shapes_and_host_fields():
    a, b = _batch(), _batch()
    assert signature(a) == signature(b)
    assert signature(a) != signature(_batch(T=16))
    assert signature(a) != signature(_batch(share=0.5))
    a.loss_share = object()   # a host object (packed rows' segments): not capturable
    assert signature(a) is None


def test_step_graph_runs_uncapturable_batches_eagerly():
    calls = []
    sg = StepGraph(lambda b: calls.append(b) or len(calls))
    b = _batch()
    b.loss_share = object()
    assert sg(b) == 1 and sg(b) == 2 and sg.captures == 0 and not sg.graphs


def test_refresh_lr_moves_the_device_lr_outside_the_step():
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([p], lr=0.1, compiled=False)
    p.grad = torch.ones(3)
    opt.step()
    (buf, lr), = opt._lr.values()
    assert lr == 0.1 and float(buf) == torch.tensor(0.1).item()
    opt.param_groups[0]["lr"] = 0.05
    opt.refresh_lr()
    (buf2, lr2), = opt._lr.values()
    assert buf2 is buf and lr2 == 0.05 and float(buf) == torch.tensor(0.05).item()
