"""The target's tensors, read by name without loading the model (a drafter needs only the
target's embedding and lm_head; a multimodal wrapper's text decoder sits under a prefix), and the
target's logits from its final hidden state: what training and evaluation both compute with."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from draftport.errors import DraftportError

TEXT_PREFIXES = ("", "language_model.", "model.language_model.")


def tensor_names(path: Path) -> dict[str, Path]:
    """name -> file, from the safetensors headers (no tensor is read)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            out.update({n: f for n in sf.keys()})
    return out


def read_text_tensor(path: str | Path, name: str, tied_to: str | None = None) -> torch.Tensor:
    """A tensor of the text decoder by its plain causal-LM name ('model.norm.weight',
    'lm_head.weight'), found at the top level or under a multimodal wrapper's prefix."""
    path = Path(path)
    names = tensor_names(path)
    for cand in [name, *(tied_to and [tied_to] or [])]:
        for pre in TEXT_PREFIXES:
            full = pre + (cand.removeprefix("model.") if pre == "model.language_model." else cand)
            if full in names:
                with safe_open(str(names[full]), framework="pt") as sf:
                    return sf.get_tensor(full)
    raise DraftportError(path, f"target has no tensor {name} (nor under {', '.join(p for p in TEXT_PREFIXES if p)})")


def read_target_tensor(path: str | Path, suffix: str) -> torch.Tensor:
    """One tensor of a target folder by name suffix (e.g. 'lm_head.weight'), without loading the
    model: the drafter needs only the target's embedding and lm_head."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftportError(path, "no *.safetensors weights in the target folder")
    hits = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name == suffix or name.endswith("." + suffix):
                    hits.append((f, name))
    if not hits:
        if suffix == "lm_head.weight":  # tied embeddings
            return read_target_tensor(path, "embed_tokens.weight")
        raise DraftportError(path, f"target has no tensor named *{suffix}")
    hits.sort(key=lambda h: len(h[1]))  # the text model's own tensor over a vision tower's
    f, name = hits[0]
    with safe_open(str(f), framework="pt") as sf:
        return sf.get_tensor(name)


def target_logits(final: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
    """Full-vocab target logits [B, T, V] in fp32."""
    return final.float() @ target_head.float().t()
