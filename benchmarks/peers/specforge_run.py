"""SpecForge 0.2.0's EAGLE-3 offline training step, several shapes and trainable sets in one process.

The draft model, wrapper, target head, optimizer and trainer core are wired exactly as the anchor
wires them (../shared/anchors/specforge_train_bench.py, --wrap none: SpecForge's own
LlamaForCausalLMEagle3, OnlineEagle3Model with flex attention, TargetHead, Eagle3TrainStrategy,
TrainerCore, BF16Optimizer with fp32 masters, clip 0.5), at the drafter's shape --shape
H,I,heads,kv,head_dim,Vd,V (Kimi-K2's by default), built once per trainable set:
  --sets trained frozen   trained: its default (lm_head trained); frozen: lm_head frozen, as
                          speculators and draftport train it (the optimizer is rebuilt over that set)
  --seqs T ...            one sample of T tokens per step (all masks ones), as the anchor
  --mix FILE              the length mix (JSON {"lengths", optional "prompts": rows without loss at
                          each sample's head}) as SpecForge trains by default: training.batch_size 1 and
                          DataCollatorWithPadding, i.e. one sample per step at its own length (no
                          padding); one pass over all samples warms up (compiles every length), the
                          next is timed; the lm_head-trained set only (its default)
Timing: torch.cuda.synchronize around each step. Prints one JSON line per configuration.
bench_train_h200.py calls it once per shape: a later shape in the same process read slower
(benchmarks/results/HISTORY.md, the sixth pair).
"""
import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time

ap = argparse.ArgumentParser()
ap.add_argument("--toy", action="store_true", help="the toy shape (--shape 64,128,4,4,16,256,1024)")
ap.add_argument("--shape", default=None, metavar="H,I,heads,kv,head_dim,Vd,V",
                help="the drafter's sizes (bench_train_h200.py passes its --shape); default Kimi-K2's")
ap.add_argument("--seqs", type=int, nargs="*", default=[2048])
ap.add_argument("--mix", default=None)
ap.add_argument("--mix-passes", type=int, default=1, help="timed passes over the mix (the figure: its "
                "real tokens over the median pass)")
ap.add_argument("--sets", nargs="*", default=["trained", "frozen"])
ap.add_argument("--ttt", type=int, default=7)
ap.add_argument("--iters", type=int, default=8)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--attn", default="flex_attention")
ap.add_argument("--off-draft-scale", type=float, default=0.5,
                help="the target head's rows outside the draft vocab scaled by this (the bench's "
                     "OFF_DRAFT_SCALE: the greedy choice a draft id at nearly every row, as on real "
                     "data; 1: an unbiased random head, the choice a draft id at Vd / V of the rows)")
ap.add_argument("--cpu-test", action="store_true", help="as the anchor's: triton stubbed for import, "
                "SpecForge's reference loss in place of its Triton kernel (plumbing only)")
a = ap.parse_args()

if importlib.util.find_spec("specforge") is None:   # before torch's import: a missing peer fails in ~0.1 s
    sys.exit(f"specforge_run.py: specforge is not installed in {sys.executable} (pip install --no-deps specforge==0.2.0)")

import torch  # noqa: E402

if a.cpu_test:   # the anchor's CPU plumbing path, unchanged
    import transformers.generation.utils  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch._inductor.codecache  # noqa: F401
    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import types

    tr = types.ModuleType("triton")
    tr.jit = lambda fn=None, **k: fn if fn is not None else (lambda f: f)
    tr.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    tl = types.ModuleType("triton.language")
    tl.constexpr = object
    tr.language = tl
    sys.modules["triton"], sys.modules["triton.language"] = tr, tl

from transformers import LlamaConfig  # noqa: E402

from specforge.algorithms.eagle3.model import OnlineEagle3Model  # noqa: E402
from specforge.modeling.auto import AutoDraftModel  # noqa: E402
from specforge.modeling.target.target_head import TargetHead  # noqa: E402
from specforge.optimizer import BF16Optimizer  # noqa: E402
from specforge.runtime.contracts import TrainBatch  # noqa: E402
from specforge.training.backend import FSDPTrainingBackend, ParallelConfig  # noqa: E402
from specforge.training.controller import TrainerCore  # noqa: E402
from specforge.training.strategies.base import Eagle3TrainStrategy  # noqa: E402

