# Origin: /work/shared/anchors/speculators_train_bench.py (the CEO's anchor measurement, copied
# unchanged below this header so that it travels with the working tree to the device machine;
# the device receives only the repository). Third-party-ish reference: do not edit.
"""Anchor measurement: speculators 0.9.0 Eagle3DraftModel training step at Kimi-K2 drafter size.

Prints tokens/s of forward+backward+AdamW, analytic FLOPs/token, MFU vs a peak, peak memory.
Used by the CEO to set the performance goal; not part of the project.
usage: python speculators_train_bench.py [--toy] [--seq 2048] [--ttt 7] [--iters 10]
"""
import argparse, json, time
import torch
from transformers import LlamaConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.losses import resolve_loss_config

ap = argparse.ArgumentParser()
ap.add_argument("--toy", action="store_true")
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--ttt", type=int, default=7)
ap.add_argument("--iters", type=int, default=10)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--peak-tflops", type=float, default=790.0)
ap.add_argument("--attn", default="simple_flex_attention")
ap.add_argument("--loss-impl", default="fused", help="fused (Triton, GPU) or eager")
a = ap.parse_args()

if a.toy:
    H, I, NH, HD, DV, V = 64, 128, 4, 16, 256, 1024
else:
    H, I, NH, HD, DV, V = 7168, 18432, 64, 128, 32000, 163840
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32

lc = LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=NH, num_key_value_heads=NH,
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
with torch.no_grad():  # frozen verifier pieces are not initialized without a verifier checkpoint
    for name, p_ in model.named_parameters():
        if not torch.isfinite(p_).all() or "verifier" in name or "embed" in name:
            p_.copy_(torch.ones_like(p_) if p_.dim() == 1 else torch.randn_like(p_) * 0.02)
model = model.to(dt)
hot = torch.sort(torch.randperm(V)[:DV]).values
d2t = (hot - torch.arange(DV)).to(dev)
t2d = torch.zeros(V, dtype=torch.bool); t2d[hot] = True
model.load_vocab_mappings(t2d.to(dev), d2t)
model.train()
params = [p for p in model.parameters() if p.requires_grad]
n_train = sum(p.numel() for p in params)
opt = torch.optim.AdamW(params, lr=1e-4, fused=(dev == "cuda"))

T = a.seq
g = torch.Generator(device=dev).manual_seed(0)
hs = torch.randn(1, T, 3 * H, device=dev, dtype=dt, generator=g)
ids = torch.randint(0, V, (1, T), device=dev, generator=g)
doc = torch.zeros(1, T, dtype=torch.long, device=dev)
mask = torch.ones(1, T, dtype=torch.bool, device=dev)
last = torch.randn(1, T, H, device=dev, dtype=dt, generator=g)

loss_cfg = resolve_loss_config("kl_div", a.loss_impl)

def step():
    _, loss, _ = model(hs, ids, doc, loss_mask=mask, verifier_last_hidden_states=last,
                       ttt_steps=a.ttt, ttt_step_loss_decay=0.8, loss_config=loss_cfg)
    loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    return loss

sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
for _ in range(a.warmup):
    step()
sync()
if dev == "cuda":
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
for _ in range(a.iters):
    loss = step()
sync()
dtime = (time.perf_counter() - t0) / a.iters
tok_s = T / dtime
q = NH * HD
lm_trainable = any(p_.requires_grad for n_, p_ in model.named_parameters() if n_.startswith("lm_head"))
layer = 2 * (3 * 2 * H * q + q * H + 3 * H * I)                # qkv (2H in), o, mlp: fwd FLOPs/token
head = 2 * H * DV                                               # draft lm_head fwd
attn = 2 * 2 * (T / 2) * q                                      # causal QK^T and AV fwd
fc = 2 * 3 * H * H
# train = fwd + input-grad (~fwd) + weight-grad for trainable weights only; attention bwd ~2x fwd
flops_tok = (a.ttt * (3 * layer + (3 if lm_trainable else 2) * head + 3 * attn)
             + 2 * fc + 2 * H * DV)                             # fc: no input grad; frozen verifier head fwd
mfu = flops_tok * tok_s / (a.peak_tflops * 1e12)
out = {"impl": "speculators-0.9.0", "attn": a.attn, "loss_impl": a.loss_impl, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
       "torch": torch.__version__, "seq": T, "ttt": a.ttt, "hidden": H, "trainable_params": n_train, "lm_head_trainable": lm_trainable,
       "step_s": dtime, "tokens_per_s": tok_s, "gflop_per_token": flops_tok / 1e9, "mfu": mfu,
       "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30) if dev == "cuda" else None,
       "loss": float(loss.detach())}
print(json.dumps(out))
