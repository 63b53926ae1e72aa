"""The world's made-up language and its two corpora ("old" for K2, "new" for K2.5), from a seed.

Pseudo-words (no copied text) with the properties that matter to speculative decoding:
Zipf-skewed word use, topics with their own vocabulary, fixed collocations (each topic noun has
its adjective, verbs and partner noun) and per-topic sentence templates, so an assistant turn is
largely predictable from the user turn, but not entirely. The "new" distribution keeps the
language and shifts what K2.5's data shifts: topic weights, two new topics, a new polite word,
other connectives, numbered lists and longer answers. Per-sample RNGs are seeded by strings
(`random.Random(str)` hashes with sha512, not with the salted `hash()`).

Two kinds of prompts: "chat" (a one- or two-sentence question: the training corpora) and "long"
(a passage of several paragraphs, then a question; its answer quotes the passage, so it copies
more from the context, as summarisation or code editing do): an eval set with other statistics
and other context lengths.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from draftport.plan.params import WorldParams

ONSETS = [
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "sh",
    "ch",
    "th",
    "br",
    "kr",
    "pl",
    "st",
    "tr",
    "gl",
    "dr",
]
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
    "@ , Q X D K R # U R D T ?",  # the polite forms: rare in old, common in new
    "@ : O v D K . Q # U ?",
]

# How the two distributions differ. Style shifts are changes of frequency, not of existence (K2
# had seen lists and newlines; K2.5 uses them more): an absent construct would make K2 hopeless on
# new data, which is not the situation the port is in. New topics are the exception: their
# words do not occur in the old data at all (the "new words" of K2.5's data).
STYLE = {
    "old": {
        "user_weights": [4, 4, 3, 4, 0.3, 0.3],
        "sentences": (2, 4),
        "list_prob": 0.12,
        "connective_prob": 0.35,
        "new_connectives": 0.15,
        "new_ack": 0.15,
        "summary_prob": 0.08,
    },
    "new": {
        "user_weights": [3, 3, 2, 3, 2, 2],
        "sentences": (3, 6),
        "list_prob": 0.5,
        "connective_prob": 0.5,
        "new_connectives": 0.8,
        "new_ack": 0.8,
        "summary_prob": 0.7,
    },
}


# Long prompts (a passage, then a question): sentences in the passage and per paragraph, the
# weights of a later paragraph's focus (keyword, second noun, another noun), the share of answer
# sentences quoted from the passage, and a cap on the passage's words. Sized by token counts: the
# embedded world's (vocab 2048) long prompts take ~105-230 tokens, the micro profile's (vocab 512,
# ~2.2x the tokens) ~150-475, so prompt + answer stays inside the targets' 512 positions.
LONG_SENTENCES = (12, 22)
LONG_PARAGRAPH = (3, 6)
LONG_FOCUS = [0.4, 0.3, 0.3]
LONG_QUOTE_PROB = 0.6
LONG_MAX_WORDS = 140  # rare nouns split into many tokens: the sentence count alone does not bound them


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
    verb_of: dict[str, list[str]]  # noun -> its two verbs (used 75% / 25%)
    adj_of: dict[str, str]
    partner: dict[str, str]  # noun -> the noun it goes with
    template_cum: list[float]  # Zipf over a topic-specific permutation of SENTENCES
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
        out = set(
            self.det
            + self.prep
            + self.pron
            + self.aux
            + self.qword
            + self.ack_old
            + self.ack_new
            + self.conn_old
            + self.conn_new
            + self.gen_nouns
            + self.gen_verbs
            + self.gen_adjs
            + [self.polite, self.summary]
        )
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
            w = "".join(
                rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                for _ in range(rng.randint(syl_min, syl_max))
            )
            if w not in taken and len(w) >= 2:
                taken.add(w)
                out.append(w)
        return out

    lang = Language(
        det=words(4, 1, 1),
        prep=words(6, 1, 1),
        pron=words(4, 1, 1),
        aux=words(4, 1, 1),
        qword=words(5, 1, 2),
        ack_old=words(3, 2, 2),
        ack_new=words(3, 2, 2),
        conn_old=words(4, 2, 2),
        conn_new=words(4, 2, 3),
        polite=words(1, 2, 2)[0],
        summary=words(1, 3, 3)[0],
        gen_nouns=words(60, 1, 2),
        gen_verbs=words(30, 1, 2),
        gen_adjs=words(30, 1, 2),
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
        lang.topics.append(
            Topic(
                name=words(1, 2, 2)[0],
                nouns=nouns,
                verbs=verbs,
                adjs=adjs,
                units=words(3, 1, 2),
                verb_of={n: rng.sample(verbs, 2) for n in nouns},
                adj_of={n: rng.choice(adjs) for n in nouns},
                partner={n: rng.choice([m for m in nouns if m != n]) for n in nouns},
                template_cum=cum,
                opening=rng.sample(verbs, 1) + words(1, 1, 2),
                closing=words(2, 1, 2),
            )
        )
    return lang


def topic_weights(kind: str) -> list[float]:
    """Topic mix of each distribution: "new" partly reverses the old ranking and adds two topics."""
    old = [1.0 / (r + 1) ** 0.8 for r in range(N_OLD_TOPICS)]
    if kind == "old":
        w = old + [0.0] * N_NEW_TOPICS
    elif kind == "new":
        # the old ranking partly reversed (what was niche grew), plus two new topics
        w = [0.4 * a + 0.6 * b for a, b in zip(old, reversed(old))]
        w += [0.07 * sum(old)] * N_NEW_TOPICS  # each new topic: ~6.5% of the new mix
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


def _setup(kind: str, lang: Language, rng: random.Random) -> tuple[Topic, dict]:
    """The sample's topic and its context: keyword K, second noun M, the user's number and unit."""
    weights = topic_weights(kind)
    ti = rng.choices(range(len(weights)), weights=weights)[0]
    topic = lang.topics[ti]
    k = rng.choices(topic.nouns, cum_weights=_CUM20)[0]
    m = rng.choice([n for n in topic.nouns if n != k])
    return topic, {"K": k, "M": m, "#": _number(rng), "U": rng.choice(topic.units)}


def _sentence(lang: Language, topic: Topic, ctx: dict, rng: random.Random) -> list[str]:
    tpl = SENTENCES[rng.choices(range(len(SENTENCES)), cum_weights=topic.template_cum)[0]]
    return _render(tpl, lang, topic, ctx, rng)


def _answer(kind: str, lang: Language, topic: Topic, ctx: dict, rng: random.Random, sentence) -> str:
    """An assistant turn in the style of `kind`; sentence() gives each body sentence's words."""
    style, k = STYLE[kind], ctx["K"]

    def pick(old_words: list[str], new_words: list[str], new_share: float) -> str:
        return rng.choices(
            new_words if rng.random() < new_share else old_words, cum_weights=_zipf(len(old_words), 1.1)
        )[0]

    # opening: acknowledgement, then the keyword and the number echoed from the user turn
    new_ack = rng.random() < style["new_ack"]
    words = [rng.choices(lang.ack_new if new_ack else lang.ack_old, cum_weights=_CUM3)[0], "!" if new_ack else ","]
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
    return _detok(words)