if a.cpu_test:
    sys.modules.pop("triton", None), sys.modules.pop("triton.language", None)
    import specforge.algorithms.eagle3.model as _m
    import specforge.core.loss as _l

    class _RefLoss:
        @staticmethod
        def apply(logits, target_p, position_mask):
            return _l._compute_loss(logits, target_p, position_mask)
    _m.LogSoftmaxLoss = _RefLoss

if a.shape:
    H, I, NH, KV, HD, DV, V = (int(x) for x in a.shape.split(","))
elif a.toy:
    H, I, NH, KV, HD, DV, V = 64, 128, 4, 4, 16, 256, 1024
else:
    H, I, NH, KV, HD, DV, V = 7168, 18432, 64, 64, 128, 32000, 163840
cuda = torch.cuda.is_available() and not a.cpu_test
dev = torch.device("cuda" if cuda else "cpu")
dt = torch.bfloat16 if cuda else torch.float32
sync = torch.cuda.synchronize if cuda else (lambda: None)

t0 = time.perf_counter()
draft_cfg = LlamaConfig(
    architectures=["LlamaForCausalLMEagle3"], hidden_size=H, intermediate_size=I,
    num_attention_heads=NH, num_key_value_heads=KV, head_dim=HD, vocab_size=V, draft_vocab_size=DV,
    max_position_embeddings=4096 if (a.toy or a.cpu_test) else 131072, rope_theta=1e6, rms_norm_eps=1e-5,
    hidden_act="silu", num_hidden_layers=1, tie_word_embeddings=False, pad_token_id=0,
    torch_dtype="bfloat16")
draft_cfg.draft_vocab_size = DV
torch.manual_seed(0)
with torch.device(dev):
    draft = AutoDraftModel.from_config(draft_cfg, attention_backend=a.attn, torch_dtype=dt)
draft.freeze_embedding()
draft = draft.to(device=dev, dtype=dt)
g_cpu = torch.Generator().manual_seed(0)
hot = torch.sort(torch.randperm(V, generator=g_cpu)[:DV]).values
t2d = torch.zeros(V, dtype=torch.bool)
t2d[hot] = True
with torch.no_grad():
    draft.t2d.copy_(t2d.to(dev))
    draft.d2t.copy_((hot - torch.arange(DV)).to(dev))
draft.vocab_mapping_loaded = True
model = OnlineEagle3Model(draft_model=draft, length=a.ttt, attention_backend=a.attn).to(device=dev, dtype=dt)
cfg_dir = tempfile.mkdtemp(prefix="sf_target_")
LlamaConfig(hidden_size=H, vocab_size=V, intermediate_size=I, num_attention_heads=NH,
            num_key_value_heads=KV, head_dim=HD, num_hidden_layers=61).save_pretrained(cfg_dir)
with torch.device(dev):
    target_head = TargetHead(cfg_dir)
with torch.no_grad():
    target_head.fc.weight.normal_(0.0, 0.02)
    target_head.fc.weight[~t2d.to(target_head.fc.weight.device)] *= a.off_draft_scale
target_head.freeze_weights()
target_head = target_head.eval().to(device=dev, dtype=torch.bfloat16 if cuda else dt)
build_s = time.perf_counter() - t0


def optimizer_factory(draft_module):  # _ConfiguredOptimizerFactory with the schema's defaults
    return BF16Optimizer(draft_module, lr=1e-4, max_grad_norm=0.5, warmup_ratio=0.015,
                         lr_scheduler="cosine", total_steps=10_000, offload_master=False)


def make_core():
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(tp_size=1), optimizer_factory=optimizer_factory)
    wrapped = backend.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    strategy = Eagle3TrainStrategy(wrapped, target_head=target_head, ploss_decay=0.8,
                                   compact_teacher=False, compact_teacher_chunk_size=None)
    wrapped.train()
    return TrainerCore(strategy, backend, accumulation_steps=1), backend


g = torch.Generator(device=dev).manual_seed(0)


