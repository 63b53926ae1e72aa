"""params.yaml: the one parameter file, its profiles and its schema.

Every value a step uses lives in params.yaml, grouped by step. A profile (configs/<name>.yaml)
is a partial params.yaml layered on top (`snakemake --configfile=configs/micro.yaml --cores 2 phase1`); the merge
is a recursive dict update, exactly what Snakemake does with its configfiles.

The schema is one pydantic model tree, `Params` (a group of params.yaml is a model: unknown keys
refused, strict types, ranges, a description on every field). Two of its models are used as they
are by the code: `TrainConfig` (every `train` group: the training loop's config) and
`WorldParams` (the `world` group; `WorldParams().model_dump()` is the embedded world). Their
defaults are the only defaults; params.yaml still writes every value out (a test checks it).

`validate` runs before any work (the Snakefile calls it at parse time, every script again): an
unknown key, a wrong type or a bad value is one line naming the dotted key, the first problem in
the order of the file.

No torch, no snakemake here: the Snakefile imports this on every start.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_serializer,
)
from pydantic_core import PydanticCustomError

from draftport.errors import DraftportError

# get: the dotted-key lookup both use
from draftport.plan.registry import STEP_NAMES, TORCHRUN_INSIDE, TRAINING_STEPS, get

PARAMS_FILE = "params.yaml"


class ParamsError(DraftportError):
    """A bad parameter: str() is one line, `key: problem`."""


def _show(v: Any) -> str:
    s = json.dumps(v) if isinstance(v, (str, list, dict)) or v is None else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


# ---- leaf types --------------------------------------------------------------------------------
# Plain int / float / bool / Literal fields are strict (the models' config): an int refuses "32"
# and 1.5, a float refuses true (an int is taken, as a float), a bool refuses 1. The kinds below
# add what pydantic has no word for; their problems are already params.yaml's one-line wording.
def _problem(text: str, at: str = "") -> PydanticCustomError:
    """at: appended to the field's dotted key (an entry of a list: `[1] (code)`)."""
    return PydanticCustomError("draftport", "{problem}", {"problem": text, "at": at})


def _non_empty(v: str) -> str:
    if not v.strip():
        raise _problem(f"expected a non-empty string, got {_show(v)}")
    return v


def _is_hub_id(v: Any) -> bool:
    return isinstance(v, str) and v.count("/") == 1 and not v.startswith("/") and not v.endswith("/")


def _hub_id(v: str) -> str:
    if not _is_hub_id(v):
        raise _problem(f"expected a hub id like org/name, got {_show(v)}")
    return v


def _hub_id_or_folder(v: str) -> str:
    """org/name, or a folder written as a path (/abs, ./rel, ../rel): a drafter the team has on disk."""
    if not (_is_hub_id(v) or v.startswith(("/", "./", "../"))):
        raise _problem(f"expected a hub id like org/name or a folder (./path, /path), got {_show(v)}")
    return v


def _hub_ids(v: Any) -> Any:
    if not isinstance(v, list):
        raise _problem(f"expected a list of hub ids like org/name, got {_show(v)}")
    for x in v:
        if not _is_hub_id(x):
            raise _problem(f"expected hub ids like org/name, got {_show(x)}")
    return v


def _int_list(min_entry: int | None = None, max_len: int | None = None, empty: bool = False):
    def check(v: Any) -> Any:
        if (
            not isinstance(v, list)
            or (not v and not empty)
            or any(isinstance(x, bool) or not isinstance(x, int) for x in v)
        ):
            raise _problem(f"expected a {'' if empty else 'non-empty '}list of integers, got {_show(v)}")
        if min_entry is not None and v and min(v) < min_entry:
            raise _problem(f"every entry must be >= {_num(min_entry)}, got {v}")
        if max_len is not None and len(v) > max_len:
            raise _problem(f"expected at most {_num(max_len)} entries, got {len(v)}")
        return v

    return BeforeValidator(check)


Str = Annotated[str, AfterValidator(_non_empty)]  # a non-empty string
PathStr = Annotated[str, AfterValidator(_non_empty)]  # a file or folder (relative: to the repo)
HubId = Annotated[str, AfterValidator(_non_empty), AfterValidator(_hub_id)]  # org/name
HubIdOrFolder = Annotated[str, AfterValidator(_non_empty), AfterValidator(_hub_id_or_folder)]
HubIdList = Annotated[list[str], BeforeValidator(_hub_ids)]  # may be empty


def F(default: Any = ..., doc: str = "", **kw) -> Any:
    """A field: its default (... = required in the model), its description, its ranges."""
    return Field(default, description=doc, **kw)


