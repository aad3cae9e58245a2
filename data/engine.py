"""OpenAI-compatible serving engines for ``spectrain-distill --server``: HTTP client, worker pool, served-verifier check.

What each engine does, as read in its source (stored copies of the repositories named):

- **vLLM** (``vllm/entrypoints/openai/completion/protocol.py``, ``CompletionRequest`` / ``CompletionResponseChoice``):
  ``prompt`` may be a list of token ids; ``return_token_ids: true`` adds ``choices[0].token_ids`` (the generated ids,
  the EOS included when it stopped on one) and ``prompt_token_ids``; ``logprobs: k`` gives ``choices[0].logprobs =
  {tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`` whose keys are ``"token_id:N"`` with
  ``return_tokens_as_token_ids: true`` (plain token strings otherwise, where two ids with one spelling would share a
  key); ``seed`` per request. ``POST /tokenize`` takes ``{"model", "messages", "add_generation_prompt",
  "add_special_tokens"}`` (rendered with the engine's chat template) or ``{"prompt"}`` and answers ``{"tokens": [...],
  "count", "max_model_len"}``.
- **SGLang** (``python/sglang/srt/entrypoints/openai/serving_completions.py``, ``serving_tokenize.py``): ``prompt`` as
  ids goes in as ``input_ids``; ``return_token_ids`` gives ``token_ids`` / ``prompt_token_ids`` like vLLM; logprobs in
  the OpenAI completions layout with token *texts* (``return_text_in_logprobs``); ``seed`` becomes
  ``sampling_seed``. ``POST /v1/tokenize`` takes text only (``{"prompt", "add_special_tokens"}``), so it cannot show
  how the engine renders a chat.
- **llama.cpp ``llama-server``** (``tools/server/README.md``; ``server_task_result_cmpl_final::to_json_oaicompat``):
  ``prompt`` may be a list of ids; the OpenAI ``/v1/completions`` answer has no id list, but ``logprobs: k`` gives
  ``choices[0].logprobs.content = [{id, token, logprob, bytes, top_logprobs: [{id, token, logprob}]}]`` (so the ids
  come from there); ``seed``, ``top_k`` (<= 0: off), ``min_p``, ``repeat_penalty`` are its own sampler fields.
  ``POST /tokenize {"content", "add_special", "parse_special"}`` answers ``{"tokens": [ids]}``; ``POST
  /apply-template {"messages"}`` answers ``{"prompt": text}`` (the server's chat template).
- **TGI** (``router/src/lib.rs``: ``Prompt`` deserializes from a string or a list of strings): ``/v1/completions``
  takes text only (``--prompt_format text``), returns no ids and only each token's own log-probability (no top-2), so
  replies are re-tokenized here and the check judges a parting by the local verifier's margin. ``POST /tokenize
  {"inputs"}`` answers ``[{id, text, start, stop}]`` for text; TGI cannot render a chat through it.

Every request also carries the fields that make an engine sample the full distribution like the local loop
(``top_p: 1``, ``top_k: -1``, ``min_p: 0``, no repetition penalty); an engine ignores those it does not know.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeVar

from spectrain.heads.errors import SpectrainError

# The near-tie bound of the served-verifier check by the engine's dtype: a parting is allowed only where both paths'
# top-1 minus top-2 logit (= log-probability) margins are at most this. bf16 logits of magnitude 16-32 are spaced
# 0.125 apart, and two engines' kernels (other reduction orders, fused ops) differ by a few such steps after the
# hidden states round differently: 4 steps = 0.5. fp16 has 3 more mantissa bits (step 2**-6 there): 4 steps =
# 0.0625. fp32 rounding is ~1e-6 at that size; what differs is the order of accumulation, ~1e-4-1e-3 on a logit
# after a deep stack, so 0.02 leaves room while a different model or a Q4 file parts at margins of 0.1 and more.
NEAR_TIE = {"bfloat16": 0.5, "float16": 0.0625, "float32": 0.02}
# Short fixed probes for the check: rendered with the verifier's chat template, answered greedily by both paths.
PROBES = ("What is the capital of France?", "Write a short poem about the sea.",
          "Explain how a bicycle works.", "List three prime numbers.")
# Sent with every request so that the engine samples the full distribution at the temperature, as the local loop
# does: vLLM / SGLang (top_k -1 = off, repetition_penalty), llama-server (top_k <= 0 = off, min_p, repeat_penalty).
FULL_DISTRIBUTION = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "repeat_penalty": 1.0}

T = TypeVar("T")
R = TypeVar("R")


class EndpointDown(Exception):
    """An endpoint that stopped answering (refused / reset connection, timeout, 5xx) after its retries: the run drops
    it and hands its unfinished conversations to the others. Not a :class:`SpectrainError`: it is not bad input."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"{url}: {reason}")
        self.url, self.reason = url, reason