def _sample(kind: str, lang: Language, rng: random.Random) -> dict:
    """A chat sample: a one- or two-sentence question and its answer."""
    topic, ctx = _setup(kind, lang, rng)
    user_tpl = rng.choices(USER_TEMPLATES, weights=STYLE[kind]["user_weights"])[0]
    user = _detok(_render(user_tpl, lang, topic, ctx, rng))
    answer = _answer(kind, lang, topic, ctx, rng, lambda: _sentence(lang, topic, ctx, rng))
    return {"user": user, "assistant": answer, "topic": topic.name}


def _passage(lang: Language, topic: Topic, ctx: dict, rng: random.Random) -> tuple[list[str], list[list[str]]]:
    """A long passage (paragraphs about the keyword, the second noun and other topic nouns) and
    its sentences about the keyword, the facts an answer quotes."""
    k, m = ctx["K"], ctx["M"]
    words: list[str] = []
    facts: list[list[str]] = []
    left = rng.randint(*LONG_SENTENCES)
    while left > 0 and len(words) < LONG_MAX_WORDS:
        # the first paragraph is about the keyword; later ones about it, the second noun or another noun
        focus = k if not words else rng.choices([k, m, None], weights=LONG_FOCUS)[0]
        if focus is None:
            focus = rng.choices(topic.nouns, cum_weights=_CUM20)[0]
        if focus == k:
            pctx = dict(ctx)
        else:
            # the keyword as the second noun: facts about the keyword are spread over the passage
            pctx = {"K": focus, "M": k, "#": _number(rng), "U": rng.choice(topic.units)}
        if words:
            words.append("\n")
        for _ in range(min(left, rng.randint(*LONG_PARAGRAPH))):
            if len(words) >= LONG_MAX_WORDS:
                break
            sent = _sentence(lang, topic, pctx, rng)
            if k in sent:
                facts.append(sent)
            words += sent
            left -= 1
    return words, facts


def _long_sample(kind: str, lang: Language, rng: random.Random) -> dict:
    """A long-prompt sample: a passage and a question; the answer quotes the passage's sentences."""
    topic, ctx = _setup(kind, lang, rng)
    passage, facts = _passage(lang, topic, ctx, rng)
    user_tpl = rng.choices(USER_TEMPLATES, weights=STYLE[kind]["user_weights"])[0]
    user = _detok(passage + ["\n"] + _render(user_tpl, lang, topic, ctx, rng))

    rng.shuffle(facts)  # quoted in a random order, each at most once

    def sentence() -> list[str]:
        if facts and rng.random() < LONG_QUOTE_PROB:
            return facts.pop()
        return _sentence(lang, topic, ctx, rng)

    answer = _answer(kind, lang, topic, ctx, rng, sentence)
    return {"user": user, "assistant": answer, "topic": topic.name, "prompt_kind": "long"}


PROMPT_KINDS = ("chat", "long")


def generate_corpus(
    kind: str, n: int, seed: int, *, start: int = 0, language_seed: int | None = None, prompts: str = "chat"
) -> list[dict]:
    """`n` samples {"user", "assistant", "topic"} of the "old" or "new" distribution.

    Sample i depends only on (kind, prompts, seed, i): the stream is prefix-stable, so a held-out
    split is just `start=n_train` of the same stream. "topic" is bookkeeping (for tests and reports).
    prompts: "chat" (short questions) or "long" (a passage, then a question; those samples also
    carry "prompt_kind": "long"). language_seed: default the embedded world's (WorldParams).
    """
    topic_weights(kind)  # validates kind
    if prompts not in PROMPT_KINDS:
        raise ValueError(f"prompts must be one of {PROMPT_KINDS}, not {prompts!r}")
    if language_seed is None:
        language_seed = WorldParams().language_seed
    lang = make_language(language_seed)
    if prompts == "long":
        # a seed string of its own: the chat streams (every existing corpus) stay byte-identical
        return [_long_sample(kind, lang, random.Random(f"{kind}:long:{seed}:{i}")) for i in range(start, start + n)]
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