class Group(BaseModel):
    """A group of params.yaml. In a params file every key of a group must be written out,
    unless the group says `keys_optional` (then a key left out takes the model's default)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)
    keys_optional: ClassVar[bool] = False


# ---- the training config (every `train` group) -------------------------------------------------
class FastParams(Group):
    """How impl fused / compiled computes a step (draftport.model.fast.path.FastPath's params;
    the CPU runs torch's CPU kernels whatever the attention). Every choice gives the same
    updates up to the kernels' rounding: a change of them still resumes a run."""

    keys_optional: ClassVar[bool] = True

    attention: Literal["flash", "cudnn", "fa4"] = F(
        "flash",
        "the CUDA kernel of the causal attention: flash (FlashAttention 2 in torch), cudnn (cuDNN's "
        "fused attention; the H200 training benchmark's choice) or fa4 (FlashAttention-4, `pip install --pre "
        "flash-attn-4`, Hopper/Blackwell)",
    )
    packed_attention: Literal["auto", "varlen", "segments"] = F(
        "auto",
        "packed rows' causal attention on CUDA: varlen (the kernel's variable-length form, one call for "
        "all samples; flash's kernel under every attention), segments (the dense kernel once per sample; "
        "refused under cudnn, which rejects one-token segments); auto: varlen",
    )
    compile_tuning: bool = F(
        True,
        "impl compiled: inductor's coordinate-descent tuning (each kernel's block "
        "sizes searched as it compiles; the first steps of each shape compile longer)",
    )
    tune_min_steps: int = F(
        1000,
        "compile_tuning only for a training of at least this many steps: the search costs its "
        "first process tens of seconds, which a short training (a curve point, the GPU profile's "
        "phases) never earns back",
        ge=0,
    )

    @field_validator("packed_attention")
    @classmethod
    def _kernel_takes_it(cls, v: str, info) -> str:
        if v == "segments" and info.data.get("attention") == "cudnn":
            raise _problem(
                "segments under attention cudnn: cuDNN refuses a one-token segment (s_q = s_kv = 1, "
                "measured on an H100); use varlen or auto"
            )
        return v


class TrainConfig(Group):
    """The training loop's knobs (draftport.training.loop.train): AdamW, linear warmup + cosine decay,
    gradient clipping, the TTT loss. `TrainConfig(**d)` and `TrainConfig.from_dict(d, where)`
    raise a ParamsError (a DraftportError) naming the key."""

    keys_optional: ClassVar[bool] = True

    steps: int = F(200, "optimizer steps", ge=1)
    batch_size: int = F(8, "global batch, in samples (split over the torchrun processes)", ge=1)
    lr: float = F(1e-3, "peak learning rate (AdamW), reached after the warmup", ge=1e-7, le=1.0)
    min_lr_ratio: float = F(0.1, "the cosine decay ends at lr * min_lr_ratio", ge=0, le=1)
    warmup_steps: int = F(20, "linear warmup from 0 to lr, in steps", ge=0)
    weight_decay: float = F(0.0, "AdamW weight decay", ge=0, le=1)
    grad_clip: float = F(1.0, "clip of the global gradient norm", ge=0)
    ttt_steps: int = F(3, "TTT steps: draft positions the drafter is unrolled over in training", ge=1, le=16)
    gamma: float = F(0.8, "TTT loss weight: step j's loss counts gamma**j", ge=0, le=1)
    seed: int = F(0, "data order: a step's batch is a pure function of (seed, step)", ge=0)
    checkpoint_every: int = F(50, "steps between checkpoints (a run resumes from the last)", ge=1)
    keep_checkpoints: int = F(2, "checkpoints kept, the older ones removed", ge=1)
    log_every: int = F(10, "steps between logged metrics (MLflow)", ge=1)
    dtype: Literal["auto", "float32", "bfloat16"] = F("auto", "auto: float32 on CPU, bfloat16 autocast on CUDA")
    device: Literal["auto", "cuda", "cpu"] = F(
        "auto",
        "where the training computes (drafter, target head, batches, optimizer state): auto is "
        "cuda:LOCAL_RANK when torch sees a GPU, else the CPU; cuda without a GPU is refused; a run resumes "
        "on another device",
    )
    train_lm_head: bool = F(True, "train the drafter's lm_head (false: frozen; Phase 1's vocab remap needs it)")
    impl: Literal["auto", "reference", "fused", "compiled"] = F(
        "auto",
        "reference: dense-mask attention and whole-tensor loss (the readable definition); "
        "fused: flash attention + log-sum-exp merge, row-chunked fused soft-CE (same terms); "
        "compiled: fused + torch.compile of the per-step regions; auto: compiled on CUDA, else reference",
    )
    parallel: Literal["ddp", "fsdp"] = F(
        "ddp",
        "under torchrun (resources.<step>.torchrun): ddp replicates the drafter; fsdp shards "
        "its weights, gradients and AdamW moments over the ranks",
    )
    eval_every: int = F(
        0,
        "steps between evaluations of tau on the held-out monitor set (step "
        "features_monitor), logged as accept_length by step; 0: none",
        ge=0,
    )
    patience: int = F(
        0,
        "early stop once this many evaluations in a row bring no better held-out tau "
        "than the best so far (needs eval_every); 0: train every step",
        ge=0,
    )
    packing: bool = F(
        False,
        "lay a step's samples end to end in one row (draftport.data.packing: attention, RoPE "
        "positions and the loss stay per sample, the same loss as padding them) instead of "
        "right-padding each to the longest; no compute is spent on padding",
    )
    tokens_per_step: int = F(
        0,
        "with packing: each step (each process under torchrun) packs the next samples of the seeded "
        "data order into one row of exactly this many tokens, padding the rest, instead of batch_size "
        "samples: every step has one shape (no recompiles) and a real pair's steps hold tens of "
        "thousands of tokens; a sample longer than it is refused; 0: batch_size samples a step",
        ge=0,
    )
    l2sp_lambda: float = F(
        0.0,
        "L2-SP: the loss gains l2sp_lambda * sum ||w - w0||^2 over the trained weights, w0 the weights the "
        "training started from (a fine-tune's init after its vocab remap; a resume keeps them): the fine-tune "
        "stays near the source (a Kimi K2.6 -> K2.7 port used 1e-4); 0: off. A training from init scratch "
        "refuses it (train_phase1_scratch reads phase1.train too)",
        ge=0,
    )
    freeze: list[Literal["fc", "input_norms", "attention", "post_attention_norm", "mlp", "final_norm"]] = F(
        default_factory=list,
        doc="parts of the drafter kept at their initial weights (no gradient, no optimizer "
        "state): fc (the projection of the aux states), input_norms (input_layernorm, hidden_norm: the embedding "
        "and aux halves' norms), attention (q/k/v/o), post_attention_norm, mlp (gate/up/down), final_norm (norm); "
        "lm_head: train_lm_head. []: none",
    )
    fast: FastParams = F(
        default_factory=FastParams,
        doc="impl fused / compiled: how a step is computed (the attention kernels, compile tuning)",
    )

    # freeze's parts: the flat names of their weights (lm_head is train_lm_head's)
    FREEZE_PARTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "fc": ("fc.weight",),
        "input_norms": ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"),
        "attention": (
            "midlayer.self_attn.q_proj.weight",
            "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight",
            "midlayer.self_attn.o_proj.weight",
        ),
        "post_attention_norm": ("midlayer.post_attention_layernorm.weight",),
        "mlp": ("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"),
        "final_norm": ("norm.weight",),
    }

    @field_validator("l2sp_lambda")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise _problem(f"expected a finite number, got {v}")
        return v

    @field_validator("freeze", mode="before")
    @classmethod
    def _freeze_parts(cls, v: Any, info) -> Any:
        parts = ", ".join(cls.FREEZE_PARTS)
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise _problem(f"expected a list of part names ({parts}), got {_show(v)}")
        for i, x in enumerate(v):
            if x == "lm_head":
                raise _problem(f"lm_head: set train_lm_head: false to freeze it; parts: {parts}")
            if x not in cls.FREEZE_PARTS:
                raise _problem(f"unknown part {_show(x)}; parts: {parts}")
            if x in v[:i]:
                raise _problem(f"{_show(x)} twice")
        if set(v) == set(cls.FREEZE_PARTS) and info.data.get("train_lm_head") is False:
            raise _problem("every part frozen and train_lm_head false: nothing left to train")
        return v

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _params_error(e, data, type(self), "train.") from None

    # only a wrapper of BaseModel.__init__ (pydantic's own mark, as RootModel's): validation of a
    # params file goes on calling pydantic's, so its errors stay ValidationErrors placed in the file
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, d: dict, where: str = "train") -> "TrainConfig":
        unknown = sorted(set(d) - set(cls.model_fields))
        if unknown:
            raise DraftportError(where, f"unknown training key(s): {', '.join(map(str, unknown))}")
        return _checked(cls, d, f"{where}.")


# ---- the world (step world) --------------------------------------------------------------------
class WorldModel(Group):
    """The targets' shape (a small decoder; both targets share it). arch: transformers' own
    LlamaForCausalLM (the embedded world), DeepseekV3ForCausalLM (Kimi-K2/K2.5's architecture:
    MLA attention, MoE layers after the first first_k_dense_replace) or Qwen3ForCausalLM (dense,
    q/k norms). arch and the DeepSeek-V3 keys may be left out (arch: llama; a DeepSeek-V3 key:
    derived from the sizes, draftport.world.targets.target_config) and stay out of the dump, so
    the Llama world's params are what they were; params.yaml writes the other keys out."""

    keys_optional: ClassVar[bool] = True

    arch: Literal["llama", "deepseek_v3", "qwen3"] = F(
        "llama",
        "the targets' architecture (transformers' own class, no remote code): llama, deepseek_v3 "
        "(Kimi-K2's: MLA + MoE) or qwen3",
    )
    hidden_size: int = F(128, "hidden size H of the targets", ge=1)
    intermediate_size: int = F(384, "MLP width (deepseek_v3: of the dense layers)", ge=1)
    num_hidden_layers: int = F(4, "decoder layers L (bounds features.aux_layer_ids)", ge=1)
    num_attention_heads: int = F(4, "attention heads", ge=1)
    num_key_value_heads: int = F(
        4, "key/value heads (grouped-query attention when fewer; deepseek_v3: = num_attention_heads)", ge=1
    )
    head_dim: int = F(
        32,
        "per-head size (vLLM's CPU attention has no kernel below 32; deepseek_v3: what its "
        "MLA head sizes are derived from)",
        ge=1,
    )
    max_position_embeddings: int = F(512, "longest sequence (also the tokenizer's model_max_length)", ge=1)
    # deepseek_v3 only; left out: derived (draftport.world.targets.target_config)
    q_lora_rank: int = F(None, "deepseek_v3: MLA query compression rank (left out: hidden_size / 2)", ge=1)
    kv_lora_rank: int = F(None, "deepseek_v3: MLA key/value latent rank (left out: hidden_size / 4)", ge=1)
    qk_nope_head_dim: int = F(None, "deepseek_v3: per-head query/key size without RoPE (left out: head_dim)", ge=1)
    qk_rope_head_dim: int = F(
        None, "deepseek_v3: per-head query/key size with RoPE, even (left out: head_dim / 2)", ge=2
    )
    v_head_dim: int = F(None, "deepseek_v3: per-head value size (left out: head_dim)", ge=1)
    n_routed_experts: int = F(None, "deepseek_v3: routed experts of a MoE layer (left out: 4)", ge=2)
    num_experts_per_tok: int = F(None, "deepseek_v3: routed experts per token (left out: 2)", ge=1)
    n_shared_experts: int = F(None, "deepseek_v3: shared experts of a MoE layer (left out: 1)", ge=0)
    moe_intermediate_size: int = F(
        None,
        "deepseek_v3: an expert's MLP width, a multiple of 8 (left out: "
        "intermediate_size / (num_experts_per_tok + n_shared_experts), rounded down "
        "to one: a token's MoE compute is a dense layer's, as in DeepSeek-V3 and "
        "Kimi-K2)",
        ge=8,
    )
    first_k_dense_replace: int = F(
        None, "deepseek_v3: the first layers that stay dense, the rest MoE (left out: 1, as Kimi-K2)", ge=0
    )
    n_group: int = F(None, "deepseek_v3: expert groups of the router (left out: 1, as Kimi-K2)", ge=1)
    topk_group: int = F(
        None, "deepseek_v3: groups a token's experts are chosen from, at most n_group (left out: 1, as Kimi-K2)", ge=1
    )

    DEEPSEEK_KEYS: ClassVar[tuple[str, ...]] = (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
        "n_group",
        "topk_group",
    )

    @field_validator(*DEEPSEEK_KEYS)
    @classmethod
    def _deepseek_only(cls, v, info):
        arch = info.data.get("arch", "llama")
        if v is not None and arch != "deepseek_v3":
            raise _problem(f"a deepseek_v3 key, but world.model.arch is {arch}")
        return v

    @model_serializer(mode="wrap")
    def _leave_out_unset(self, handler):  # arch llama and the keys to derive stay out: the Llama world's dump
        return {k: v for k, v in handler(self).items() if v is not None and not (k == "arch" and v == "llama")}