def make_batch(T, i=0, prompt=0):
    lm = torch.ones(1, T, dtype=torch.long, device=dev)
    lm[:, :prompt] = 0   # a prompt: no loss
    return TrainBatch(
        sample_ids=[f"synthetic-{i}"], strategy="eagle3",
        tensors={"input_ids": torch.randint(0, V, (1, T), device=dev, generator=g),
                 "attention_mask": torch.ones(1, T, dtype=torch.long, device=dev),
                 "loss_mask": lm,
                 "hidden_state": torch.randn(1, T, 3 * H, device=dev, dtype=dt, generator=g),
                 "target": torch.randn(1, T, H, device=dev, dtype=dt, generator=g)},
        metadata={"target_repr": "hidden_state"})


def run(core, batches, warm_passes, passes):
    t_w = time.perf_counter()
    for _ in range(warm_passes):
        for b in batches:
            r = core.train_step(b)
    sync()
    warm_s = time.perf_counter() - t_w
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(passes):
        for b in batches:
            sync()
            t = time.perf_counter()
            r = core.train_step(b)
            sync()
            times.append(time.perf_counter() - t)
    return times, warm_s, r, (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


for which in a.sets:
    draft.lm_head.weight.requires_grad_(which == "trained")
    core, backend = make_core()
    n_train = sum(p.numel() for p in model.draft_model.parameters() if p.requires_grad)
    common = dict(impl="specforge-0.2.0", shape=[H, I, NH, KV, HD, DV, V], attn=a.attn, attn_class=type(draft.midlayer.self_attn).__name__,
                  wrapper_kind=backend._wrapper_kind, trainable_params=n_train,
                  lm_head_trainable=bool(draft.lm_head.weight.requires_grad), set=which,
                  optimizer="specforge BF16Optimizer: fp32 masters + torch.optim.AdamW, clip 0.5",
                  torch=torch.__version__, transformers=__import__("transformers").__version__,
                  device=torch.cuda.get_device_name() if cuda else "cpu", build_s=build_s)
    for T in a.seqs:
        b = make_batch(T)
        t_w = time.perf_counter()
        for _ in range(a.warmup):
            core.train_step(b)
        sync()
        warm_s = time.perf_counter() - t_w
        times, _, r, peak = run(core, [b] * a.iters, 0, 1)
        med = statistics.median(times)
        print(json.dumps(dict(common, config=f"seq{T}", seq=T, step_s_median=med, step_s_each=times,
                              tokens_per_s=T / med, real_tokens_per_s=T / med, warmup_s=warm_s,
                              peak_mem_gib=peak, loss=r.loss)), flush=True)
        del b
    del core, backend
    if cuda:
        torch.cuda.empty_cache()

# the mix last (so that a caller's timeout costs it first), at SpecForge's default set
if a.mix and "trained" in a.sets:
    which = "trained"
    draft.lm_head.weight.requires_grad_(True)
    core, backend = make_core()
    n_train = sum(p.numel() for p in model.draft_model.parameters() if p.requires_grad)
    common.update(trainable_params=n_train, lm_head_trainable=True, set=which)
    spec = json.load(open(a.mix))
    lengths = spec["lengths"]
    batches = [make_batch(n, i, p) for i, (n, p) in enumerate(zip(lengths, spec.get("prompts") or [0] * len(lengths)))]
    times, warm_s, r, peak = run(core, batches, 1, a.mix_passes)
    n = len(batches)
    pass_s = [sum(times[i:i + n]) for i in range(0, len(times), n)]
    med = statistics.median(pass_s)
    print(json.dumps(dict(common, config="mix", rows=len(batches), samples=len(lengths),
                          real_tokens=sum(lengths), real_fraction=1.0, step_s_each=times,
                          passes=len(pass_s), pass_s=pass_s, step_s_total=med,
                          real_tokens_per_s=sum(lengths) / med,
                          tokens_per_s=sum(lengths) / med, warmup_s=warm_s, peak_mem_gib=peak,
                          loss=r.loss, layout="batch_size 1 (its default), DataCollatorWithPadding: "
                                              "one sample per step at its own length")), flush=True)
    del batches
