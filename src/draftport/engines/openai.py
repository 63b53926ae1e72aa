"""The target's own answers from a server: an OpenAI-compatible completions API (vLLM, SGLang).

For a target too large for this process, the answers come from the target served elsewhere.
The prompts go as token ids (already rendered through the chat template here, so the server
sees exactly the tokens the features will hold) and the answers come back as token ids, greedy
(temperature 0), stopping at the target's EOS (kept, as draftport.data.capture.regenerate keeps it).

vLLM (checked in 0.32): /v1/completions takes `prompt` as a list of token ids and returns each
choice's `token_ids` when `return_token_ids` is true. SGLang's OpenAI-compatible server also
takes token-id prompts; its answer ids are read from the same field when it provides them.

Tens of thousands of requests go to one server (the kimi profile: ~37K), so a request that
meets a server away, restarting or overloaded is retried (tenacity): connection errors,
dropped connections, timeouts and HTTP 5xx / 429, with exponential backoff (jittered), for up
to `retry_s` seconds per request ($DRAFTPORT_OPENAI_RETRY_S, default 600); then one line naming
the URL. Any other HTTP error (4xx: a wrong model name, a bad request) fails at once.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_exponential, wait_random

from draftport.errors import DraftportError

WAIT_FIRST_S = 0.5  # the first backoff; doubling (plus up to WAIT_JITTER_S) up to WAIT_MAX_S
WAIT_MAX_S = 30.0
WAIT_JITTER_S = 0.5


def retry_seconds() -> float:
    """Each request's retry budget: $DRAFTPORT_OPENAI_RETRY_S, default 600 s."""
    return float(os.environ.get("DRAFTPORT_OPENAI_RETRY_S") or 600)


class _Transient(Exception):
    """A failure worth retrying (the server is away, restarting or overloaded)."""


def _post_once(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300].replace("\n", " ")
        if e.code >= 500 or e.code == 429:
            raise _Transient(f"HTTP {e.code}: {detail}") from None
        raise DraftportError(url, f"HTTP {e.code}: {detail}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        # refused, reset, dropped mid-answer (RemoteDisconnected, IncompleteRead), timed out
        raise _Transient(f"cannot reach the server ({getattr(e, 'reason', None) or e!r})") from None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise DraftportError(url, f"the server's answer is not JSON: {raw[:120]!r}") from None


def post_json(url: str, body: dict, *, timeout: float = 600.0, retry_s: float | None = None) -> dict:
    """POST `body` as JSON, the answer's JSON; transient failures retried for retry_s seconds."""
    budget = retry_seconds() if retry_s is None else float(retry_s)
    t0 = time.monotonic()

    def first_warning(rs) -> None:
        if rs.attempt_number == 1:
            print(
                f"warning: {url}: {rs.outcome.exception()}; retrying for up to {budget:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    retrying = Retrying(
        retry=retry_if_exception_type(_Transient),
        stop=stop_after_delay(budget),
        wait=wait_exponential(multiplier=WAIT_FIRST_S, max=WAIT_MAX_S) + wait_random(0, WAIT_JITTER_S),
        before_sleep=first_warning,
        reraise=True,
    )
    try:
        return retrying(_post_once, url, body, timeout)
    except _Transient as e:
        tries = retrying.statistics.get("attempt_number", 1)
        raise DraftportError(
            url, f"{e}; gave up after {tries} tries in {time.monotonic() - t0:.0f} s (retry budget {budget:.0f} s)"
        ) from None


def complete_ids(
    base_url: str,
    model: str,
    prompt: list[int],
    *,
    max_new_tokens: int,
    eos_id: int,
    timeout: float = 600.0,
    retry_s: float | None = None,
) -> list[int]:
    """One greedy completion of a token-id prompt; the answer's token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": [eos_id],
        "return_token_ids": True,
        "skip_special_tokens": False,
    }
    url = base_url.rstrip("/") + "/completions"
    out = post_json(url, body, timeout=timeout, retry_s=retry_s)
    choice = (out.get("choices") or [{}])[0]
    ids = choice.get("token_ids")
    if ids is None:
        raise DraftportError(url, "the server returned no token ids (needs return_token_ids support: vLLM >= 0.10)")
    ids = list(ids)
    if choice.get("finish_reason") == "stop" and (not ids or ids[-1] != eos_id):
        ids.append(eos_id)  # a server that drops the stop token from the ids
    return ids


def regenerate_openai(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    concurrency: int = 16,
    progress=None,
    timeout: float = 600.0,
    retry_s: float | None = None,
) -> list[list[int]]:
    """Greedy answers of the served target to every prompt, in order (requests in parallel)."""
    if not base_url or not model:
        raise DraftportError("features.base_url", "regenerate openai needs base_url and served_model")

    def one(p):
        ids = complete_ids(
            base_url, model, p, max_new_tokens=max_new_tokens, eos_id=eos_id, timeout=timeout, retry_s=retry_s
        )
        if progress is not None:
            progress(1)
        return ids

    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        return list(pool.map(one, prompts))
    finally:  # a failure stops the queued requests (map submits them all up front)
        pool.shutdown(wait=True, cancel_futures=True)
