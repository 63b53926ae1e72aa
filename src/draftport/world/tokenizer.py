"""The world's tokenizer: byte-level BPE trained on both corpora, its special tokens and chat
template, and the encoders the world's own code uses (draftport.data.features renders prompts for
any target through its chat template instead; a test checks the two agree here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 0..4
BOS, USER, ASSISTANT, END, PAD = "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"

# Real engines render prompts with this (vLLM, SGLang, transformers' apply_chat_template).
# It produces exactly what encode_world_chat/encode_world_prompt produce; a test checks that.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_tokenizer(out_dir: str | Path, samples: Iterable[dict], *, vocab_size: int, model_max_length: int) -> Path:
    """Byte-level BPE (as Kimi's and most engines' tokenizers): every string round-trips.

    Writes an ordinary HF tokenizer folder; the config is written by hand rather than through
    PreTrainedTokenizerFast.save_pretrained so its content does not drift with transformers
    versions (v5 moves the chat template to a separate file; we want it in tokenizer_config.json).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = (t for s in samples for t in (s["user"], s["assistant"]))
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    special_map = {"bos_token": BOS, "eos_token": END, "pad_token": PAD, "additional_special_tokens": [USER, ASSISTANT]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **special_map,
        "extra_special_tokens": [USER, ASSISTANT],  # transformers >= 5 name of the same list
        "add_bos_token": False,  # the chat template writes <|bos|> itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out_dir


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_world_tokenizer(folder: str | Path):
    """The `tokenizers.Tokenizer` of a world/target folder (fast, no transformers import)."""
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def _encode(tokenizer, text: str) -> list[int]:
    # works with a tokenizers.Tokenizer (Encoding.ids) and a transformers tokenizer (list)
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def encode_world_prompt(tokenizer, user: str) -> list[int]:
    """`<|bos|><|user|>{user}<|end|><|assistant|>`: what an engine is sent."""
    return _encode(tokenizer, f"{BOS}{USER}{user}{END}{ASSISTANT}")


def encode_world_chat(tokenizer, sample: dict) -> tuple[list[int], int]:
    """(ids, response_start): ids[response_start:] is the assistant turn `{assistant}<|end|>`.

    The two parts are encoded separately so no BPE merge crosses the boundary; special tokens
    split the text anyway, so this equals encoding the whole string (a test checks it).
    """
    prompt = encode_world_prompt(tokenizer, sample["user"])
    return prompt + _encode(tokenizer, sample["assistant"] + END), len(prompt)
