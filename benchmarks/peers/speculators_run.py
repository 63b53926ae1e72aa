"""speculators 0.9.0's Eagle3DraftModel training step, several shapes in one process.

The model, vocab map, optimizer and step are the anchor's (benchmarks/anchors/
speculators_train_bench.py: bf16 parameters, fused AdamW, eager KL loss, flex attention, TTT 7,
decay 0.8), at the drafter's shape --shape H,I,heads,kv,head_dim,Vd,V (the anchor's Kimi-K2 size
by default; key/value heads as given: grouped-query attention in speculators' own layer), built
once; then each configuration runs its warmup and timed steps:
  --seqs T ...   one sample of T tokens per step (document ids all 0), as the anchor;
  --mix FILE     a length mix (JSON {"lengths": [...], optional "prompts": [...] rows without loss
                 at each sample's head}) as speculators trains on it by default:
                 its MultipackDistributedBatchSamplerV2 groups samples into rows of
                 --total-seq-len tokens (its default 8192) and its CollateFn packs each group
                 (document ids, positions restarting per sample, -1 on the padding); one pass over
                 all rows warms up (compiles every shape), the next is timed; throughput counts
                 real tokens (document id != -1).
  --sets frozen trained
                 the trainable sets, in this order: frozen (its default: lm_head frozen, as
                 speculators builds it) and trained (the same model with lm_head.weight trainable:
                 the set SpecForge trains by default, so a ratio to it compares equal work); each
                 set runs every shape; records carry "set".
Prints one JSON line per configuration ({"config": ...}) and flushes it, so a caller that stops
this process early keeps what finished.
bench_train_h200.py calls it once per shape: a later shape in the same process read slower
(benchmarks/results/HISTORY.md, the sixth pair).
"""
import argparse
import importlib.util
import json
import statistics
import sys
import time

if importlib.util.find_spec("speculators") is None:   # before torch's import: a missing peer fails in ~0.1 s
    sys.exit(f"speculators_run.py: speculators is not installed in {sys.executable} (pip install speculators==0.9.0)")

import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.losses import resolve_loss_config  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--toy", action="store_true", help="the toy shape (--shape 64,128,4,4,16,256,1024)")
ap.add_argument("--shape", default=None, metavar="H,I,heads,kv,head_dim,Vd,V",
                help="the drafter's sizes (bench_train_h200.py passes its --shape); default Kimi-K2's")
ap.add_argument("--seqs", type=int, nargs="*", default=[2048])
ap.add_argument("--mix", default=None)
ap.add_argument("--mix-passes", type=int, default=1, help="timed passes over the mix (the figure: its "
                "real tokens over the median pass)")
ap.add_argument("--total-seq-len", type=int, default=8192, help="speculators' default total_seq_len")
ap.add_argument("--ttt", type=int, default=7)
ap.add_argument("--iters", type=int, default=8)
ap.add_argument("--warmup", type=int, default=2)
ap.add_argument("--attn", default="simple_flex_attention")
ap.add_argument("--loss-impl", default="eager")
ap.add_argument("--sets", nargs="*", default=["frozen"], choices=["frozen", "trained"])
a = ap.parse_args()

if a.shape:
    H, I, NH, KV, HD, DV, V = (int(x) for x in a.shape.split(","))
elif a.toy:
    H, I, NH, KV, HD, DV, V = 64, 128, 4, 4, 16, 256, 1024
else:
    H, I, NH, KV, HD, DV, V = 7168, 18432, 64, 64, 128, 32000, 163840
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
cuda = dev == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
t_build = time.perf_counter()

# ---- the anchor's model, at the shape asked for (the anchor's: Kimi-K2's, 64 key/value heads) ----
lc = LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=KV,
                 head_dim=HD, vocab_size=V, max_position_embeddings=131072, rms_norm_eps=1e-5,
                 rope_theta=1e6, num_hidden_layers=1)
lc._attn_implementation = a.attn
cfg = Eagle3SpeculatorConfig(
    transformer_layer_config=lc, draft_vocab_size=DV, norm_before_residual=False,
    eagle_aux_hidden_state_layer_ids=[2, 30, 58],
    speculators_config=SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=a.ttt)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
    ),
)
with torch.device(dev):
    model = Eagle3DraftModel(cfg)
with torch.no_grad():
    for name, p_ in model.named_parameters():
        if not torch.isfinite(p_).all() or "verifier" in name or "embed" in name:
            p_.copy_(torch.ones_like(p_) if p_.dim() == 1 else torch.randn_like(p_) * 0.02)
model = model.to(dt)
hot = torch.sort(torch.randperm(V)[:DV]).values
d2t = (hot - torch.arange(DV)).to(dev)
t2d = torch.zeros(V, dtype=torch.bool)
t2d[hot] = True
model.load_vocab_mappings(t2d.to(dev), d2t)
model.train()
loss_cfg = resolve_loss_config("kl_div", a.loss_impl)
build_s = time.perf_counter() - t_build
params, n_train, opt, lm_trainable, which = [], 0, None, False, None


def use_set(name):
    """The trainable set `name` (frozen: as speculators builds the model; trained: lm_head too),
    with a fresh fused AdamW over it."""
    global params, n_train, opt, lm_trainable, which
    model.lm_head.weight.requires_grad_(name == "trained")
    params = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=cuda)
    lm_trainable = any(p_.requires_grad for n_, p_ in model.named_parameters() if n_.startswith("lm_head"))
    which = name
    lm_head_at_start[0] = model.lm_head.weight.detach().clone()


