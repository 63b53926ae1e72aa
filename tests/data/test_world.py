"""The embedded world: corpus, tokenizer and the two targets, on the micro profile's world."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftport.plan import params
from draftport.world import PIPELINE_KEYS, _write_corpora, base_params, build_world_base
from draftport.world.language import generate_corpus, make_language, read_jsonl, topic_distribution
from draftport.world.tokenizer import (
    CHAT_TEMPLATE,
    encode_world_chat,
    encode_world_prompt,
    load_world_tokenizer,
    train_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
# the micro profile's world group, as the pipeline passes it (build and source_drafter included)
MICRO_GROUP = dict(params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")["world"], threads=1)
MICRO = base_params(MICRO_GROUP)  # one thread: the suite shares the cores


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("world")
    return out, build_world_base(out, MICRO_GROUP, progress=False)


@pytest.mark.slow  # builds a micro world
def test_the_world_is_built_from_the_params_world_group(world):
    """No copy of the world's values outside params: its defaults are WorldParams', the micro
    world is the micro profile's, and it reads only keys the params model has."""
    _, manifest = world
    assert manifest["params"] == MICRO and set(MICRO) <= set(params.WorldParams.model_fields)
    default = params.WorldParams().model_dump()
    assert base_params() == {k: v for k, v in default.items() if k not in PIPELINE_KEYS}
    assert base_params(params.read_yaml(ROOT / "params.yaml")["world"]) == base_params()
    assert set(PIPELINE_KEYS) <= set(params.WorldParams.model_fields) and not set(PIPELINE_KEYS) & set(MICRO)


def test_corpus_is_deterministic_and_prefix_stable():
    a = generate_corpus("new", 50, seed=3)
    assert a == generate_corpus("new", 50, seed=3)
    assert a != generate_corpus("new", 50, seed=4)
    # a held-out split is the same stream further on
    assert generate_corpus("new", 20, seed=3, start=30) == a[30:]
    with pytest.raises(ValueError):
        generate_corpus("newer", 1, seed=0)


def test_old_and_new_differ_in_topics_and_style():
    old, new = generate_corpus("old", 2000, seed=0), generate_corpus("new", 2000, seed=0)
    p, q = topic_distribution(old), topic_distribution(new)
    tv = 0.5 * sum(abs(p.get(t, 0) - q.get(t, 0)) for t in set(p) | set(q))
    assert tv > 0.2, tv
    new_topics = set(q) - set(p)
    assert len(new_topics) == 2 and sum(q[t] for t in new_topics) > 0.08
    # the same language: every old topic is still there
    assert set(p) <= set(q)

    def lists(c):
        return sum("\n1." in s["assistant"] for s in c) / len(c)

    def length(c):
        return sum(len(s["assistant"].split()) for s in c) / len(c)

    assert lists(new) > 2 * lists(old) > 0  # shifted frequency, not a new construct
    assert length(new) > 1.3 * length(old)


def test_new_words_are_only_in_new_and_answers_depend_on_prompt():
    lang = make_language(MICRO["language_seed"])
    old = generate_corpus("old", 500, seed=0)
    old_words = {w for s in old for w in re.findall(r"[a-z]+", (s["user"] + " " + s["assistant"]).lower())}
    for t in lang.topics[-2:]:
        assert not set(t.nouns) & old_words
    for s in old + generate_corpus("new", 200, seed=0):
        number = re.findall(r"\d+", s["user"])[-1]
        assert number in s["assistant"]  # the number is echoed
        words = set(re.findall(r"[a-z]+", s["user"].lower()))
        assert words & set(re.findall(r"[a-z]+", s["assistant"].lower())) - set(lang.det)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_chat_streams_are_unchanged_by_long_prompts():
    """The long prompts' stream is a new one: every chat sample (the targets' corpora) is as before."""
    chat = json.dumps(generate_corpus("new", 5, 0), sort_keys=True).encode()
    assert _sha(chat) == "47ee030b72add650ebbeb0ee402579c686033b9e3c9bb67403675cd6d6f0da01"
    old = json.dumps(generate_corpus("old", 5, 0), sort_keys=True).encode()
    assert _sha(old) == "87391df5e503e4a650e8b7d93bf09ad073113b450117bd24e3edea87bdbe1942"
    assert generate_corpus("new", 5, 0, prompts="chat") == generate_corpus("new", 5, 0)
    with pytest.raises(ValueError, match="prompts"):
        generate_corpus("new", 1, 0, prompts="longer")