class TargetTraining(Group):
    """How a world target is trained (target_old from scratch, target_new continued from it)."""

    steps: int = F(..., "optimizer steps", ge=1)
    lr: float = F(..., "peak learning rate (linear warmup, cosine down to 10%)", ge=0)
    batch_size: int = F(..., "sequences per step", ge=1)
    seq_len: int = F(..., "tokens per training sequence", ge=1)
    warmup: int = F(..., "warmup steps", ge=0)


class DrafterArch(Group):
    """The source drafter's shape; a key left out is derived from the target
    (draftport.model.bind.new_drafter_config): heads 4, key/value heads = heads, head_dim =
    hidden / heads, intermediate 3 x hidden, rope_theta 10000."""

    keys_optional: ClassVar[bool] = True

    num_attention_heads: int = F(None, "attention heads (left out: 4)", ge=1)
    intermediate_size: int = F(None, "MLP width (left out: 3 x hidden_size)", ge=1)
    num_key_value_heads: int = F(None, "key/value heads (left out: = num_attention_heads)", ge=1)
    head_dim: int = F(None, "per-head size (left out: hidden_size / num_attention_heads)", ge=1)
    rope_theta: float = F(None, "RoPE base (left out: 10000)", ge=1)

    @model_serializer(mode="wrap")
    def _leave_out_derived(self, handler):  # a key not given stays out: bind derives it
        return {k: v for k, v in handler(self).items() if v is not None}


class SourceDrafterParams(Group):
    """The world's "AQ-MedAI drafter": an EAGLE-3 drafter trained for target_old, published as
    the hub repo source.repo_id in artifacts/world/hub."""

    n_samples: int = F(
        4000,
        "training samples: the first old-corpus prompts (Phase 1 gets far fewer: "
        "the real source saw 1.4M, the new data is 37K)",
        ge=1,
    )
    max_new_tokens: int = F(96, "answer length", ge=1)
    draft_vocab_ratio: float = F(
        0.25, "draft vocabulary size as a share of the vocab (at least 8 ids)", ge=0.001, le=1.0
    )
    batch_size: int = F(32, "generation batch", ge=1)
    answers: Literal["regenerated", "corpus"] = F(
        "corpus",
        "regenerated: target_old's own greedy answers (a generation per sample); corpus: the "
        "corpus's answers, teacher-forced (one prefill per sample; the labels are the target's choices either way)",
    )
    monitor_samples: int = F(
        64,
        "the last old-corpus prompts, answered by target_old: the held-out set "
        "whose tau (train.eval_every) traces the source's plateau; 0: none",
        ge=0,
    )
    arch: DrafterArch = F(
        default_factory=lambda: DrafterArch(num_attention_heads=4, intermediate_size=384),
        doc="the drafter's shape; keys left out are derived from the target",
    )
    train: TrainConfig = F(
        default_factory=lambda: TrainConfig(
            steps=1200,
            batch_size=16,
            lr=0.003,
            warmup_steps=20,
            ttt_steps=3,
            log_every=50,
            checkpoint_every=1200,
            eval_every=100,
        ),
        doc="its training (draftport.training.loop)",
    )


class WorldParams(Group):
    """Step world: the embedded K2 -> K2.5 analog (corpus, tokenizer, target_old, target_new,
    the source drafter). The defaults are the embedded world: `WorldParams().model_dump()`.
    (Field order: the world's own keys, then what the pipeline adds, as a missing key is named.)"""

    seed: int = F(0, "corpus and training seed (everything is deterministic from seed, language_seed)", ge=0)
    language_seed: int = F(20250711, "seed of the synthetic language (its words and grammar)", ge=0)
    n_old: int = F(6000, "samples of the old corpus (target_old's training data)", ge=1)
    n_new: int = F(6000, "samples of the new corpus (target_new's; bounds phase2.n_samples)", ge=1)
    n_heldout: int = F(300, "held-out prompts per corpus (the eval sets; bounds features.eval_samples)", ge=1)
    vocab_size: int = F(
        2048,
        "the targets' vocabulary (bounds vocab_new.draft_vocab_size): the BPE learns up to "
        "this many tokens; where the language holds fewer, the rest are rows no text uses, as real "
        "models pad theirs (Kimi-K2: 163,840)",
        ge=1,
    )
    threads: int = F(2, "torch threads while the world is built", ge=0)
    device: Literal["auto", "cuda", "cpu"] = F(
        "auto",
        "where the world's targets train and answer, and its source drafter is captured and trained: "
        "auto is the GPU when torch sees one, else the CPU; cuda without a GPU is refused",
    )
    model: WorldModel = F(default_factory=WorldModel, doc="the targets' shape")
    target_old: TargetTraining = F(
        default_factory=lambda: TargetTraining(steps=300, lr=0.003, batch_size=16, seq_len=128, warmup=30),
        doc='"K2": trained from scratch on the old corpus',
    )
    target_new: TargetTraining = F(
        default_factory=lambda: TargetTraining(steps=160, lr=0.0015, batch_size=16, seq_len=128, warmup=10),
        doc='"K2.5": target_old continued on the new corpus',
    )
    measure_samples: int = F(200, "held-out prompts the two targets are measured on", ge=1)
    build: bool = F(True, "false: no embedded world (a real target, e.g. the kimi profile)")
    source_drafter: SourceDrafterParams = F(
        default_factory=SourceDrafterParams, doc="the source drafter, trained for target_old"
    )


# ---- the other groups --------------------------------------------------------------------------
class SourceParams(Group):
    """Step fetch: the source drafter, pinned."""

    repo_id: HubIdOrFolder = F(..., "hub repo of the source drafter (org/name), or its folder (./path, /path)")
    revision: Str = F(..., "branch, tag or commit (the resolved commit is recorded)")
    cache_dir: Optional[PathStr] = F(..., "hub cache; null = the default HF cache")
    offline: bool = F(..., "HF_HUB_OFFLINE=1: nothing leaves the machine")
    lock_file: Optional[PathStr] = F(..., "a sha256-per-file lock kept outside the outputs; a later fetch must match")
    allow_pickle: bool = F(
        ...,
        "pickle weights (.bin/.pt) can run code: refused unless true, then converted "
        "to safetensors at fetch with torch.load(weights_only=True)",
    )


# ---- the named held-out sets (targets.eval_sets) -------------------------------------------------
EVAL_SET_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")  # it names MLflow metrics (accept_length/<name>) and files
SHARE_TOLERANCE = 1e-6  # how far from 1 the shares may add up (decimal shares in YAML)


class EvalSet(Group):
    """One entry of targets.eval_sets: a kind of the served traffic, its held-out prompts and its share."""

    keys_optional: ClassVar[bool] = True  # n may be left out

    name: str = F(
        ...,
        "the set's name: lowercase letters, digits, _ and -, a letter or digit first, at most 40 characters "
        "(it names the MLflow metric accept_length/<name> and files)",
    )
    prompts: PathStr = F(..., 'its held-out prompts, JSONL ({"user": ...} per line), disjoint from prompts_train')
    share: float = F(..., "its share of the served traffic (output tokens); the shares add up to 1", gt=0, le=1)
    n: Optional[int] = F(None, "prompts taken from the file's start; null: features.eval_samples", ge=1)


def eval_set_label(i: int, s: Any) -> str:
    """How a problem names entry i of targets.eval_sets: its index and, when it has one, its name."""
    name = s.get("name") if isinstance(s, dict) else None
    return f"targets.eval_sets[{i}]" + (f" ({name})" if isinstance(name, str) and name.strip() else "")