class RequestRefused(SpectrainError):
    """A 4xx answer: the engine refused this request (a prompt past its context, a parameter it rejects, a wrong
    model name or key). Retrying cannot mend it; ``code`` and ``message`` are the engine's."""

    def __init__(self, text: str, code: int, message: str):
        super().__init__(text)
        self.code, self.message = code, message


@dataclass
class Completion:
    """One generated reply as an engine returned it.

    ``token_ids``: the generated ids where the engine returns them (vLLM / SGLang ``token_ids``, llama-server's
    ``logprobs.content[].id``), else None (re-tokenize ``text``). ``top_logprobs``: per generated token, the returned
    top log-probabilities sorted high to low (empty lists when not asked or not returned).
    """

    text: str
    token_ids: list[int] | None
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None

    def margin(self, position: int) -> float | None:
        """Top-1 minus top-2 log-probability at ``position`` (a logit difference), None where not returned."""
        if position < len(self.top_logprobs) and len(self.top_logprobs[position]) >= 2:
            return self.top_logprobs[position][0] - self.top_logprobs[position][1]
        return None


def engine_message(body: bytes) -> str:
    """The error text an engine put in a failed response's body (vLLM / llama-server ``{"error": {"message"}}``,
    SGLang / older vLLM ``{"message"}``, TGI ``{"error": "..."}``, FastAPI ``{"detail"}``), else the raw start."""
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body[:300].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("error", "message", "detail"):
            if payload.get(key):
                return str(payload[key])
    return json.dumps(payload)[:300]