def test_long_prompts_are_passages_whose_answers_quote_them():
    chat, long = generate_corpus("new", 60, 0), generate_corpus("new", 60, 0, prompts="long")
    assert max(len(s["user"].split()) for s in chat) * 5 < min(len(s["user"].split()) for s in long)
    assert all(s["prompt_kind"] == "long" for s in long) and not any("prompt_kind" in s for s in chat)
    assert all(s["user"].count("\n") >= 2 and s["user"].endswith("?") for s in long)  # paragraphs, then a question
    assert len({len(s["user"].split()) for s in long}) > 10  # passages of varying length

    def quoted(s):  # answer sentences copied verbatim from the passage
        passage = {x.strip().lower() for x in re.split(r"[.?\n]", s["user"])}
        return sum(x.strip().lower() in passage for x in re.split(r"[.\n]", s["assistant"]) if len(x.split()) > 3)

    assert sum(quoted(s) > 0 for s in long) > 0.8 * len(long)
    assert not any(quoted(s) for s in chat)
    for s in long:  # the question's number is echoed, as in chat answers
        assert re.findall(r"\d+", s["user"])[-1] in s["assistant"]


def test_long_stream_is_deterministic_prefix_stable_and_its_own():
    a = generate_corpus("new", 30, 3, prompts="long")
    assert a == generate_corpus("new", 30, 3, prompts="long")
    assert generate_corpus("new", 10, 3, start=20, prompts="long") == a[20:]
    assert a != generate_corpus("new", 30, 4, prompts="long")
    assert a != generate_corpus("old", 30, 3, prompts="long")


def test_world_writes_heldout_long_apart_from_training(tmp_path):
    """corpus/heldout_long.jsonl: n_heldout new-distribution long prompts, none a training prompt,
    that fit the micro targets' positions with the answer; the chat files keep their bytes."""
    old, new, heldout, corpus = _write_corpora(tmp_path, MICRO)
    long = read_jsonl(corpus["heldout_long"])
    assert corpus["heldout_long"] == tmp_path / "corpus/heldout_long.jsonl" and len(long) == MICRO["n_heldout"]
    assert {s["prompt_kind"] for s in long} == {"long"}
    assert not {s["user"] for s in long} & {s["user"] for s in read_jsonl(corpus["new"])}
    pinned = {
        "old": "cafc33edcc7df05eb4232506eadb46d7a840c7c0a5ec90ab0f028390a48f7589",
        "new": "1f1cd35385dad089f97072ec2814cedbe35fc9e51108254f22a36e3d9e9410a2",
        "heldout_old": "6f3bb568c3b74c06e0ad890a3ad1c0109b188aab10b802f07cb8fa4cbd706b32",
        "heldout_new": "b7eca2b3e10ebcd008ada84e883bacda7948a78ed3bb02143c2410ec6770fd7e",
    }
    assert {k: _sha(corpus[k].read_bytes()) for k in pinned} == pinned
    tok_dir = train_tokenizer(tmp_path / "tok", old + new, vocab_size=MICRO["vocab_size"], model_max_length=512)
    tok = load_world_tokenizer(tok_dir)
    chat_len = [len(encode_world_prompt(tok, s["user"])) for s in heldout["new"]]
    long_len = [len(encode_world_prompt(tok, s["user"])) for s in long]
    max_new = params.load(ROOT / "configs/micro.yaml", base=ROOT / "params.yaml")["features"]["max_new_tokens"]
    assert max(chat_len) < min(long_len)
    assert max(long_len) + max_new + 3 <= MICRO["model"]["max_position_embeddings"]