def _eval_set_problem(s: Any) -> str | None:
    """What is wrong with one entry of targets.eval_sets on its own (None: nothing)."""
    if not isinstance(s, dict):
        return f"expected a mapping of name, prompts, share (and n), got {_show(s)}"
    unknown = [k for k in s if k not in EvalSet.model_fields]
    if unknown:
        return f"unknown key {_show(unknown[0])} (an eval set's keys: {', '.join(EvalSet.model_fields)})"
    missing = [k for k, f in EvalSet.model_fields.items() if f.is_required() and k not in s]
    if missing:
        return f"{missing[0]}: missing"
    name, prompts, share, n = s["name"], s["prompts"], s["share"], s.get("n")
    if not isinstance(name, str) or not EVAL_SET_NAME.fullmatch(name):
        return (
            "name: lowercase letters, digits, _ and -, a letter or digit first, at most 40 characters "
            f"(it names metrics and files), got {_show(name)}"
        )
    if not isinstance(prompts, str) or not prompts.strip():
        return f"prompts: expected a non-empty string (a JSONL file), got {_show(prompts)}"
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        return f"share: expected a number > 0 and <= 1, got {_show(share)}"
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        return f"n: expected an integer >= 1 or null, got {_show(n)}"
    return None


def _eval_sets(v: Any) -> Any:
    """targets.eval_sets: null, or a non-empty list of good entries (the names and shares together:
    the cross checks, check_eval_set_totals)."""
    if v is None:
        return v
    if not isinstance(v, list) or not v:
        raise _problem(f"expected null or a non-empty list of sets (name, prompts, share, n), got {_show(v)}")
    for i, s in enumerate(v):
        problem = _eval_set_problem(s)
        if problem:
            raise _problem(problem, at=eval_set_label(i, s).removeprefix("targets.eval_sets"))
    return v


def check_eval_set_totals(sets: list[dict]) -> None:
    """Names unique, shares adding up to 1: ParamsError naming the entry (or the list, for the sum)."""
    first: dict[str, int] = {}
    for i, s in enumerate(sets):
        if s["name"] in first:
            raise ParamsError(
                eval_set_label(i, s),
                f"the name is also targets.eval_sets[{first[s['name']]}]'s: each set's name is its own "
                "(it names metrics and files)",
            )
        first[s["name"]] = i
    total = math.fsum(s["share"] for s in sets)
    if abs(total - 1.0) > SHARE_TOLERANCE:
        terms = " + ".join(f"{s['name']} {s['share']:g}" for s in sets)
        raise ParamsError("targets.eval_sets", f"the shares add up to {total:.6g} ({terms}), not 1")


def check_eval_sets(sets: Any) -> list[dict]:
    """targets.eval_sets checked on its own (`draftport init --eval-set`): each entry, then the
    names and shares together. -> the sets; ParamsError naming the entry."""
    try:
        _eval_sets(sets)
    except PydanticCustomError as e:
        ctx = e.context or {}
        raise ParamsError("targets.eval_sets" + ctx.get("at", ""), ctx["problem"]) from None
    if sets:
        check_eval_set_totals(sets)
    return sets


def resolved_eval_sets(p: dict, target: str = "new") -> list[dict]:
    """The held-out sets a target answers, as [{name, prompts, share, n}] with n filled in. No
    targets.eval_sets: one set, heldout (targets.prompts_eval_new, share 1, features.eval_samples);
    the old target answers the named sets as they are, the default set from targets.prompts_eval_old
    (prompts None when that is null). p: the params, or a step's subset of them."""
    if target not in ("new", "old"):
        raise ValueError(f"target must be new or old, got {target!r}")
    t, n = p.get("targets") or {}, (p.get("features") or {}).get("eval_samples")
    if t.get("eval_sets"):
        return [
            {
                "name": s["name"],
                "prompts": s["prompts"],
                "share": float(s["share"]),
                "n": s["n"] if s.get("n") is not None else n,
            }
            for s in t["eval_sets"]
        ]
    prompts = t.get("prompts_eval_new") if target == "new" else t.get("prompts_eval_old")
    return [{"name": "heldout", "prompts": prompts, "share": 1.0, "n": n}]


class TargetsParams(Group):
    """The targets and prompt sets (an existing folder, a pipeline output, or a hub id)."""

    new: Str = F(..., "the new target (the one the drafter is ported to)")
    old: Optional[Str] = F(..., "the old target (the source's own); null: no source-on-its-own-target reference")
    prompts_train: PathStr = F(..., 'training prompts, JSONL ({"user": ...} per line)')
    prompts_eval_new: PathStr = F(..., "held-out prompts for the new target (the eval set)")
    prompts_eval_old: Optional[PathStr] = F(..., "held-out prompts for the old target; null: none")
    eval_sets: Annotated[Optional[list[EvalSet]], BeforeValidator(_eval_sets)] = F(
        None,
        "named held-out sets, one per kind of served traffic, each {name, prompts, share, n}: accept length "
        "per set, and the decision on their share-weighted figure; the old target answers the same prompts. "
        "null: one set, heldout (prompts_eval_new, share 1)",
    )
    trust_remote_code: HubIdList = F(
        ..., "hub repos whose own code (config.json auto_map: model, tokenizer) may run; [] = none"
    )


class FeaturesParams(Group):
    """Steps features_new / features_eval / features_phase2: answers regenerated by the target
    itself, and its hidden states at the aux layers."""

    aux_layer_ids: Annotated[list[int], _int_list(0, 3)] = F(
        ..., "the layers the drafter reads (at most 3, must be the source drafter's)"
    )
    aux_convention: Literal["vllm", "sglang"] = F(..., "vllm: id k = the state entering layer k; sglang: leaving it")
    max_new_tokens: int = F(..., "answer length", ge=1)
    batch_size: int = F(..., "generation batch", ge=1)
    dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = F(
        ...,
        "storage dtype of the captured states; fp8_e4m3: float8 with a float32 scale per token and state, "
        "half of bf16's bytes. The target itself runs in bfloat16 on a GPU, float32 on the CPU (and for float32)",
    )
    device: Str = F(..., "torch device of the target (engine transformers)")
    eval_samples: int = F(..., "held-out prompts with features (the offline eval)", ge=1)
    engine: Literal["transformers", "vllm"] = F(
        ...,
        "hidden states: transformers in this process (device_map over the visible GPUs), or vLLM's "
        "extract_hidden_states with tensor parallelism",
    )
    tensor_parallel_size: int = F(..., "engine vllm: GPUs the target is sharded over", ge=1)
    regenerate: Literal["local", "openai"] = F(
        ...,
        "the target's own answers: generated here, or by the target served behind an "
        "OpenAI-compatible API (vLLM, SGLang) at base_url",
    )
    base_url: Optional[Str] = F(..., "regenerate openai: the server, e.g. http://127.0.0.1:8000/v1")
    served_model: Optional[Str] = F(..., "regenerate openai: the name the server knows the target by")
    compile: bool = F(
        True,
        "a GPU capture (engine transformers): each decoder layer compiled by torch.compile, "
        "batch lengths padded to a multiple of 128 (falls back to eager if it fails); the CPU never "
        "compiles",
    )
    storage: Literal["disk", "online", "hybrid"] = F(
        "disk",
        "training data's states: disk (captured by features_new / features_phase2 and stored); online "
        "(those steps store the answers only, each training step captures the states into a bounded spool, "
        "deleted as read); hybrid (online, the first epoch kept on disk for the later ones when it fits)",
    )
    spool_gb: float = F(64.0, "storage online / hybrid: the spool's bound in GB (at least one shard)", gt=0)
    spool_dir: Optional[Str] = F(
        None,
        "storage online / hybrid: where the spool lives (a shared filesystem on "
        "a cluster); null: beside the training step's checkpoints",
    )
    serve_tok_s: Optional[float] = F(
        None,
        "the serving deployment's measured output tok/s (all requests, all "
        "its GPUs) that regenerates the answers: `draftport estimate` bills the "
        "regeneration at it; null: derived from the target's size and the GPUs "
        "(docs/estimate.md)",
        gt=0,
    )


class VocabNewParams(Group):
    """Step vocab_new: the new target's draft vocabulary (top-N ids of its own answers)."""

    draft_vocab_size: int = F(..., "ids in the draft vocabulary", ge=8)


def _bucket_edges(v: list[int]) -> list[int]:
    if v[0] != 0 or any(b <= a for a, b in zip(v, v[1:])):
        raise _problem(f"expected lower edges starting at 0, strictly increasing, got {v}")
    return v


