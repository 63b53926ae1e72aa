"""The embedded analog world: a small Kimi-K2 -> Kimi-K2.5 pair, built from a seed, no download.

Why it exists: the port has to be exercised end to end on a laptop with no GPU and no hub. So the
pipeline builds its own pair of targets with real maths at small scale:

    synthetic language ─► corpus/old.jsonl ─┐
                       └► corpus/new.jsonl ─┼► tokenizer/ (BPE over old ∪ new)
                                            ├► target_old/  "K2":   Llama trained on old
                                            └► target_new/  "K2.5": target_old continued on new

The language is made-up pseudo-words (no copied text) with the properties that matter to
speculative decoding: Zipf-skewed word use, topics with their own vocabulary, fixed collocations
(each topic noun has its adjective, verbs and partner noun) and per-topic sentence templates, so an
assistant turn is largely predictable from the user turn, but not entirely. The "new" distribution
keeps the language and shifts what K2.5's data shifts: topic weights, two new topics, a new polite
word, other connectives, numbered lists and longer answers.

Everything is deterministic from (seed, language_seed): per-sample RNGs are seeded by strings
(`random.Random(str)` hashes with sha512, not with the salted `hash()`), training uses a seeded
torch.Generator and deterministic algorithms on a fixed number of threads.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# ──────────────────────────────────────────────────────────────────────────────────────────────
# Presets. Plain values, read by rules/world.smk from params.yaml (these are the defaults).
# "default": the embedded world (base ≤ ~2.5 min on 2 cores); "micro": for tests (seconds).
# ──────────────────────────────────────────────────────────────────────────────────────────────

WORLD_PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "seed": 0,
        "language_seed": 20250711,
        "n_old": 6000,
        "n_new": 6000,
        "n_heldout": 300,          # per kind; heldout_new.jsonl is the evaluation prompt set
        "vocab_size": 2048,
        "threads": 2,
        "model": {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 32,
            "max_position_embeddings": 512,
        },
        "target_old": {"steps": 300, "lr": 3e-3, "batch_size": 16, "seq_len": 128, "warmup": 30},
        "target_new": {"steps": 160, "lr": 1.5e-3, "batch_size": 16, "seq_len": 128, "warmup": 10},
        "measure_samples": 200,
    },
    "micro": {
        "seed": 0,
        "language_seed": 20250711,
        "n_old": 300,
        "n_new": 300,
        "n_heldout": 40,
        "vocab_size": 512,
        "threads": 2,
        "model": {
            "hidden_size": 64,
            "intermediate_size": 192,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,   # head_dim 32: vLLM's CPU attention has no smaller kernel
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 512,
        },
        "target_old": {"steps": 12, "lr": 3e-3, "batch_size": 8, "seq_len": 64, "warmup": 2},
        "target_new": {"steps": 8, "lr": 1.5e-3, "batch_size": 8, "seq_len": 64, "warmup": 1},
        "measure_samples": 40,
    },
}

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 0..4
BOS, USER, ASSISTANT, END, PAD = "<|bos|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"

# Real engines render prompts with this (vLLM, SGLang, transformers' apply_chat_template).
# It produces exactly what encode_chat/encode_prompt produce; a test checks that.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}<|end|>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# ──────────────────────────────────────────────────────────────────────────────────────────────
# 1. The language and the corpus
# ──────────────────────────────────────────────────────────────────────────────────────────────

ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
          "sh", "ch", "th", "br", "kr", "pl", "st", "tr", "gl", "dr"]
VOWELS = ["a", "e", "i", "o", "u", "a", "e", "o", "ai", "ou", "ei", "ia"]
CODAS = ["", "", "", "", "n", "r", "s", "l", "m", "k", "st", "nd"]

N_OLD_TOPICS, N_NEW_TOPICS = 8, 2

# Sentence templates, one symbol per word (filled by _render). K: the sample's keyword, shared by
# the user turn and the answer; A/V/P: its adjective, verb and partner noun, J the partner's
# adjective; M: the sample's second noun; N: M or a fresh topic noun, W/B its verb/adjective;
# D det, R prep, O pronoun, X auxiliary, Q question word, T topic name, # the user's number, U its
# unit, g/v/a general noun/verb/adjective, @ the polite word. Each topic weighs these differently.
SENTENCES = [
    "D A K V D P .",
    "D K V R D N .",
    "O X V D K R # U .",
    "D P X J R D K .",
    "D N W D B g .",
    "R D T , D K X V .",
    "D M W D A K .",
    "O v D a g R D M .",
]
USER_TEMPLATES = [
    "Q X D K V R # U ?",
    "O v D A K . Q X # U ?",
    "T : Q D K R # U ?",
    "Q X D K V D M R # U ?",
    "@ , Q X D K R # U R D T ?",     # the polite forms: rare in old, common in new
    "@ : O v D K . Q # U ?",
]

# How the two distributions differ. Style shifts are changes of frequency, not of existence (K2
# had seen lists and newlines; K2.5 uses them more): an absent construct would make K2 hopeless on
# new data, which is not the situation the port is in. New topics are the exception: their
# words do not occur in the old data at all (the "new words" of K2.5's data).
STYLE = {
    "old": {"user_weights": [4, 4, 3, 4, 0.3, 0.3], "sentences": (2, 4), "list_prob": 0.12,
            "connective_prob": 0.35, "new_connectives": 0.15, "new_ack": 0.15, "summary_prob": 0.08},
    "new": {"user_weights": [3, 3, 2, 3, 2, 2], "sentences": (3, 6), "list_prob": 0.5,
            "connective_prob": 0.5, "new_connectives": 0.8, "new_ack": 0.8, "summary_prob": 0.7},
}


def _zipf(n: int, s: float = 1.0) -> list[float]:
    """Cumulative Zipf weights for ranks 0..n-1, for random.choices(cum_weights=...)."""
    cum, total = [], 0.0
    for r in range(n):
        total += 1.0 / (r + 1) ** s
        cum.append(total)
    return cum


@dataclass
class Topic:
    name: str
    nouns: list[str]
    verbs: list[str]
    adjs: list[str]
    units: list[str]
    verb_of: dict[str, list[str]]     # noun -> its two verbs (used 75% / 25%)
    adj_of: dict[str, str]
    partner: dict[str, str]           # noun -> the noun it goes with
    template_cum: list[float]         # Zipf over a topic-specific permutation of SENTENCES
    opening: list[str]
    closing: list[str]


@dataclass
class Language:
    det: list[str]
    prep: list[str]
    pron: list[str]
    aux: list[str]
    qword: list[str]
    ack_old: list[str]
    ack_new: list[str]
    conn_old: list[str]
    conn_new: list[str]
    polite: str
    summary: str
    gen_nouns: list[str]
    gen_verbs: list[str]
    gen_adjs: list[str]
    topics: list[Topic] = field(default_factory=list)

    def words(self) -> set[str]:
        out = set(self.det + self.prep + self.pron + self.aux + self.qword + self.ack_old
                  + self.ack_new + self.conn_old + self.conn_new + self.gen_nouns + self.gen_verbs
                  + self.gen_adjs + [self.polite, self.summary])
        for t in self.topics:
            out |= set([t.name] + t.nouns + t.verbs + t.adjs + t.units + t.opening + t.closing)
        return out


@functools.lru_cache(maxsize=4)
def make_language(language_seed: int) -> Language:
    """The lexicon and its grammar. Frequent classes get short words, as in natural languages."""
    rng = random.Random(f"language:{language_seed}")
    taken: set[str] = set()

    def words(count: int, syl_min: int, syl_max: int) -> list[str]:
        out = []
        while len(out) < count:
            w = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                        for _ in range(rng.randint(syl_min, syl_max)))
            if w not in taken and len(w) >= 2:
                taken.add(w)
                out.append(w)
        return out

    lang = Language(
        det=words(4, 1, 1), prep=words(6, 1, 1), pron=words(4, 1, 1), aux=words(4, 1, 1),
        qword=words(5, 1, 2), ack_old=words(3, 2, 2), ack_new=words(3, 2, 2),
        conn_old=words(4, 2, 2), conn_new=words(4, 2, 3), polite=words(1, 2, 2)[0],
        summary=words(1, 3, 3)[0],
        gen_nouns=words(60, 1, 2), gen_verbs=words(30, 1, 2), gen_adjs=words(30, 1, 2),
    )
    # the new connective set keeps one old one: a style shift, not a new language
    lang.conn_new[0] = lang.conn_old[1]
    for _ in range(N_OLD_TOPICS + N_NEW_TOPICS):
        nouns, verbs, adjs = words(20, 2, 3), words(8, 2, 3), words(6, 2, 3)
        order = list(range(len(SENTENCES)))
        rng.shuffle(order)
        weights = [0.0] * len(SENTENCES)
        for rank, i in enumerate(order):
            weights[i] = 1.0 / (rank + 1) ** 1.2
        cum = list(itertools.accumulate(weights))
        lang.topics.append(Topic(
            name=words(1, 2, 2)[0], nouns=nouns, verbs=verbs, adjs=adjs, units=words(3, 1, 2),
            verb_of={n: rng.sample(verbs, 2) for n in nouns},
            adj_of={n: rng.choice(adjs) for n in nouns},
            partner={n: rng.choice([m for m in nouns if m != n]) for n in nouns},
            template_cum=cum, opening=rng.sample(verbs, 1) + words(1, 1, 2),
            closing=words(2, 1, 2),
        ))
    return lang


def topic_weights(kind: str) -> list[float]:
    """Topic mix of each distribution: "new" partly reverses the old ranking and adds two topics."""
    old = [1.0 / (r + 1) ** 0.8 for r in range(N_OLD_TOPICS)]
    if kind == "old":
        w = old + [0.0] * N_NEW_TOPICS
    elif kind == "new":
        # the old ranking partly reversed (what was niche grew), plus two new topics
        w = [0.4 * a + 0.6 * b for a, b in zip(old, reversed(old))]
        w += [0.07 * sum(old)] * N_NEW_TOPICS   # each new topic: ~6.5% of the new mix
    else:
        raise ValueError(f"kind must be 'old' or 'new', not {kind!r}")
    total = sum(w)
    return [x / total for x in w]


def _number(rng: random.Random) -> str:
    r = rng.random()
    return str(rng.randint(2, 20) if r < 0.4 else rng.randint(21, 99) if r < 0.75 else rng.randint(100, 999))


def _render(template: str, lang: Language, topic: Topic, ctx: dict, rng: random.Random) -> list[str]:
    """Fill one template. Keyword collocates are fixed per noun: that is what makes answers predictable."""
    k, m = ctx["K"], ctx["M"]
    out = []
    for sym in template.split():
        if sym == "D":
            w = rng.choices(lang.det, cum_weights=_CUM4)[0]
        elif sym == "R":
            w = rng.choices(lang.prep, cum_weights=_CUM6)[0]
        elif sym == "O":
            w = rng.choices(lang.pron, cum_weights=_CUM4)[0]
        elif sym == "X":
            w = rng.choices(lang.aux, cum_weights=_CUM4)[0]
        elif sym == "Q":
            w = rng.choice(lang.qword)
        elif sym == "K":
            w = k
        elif sym == "M":
            w = m
        elif sym == "A":
            w = topic.adj_of[k]
        elif sym == "V":
            w = topic.verb_of[k][0 if rng.random() < 0.75 else 1]
        elif sym == "P":
            w = topic.partner[k]
        elif sym == "J":
            w = topic.adj_of[topic.partner[k]]
        elif sym == "N":
            # half the time the noun already in play, else a fresh Zipf draw from the topic
            w = m if rng.random() < 0.5 else rng.choices(topic.nouns, cum_weights=_CUM20)[0]
            ctx["N"] = w
        elif sym == "W":
            w = topic.verb_of[ctx.get("N", m)][0]
        elif sym == "B":
            w = topic.adj_of[ctx.get("N", m)]
        elif sym == "T":
            w = topic.name
        elif sym == "#":
            w = ctx["#"]
        elif sym == "U":
            w = ctx["U"]
        elif sym == "g":
            w = rng.choices(lang.gen_nouns, cum_weights=_CUM60)[0]
        elif sym == "v":
            w = rng.choices(lang.gen_verbs, cum_weights=_CUM30)[0]
        elif sym == "a":
            w = rng.choices(lang.gen_adjs, cum_weights=_CUM30)[0]
        elif sym == "@":
            w = lang.polite
        else:  # punctuation
            w = sym
        out.append(w)
    return out


_CUM3, _CUM4, _CUM6, _CUM20, _CUM30, _CUM60 = (_zipf(n, 1.1) for n in (3, 4, 6, 20, 30, 60))


def _detok(words: list[str]) -> str:
    """Words to text: punctuation attaches left, sentences start with a capital."""
    text, cap = "", True
    for w in words:
        if w in ".,?!:":
            text += w
            cap = w in ".?!"
            continue
        if w.startswith("\n"):
            text += w
            cap = True
            continue
        if text and not text.endswith("\n"):
            text += " "
        text += w.capitalize() if cap else w
        cap = False
    return text


def _sample(kind: str, lang: Language, rng: random.Random) -> dict:
    weights = topic_weights(kind)
    ti = rng.choices(range(len(weights)), weights=weights)[0]
    topic = lang.topics[ti]
    k = rng.choices(topic.nouns, cum_weights=_CUM20)[0]
    m = rng.choice([n for n in topic.nouns if n != k])
    ctx = {"K": k, "M": m, "#": _number(rng), "U": rng.choice(topic.units)}

    style = STYLE[kind]
    user_tpl = rng.choices(USER_TEMPLATES, weights=style["user_weights"])[0]
    user = _detok(_render(user_tpl, lang, topic, ctx, rng))

    def sentence() -> list[str]:
        tpl = SENTENCES[rng.choices(range(len(SENTENCES)), cum_weights=topic.template_cum)[0]]
        return _render(tpl, lang, topic, ctx, rng)

    def pick(old_words: list[str], new_words: list[str], new_share: float) -> str:
        return rng.choices(new_words if rng.random() < new_share else old_words,
                           cum_weights=_zipf(len(old_words), 1.1))[0]

    # opening: acknowledgement, then the keyword and the number echoed from the user turn
    new_ack = rng.random() < style["new_ack"]
    words = [rng.choices(lang.ack_new if new_ack else lang.ack_old, cum_weights=_CUM3)[0],
             "!" if new_ack else ","]
    words += topic.opening + [k, ctx["#"], ctx["U"], "."]
    n = rng.randint(*style["sentences"])
    if rng.random() < style["list_prob"]:
        for i in range(n):
            words += [f"\n{i + 1}."] + sentence()
        words += ["\n"]
    else:
        for _ in range(n):
            if rng.random() < style["connective_prob"]:
                words += [pick(lang.conn_old, lang.conn_new, style["new_connectives"]), ","]
            words += sentence()
    words += topic.closing + [k, "."]
    if rng.random() < style["summary_prob"]:
        words += ["\n", lang.summary, ":", k, ",", ctx["#"], ctx["U"], "."]
    return {"user": user, "assistant": _detok(words), "topic": topic.name}


def generate_corpus(kind: str, n: int, seed: int, *, start: int = 0,
                    language_seed: int = WORLD_PRESETS["default"]["language_seed"]) -> list[dict]:
    """`n` chat samples {"user", "assistant", "topic"} of the "old" or "new" distribution.

    Sample i depends only on (kind, seed, i): the stream is prefix-stable, so a held-out split is
    just `start=n_train` of the same stream. "topic" is bookkeeping (for tests and reports).
    """
    topic_weights(kind)  # validates kind
    lang = make_language(language_seed)
    return [_sample(kind, lang, random.Random(f"{kind}:{seed}:{i}")) for i in range(start, start + n)]


def topic_distribution(samples: Iterable[dict]) -> dict[str, float]:
    counts: dict[str, int] = {}
    for s in samples:
        counts[s["topic"]] = counts.get(s["topic"], 0) + 1
    total = sum(counts.values()) or 1
    return {t: c / total for t, c in sorted(counts.items())}


def write_jsonl(path: str | Path, samples: Iterable[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


# ──────────────────────────────────────────────────────────────────────────────────────────────
# 2. Tokenizer
# ──────────────────────────────────────────────────────────────────────────────────────────────

def train_tokenizer(out_dir: str | Path, samples: Iterable[dict], vocab_size: int = 2048,
                    model_max_length: int = 512) -> Path:
    """Byte-level BPE (as Kimi's and most engines' tokenizers): every string round-trips.

    Writes an ordinary HF tokenizer folder; the config is written by hand rather than through
    PreTrainedTokenizerFast.save_pretrained so its content does not drift with transformers
    versions (v5 moves the chat template to a separate file; we want it in tokenizer_config.json).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = (t for s in samples for t in (s["user"], s["assistant"]))
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))

    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    special_map = {"bos_token": BOS, "eos_token": END, "pad_token": PAD,
                   "additional_special_tokens": [USER, ASSISTANT]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        **special_map,
        "extra_special_tokens": [USER, ASSISTANT],  # transformers >= 5 name of the same list
        "add_bos_token": False,   # the chat template writes <|bos|> itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return out_dir


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_tokenizer(folder: str | Path):
    """The `tokenizers.Tokenizer` of a world/target folder (fast, no transformers import)."""
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))