lm_head_at_start = [None]


def step(b):
    _, loss, _ = model(b["hidden_states"], b["input_ids"], b["document_ids"], loss_mask=b["loss_mask"],
                       position_ids=b.get("position_ids"), verifier_last_hidden_states=b["verifier_last_hidden_states"],
                       ttt_steps=a.ttt, ttt_step_loss_decay=0.8, loss_config=loss_cfg)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def emit(rec):
    rec.update(impl="speculators-0.9.0", shape=[H, I, NH, KV, HD, DV, V], attn=a.attn, loss_impl=a.loss_impl,
               ttt=a.ttt, trainable_params=n_train,
               lm_head_trainable=lm_trainable, set=which,
               lm_head_changed=bool((model.lm_head.weight.detach() != lm_head_at_start[0]).any()),
               torch=torch.__version__, build_s=build_s,
               device=torch.cuda.get_device_name() if cuda else "cpu")
    print(json.dumps(rec), flush=True)


def timed(batches, warm_passes, passes):
    """Per-step device times of `passes` passes over `batches` after `warm_passes` untimed."""
    t_w = time.perf_counter()
    for _ in range(warm_passes):
        for b in batches:
            loss = step(b)
    sync()
    warm_s = time.perf_counter() - t_w
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(passes):
        for b in batches:
            sync()
            t = time.perf_counter()
            loss = step(b)
            sync()
            times.append(time.perf_counter() - t)
    return times, warm_s, float(loss.detach()), (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def run_shapes():
    """Every shape asked for (--seqs, then --mix) at the current trainable set."""
    g = torch.Generator(device=dev).manual_seed(0)
    for T in a.seqs:
        b = {"hidden_states": torch.randn(1, T, 3 * H, device=dev, dtype=dt, generator=g),
             "input_ids": torch.randint(0, V, (1, T), device=dev, generator=g),
             "document_ids": torch.zeros(1, T, dtype=torch.long, device=dev),
             "loss_mask": torch.ones(1, T, dtype=torch.bool, device=dev),
             "verifier_last_hidden_states": torch.randn(1, T, H, device=dev, dtype=dt, generator=g)}
        t_w = time.perf_counter()
        for _ in range(a.warmup):
            step(b)
        sync()
        warm_s = time.perf_counter() - t_w
        times, _, loss, peak = timed([b] * a.iters, 0, 1)
        med = statistics.median(times)
        emit({"config": f"seq{T}", "seq": T, "real_tokens_per_step": T, "step_s_median": med, "step_s_each": times,
              "tokens_per_s": T / med, "real_tokens_per_s": T / med, "warmup_s": warm_s, "peak_mem_gib": peak,
              "loss": loss})
        del b
        if cuda:
            torch.cuda.empty_cache()

    if a.mix:
        from speculators.train.data import CollateFn
        from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

        spec = json.load(open(a.mix))
        lengths = spec["lengths"]
        prompts = spec.get("prompts") or [0] * len(lengths)
        samples = []
        for n, np_ in zip(lengths, prompts):   # what its dataset's __getitem__ returns (on the device: no copy is timed)
            lm = torch.ones(n, dtype=torch.bool, device=dev)
            lm[:np_] = False   # a prompt: no loss
            samples.append({"hidden_states": torch.randn(n, 3 * H, device=dev, dtype=dt, generator=g),
                            "input_ids": torch.randint(0, V, (n,), device=dev, generator=g),
                            "verifier_last_hidden_states": torch.randn(n, H, device=dev, dtype=dt, generator=g),
                            "loss_mask": lm, "lengths": torch.tensor([n], dtype=torch.long),
                            "position_ids": torch.arange(n, dtype=torch.long, device=dev)})
        sampler = MultipackDistributedBatchSamplerV2(batch_max_length=a.total_seq_len, lengths=lengths,
                                                     num_replicas=1, rank=0, seed=0)
        collate = CollateFn(a.total_seq_len, H, num_target_layers=3, dtype=dt)
        groups = list(iter(sampler))
        batches = []
        for idx in groups:
            c = collate([samples[i] for i in idx])
            batches.append({k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in c.items()})
        real = [int((b["document_ids"] != -1).sum()) for b in batches]
        used = sorted(i for idx in groups for i in idx)
        times, warm_s, loss, peak = timed(batches, 1, a.mix_passes)
        n = len(batches)
        pass_s = [sum(times[i:i + n]) for i in range(0, len(times), n)]
        med = statistics.median(pass_s)
        emit({"config": "mix", "rows": len(batches), "row_tokens": a.total_seq_len, "samples_used": len(used),
              "samples": len(lengths), "real_tokens": sum(real),
              "real_fraction": sum(real) / (len(batches) * a.total_seq_len),
              "step_s_each": times, "passes": len(pass_s), "pass_s": pass_s, "step_s_total": med,
              "real_tokens_per_s": sum(real) / med,
              "tokens_per_s": len(batches) * a.total_seq_len / med, "warmup_s": warm_s, "peak_mem_gib": peak,
              "loss": loss, "layout": "speculators' MultipackDistributedBatchSamplerV2 + CollateFn (packed rows, "
                                      "document ids)"})


for name in a.sets:
    use_set(name)
    run_shapes()