def _trees(v: Any) -> Any:
    """eval.trees: [steps, topk, num_draft_tokens] each, as SGLang accepts them (the bound on draft
    tokens is draftport.evaluation.trees.tree_candidates' count, plus the root)."""
    if not isinstance(v, list):
        raise _problem(f"expected a list of [steps, topk, num_draft_tokens], got {_show(v)}")
    for t in v:
        if not (isinstance(t, list) and len(t) == 3 and all(type(x) is int for x in t)):
            raise _problem(f"a tree is [steps, topk, num_draft_tokens] (integers), got {_show(t)}")
        steps, topk, n = t
        if not (1 <= steps <= 16 and 1 <= topk <= 16):
            raise _problem(f"{t}: steps and topk must lie in [1, 16]")
        most = 1 + topk + (steps - 1) * topk * topk
        if not 2 <= n <= most:
            raise _problem(f"{t}: num_draft_tokens must lie in [2, {most}] (the root + the nodes the tree drafts)")
    return v


class EvalParams(Group):
    """Every phase: the offline accept length, drafted as an engine drafts."""

    k: int = F(..., "draft tokens per verify cycle", ge=1, le=16)
    k_max: int = F(
        8,
        "the phases' and the curves' evaluations draft this deep once and report every k up to it (by_k: tau, "
        "per-position acceptance, per set and bucket); at least eval.k; R2 takes break-even at each n's best k",
        ge=1,
        le=16,
    )
    trees: Annotated[list[list[int]], BeforeValidator(_trees)] = F(
        [],
        "SGLang-style draft trees measured offline in the phases' evaluations, each [steps, topk, "
        "num_draft_tokens] (--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens); "
        "no engine serves EAGLE-3 trees on the CPU, so the figure is never checked online",
    )
    batch_size: int = F(..., "eval batch", ge=1)
    max_samples: Optional[int] = F(..., "held-out samples evaluated; null: all of them", ge=1)
    device: Literal["auto", "cuda", "cpu"] = F(
        ...,
        "where the evaluation drafts (also the drift probe's): auto is the GPU when torch sees one, "
        "else the CPU; cuda without a GPU is refused",
    )
    context_buckets: Annotated[list[int], _int_list(0, 8), AfterValidator(_bucket_edges)] = F(
        [0, 512, 2048, 8192],
        "lower edges of the context-length buckets of the verify position (the token the engine drafts "
        "from), the first 0, strictly increasing; the last bucket is open-ended: accept length per bucket "
        "(real serving contexts: [0, 512, 2048, 8192], the schema's default)",
    )


class CostModelParams(Group):
    """Every phase: projected tok/s = tau / (verify + k * draft); break-even tau at the baseline."""

    baseline_tok_s: float = F(..., "tok/s of the target without a drafter", ge=1e-9)
    verify_ms: float = F(..., "one verify cycle of the target, ms (drafting included when draft_ms is 0)", ge=1e-9)
    draft_ms: float = F(..., "one draft token, ms", ge=0)


class Phase1Params(Group):
    """Steps train_phase1 (fine-tune the source) and train_phase1_scratch (the control: same data
    and budget), and their evals."""

    n_samples: int = F(..., "training samples (new target's answers)", ge=1)
    vocab_policy: Literal["remap", "keep"] = F(
        ..., "remap: lm_head rows move onto the new draft map by target id; keep: the source's map"
    )
    train: TrainConfig = F(..., "the training run")


class Phase2Params(Group):
    """Steps features_phase2 + train_phase2: scaled data, Phase 1's drafter continued."""

    n_samples: int = F(..., "samples in all (Phase 1's included); must exceed phase1.n_samples", ge=1)
    train: TrainConfig = F(..., "the training run")


class ReferenceParams(Group):
    """A published drafter trained for the new target itself (an upper bound): fetched like the
    source (source.cache_dir, source.offline), evaluated in Phase 0 next to it."""

    repo_id: HubId = F(..., "hub repo (org/name)")
    revision: Str = F(..., "branch, tag or commit")
    note: Optional[Str] = F(..., "shown in the report next to it")


_RESOURCE_DOCS = {
    "gpu": "GPUs",
    "mem_mb": "memory, MB",
    "runtime": "minutes",
    "threads": "threads (cores)",
    "torchrun": "training steps only (and budget: its trainings): one process per GPU "
    "(torchrun --nproc_per_node <gpu>)",
}


class ResourceDefault(Group):
    """What every step asks of the machine or the cluster (draftport.plan.cluster)."""

    gpu: int = F(..., _RESOURCE_DOCS["gpu"], ge=0)
    mem_mb: int = F(..., _RESOURCE_DOCS["mem_mb"], ge=1)
    runtime: int = F(..., _RESOURCE_DOCS["runtime"], ge=1)
    threads: int = F(..., _RESOURCE_DOCS["threads"], ge=1)
    torchrun: bool = F(..., _RESOURCE_DOCS["torchrun"])


class ResourceOverride(Group):
    """A step's resources: the keys given override resources.default's."""

    keys_optional: ClassVar[bool] = True

    gpu: int = F(None, _RESOURCE_DOCS["gpu"], ge=0)
    mem_mb: int = F(None, _RESOURCE_DOCS["mem_mb"], ge=1)
    runtime: int = F(None, _RESOURCE_DOCS["runtime"], ge=1)
    threads: int = F(None, _RESOURCE_DOCS["threads"], ge=1)
    torchrun: bool = F(None, _RESOURCE_DOCS["torchrun"])


RESOURCE_RULES = ("default", *STEP_NAMES)
TRAINING_RULES = (*TRAINING_STEPS, *TORCHRUN_INSIDE)


class _ResourcesGroup(Group):
    keys_optional: ClassVar[bool] = True


# one field per step of draftport.plan.registry (a step left out takes resources.default)
ResourcesParams = create_model(
    "ResourcesParams",
    __base__=_ResourcesGroup,
    __module__=__name__,
    __doc__="Snakemake resources per step: `default` for every step, a step's entry overrides keys of it.",
    default=(ResourceDefault, F(None, "every step's gpu, mem_mb, runtime, threads, torchrun (required)")),
    **{r: (ResourceOverride, F(None, f"step {r}: overrides of resources.default")) for r in STEP_NAMES},
)


class OnlineParams(Group):
    """Steps online_phase0 / online_phase1: the phase's drafter served by vLLM's EAGLE-3
    speculative decoding (greedy, k = eval.k); tau from vLLM's counters next to the offline
    evaluator on the same sequences."""

    enabled: bool = F(..., "true: `all` and the report include the online steps")
    n_prompts: int = F(..., "prompts from targets.prompts_eval_new", ge=1)
    max_new_tokens: int = F(..., "answer length", ge=1)
    max_num_seqs: int = F(..., "vLLM's concurrent sequences", ge=1)
    tolerance: float = F(
        ..., "the step fails when online and offline tau differ by more (a bug, not noise)", ge=0, le=1
    )
    dtype: Literal["float32", "bfloat16", "float16"] = F(..., "vLLM's dtype")
    vllm_python: Optional[PathStr] = F(
        ..., "vLLM's venv python; null: $DRAFTPORT_VLLM_PYTHON, else .venv-vllm/bin/python"
    )
    tensor_parallel_size: int = F(..., "GPUs vLLM shards the target over", ge=1)
    embed_tokens: Literal["drop", "target"] = F(
        "drop",
        "the export's embed_tokens (vLLM serves a drafter's own copy, SGLang always the target's): "
        "drop = none, so vLLM takes the target's as SGLang does; target = the new target's, bit for bit. "
        "A drafter carrying another embedding (the old target's) is never exported as is",
    )


def _folder_name(v: str) -> str:
    if "/" in v or v in (".", "..") or v.startswith("."):
        raise _problem(f"expected a plain folder name (no '/', not hidden), got {_show(v)}")
    return v


