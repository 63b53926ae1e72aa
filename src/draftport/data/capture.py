"""Hidden-state capture from a `transformers` target, and greedy response regeneration.

Aux layer convention (recorded with every shard): "vllm" reads id k as the state entering
decoder layer k (transformers' hidden_states[k], so k = 0 is the embedding output); "sglang"
reads id k as the state leaving layer k (hidden_states[k + 1]). The final state is taken after
the model's last norm: through the target's lm_head it gives the logits the engine verifies with.
Hooks rather than output_hidden_states: they mean the same thing in every transformers version
and in wrapped (multimodal) models.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftport.errors import DraftportError
from draftport.model.target import TEXT_PREFIXES, tensor_names


def decoder_parts(model):
    """(layers, final_norm, lm_head) of a causal LM, found through multimodal wrappers
    (Kimi-K2.5 keeps its text model under `language_model`)."""
    for _, mod in model.named_modules():
        layers = getattr(mod, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and getattr(mod, "norm", None) is not None:
            head = model.get_output_embeddings()
            if head is None:
                break
            return layers, mod.norm, head
    raise DraftportError(None, f"cannot find decoder layers / final norm / lm_head in {type(model).__name__}")


def compile_layers(model, mode: str = "default") -> None:
    """Each decoder layer's forward through torch.compile (dynamic=False): the capture hooks (a
    pre-hook on aux layers, a hook on the final norm that ends the forward) stay outside the
    compiled code, in the module's eager __call__, and the layers share one graph (their weights
    are its inputs). dynamic=False compiles once per batch shape: pad the batch lengths
    (padded_length) to bound them."""
    # lazy: torch._dynamo takes seconds to import; only a compiled capture needs it
    import torch._dynamo as dynamo

    layers, _, _ = decoder_parts(model)
    for k in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo.config, k):  # the layers share their graphs; bound the shapes, not the layers
            setattr(dynamo.config, k, max(getattr(dynamo.config, k), 64 if "accumulated" not in k else 1024))
    for layer in layers:
        layer.forward = torch.compile(layer.forward, mode=None if mode == "default" else mode, dynamic=False)


def uncompile_layers(model) -> None:
    """Undo compile_layers (the layers' own forward again)."""
    layers, _, _ = decoder_parts(model)
    for layer in layers:
        layer.__dict__.pop("forward", None)


def padded_length(n: int, multiple: int, top: int) -> int:
    """n rounded up to a multiple (0: n), at most max(top, n): a compiled forward's batch width."""
    return n if multiple <= 0 else min(-(-n // multiple) * multiple, max(top, n))


def check_aux_ids(aux_ids, num_layers: int, convention: str, where=None):
    """vllm: 0..L (L = the state leaving the last layer, before the final norm: vLLM collects
    it after the loop too); sglang: 0..L-1."""
    if convention not in ("vllm", "sglang"):
        raise DraftportError(where, f"aux convention must be vllm or sglang, got {convention!r}")
    limit = num_layers if convention == "vllm" else num_layers - 1
    bad = [i for i in aux_ids if not 0 <= i <= limit]
    if bad:
        raise DraftportError(
            where, f"aux layer ids {bad} out of range for a target with {num_layers} layers ({convention} convention)"
        )


# Where a multimodal wrapper keeps its text decoder (Kimi-K2.5: language_model.model.layers.*,
# language_model.lm_head.weight; newer transformers layouts: model.language_model.*).
@contextlib.contextmanager
def remote_code_refused(path):
    """transformers' refusal to run a repo's own code (trust_remote_code off) as one line."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise DraftportError(
            path,
            "the model needs its own code (auto_map) and trust_remote_code is off: add "
            "its repo id to targets.trust_remote_code to run it",
        ) from None


def capture_dtype(device, storage: str = "bfloat16") -> torch.dtype:
    """The dtype a target is loaded in to answer and capture: bfloat16 on a GPU (device 'cuda',
    'cuda:N', or 'auto' with one visible), what engines serve and what its tensor cores run (an
    H200 at an 8B shape: 2.8K tok/s in float32, 33K in bfloat16); float32 on the CPU, so the
    embedded world's figures stay those it always had; float32 too where the features are stored
    in float32 (as the vLLM path runs its engine)."""
    if storage == "float32":
        return torch.float32
    gpu = torch.cuda.is_available() if str(device) == "auto" else torch.device(device).type == "cuda"
    return torch.bfloat16 if gpu else torch.float32


def load_target(path: str | Path, *, dtype=torch.float32, device="cpu", trust_remote_code=False):
    """A transformers causal LM from a local folder (never pickle, no remote code unless asked).

    A multimodal wrapper (config.json with a `text_config`, weights under `language_model.`)
    loads as its text decoder alone: the vision tower is never built. device "auto": the
    weights are spread over the visible GPUs (device_map), for targets that fit them.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise DraftportError(path, "not a model folder (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise DraftportError(path, "no *.safetensors weights (pickle weights are refused)")
    kw: dict = {}
    raw = json.loads((path / "config.json").read_text())
    if "text_config" in raw and "num_hidden_layers" not in raw:
        tc = dict(raw["text_config"])
        if "model_type" not in tc:
            raise DraftportError(path / "config.json", "text_config has no model_type")
        kw["config"] = AutoConfig.for_model(tc.pop("model_type"), **tc)
        prefix = next((p for p in TEXT_PREFIXES[1:] if any(n.startswith(p) for n in tensor_names(path))), None)
        if prefix is None:
            raise DraftportError(path, "a multimodal config but no language_model.* weights")
        # the wrapper's names -> the text model's (model.layers.*, lm_head.*)
        kw["key_mapping"] = (
            {r"^language_model\.": ""}
            if prefix == "language_model."
            else {r"^model\.language_model\.": "model.", r"^lm_head\.": "lm_head."}
        )
    if device == "auto":
        kw["device_map"] = "auto"
    with remote_code_refused(path):
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code, **kw
        )
    return (model if device == "auto" else model.to(device)).eval()


class _Stop(Exception):
    """Raised by the final norm's hook: the forward has given all a capture reads."""


class Capture:
    """Context manager: hooks that record aux states and the final normed state of one forward.
    stop: the forward ends at the final norm (its hook raises _Stop, which capture_features
    catches), so the model's own logits [B, T, vocab] are never computed: the capture takes its
    greedy choice from the head itself, in float32."""

    def __init__(self, model, aux_ids, convention="vllm", stop: bool = False):
        self.layers, self.norm, self.head = decoder_parts(model)
        check_aux_ids(aux_ids, len(self.layers), convention)
        self.aux_ids, self.convention, self.stop = list(aux_ids), convention, stop
        self.states: dict[int, torch.Tensor] = {}
        self.final = None
        self.handles = []

    def __enter__(self):
        for slot, k in enumerate(self.aux_ids):
            if self.convention == "vllm":

                def pre(mod, args, kwargs, slot=slot):
                    hs = args[0] if args else kwargs["hidden_states"]
                    self.states[slot] = hs.detach()

                # id L: what enters the final norm (the state leaving the last layer)
                where = self.layers[k] if k < len(self.layers) else self.norm
                self.handles.append(where.register_forward_pre_hook(pre, with_kwargs=True))
            else:

                def post(mod, args, out, slot=slot):
                    hs = out[0] if isinstance(out, tuple) else out
                    self.states[slot] = hs.detach()

                self.handles.append(self.layers[k].register_forward_hook(post))

        def fin(mod, args, out):
            self.final = out.detach()
            if self.stop:
                raise _Stop

        self.handles.append(self.norm.register_forward_hook(fin))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def result(self):
        aux = torch.cat([self.states[i] for i in range(len(self.aux_ids))], dim=-1)
        return aux, self.final


@torch.no_grad()
def capture_features(model, input_ids, attention_mask, aux_ids, convention="vllm"):
    """aux [B, T, 3H] and final [B, T, H] for right-padded sequences (attention_mask None: causal
    attention alone, which never lets a token see the padding to its right). The forward stops
    at the final norm: no logits are computed."""
    with Capture(model, aux_ids, convention, stop=True) as cap:
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _Stop:
            pass
    if cap.final is None:
        raise DraftportError(None, f"the final norm of {type(model).__name__} never ran: nothing captured")
    return cap.result()


@torch.no_grad()
def regenerate(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    batch_size: int = 32,
    progress=None,
) -> list[list[int]]:
    """Greedy responses of the target itself (what it will verify), stopping at eos (kept)."""
    out: list[list[int]] = []
    dev = next(model.parameters()).device
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s : s + batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), L), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for i, p in enumerate(chunk):  # left padding for generation
            ids[i, L - len(p) :] = torch.tensor(p)
            mask[i, L - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
        for row in gen[:, L:].tolist():
            resp = []
            for t in row:
                resp.append(t)
                if t == eos_id:
                    break
            out.append(resp)
        if progress is not None:
            progress(len(chunk))
    return out


def target_identity(path: str | Path) -> dict:
    """{id, revision} of a target folder: from draftport_target.json, else the folder name."""
    path = Path(path)
    meta = path / "draftport_target.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        return {"id": m.get("name", path.name), "revision": m.get("revision", "local")}
    return {"id": path.name, "revision": "local"}


def trusted(target, trust_remote_code) -> bool:
    """Whether a target folder may run its own code: its hub repo (the fetch recorded it), or the
    folder itself, is named in targets.trust_remote_code."""
    lock = Path(target) / "fetch.lock.json"
    repo = json.loads(lock.read_text()).get("source") if lock.is_file() else str(target)
    return repo in set(trust_remote_code or ())
