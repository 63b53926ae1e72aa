"""The target's own answers from a server: an OpenAI-compatible completions API (vLLM, SGLang).

For a target too large for this process, the answers come from the target served elsewhere.
The prompts go as token ids (already rendered through the chat template here, so the server
sees exactly the tokens the features will hold) and the answers come back as token ids, greedy
(temperature 0), stopping at the target's EOS (kept, as draftport.target.regenerate keeps it).

vLLM (checked in 0.32): /v1/completions takes `prompt` as a list of token ids and returns each
choice's `token_ids` when `return_token_ids` is true. SGLang's OpenAI-compatible server also
takes token-id prompts; its answer ids are read from the same field when it provides them.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from .errors import DraftportError


def complete_ids(base_url: str, model: str, prompt: list[int], *, max_new_tokens: int, eos_id: int,
                 timeout: float = 600.0) -> list[int]:
    """One greedy completion of a token-id prompt; the answer's token ids."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_new_tokens, "temperature": 0.0,
            "stop_token_ids": [eos_id], "return_token_ids": True, "skip_special_tokens": False}
    url = base_url.rstrip("/") + "/completions"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
        raise DraftportError(url, f"HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise DraftportError(url, f"cannot reach the server ({getattr(e, 'reason', e)})") from None
    choice = (out.get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise DraftportError(url, "the server returned no token ids (needs return_token_ids support: vLLM >= 0.10)")
    ids = list(ids)
    if choice.get("finish_reason") == "stop" and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)  # a server that drops the stop token from the ids
    return ids


def regenerate_openai(base_url: str, model: str, prompts: list[list[int]], *, max_new_tokens: int, eos_id: int,
                      concurrency: int = 16, progress=None) -> list[list[int]]:
    """Greedy answers of the served target to every prompt, in order (requests in parallel)."""
    if not base_url or not model:
        raise DraftportError("features.base_url", "regenerate openai needs base_url and served_model")

    def one(p):
        ids = complete_ids(base_url, model, p, max_new_tokens=max_new_tokens, eos_id=eos_id)
        if progress is not None:
            progress(1)
        return ids

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, prompts))