class PublishParams(Group):
    """Step publish (opt-in) and `draftport publish`: the chosen drafter as a hub-ready folder with
    its model card (draftport.outputs.publish, docs/publish.md)."""

    enabled: bool = F(..., "true: the step exists (`snakemake publish`) and `all` includes it")
    phase: Optional[Literal["phase1_scratch", "phase1", "phase2"]] = F(
        ...,
        "the drafter to publish; null: the decision's (init scratch -> phase1_scratch, else phase2 when it "
        "helps, else phase1)",
    )
    folder: Annotated[str, AfterValidator(_non_empty), AfterValidator(_folder_name)] = F(
        ..., "artifacts/publish/<folder>/: config.json, model.safetensors, README.md"
    )
    base_model: Optional[Str] = F(
        ..., "the card's base_model and the config's verifier; null: targets.new (a hub id is needed to push)"
    )
    repo_id: Optional[HubId] = F(
        ..., "the hub repo the card's commands name (draftport publish --repo-id overrides it); null: the local folder"
    )
    embed_tokens: Literal["drop", "target"] = F(
        ...,
        "target: the new target's embed_tokens, bit for bit (vLLM and speculators then embed as SGLang does); "
        "drop: none (speculators 0.9.0 fills a missing one with uninitialized memory)",
    )
    k: Annotated[list[int], _int_list(1, 16)] = F(
        ...,
        "draft tokens per cycle of the card's tau table (eval.k is always included), measured on the published folder",
    )
    library_name: Str = F(..., "the card's library_name")
    tags: list[str] = F(..., "the card's tags")
    license: Optional[Str] = F(..., "the card's license (a hub license id); null: none stated")


class DriftParams(Group):
    """Step drift (beside Phase 0): the old and the new target on the same tokens (the new
    target's answers to the eval prompts): how far the hidden states moved, and what that costs
    the source drafter (draftport.evaluation.drift)."""

    enabled: bool = F(
        ...,
        "run the probe (needs targets.old); the kimi profile turns it off: two 1T-parameter prefills over the eval set",
    )
    max_tokens: int = F(4096, "tokens sampled for linear CKA (cosine and norms use every assistant token)", ge=2)


class MonitorParams(Group):
    """Step features_monitor: the held-out set of tau during training (train.eval_every)."""

    n_samples: int = F(
        ...,
        "the last prompts of targets.prompts_train, answered by the new target (no training prefix may reach them)",
        ge=1,
    )
    k: int = F(..., "draft tokens per cycle of the held-out tau (its own: eval.k edits retrain nothing)", ge=1, le=16)
    batch_size: int = F(..., "its eval batch", ge=1)


class CurvesParams(Group):
    """Steps train_curves / eval_curves (target `curves`): fine-tune and scratch at several
    sample counts, several seeds each, under one budget rule."""

    enabled: bool = F(..., "false: no curves (the decision then rests on the phases alone)")
    n_samples: Annotated[list[int], _int_list(1, 64)] = F(
        ..., "sample counts, ascending (a prefix of Phase 1's + Phase 2's capture: at most phase2.n_samples)"
    )
    seeds: Annotated[list[int], _int_list(0, 64)] = F(..., "seeds per point (data order; scratch's init)")
    inits: list[Literal["source", "scratch"]] = F(..., "source: fine-tune the source drafter; scratch: the control")
    epochs: float = F(
        ...,
        "the budget rule: steps = min(train.steps, max(min_steps, ceil(epochs * n / "
        "train.batch_size))): the same epochs at every n",
        ge=0.01,
    )
    min_steps: int = F(..., "fewest steps of a point", ge=1)
    arms_n_samples: Annotated[list[int], _int_list(1, 16, empty=True)] = F(
        ...,
        "the n at which the arms below train (each among n_samples: an arm is compared with plain "
        "fine-tuning at the same n and seeds): arms x len(arms_n_samples) x len(seeds) trainings more; "
        "[]: no arms (answers and recipes unused)",
    )
    answers: bool = F(
        ...,
        "the regenerate-or-not arm: each init trained on the prompts' own answers as "
        "the dataset gives them (step features_dataset: a prefill, no decoding), scored on "
        "the new target's own answers like every point (rule R7)",
    )
    recipes: dict[str, dict[str, Any]] = F(
        ...,
        "port recipes: name -> train keys that differ from `train` (e.g. {l2sp_lambda: 1.0e-4}, "
        "{lr: 5.0e-4}, {freeze: [fc]}); each one an arm fine-tuning the source (rule R8); {}: none",
    )
    train: TrainConfig = F(
        ...,
        "the training run of every point (steps: the most a point may take; "
        "seed: replaced by each point's; patience > 0: stop at a plateau)",
    )


class DataParams(Group):
    """How much of Phase 2's data to make: all of phase2.n_samples at once (step features_phase2), or
    in rounds that stop when more data stops paying (step budget, draftport.evaluation.budget)."""

    budget: Literal["fixed", "adaptive"] = F(
        "fixed",
        "fixed: phase2.n_samples captured at once; adaptive: rounds of n x factor from phase1.n_samples, "
        "each trained (the source, `seeds`, the curves' budget rule and curves.train) and scored, until the next "
        "round's projected gain's upper CI bound < decision.min_gain, phase2.n_samples (the cap) or max_hours; "
        "Phase 2 trains on what was captured",
    )
    factor: float = F(2.0, "adaptive: each round's n = the last one's x factor", gt=1.0, le=16.0)
    seeds: Annotated[list[int], _int_list(0, 16)] = F([0, 1, 2], "adaptive: seeds trained per round")
    max_hours: Optional[float] = F(
        None,
        "adaptive: the rounds' device-hours (capture and training) may not pass "
        "this; null: no cap but phase2.n_samples",
        gt=0,
    )


def _batch_sizes(v: list[int]) -> list[int]:
    if not v or any(b < 1 for b in v) or sorted(set(v)) != v:
        raise ValueError(f"{v}: batch sizes >= 1, strictly increasing, at least one")
    return v


class ServingParams(Group):
    """Step decision, rule R11: how to serve the recommended drafter and the source as-is."""

    batch_sizes: Annotated[list[int], AfterValidator(_batch_sizes)] = F(
        [1],
        "the batch sizes (requests decoding together) you serve at: the best draft configuration at each, "
        "speculation off where the target alone is faster",
    )
    step_table: Optional[str] = F(
        None,
        "a CSV of measured engine steps, batch_size,k,step_ms (k 0: the target alone), or batch_size,k,itl_ms,"
        "accept_length as `vllm bench` reports them; null: derived from a real target's config and serving.gpu, "
        "tensor_parallel and context; the embedded world: the cost model's figures at eval.k, batch 1 only",
    )
    ms_per_draft_token: float = F(
        1.0,
        "without a table: what one more draft token adds to a step, ms (about 1 ms for Llama-3.1-8B on an H100, "
        "vLLM issue #20780)",
        ge=0,
    )
    gpu: Literal["H100", "H200"] = F(
        "H200", "a real target without a table: the GPU the step times are derived for (draftport.profile.estimate)"
    )
    tensor_parallel: int = F(8, "a real target without a table: the GPUs one serving instance spans", ge=1)
    context: int = F(2048, "a real target without a table: the mean context of a decoding request, tokens", ge=1)


class DecisionParams(Group):
    """Step decision: bootstrap CIs over prompts and the rules of draftport.evaluation.decision."""

    n_boot: int = F(..., "bootstrap replicates", ge=100)
    level: float = F(..., "confidence level of every interval", ge=0.5, le=0.999)
    seed: int = F(..., "the bootstrap's seed", ge=0)
    min_gain: float = F(
        0.05,
        "rule R6: a tau gain from more data smaller than this is not worth collecting (0: any significant gain is)",
        ge=0,
    )
    min_share: float = F(
        0.05,
        "rule R10: a held-out set with at least this share of the traffic on which the recommended drafter "
        "is significantly worse is named in the recommendation (a context bucket is named whatever its share)",
        ge=0,
        le=1,
    )
    serving_tokens_per_day: Optional[float] = F(
        None,
        "tokens the deployment generates a day: with it the recommendation states the payback (days "
        "of serving until the port's GPU-hours are recovered by the faster decoding); null: not stated",
        gt=0,
    )


class Params(Group):
    """The whole of params.yaml (a profile layered on it)."""

    profile: Str = F(..., "names the MLflow experiment (draftport-<profile>)")
    world: WorldParams = F(..., "step world: the embedded K2 -> K2.5 analog and its source drafter")
    source: SourceParams = F(..., "step fetch: the source drafter, pinned")
    targets: TargetsParams = F(..., "the targets and prompt sets")
    features: FeaturesParams = F(..., "the features steps: the target's answers and hidden states")
    vocab_new: VocabNewParams = F(..., "step vocab_new: the new target's draft vocabulary")
    eval: EvalParams = F(..., "every phase: the offline accept length")
    costmodel: CostModelParams = F(..., "every phase: projected tok/s")
    drift: DriftParams = F(..., "step drift: how far the new target's hidden states moved")
    phase1: Phase1Params = F(..., "Phase 1: fine-tune the source (and the from-scratch control)")
    phase2: Phase2Params = F(..., "Phase 2: scaled data, continued")
    monitor: MonitorParams = F(..., "step features_monitor: the held-out set of tau during training")
    curves: CurvesParams = F(..., "the learning curves: fine-tune and scratch by sample count and seed")
    data: DataParams = F(..., "Phase 2's data: all at once, or an adaptive budget in rounds")
    decision: DecisionParams = F(..., "step decision: the recommendation and its confidence")
    serving: ServingParams = F(..., "step decision: how to serve the drafters (rule R11)")
    reference: Optional[ReferenceParams] = F(..., "a published drafter for the new target (an upper bound); null: none")
    resources: ResourcesParams = F(..., "Snakemake resources per step")
    online: OnlineParams = F(..., "the online steps (vLLM)")
    publish: PublishParams = F(..., "step publish: the chosen drafter as a hub-ready folder")


