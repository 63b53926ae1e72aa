"""A speculators-format EAGLE-3 drafter's teacher-forced forward, computed by speculators itself.

Runs INSIDE the speculators venv (.venv-speculators), never in the project's: it imports only
speculators, torch, safetensors and the standard library. draftport.evaluation.roundtrip
calls it as a subprocess:

    .venv-speculators/bin/python src/draftport/engines/speculators/runners/forward_speculators.py \
        --model CONVERTED --inputs inputs.safetensors --steps 3 --out out.safetensors --meta meta.json

The model is loaded with Eagle3DraftModel.from_pretrained (which also reads the verifier its
config names: embed_tokens when the checkpoint lacks it, lm_head, the final norm).
inputs.safetensors: `aux` [N, 3H] float32 (the target's aux states of B sequences, one after
another), `tokens` [N] int64, `offsets` [B + 1] int64. Each sequence runs alone (speculators'
teacher forcing shifts the tokens over the whole packed row, across document boundaries):
hidden_states = its aux states, input_ids = its tokens shifted by one (row p gets token p + 1, 0
past the end: the token the drafter embeds at step 0), position_ids 0..T-1. Under flex attention
(speculators' default) a sequence is padded to a multiple of 128 rows (document id -1, token 0).
out.safetensors: `logits_{j}` [N, draft vocab] float32, the lm_head output of TTT step j for every
row (read by a forward hook: speculators returns only the argmax); with --dump-embedding the
model's `embed_tokens` as loaded. meta.json: versions, attention implementation, the verifier.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import version

BLOCK = 128  # flex attention's block size: speculators' block masks need rows in whole blocks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attn", default=None, help="attention implementation (default: speculators' own)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--dump-embedding", action="store_true")
    a = ap.parse_args(argv)

    # lazy: runs in the speculators venv, once the arguments are parsed
    import torch
    from safetensors.torch import load_file, save_file
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    torch.set_num_threads(1)
    config = Eagle3SpeculatorConfig.from_pretrained(a.model)
    if a.attn:
        config.transformer_layer_config._attn_implementation = a.attn
    model = Eagle3DraftModel.from_pretrained(a.model, config=config).eval()
    attn = model._attn_impl
    inp = load_file(a.inputs)
    aux, tokens, offsets = inp["aux"].float(), inp["tokens"].long(), inp["offsets"].tolist()
    dtype = model.fc.weight.dtype
    steps_out: list[list] = [[] for _ in range(a.steps)]
    captured: list = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: captured.append(out.detach()))
    with torch.no_grad():
        for s, e in zip(offsets, offsets[1:]):
            T = e - s
            L = -(-T // BLOCK) * BLOCK if attn == "simple_flex_attention" else T
            hs = torch.zeros(1, L, aux.shape[1], dtype=dtype)
            hs[0, :T] = aux[s:e].to(dtype)
            ids = torch.zeros(1, L, dtype=torch.long)
            ids[0, : T - 1] = tokens[s + 1 : e]
            doc = torch.full((1, L), -1, dtype=torch.long)
            doc[0, :T] = 0
            pos = torch.arange(L, dtype=torch.long)[None]
            captured.clear()
            model(hidden_states=hs, input_ids=ids, document_ids=doc, position_ids=pos, ttt_steps=a.steps)
            if len(captured) != a.steps:
                raise RuntimeError(f"lm_head ran {len(captured)} times for {a.steps} TTT steps")
            for j, lg in enumerate(captured):
                steps_out[j].append(lg[0, :T].float())
    hook.remove()
    out = {f"logits_{j}": torch.cat(rows).contiguous() for j, rows in enumerate(steps_out)}
    if a.dump_embedding:
        out["embed_tokens"] = model.embed_tokens.weight.detach().contiguous()
    save_file(out, a.out)
    verifier = config.speculators_config.verifier
    meta = {
        "speculators_version": version("speculators"),
        "transformers_version": version("transformers"),
        "torch_version": torch.__version__,
        "attn_implementation": attn,
        "dtype": str(dtype).removeprefix("torch."),
        "verifier": verifier.name_or_path,
        "steps": a.steps,
        "sequences": len(offsets) - 1,
        "rows": int(offsets[-1]),
        "embed_tokens_has_nan": bool(model.embed_tokens.weight.isnan().any()),
        "norm_before_residual": bool(config.norm_before_residual),
        "aux_layer_ids": list(config.eagle_aux_hidden_state_layer_ids or []),
    }
    with open(a.meta, "w") as f:
        json.dump(meta, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