class Endpoint:
    """One OpenAI-compatible server: ``Endpoint("http://host:8000")`` (a trailing ``/v1`` is accepted).

    Requests that fail by the connection (refused, reset, timeout) or with a 5xx are retried ``retries`` times with
    exponential backoff (``backoff``, 2x ``backoff``, ... seconds), then raise :class:`EndpointDown`. A 4xx is a
    :class:`RequestRefused` and a body that is not JSON a :class:`SpectrainError`, each naming the endpoint and the
    engine's message: retrying cannot mend a request the engine refuses or an answer we cannot read.
    """

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0, retries: int = 3,
                 backoff: float = 1.0):
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise SpectrainError(f"--server {url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)")
        self.url = url[:-3] if url.endswith("/v1") else url
        self.api_key, self.timeout, self.retries, self.backoff = api_key, timeout, retries, backoff
        self.model: str | None = None

    def __repr__(self) -> str:
        return f"Endpoint({self.url})"

    def request(self, method: str, path: str, body: dict | None = None, refused_ok: bool = False) -> Any:
        """The JSON answer to ``method path``; with ``refused_ok`` a 4xx answers None (a route the engine lacks)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        last = ""
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as e:
                message = engine_message(e.read())
                if e.code < 500:
                    if refused_ok:
                        return None
                    raise RequestRefused(f"{self.url} answered HTTP {e.code} to {method} {path}: {message}", e.code,
                                         message) from None
                last = f"HTTP {e.code} to {method} {path}: {message}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout,
                    http.client.HTTPException) as e:
                last = f"{method} {path} failed: {getattr(e, 'reason', None) or e!r}"
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        else:
            raise EndpointDown(self.url, f"{last} (after {self.retries + 1} tries)")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SpectrainError(f"{self.url} answered {method} {path} with something that is not JSON: "
                                 f"{raw[:200]!r}") from None

    def models(self) -> list[str]:
        """The model names ``GET /v1/models`` lists."""
        payload = self.request("GET", "/v1/models")
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise SpectrainError(f"{self.url}: malformed answer to GET /v1/models (no data[].id): {str(payload)[:200]}")
        return [m["id"] for m in data]

    def resolve_model(self, wanted: str | None) -> str:
        """``wanted`` (``--served_model``) if the endpoint lists it, else the single model it lists."""
        names = self.models()
        if wanted is not None:
            if wanted not in names:
                raise SpectrainError(f"{self.url} does not serve --served_model {wanted!r}; it lists {names}")
            self.model = wanted
        elif len(names) == 1:
            self.model = names[0]
        else:
            raise SpectrainError(f"{self.url} lists {len(names)} models ({names}); say which with --served_model NAME")
        return self.model

    def complete(self, prompt: list[int] | str, max_tokens: int, temperature: float, seed: int | None,
                 top_logprobs: int = 0) -> Completion:
        """``POST /v1/completions`` for one prompt (token ids or text)."""
        body = self._sampling(max_tokens, temperature, seed, top_logprobs)
        body.update(prompt=prompt)
        if top_logprobs:
            body["logprobs"] = top_logprobs
        return parse_completion(self.url, "/v1/completions", self.request("POST", "/v1/completions", body))

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, seed: int | None,
             top_logprobs: int = 0) -> Completion:
        """``POST /v1/chat/completions`` (the engine renders the chat with its own template)."""
        body = self._sampling(max_tokens, temperature, seed, top_logprobs)
        body.update(messages=messages)
        if top_logprobs:
            body.update(logprobs=True, top_logprobs=top_logprobs)
        return parse_completion(self.url, "/v1/chat/completions", self.request("POST", "/v1/chat/completions", body))

    def _sampling(self, max_tokens: int, temperature: float, seed: int | None, top_logprobs: int) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": temperature, "stream": False,
                "return_token_ids": True, **FULL_DISTRIBUTION}
        if top_logprobs:
            body["return_tokens_as_token_ids"] = True
        if seed is not None:
            body["seed"] = seed
        return body

    def rendered_chat(self, messages: list[dict]) -> tuple[list[int], str] | None:
        """The ids the engine's own chat template gives ``messages`` (with the generation prompt) and how they were
        asked for: vLLM's ``/tokenize`` with ``messages``, else llama-server's ``/apply-template`` then
        ``/tokenize``; None where the engine has neither (SGLang's and TGI's tokenizers take text only)."""
        payload = self.request("POST", "/tokenize", {"model": self.model, "messages": messages,
                                                     "add_generation_prompt": True, "add_special_tokens": False},
                               refused_ok=True)
        # Non-empty: llama-server's /tokenize answers a body without "content" with 200 and no tokens.
        if isinstance(payload, dict) and _int_list(payload.get("tokens")) and payload["tokens"]:
            return payload["tokens"], "POST /tokenize {messages} (vLLM)"
        rendered = self.request("POST", "/apply-template", {"messages": messages}, refused_ok=True)
        if isinstance(rendered, dict) and isinstance(rendered.get("prompt"), str):
            payload = self.request("POST", "/tokenize", {"content": rendered["prompt"], "add_special": True,
                                                         "parse_special": True})
            if isinstance(payload, dict) and _int_list(payload.get("tokens")):
                return payload["tokens"], "POST /apply-template + /tokenize (llama-server)"
            raise SpectrainError(f"{self.url}: malformed answer to POST /tokenize: {str(payload)[:200]}")
        return None


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def parse_completion(url: str, path: str, payload: Any) -> Completion:
    """A completions or chat-completions answer -> :class:`Completion`; anything missing or mistyped is a
    :class:`SpectrainError` naming the endpoint, the route and the field."""
    def malformed(what: str) -> SpectrainError:
        return SpectrainError(f"{url}: malformed answer to POST {path}: {what}; the answer began "
                              f"{json.dumps(payload)[:200]}")

    choices = payload.get("choices") if isinstance(payload, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("no choices[0]")
    choice = choices[0]
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    if not isinstance(text, str):
        raise malformed("choices[0] has no text" if path.endswith("/completions") and "chat" not in path
                        else "choices[0].message has no content")
    ids = choice.get("token_ids")
    if ids is not None and not _int_list(ids):
        raise malformed("choices[0].token_ids is not a list of token ids")
    logprobs, tops = choice.get("logprobs"), []
    if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        # llama-server (completions and chat) and the chat layout: one entry per token, its id and top list inside.
        entries = logprobs["content"]
        if not all(isinstance(e, dict) for e in entries):
            raise malformed("choices[0].logprobs.content holds a non-object")
        if ids is None and entries and all(isinstance(e.get("id"), int) for e in entries):
            ids = [e["id"] for e in entries]
        tops = [sorted((float(t["logprob"]) for t in e.get("top_logprobs") or [] if "logprob" in t), reverse=True)
                for e in entries]
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("top_logprobs"), list):
        # vLLM / SGLang completions: {token: logprob} per token; vLLM's keys are "token_id:N" when asked.
        tops = [sorted(map(float, d.values()), reverse=True) if isinstance(d, dict) else []
                for d in logprobs["top_logprobs"]]
        tokens = logprobs.get("tokens") or []
        if ids is None and tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
            ids = [int(t.split(":", 1)[1]) for t in tokens]
    return Completion(text=text, token_ids=ids, top_logprobs=tops, finish_reason=choice.get("finish_reason"))


# --------------------------------------------------------------------------- the worker pool


@dataclass
class PoolReport:
    """What a pool run did: conversations finished per endpoint and the endpoints dropped, with why."""

    finished: dict[str, int]
    dropped: dict[str, str]


def run_pool(endpoints: list[Endpoint], in_flight: int, items: list[T], work: Callable[[Endpoint, T], R],
             on_result: Callable[[T, R], None], log: Callable[[str], None] = print) -> PoolReport:
    """Every item through ``work(endpoint, item)`` on ``in_flight`` threads per endpoint, one shared queue;
    ``on_result`` runs in the calling thread (the single writer) as each item finishes.

    An item whose endpoint goes down (:class:`EndpointDown`) goes back to the front of the queue and the endpoint is
    dropped; when none is left with items unfinished, a :class:`SpectrainError` names every endpoint and why it was
    dropped. Any other exception from ``work`` or ``on_result`` stops the pool (threads still running finish their
    request; their results are discarded) and propagates.
    """
    queue: deque = deque(items)
    alive = {e.url: e for e in endpoints}
    report = PoolReport(finished={e.url: 0 for e in endpoints}, dropped={})
    running: dict[Future, tuple[Endpoint, T]] = {}
    executor = ThreadPoolExecutor(max_workers=max(1, in_flight * len(endpoints)), thread_name_prefix="distill")
    try:
        def fill(endpoint: Endpoint) -> None:
            while queue and endpoint.url in alive and sum(e is endpoint for e, _ in running.values()) < in_flight:
                item = queue.popleft()
                running[executor.submit(work, endpoint, item)] = (endpoint, item)

        for endpoint in endpoints:
            fill(endpoint)
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for future in done:
                endpoint, item = running.pop(future)
                try:
                    result = future.result()
                except EndpointDown as e:
                    queue.appendleft(item)
                    if alive.pop(endpoint.url, None) is not None:
                        report.dropped[endpoint.url] = e.reason
                        log(f"distill: dropped {endpoint.url} ({e.reason}); {len(alive)} endpoint(s) left")
                    continue
                on_result(item, result)
                report.finished[endpoint.url] += 1
            for endpoint in list(alive.values()):
                fill(endpoint)
        if queue:
            reasons = "; ".join(f"{url}: {why}" for url, why in report.dropped.items())
            raise SpectrainError(f"no endpoint left with {len(queue)} conversations to go ({reasons}); everything "
                                 "finished so far is on disk: rerun the same command (with working --server "
                                 "endpoints) to resume")
        return report
    finally:
        executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------- the served-verifier check


@dataclass
class Parting:
    """The first position where the served continuation leaves the local one, and the margins there."""

    position: int
    local_id: int | None  # None: that side had ended (a stop token or the length cap)
    served_id: int | None
    local_margin: float | None
    served_margin: float | None

    def near_tie(self, bound: float) -> bool:
        """Allowed: the local margin is known and every known margin is at most ``bound``."""
        margins = [m for m in (self.local_margin, self.served_margin) if m is not None]
        return self.local_margin is not None and all(m <= bound for m in margins)


def kernel_spread(partings: Iterable[Parting | None]) -> float:
    """The largest known margin among an engine's partings from *itself* (its 1-slot replies against its N-slot
    ones; 0 when they never part): how far batching moves a logit margin in that engine, so a parting from our
    loop within it is kernel noise, not another model."""
    return max((max(m for m in (p.local_margin, p.served_margin) if m is not None) for p in partings
                if p is not None and (p.local_margin is not None or p.served_margin is not None)), default=0.0)


def first_parting(local_ids: list[int], local_margins: list[float], served: list[int],
                  served_margins: Callable[[int], float | None]) -> Parting | None:
    """None when ``served`` equals ``local_ids``, else where and how they part."""
    for j in range(max(len(local_ids), len(served))):
        a = local_ids[j] if j < len(local_ids) else None
        b = served[j] if j < len(served) else None
        if a != b:
            return Parting(j, a, b, local_margins[j] if j < len(local_margins) else None, served_margins(j))
    return None


@dataclass
class LocalContinuation:
    """The local verifier's greedy continuation of one prompt: ids (cut before the first stop id) and the top-1
    minus top-2 logit margin at each generated position (the stop position's too)."""

    ids: list[int]
    margins: list[float]


def local_greedy(model, prompt_ids: list[int], max_new_tokens: int, stops: list[int]) -> LocalContinuation:
    """Greedy decoding with the margin of every chosen token (one sequence, KV cache)."""
    import torch
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache, ids, margins = DynamicCache(), [], []
    inputs = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
            top = torch.topk(logits.float(), 2)
            margins.append(float(top.values[0] - top.values[1]))
            token = int(top.indices[0])
            if token in stops:
                break
            ids.append(token)
            inputs = torch.tensor([[token]], device=device)
    return LocalContinuation(ids, margins)


def cut_at_stop(ids: list[int], stops: list[int]) -> list[int]:
    """``ids`` up to (not including) the first stop id."""
    return ids[:next((i for i, t in enumerate(ids) if t in stops), len(ids))]


def check_endpoint(endpoint: Endpoint, generate: Callable[[Endpoint, int], Completion], tokenizer,
                   local: list[LocalContinuation], stops: list[int], near_tie: float,
                   max_new_tokens: int) -> dict:
    """Compare the endpoint's greedy continuation of every probe with the local verifier's.

    ``generate(endpoint, k)`` asks the endpoint for probe ``k`` greedily with top log-probabilities. Served ids come
    from the answer where the engine returns them, else from its text re-tokenized. Returns the endpoint's record
    (probes equal, partings allowed as near-ties with their margins); a parting that is not a near-tie is a
    :class:`SpectrainError` naming the probe, the position, both tokens (ids and texts) and both margins.
    """
    near_ties, source = [], "token ids"
    for k, mine in enumerate(local):
        completion = generate(endpoint, k)
        if completion.token_ids is not None:
            served = cut_at_stop(completion.token_ids, stops)[:max_new_tokens]
            parting = first_parting(mine.ids, mine.margins, served, completion.margin)
        else:
            source = "text re-tokenized"
            parting = text_parting(tokenizer, mine, completion)
        if parting is None:
            continue
        record = {"probe": k, "position": parting.position, "local_id": parting.local_id,
                  "served_id": parting.served_id, "local_margin": _round(parting.local_margin),
                  "served_margin": _round(parting.served_margin)}
        if not parting.near_tie(near_tie):
            def token(i: int | None) -> str:
                return "<end>" if i is None else f"{i} {tokenizer.decode([i])!r}"

            raise SpectrainError(
                f"{endpoint.url} (model {endpoint.model!r}) does not serve this verifier: probe {k} "
                f"({PROBES[k]!r}) parts from the local verifier's greedy reply at generated token {parting.position}: "
                f"local {token(parting.local_id)}, served {token(parting.served_id)}; top-2 margins: local "
                f"{_fmt(parting.local_margin)}, served {_fmt(parting.served_margin)} (a near-tie is <= {near_tie}, "
                "--near_tie). Serve the verifier itself (the same weights, in the --dtype given here), or pass "
                "--skip_verifier_check to generate anyway")
        near_ties.append(record)
    return {"probes": len(local), "equal": len(local) - len(near_ties), "near_ties": near_ties, "compared": source}


def text_parting(tokenizer, mine: LocalContinuation, completion: Completion) -> Parting | None:
    """:func:`first_parting` for an engine that returns text only (TGI): equal texts agree; else both texts are
    re-tokenized and compared, the local margin taken only where the local ids re-tokenize to themselves up to
    the parting (so it is the margin of the token that parts), the engine's from its log-probabilities if any."""
    text = tokenizer.decode(mine.ids, skip_special_tokens=True)
    if completion.text.strip() == text.strip():
        return None
    ours = tokenizer(text, add_special_tokens=False)["input_ids"]
    theirs = tokenizer(completion.text, add_special_tokens=False)["input_ids"]
    parting = first_parting(ours, [], theirs, completion.margin)
    if parting is not None and mine.ids[:parting.position + 1] == ours[:parting.position + 1]:
        parting.local_margin = mine.margins[parting.position] if parting.position < len(mine.margins) else None
    return parting


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 5)


def _fmt(value: float | None) -> str:
    return "not returned" if value is None else f"{value:.4f}"