# ---- pydantic's errors, as params.yaml's one-line problems --------------------------------------
def _unwrap(ann: Any) -> tuple[Any, bool]:
    """(the annotation without Optional, nullable?)."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) < len(typing.get_args(ann)) and len(args) == 1:
            return args[0], True
    return ann, False


def _model_of(ann: Any) -> type[BaseModel] | None:
    ann, _ = _unwrap(ann)
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _leaf_problem(err: dict, field, value: Any) -> str:
    t, ctx = err["type"], err.get("ctx") or {}
    ann, nullable = _unwrap(field.annotation) if field is not None else (None, False)
    if _model_of(ann) is not None:
        return f"expected a group of keys, got {_show(value)}"
    if value is None and not nullable:
        return "must be set (null is not allowed here)"
    if t == "draftport":
        return err["msg"]
    if t in ("int_type", "int_from_float", "int_parsing"):
        return f"expected an integer, got {_show(value)}"
    if t in ("float_type", "float_parsing"):
        return f"expected a number, got {_show(value)}"
    if t in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {_show(value)}"
    if t == "string_type" or (t == "literal_error" and not (isinstance(value, str) and value.strip())):
        return f"expected a non-empty string, got {_show(value)}"
    if t == "literal_error":
        return f"must be one of {', '.join(map(str, typing.get_args(ann)))}; got {_show(value)}"
    if t == "greater_than_equal":
        return f"must be >= {_num(ctx['ge'])}, got {_num(value)}"
    if t == "less_than_equal":
        return f"must be <= {_num(ctx['le'])}, got {_num(value)}"
    return err["msg"]  # pragma: no cover - a kind of problem the schema does not use


def _located(err: dict, data: Any, model: type[BaseModel], prefix: str) -> tuple[tuple, str, str]:
    """(where the key stands in the file, dotted key, problem) of one pydantic error."""
    loc, order, keys = err["loc"], [], []
    cur, owner, field = data, model, None
    for i, part in enumerate(loc):
        here = list(cur) if isinstance(cur, dict) else []
        if owner is None or part not in owner.model_fields:
            if err["type"] == "extra_forbidden" and i == len(loc) - 1 and part in here:
                parent = prefix + "".join(f"{k}." for k in keys)
                close = difflib.get_close_matches(str(part), list(owner.model_fields), n=1) if owner else []
                hint = f" (did you mean {parent}{close[0]}?)" if close else ""
                return (*order, here.index(part)), f"{parent}{part}", f"unknown key{hint}"
            break  # a list entry or a union member: the problem is the field's
        order.append(here.index(part) if part in here else len(here))
        keys.append(part)
        field = owner.model_fields[part]
        cur = cur.get(part) if isinstance(cur, dict) else None
        owner = _model_of(field.annotation)
    dotted = prefix + ".".join(map(str, keys)) if keys else prefix.rstrip(".") or "params"
    if err["type"] == "draftport":  # a problem of a list's entry names it: targets.eval_sets[1] (code)
        dotted += (err.get("ctx") or {}).get("at", "")
    return tuple(order), dotted, _leaf_problem(err, field, cur)


def _missing(data: dict, model: type[BaseModel], prefix: str, order: tuple = ()) -> list[tuple]:
    """Keys a params file must write out but leaves out: after the group's own keys."""
    out = []
    for i, (k, v) in enumerate(data.items()):
        sub = _model_of(model.model_fields[k].annotation) if k in model.model_fields else None
        if sub is not None and isinstance(v, dict):
            out += _missing(v, sub, f"{prefix}{k}.", (*order, i))
    if not getattr(model, "keys_optional", False):
        out += [
            ((*order, len(data) + j), f"{prefix}{name}", "missing")
            for j, name in enumerate(model.model_fields)
            if name not in data
        ]
    return out


def _params_error(e: ValidationError, data: dict, model: type[BaseModel], prefix: str = "") -> ParamsError:
    """The first problem in the order of the file (as a reader walks it, a group's missing keys
    after its own), as ParamsError(dotted key, problem)."""
    found = [_located(err, data, model, prefix) for err in e.errors(include_url=False) if err["type"] != "missing"]
    found += _missing(data, model, prefix)
    if not found:  # pragma: no cover
        raise e
    _, key, problem = min(found, key=lambda f: f[0])
    return ParamsError(key, problem)


def _checked(model: type[BaseModel], data: dict, prefix: str = "") -> BaseModel:
    """model validated from data; ParamsError otherwise (also for a key a file must write out)."""
    try:
        m = model.model_validate(data)
    except ValidationError as e:
        raise _params_error(e, data, model, prefix) from None
    missing = _missing(data, model, prefix)
    if missing:
        _, key, problem = min(missing, key=lambda f: f[0])
        raise ParamsError(key, problem)
    return m


def _in_order(out: Any, given: Any) -> Any:
    """A dump in the order of the user's keys (as the file reads)."""
    if isinstance(out, dict) and isinstance(given, dict):
        return {k: _in_order(out[k], given[k]) for k in given if k in out}
    return out


# ---- load / merge / validate -------------------------------------------------------------------
def merge(base: dict, overlay: dict) -> dict:
    """Recursive update, as Snakemake merges configfiles: dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for k, v in (overlay or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(path, "no such parameter file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ParamsError(where, f"not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(path, "expected a mapping of groups at the top level")
    return data


def load(*overlays: str | Path, base: str | Path = PARAMS_FILE) -> dict:
    """params.yaml with the profiles layered on, validated."""
    cfg = read_yaml(base)
    for o in overlays:
        cfg = merge(cfg, read_yaml(o))
    return validate(cfg)


def validate(cfg: dict, group: type[Group] | None = None, prefix: str = "", cross: bool = True) -> dict:
    """A validated copy of cfg (ints stay ints, floats become floats; only the keys given, in their
    order: a key left out of a `keys_optional` group stays out). Raises ParamsError.

    group: the model (default Params, the whole file; e.g. WorldParams with prefix "world.").
    cross: also check values against each other (sizes that must fit together; Params only).
    """
    model = group or Params
    if not isinstance(cfg, dict):
        raise ParamsError(prefix.rstrip(".") or "params", f"expected a mapping, got {_show(cfg)}")
    out = _in_order(_checked(model, cfg, prefix).model_dump(exclude_unset=True), cfg)
    if model is Params and not prefix and cross:
        _cross_checks(out)
    return out


def _check_world_sizes(cfg: dict, w: dict, f: dict) -> None:
    """A built world's targets have the layers, samples and vocab the other groups ask for."""
    layers = w["model"]["num_hidden_layers"]
    # as draftport.data.capture.check_aux_ids: vllm 0..L (L = leaving the last layer), sglang 0..L-1
    limit = layers if f["aux_convention"] == "vllm" else layers - 1
    bad = [i for i in f["aux_layer_ids"] if i > limit]
    if bad:
        raise ParamsError(
            "features.aux_layer_ids",
            f"{bad} out of range for the world's {layers}-layer targets ({f['aux_convention']} convention)",
        )
    need = cfg["phase2"]["n_samples"]
    if need > w["n_new"]:
        raise ParamsError(
            "phase2.n_samples", f"{need} samples but the world's new corpus holds world.n_new = {w['n_new']}"
        )
    if f["eval_samples"] > w["n_heldout"]:
        raise ParamsError(
            "features.eval_samples",
            f"{f['eval_samples']} but the world holds world.n_heldout = {w['n_heldout']} held-out prompts",
        )
    if cfg["vocab_new"]["draft_vocab_size"] > w["vocab_size"]:
        raise ParamsError(
            "vocab_new.draft_vocab_size",
            f"{cfg['vocab_new']['draft_vocab_size']} exceeds the vocab (world.vocab_size = {w['vocab_size']})",
        )