def _encode(tokenizer, text: str) -> list[int]:
    # works with a tokenizers.Tokenizer (Encoding.ids) and a transformers tokenizer (list)
    out = tokenizer.encode(text, add_special_tokens=False)
    return list(out.ids) if hasattr(out, "ids") else list(out)


def encode_prompt(tokenizer, user: str) -> list[int]:
    """`<|bos|><|user|>{user}<|end|><|assistant|>`: what an engine is sent."""
    return _encode(tokenizer, f"{BOS}{USER}{user}{END}{ASSISTANT}")


def encode_chat(tokenizer, sample: dict) -> tuple[list[int], int]:
    """(ids, response_start): ids[response_start:] is the assistant turn `{assistant}<|end|>`.

    The two parts are encoded separately so no BPE merge crosses the boundary; special tokens
    split the text anyway, so this equals encoding the whole string (a test checks it).
    """
    prompt = encode_prompt(tokenizer, sample["user"])
    return prompt + _encode(tokenizer, sample["assistant"] + END), len(prompt)


# ──────────────────────────────────────────────────────────────────────────────────────────────
# 3. Targets
# ──────────────────────────────────────────────────────────────────────────────────────────────

def _file_hash(paths: Iterable[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def target_revision(folder: str | Path) -> str:
    """Content hash of the weights and config: changes iff the target changes."""
    folder = Path(folder)
    return _file_hash([folder / "config.json", folder / "model.safetensors"])


def _chunks(xs: list, n: int) -> list[list]:
    size = max(1, math.ceil(len(xs) / n))
    return [xs[i:i + size] for i in range(0, len(xs), size)]


class _Deterministic:
    """Deterministic torch on a fixed thread count, without transformers' own progress bars
    (they would interleave with ours in the Snakemake log); restores the caller's settings."""

    def __init__(self, threads: int | None):
        self.threads = threads

    def __enter__(self):
        import torch
        from transformers.utils import logging as hf_logging
        self.prev = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                     hf_logging.is_progress_bar_enabled())
        if self.threads:
            torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(True)
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        import torch
        from transformers.utils import logging as hf_logging
        torch.set_num_threads(self.prev[0])
        torch.use_deterministic_algorithms(self.prev[1])
        if self.prev[2]:
            hf_logging.enable_progress_bar()


def train_target(out_dir: str | Path, tokenizer_dir: str | Path, samples: list[dict], *,
                 init_from: str | Path | None = None, config: dict | None = None,
                 steps: int = 300, lr: float = 3e-3, batch_size: int = 16, seq_len: int = 128,
                 warmup: int = 20, seed: int = 0, name: str = "target", trained_on: str = "",
                 threads: int | None = None, progress: bool = True) -> dict:
    """Train a small LlamaForCausalLM on packed chat samples; save an HF model folder.

    Loss is on all tokens, not only the assistant's: the windows are packed (nanoGPT style, no
    padding, cheapest on CPU), user turns are the same language so they are free signal for the
    small budget, and the prompt still conditions the answer either way. `init_from` continues a
    saved target (K2.5 = K2 + more training on the new data); `config` is then ignored.
    Returns the summary also written to draftport_target.json.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    t0 = time.time()
    with _Deterministic(threads):
        torch.manual_seed(seed)
        tok = load_tokenizer(tokenizer_dir)
        # one long stream of <|bos|>…<|end|> chats; windows are drawn at random offsets
        stream = []
        for s in samples:
            stream += encode_chat(tok, s)[0]
        data = torch.tensor(stream, dtype=torch.long)
        if len(data) <= seq_len + 1:
            raise ValueError(f"{name}: corpus has {len(data)} tokens, fewer than seq_len {seq_len}")

        if init_from is not None:
            model = LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32)
            if model.config.vocab_size != tok.get_vocab_size():
                raise ValueError(f"{init_from}: vocab {model.config.vocab_size} != tokenizer "
                                 f"{tok.get_vocab_size()}")
        else:
            # untied head, as Kimi's: the drafter takes embed_tokens and lm_head separately
            cfg = {**WORLD_PRESETS["default"]["model"], "tie_word_embeddings": False,
                   "rms_norm_eps": 1e-5, **(config or {}),
                   "vocab_size": tok.get_vocab_size(), "bos_token_id": tok.token_to_id(BOS),
                   "eos_token_id": tok.token_to_id(END), "pad_token_id": tok.token_to_id(PAD)}
            model = LlamaForCausalLM(LlamaConfig(**cfg))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        gen = torch.Generator().manual_seed(seed)

        def lr_at(step: int) -> float:  # linear warmup, cosine down to 10%
            if step < warmup:
                return lr * (step + 1) / warmup
            frac = (step - warmup) / max(1, steps - warmup)
            return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

        losses = []
        bar = tqdm(range(steps), desc=name, disable=not progress, leave=False)
        for step in bar:
            ix = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=gen)
            batch = torch.stack([data[i:i + seq_len + 1] for i in ix.tolist()])
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                     batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")

        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
    for f in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / f, out_dir / f)

    tail = losses[-max(1, steps // 10):]  # last 10% of steps: less noisy than the last batch
    parent = None
    if init_from is not None:
        parent_meta = Path(init_from) / "draftport_target.json"
        parent = json.loads(parent_meta.read_text()) if parent_meta.exists() else {"path": str(init_from)}
        parent = {k: parent.get(k) for k in ("name", "revision")}
    meta = {
        "name": name,
        "revision": target_revision(out_dir),
        "trained_on": trained_on,
        "steps": steps,
        "seed": seed,
        "init_from": parent,
        "lr": lr, "batch_size": batch_size, "seq_len": seq_len, "warmup": warmup,
        "tokens_seen": steps * batch_size * seq_len,
        "final_loss": round(sum(tail) / len(tail), 4),
        "seconds": round(time.time() - t0, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        # mean loss of each tenth of the run: enough to see whether it had converged
        "loss_curve": [round(sum(c) / len(c), 3) for c in _chunks(losses, 10)],
    }
    (out_dir / "draftport_target.json").write_text(json.dumps(meta, indent=2) + "\n")
    if progress:
        print(f"{name}: loss {meta['final_loss']:.3f} | {steps} steps | "
              f"{meta['tokens_seen'] / 1e3:.0f}k tokens | {meta['seconds']:.1f} s | "
              f"{meta['num_parameters'] / 1e6:.2f}M params | rev {meta['revision']}")
    return meta


# ──────────────────────────────────────────────────────────────────────────────────────────────
# 4. Measuring the pair: how predictable each target is and how far B moved from A
# ──────────────────────────────────────────────────────────────────────────────────────────────

def _assistant_predictions(model, tok, samples: list[dict], batch_size: int = 32):
    """Per sample: (logits at positions predicting assistant tokens, those tokens)."""
    import torch
    pad = tok.token_to_id(PAD)
    out = []
    for b in range(0, len(samples), batch_size):
        enc = [encode_chat(tok, s) for s in samples[b:b + batch_size]]
        width = max(len(ids) for ids, _ in enc)
        ids = torch.full((len(enc), width), pad, dtype=torch.long)
        mask = torch.zeros((len(enc), width), dtype=torch.long)
        for i, (x, _) in enumerate(enc):
            ids[i, :len(x)] = torch.tensor(x)
            mask[i, :len(x)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        for i, (x, start) in enumerate(enc):
            # position p predicts token p+1: the assistant tokens x[start:] come from p = start-1 ..
            out.append((logits[i, start - 1:len(x) - 1].float(), ids[i, start:len(x)]))
    return out


def measure_targets(target_a: str | Path, target_b: str | Path, heldout: dict[str, list[dict]],
                    threads: int | None = None) -> dict:
    """Loss / top-1 of A and B on each held-out set, and A-B greedy agreement, assistant tokens only.

    Agreement is the fraction of assistant positions where argmax A == argmax B: roughly the
    acceptance a perfect imitation of A would get against B, i.e. how far the port has to move.
    """
    import torch
    from transformers import AutoModelForCausalLM

    res: dict[str, float] = {}
    with _Deterministic(threads):
        models = {"A": AutoModelForCausalLM.from_pretrained(target_a, dtype=torch.float32).eval(),
                  "B": AutoModelForCausalLM.from_pretrained(target_b, dtype=torch.float32).eval()}
        tok = load_tokenizer(target_a)
        for kind, samples in heldout.items():
            preds = {k: _assistant_predictions(m, tok, samples) for k, m in models.items()}
            for k in models:
                logits = torch.cat([lg for lg, _ in preds[k]])
                tgt = torch.cat([t for _, t in preds[k]])
                res[f"loss_{k}_{kind}"] = round(torch.nn.functional.cross_entropy(logits, tgt).item(), 4)
                res[f"top1_{k}_{kind}"] = round((logits.argmax(-1) == tgt).float().mean().item(), 4)
            agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).float()
                               for (a, _), (b, _) in zip(preds["A"], preds["B"])])
            res[f"agree_AB_{kind}"] = round(agree.mean().item(), 4)
            res[f"assistant_tokens_{kind}"] = int(agree.numel())
    return res


# ──────────────────────────────────────────────────────────────────────────────────────────────
# 5. The base world
# ──────────────────────────────────────────────────────────────────────────────────────────────

def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def build_world_base(out_dir: str | Path, params: dict, progress: bool = True) -> dict:
    """Corpus, tokenizer, target_old ("K2") and target_new ("K2.5") under out_dir.

    Layout: tokenizer/, corpus/{old,new,heldout_old,heldout_new}.jsonl, target_old/, target_new/,
    world_base.json (the manifest returned). Held-out samples continue the training streams
    (start = n_train), so they are never in the training set by construction.
    """
    out = Path(out_dir)
    p = params
    seed, lseed = int(p["seed"]), int(p["language_seed"])
    timings: dict[str, float] = {}
    t_all = t = time.time()
    cpu_all = time.process_time()  # CPU seconds: a fairer figure than wall time on a shared box

    old = generate_corpus("old", p["n_old"], seed, language_seed=lseed)
    new = generate_corpus("new", p["n_new"], seed, language_seed=lseed)
    heldout = {
        "old": generate_corpus("old", p["n_heldout"], seed, start=p["n_old"], language_seed=lseed),
        "new": generate_corpus("new", p["n_heldout"], seed, start=p["n_new"], language_seed=lseed),
    }
    corpus = {"old": out / "corpus/old.jsonl", "new": out / "corpus/new.jsonl",
              "heldout_old": out / "corpus/heldout_old.jsonl",
              "heldout_new": out / "corpus/heldout_new.jsonl"}
    write_jsonl(corpus["old"], old)
    write_jsonl(corpus["new"], new)
    write_jsonl(corpus["heldout_old"], heldout["old"])
    write_jsonl(corpus["heldout_new"], heldout["new"])
    timings["corpus"] = time.time() - t

    t = time.time()
    tok_dir = train_tokenizer(out / "tokenizer", old + new, vocab_size=p["vocab_size"],
                              model_max_length=p["model"]["max_position_embeddings"])
    timings["tokenizer"] = time.time() - t

    threads = p.get("threads")
    t = time.time()
    meta_old = train_target(out / "target_old", tok_dir, old, config=p["model"], seed=seed,
                            name="target_old", trained_on="corpus/old.jsonl", threads=threads,
                            progress=progress, **p["target_old"])
    timings["target_old"] = time.time() - t
    t = time.time()
    meta_new = train_target(out / "target_new", tok_dir, new, init_from=out / "target_old",
                            seed=seed + 1, name="target_new", trained_on="corpus/new.jsonl",
                            threads=threads, progress=progress, **p["target_new"])
    timings["target_new"] = time.time() - t

    t = time.time()
    n_m = p.get("measure_samples", p["n_heldout"])
    metrics = measure_targets(out / "target_old", out / "target_new",
                              {k: v[:n_m] for k, v in heldout.items()}, threads=threads)
    timings["measure"] = time.time() - t
    timings["total"] = time.time() - t_all
    timings["cpu_total"] = time.process_time() - cpu_all

    paths = {"tokenizer": tok_dir, "target_old": out / "target_old", "target_new": out / "target_new",
             **corpus}
    manifest = {
        "paths": {k: str(v.relative_to(out)) for k, v in paths.items()},
        "bytes": {k: (_dir_size(v) if v.is_dir() else v.stat().st_size) for k, v in paths.items()},
        "samples": {"old": len(old), "new": len(new), "heldout_old": len(heldout["old"]),
                    "heldout_new": len(heldout["new"])},
        "topics": {"old": topic_distribution(old), "new": topic_distribution(new)},
        "vocab_size": load_tokenizer(tok_dir).get_vocab_size(),
        "targets": {"target_old": meta_old, "target_new": meta_new},
        "metrics": metrics,
        "seconds": {k: round(v, 1) for k, v in timings.items()},
        "params": p,
    }
    manifest["bytes"]["total"] = _dir_size(out)
    (out / "world_base.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if progress:
        m = metrics
        print(f"world base: {timings['total']:.0f} s | {manifest['bytes']['total'] / 1e6:.1f} MB | "
              f"top1 A/old {m['top1_A_old']:.3f} B/new {m['top1_B_new']:.3f} | "
              f"agree A-B new {m['agree_AB_new']:.3f} old {m['agree_AB_old']:.3f}")
    return manifest