@pytest.mark.slow  # builds a micro world
def test_tokenizer_round_trips_and_matches_chat_template(world):
    out, manifest = world
    tok = load_world_tokenizer(out / "tokenizer")
    assert tok.get_vocab_size() == manifest["vocab_size"] <= MICRO["vocab_size"]
    samples = read_jsonl(out / "corpus/heldout_new.jsonl")
    for s in samples[:20]:
        for text in (s["user"], s["assistant"], "Zzq 12, öü ~\n\t!"):
            assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
        ids, start = encode_world_chat(tok, s)
        whole = f"<|bos|><|user|>{s['user']}<|end|><|assistant|>{s['assistant']}<|end|>"
        assert ids == tok.encode(whole).ids
        assert ids[:start] == encode_world_prompt(tok, s["user"])
        assert tok.decode(ids[start:], skip_special_tokens=False) == s["assistant"] + "<|end|>"

    hf = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert hf.chat_template == CHAT_TEMPLATE
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("<|bos|>", "<|end|>", "<|pad|>")
    s = samples[0]
    msgs = [{"role": "user", "content": s["user"]}]
    assert hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == hf.decode(
        encode_world_prompt(hf, s["user"])
    )
    full = msgs + [{"role": "assistant", "content": s["assistant"]}]
    rendered = hf.apply_chat_template(full, tokenize=False)
    assert hf(rendered, add_special_tokens=False)["input_ids"] == encode_world_chat(tok, s)[0]


@pytest.mark.slow  # builds a micro world
def test_micro_world_is_deterministic(world, tmp_path):
    out, manifest = world
    again = build_world_base(tmp_path, MICRO_GROUP, progress=False)
    files = ("corpus/old.jsonl", "corpus/new.jsonl", "corpus/heldout_new.jsonl", "corpus/heldout_long.jsonl")
    for f in (*files, "tokenizer/tokenizer.json"):
        assert (out / f).read_bytes() == (tmp_path / f).read_bytes(), f
    for t in ("target_old", "target_new"):
        assert again["targets"][t]["revision"] == manifest["targets"][t]["revision"]
        assert (out / t / "model.safetensors").read_bytes() == (tmp_path / t / "model.safetensors").read_bytes()
    assert manifest["targets"]["target_old"]["revision"] != manifest["targets"]["target_new"]["revision"]
    assert again["metrics"] == manifest["metrics"]


@pytest.mark.slow  # builds a micro world
def test_targets_load_from_their_folders(world):
    out, manifest = world
    for name in ("target_old", "target_new"):
        folder = out / name
        model = AutoModelForCausalLM.from_pretrained(folder)
        tok = AutoTokenizer.from_pretrained(folder)
        cfg = model.config
        assert cfg.model_type == "llama" and not cfg.tie_word_embeddings
        assert cfg.vocab_size == len(tok) and cfg.hidden_size == MICRO["model"]["hidden_size"]
        assert cfg.max_position_embeddings >= 256
        assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|end|>")
        meta = json.loads((folder / "draftport_target.json").read_text())
        assert meta["name"] == name and meta["revision"] == manifest["targets"][name]["revision"]
        assert meta["trained_on"] == f"corpus/{name.split('_')[1]}.jsonl"
        assert meta["steps"] == MICRO[name]["steps"] and "seed" in meta
        ids = tok.apply_chat_template(
            [{"role": "user", "content": "Kra 5?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()
    # K2.5 continues K2: it records its parent
    parent = json.loads((out / "target_new/draftport_target.json").read_text())["init_from"]
    assert parent == {"name": "target_old", "revision": manifest["targets"]["target_old"]["revision"]}


@pytest.mark.slow  # builds a micro world
def test_manifest_lists_the_layout(world):
    out, manifest = world
    for key in ("tokenizer", "target_old", "target_new", "old", "new", "heldout_new", "heldout_long"):
        assert (out / manifest["paths"][key]).exists()
    assert (
        manifest["samples"]["heldout_long"] == MICRO["n_heldout"] == len(read_jsonl(out / "corpus/heldout_long.jsonl"))
    )
    assert manifest["bytes"]["total"] > 0 and manifest["seconds"]["total"] > 0
    assert json.loads((out / "world_base.json").read_text())["metrics"] == manifest["metrics"]
    for k in ("loss_A_old", "loss_B_new", "top1_A_old", "top1_B_new", "agree_AB_new"):
        assert k in manifest["metrics"]