def _check_resources(cfg: dict) -> None:
    """resources: a default row; torchrun only for training rules, and only with a GPU."""
    res = cfg["resources"]
    if "default" not in res:
        raise ParamsError("resources.default", "missing (every rule's gpu, mem_mb, runtime, threads, torchrun)")
    for rule, r in res.items():
        if r.get("torchrun") and rule not in TRAINING_RULES:
            raise ParamsError(
                f"resources.{rule}.torchrun", f"only training rules run under torchrun ({', '.join(TRAINING_RULES)})"
            )
        if r.get("torchrun") and {**res["default"], **r}["gpu"] < 1:
            raise ParamsError(f"resources.{rule}.torchrun", "needs gpu >= 1 (one process per GPU)")


def _check_engine_drift_seeds(cfg: dict, f: dict) -> None:
    """The served engine's address, drift's old target and data.seeds without repeats."""
    if f["regenerate"] == "openai" and not (f["base_url"] and f["served_model"]):
        raise ParamsError(
            "features.base_url" if not f["base_url"] else "features.served_model",
            "must be set when features.regenerate is openai",
        )
    if cfg["drift"]["enabled"] and not cfg["targets"]["old"]:
        raise ParamsError("drift.enabled", "needs targets.old (the probe runs the old target on the new one's tokens)")
    if len(set(cfg["data"]["seeds"])) != len(cfg["data"]["seeds"]):
        raise ParamsError("data.seeds", f"{cfg['data']['seeds']}: a seed twice")


def _check_curve_recipes(c: dict) -> None:
    """Each curves recipe: a short lowercase name, a mapping of train keys that TrainConfig accepts,
    none of the keys every arm shares."""
    for name, over in c["recipes"].items():
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", str(name)):
            raise ParamsError(
                f"curves.recipes.{name}",
                "a recipe's name: lowercase letters, digits, _ (it names checkpoints and MLflow runs)",
            )
        if not isinstance(over, dict) or not over:
            raise ParamsError(f"curves.recipes.{name}", "a mapping of the train keys the recipe changes")
        for key in ("steps", "seed", "batch_size"):
            if key in over:
                raise ParamsError(
                    f"curves.recipes.{name}.{key}",
                    "set by the budget rule / the point: every arm trains the same steps on the same batches",
                )
        try:
            TrainConfig.from_dict({**c["train"], **over}, f"curves.recipes.{name}")
        except ParamsError:
            raise
        except DraftportError as e:  # from_dict's unknown-key error: the same line, as a params error
            raise ParamsError(f"curves.recipes.{name}", e.problem) from None


def _check_curves(cfg: dict, c: dict) -> None:
    """An enabled curves group: ascending points within Phase 2's samples, distinct seeds and inits,
    arms among the points, then its recipes."""
    ns = c["n_samples"]
    if ns != sorted(set(ns)):
        raise ParamsError("curves.n_samples", f"{ns}: must be ascending, without repeats")
    if ns[-1] > cfg["phase2"]["n_samples"]:
        raise ParamsError(
            "curves.n_samples",
            f"{ns[-1]} exceeds phase2.n_samples ({cfg['phase2']['n_samples']}): "
            "the points read a prefix of Phase 1's + Phase 2's capture",
        )
    if len(set(c["seeds"])) != len(c["seeds"]):
        raise ParamsError("curves.seeds", f"{c['seeds']}: a seed twice")
    if not c["inits"] or len(set(c["inits"])) != len(c["inits"]):
        raise ParamsError("curves.inits", f"{c['inits']}: source and/or scratch, each once")
    if "scratch" in c["inits"] and c["train"].get("l2sp_lambda"):
        raise ParamsError(
            "curves.train.l2sp_lambda",
            "the scratch points start from random weights: anchor "
            "the source's points through curves.recipes instead (or set 0)",
        )
    arms_n = c["arms_n_samples"]
    if arms_n != sorted(set(arms_n)) or not set(arms_n) <= set(ns):
        raise ParamsError("curves.arms_n_samples", f"{arms_n}: ascending, each among curves.n_samples {ns}")
    if c["recipes"] and arms_n and "source" not in c["inits"]:
        raise ParamsError("curves.recipes", "fine-tune the source: needs source among curves.inits")
    _check_curve_recipes(c)


def _check_world_source(cfg: dict, w: dict) -> None:
    """A built world's new corpus holds Phase 2's and the monitor's prompts; its source drafter
    trains from scratch on prompts the old corpus holds."""
    need = cfg["phase2"]["n_samples"] + cfg["monitor"]["n_samples"]
    if need > w["n_new"]:
        raise ParamsError(
            "monitor.n_samples",
            f"phase2.n_samples + monitor.n_samples = {need} but the world's "
            f"new corpus holds world.n_new = {w['n_new']} (the monitor takes the last prompts)",
        )
    sd = w["source_drafter"]
    if sd["train"].get("l2sp_lambda"):
        raise ParamsError(
            "world.source_drafter.train.l2sp_lambda",
            "the source drafter trains from random weights: nothing to anchor to (set 0)",
        )
    if sd["n_samples"] + sd["monitor_samples"] > w["n_old"]:
        raise ParamsError(
            "world.source_drafter.n_samples",
            f"{sd['n_samples']} + monitor_samples {sd['monitor_samples']} exceed world.n_old = {w['n_old']}",
        )


def _cross_checks(cfg: dict) -> None:
    """Checks across keys and groups; their order is fixed: the first one failing is the error shown."""
    w, f = cfg["world"], cfg["features"]
    if cfg["phase2"]["n_samples"] <= cfg["phase1"]["n_samples"]:
        raise ParamsError(
            "phase2.n_samples",
            f"must exceed phase1.n_samples ({cfg['phase1']['n_samples']}): "
            "Phase 2 scales the data (the total count, Phase 1's samples included)",
        )
    if w["build"]:
        _check_world_sizes(cfg, w, f)
    _check_resources(cfg)
    _check_engine_drift_seeds(cfg, f)
    c = cfg["curves"]
    if c["enabled"]:
        _check_curves(cfg, c)
    for group in ("phase1", "phase2", "curves"):
        t = cfg[group]["train"]
        if t.get("patience") and not t.get("eval_every"):
            raise ParamsError(f"{group}.train.patience", "needs eval_every > 0 (the held-out tau it watches)")
    if w["build"]:
        _check_world_source(cfg, w)
    pk = cfg["publish"]["k"]
    if pk != sorted(set(pk)):
        raise ParamsError("publish.k", f"{pk}: must be ascending, without repeats")
    if cfg["eval"]["k"] > 16:
        raise ParamsError("eval.k", "at most 16 draft tokens")
    srv = cfg["serving"]
    if w["build"] and not srv["step_table"] and srv["batch_sizes"] != [1]:
        raise ParamsError(
            "serving.batch_sizes",
            f"{srv['batch_sizes']}: the embedded world's cost model knows batch 1 only; give serving.step_table "
            "(a CSV of measured steps) to serve larger batches",
        )
    if cfg["eval"]["k_max"] < cfg["eval"]["k"]:
        raise ParamsError(
            "eval.k_max", f"{cfg['eval']['k_max']} is below eval.k ({cfg['eval']['k']}): the deeper pass must cover k"
        )
    if cfg["targets"].get("eval_sets"):
        check_eval_set_totals(cfg["targets"]["eval_sets"])


def subset(cfg: dict, keys: list[str]) -> dict:
    """The nested sub-dict of cfg holding exactly `keys` (dotted)."""
    out: dict = {}
    for dotted in keys:
        parts = dotted.split(".")
        cur = out
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = copy.deepcopy(get(cfg, dotted))
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists stay values (MLflow params, DVC keys)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m draftport.plan.params [--configfile X ...] [--show]`: validate; print the merged params."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m draftport.plan.params", description=main.__doc__)
    ap.add_argument("--configfile", action="append", default=[], help="profile(s) layered on params.yaml")
    ap.add_argument("--params", default=PARAMS_FILE)
    ap.add_argument("--show", action="store_true", help="print the merged, validated parameters as YAML")
    a = ap.parse_args(argv)
    try:
        cfg = load(*a.configfile, base=a.params)
    except DraftportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.show:
        sys.stdout.write(yaml.safe_dump(cfg, sort_keys=False))
    else:
        print(f"ok: {a.params}{''.join(' + ' + c for c in a.configfile)} (profile {cfg['profile']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
