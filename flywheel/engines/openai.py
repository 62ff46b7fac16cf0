"""The ``openai`` engine: generation through OpenAI-compatible completion servers.

Works with ``flywheel serve-policy``, vLLM's OpenAI server, and any server that speaks
``POST /v1/completions``. To keep "never re-tokenize" (ALGORITHMS.md) the prompt goes out as the
token ids the project's chat encoder builds, and the engine asks for the generated ids
(``return_token_ids``) and their log-probs (``logprobs: 1``). ``probe()`` finds out, with one
tiny request per server, whether the server returns them; a stage that trains on what it
generates (explore) refuses a server that does not, in one line, before any work starts, while
evaluation still works from the text (re-tokenized, no log-probs). A chat's ``opening`` ids
(engines/base.py) go at the end of the prompt; the reply's ids follow them in the turn returned.

Requests are async (one event loop on a thread the engine owns), spread round-robin over the
base URLs with at most ``concurrency`` in flight per URL, with a timeout each and retries with
exponential backoff on connection errors and 5xx replies. ``generate`` sends a batch and waits
for all of it; ``submit`` sends one chat and returns a future, which is what lets episodes run
without waiting for each other (``flywheel.agent``).

    engine = OpenAIEngine(["http://127.0.0.1:8000"], tokenizer)
    gens = engine.generate([Chat(messages)], SamplingParams(temperature=0, max_new_tokens=32))
    engine.close()
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import httpx

from flywheel.chat import PromptEncoder
from flywheel.engines.base import Chat, Generation, SamplingParams, opened


class EngineError(RuntimeError):
    """A request that failed for good; the message names the server and why."""


@dataclass(frozen=True)
class Capabilities:
    token_ids: bool  # the server returns the generated token ids
    logprobs: bool  # ... and one log-prob per generated id

    def missing(self) -> list[str]:
        return [
            name
            for name, ok in (("token ids", self.token_ids), ("log-probs", self.logprobs))
            if not ok
        ]


def _mix(seed: int, index: int) -> int:
    """Distinct, stable per-request seeds from one batch seed: identical prompts in one batch
    (K samples of a task) must not get identical samples from servers that seed per request."""
    return (seed * 1_000_003 + index * 7_919 + 1) & 0x7FFFFFFF


def _short(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."


class OpenAIEngine:
    def __init__(
        self,
        base_urls: list[str],
        tokenizer: Any,
        *,
        model: str | None = None,
        concurrency: int = 32,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        stop_ids: list[int] | None = None,
    ) -> None:
        if not base_urls:
            raise ValueError("the openai engine needs at least one base URL")
        self.base_urls = [u.rstrip("/").removesuffix("/v1") for u in base_urls]
        self.tokenizer = tokenizer
        # A session's prompt resumes from its last turn's encoding (on the event loop's thread).
        self._encoder = PromptEncoder(tokenizer)
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        eos = getattr(tokenizer, "eos_token_id", None)  # no tokenizer: probing only
        self.stop_ids: list[int] = sorted({*(stop_ids or []), *([eos] if eos is not None else [])})
        self._turn = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="openai-engine", daemon=True
        )
        self._thread.start()
        self._client: httpx.AsyncClient = self._call(self._make_client())
        self._slots = {url: asyncio.Semaphore(concurrency) for url in self.base_urls}
        self.stats = {"requests": 0, "retries": 0, "generated_tokens": 0}
        self.capabilities = Capabilities(token_ids=True, logprobs=True)
        try:
            self.model = model or self._served_model()
        except BaseException:
            self.close()
            raise

    # --- plumbing -------------------------------------------------------------------------

    async def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.concurrency * len(self.base_urls))
        return httpx.AsyncClient(timeout=self.timeout_s, limits=limits)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._call(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _request(self, url: str, path: str, body: dict[str, Any] | None) -> Any:
        """One request with retries; the reply's JSON. Connection errors, timeouts and 5xx are
        retried with backoff; 4xx are the caller's mistake and fail at once."""
        reason = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._slots[url]:
                    if body is None:
                        reply = await self._client.get(url + path)
                    else:
                        reply = await self._client.post(url + path, json=body)
            except httpx.HTTPError as exc:
                reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
                continue
            if reply.status_code >= 500:
                reason = f"HTTP {reply.status_code}: {_short(reply.text)}"
                continue
            if reply.status_code >= 400:
                raise EngineError(
                    f"openai engine: {url}{path} refused the request: "
                    f"HTTP {reply.status_code}: {_short(reply.text)}"
                )
            return reply.json()
        raise EngineError(
            f"openai engine: {url}{path} failed after {self.retries + 1} tries: {reason}"
        )

    def _served_model(self) -> str:
        url = self.base_urls[0]
        try:
            listed = self._call(self._request(url, "/v1/models", None))
            return str(listed["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"openai engine: {url}/v1/models lists no model") from None

    # --- generation -----------------------------------------------------------------------

    def probe(self) -> Capabilities:
        """Ask every server for one greedy token with ids and log-probs; what all of them
        return is what the engine has. Also checks each URL is up and serves ``self.model``."""
        prompt = [0]  # an id every vocabulary has
        found = []
        for url in self.base_urls:
            listed = self._call(self._request(url, "/v1/models", None))
            names = [m.get("id") for m in listed.get("data", [])]
            if self.model not in names:
                raise EngineError(
                    f"openai engine: {url} serves {', '.join(map(str, names)) or 'no model'}, "
                    f"not {self.model}"
                )
            reply = self._call(
                self._request(url, "/v1/completions", self._body(prompt, 1, 0.0, 1.0, 0))
            )
            choice = reply["choices"][0]
            ids = choice.get("token_ids")
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            found.append(
                Capabilities(
                    token_ids=isinstance(ids, list) and len(ids) > 0,
                    logprobs=isinstance(logprobs, list) and len(logprobs) == len(ids or []) > 0,
                )
            )
        self.capabilities = Capabilities(
            token_ids=all(c.token_ids for c in found), logprobs=all(c.logprobs for c in found)
        )
        return self.capabilities

    def _body(
        self, prompt: list[int], max_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": self.stop_ids,
        }
        if seed is not None:
            body["seed"] = seed
        return body

    async def _generate_one(self, chat: Chat, params: SamplingParams) -> Generation:
        # Forced first ids of the turn go last: the server generates the rest.
        prompt = self._encoder.prompt(chat.messages, chat.turn_token_ids, chat.session)
        prompt += list(chat.opening)
        url = self.base_urls[next(self._turn) % len(self.base_urls)]
        body = self._body(
            prompt, params.max_new_tokens, params.temperature, params.top_p, params.seed
        )
        self.stats["requests"] += 1
        reply = await self._request(url, "/v1/completions", body)
        try:
            return opened(self._generation(reply["choices"][0]), chat.opening, self.tokenizer)
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(
                f"openai engine: {url}/v1/completions replied without {exc}: {_short(str(reply))}"
            ) from None

    def _generation(self, choice: dict[str, Any]) -> Generation:
        ids = choice.get("token_ids")
        token_logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(ids, list):
            # A server without token ids: the text is all there is (evaluation only).
            ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
            token_logprobs = None
        ids = [int(t) for t in ids]
        stopped = bool(ids) and ids[-1] in self.stop_ids
        text = self.tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
        self.stats["generated_tokens"] += len(ids)
        return Generation(
            text=text,
            token_ids=ids,
            logprobs=[float(x) for x in token_logprobs] if token_logprobs else [],
            finish_reason="stop" if stopped or choice.get("finish_reason") == "stop" else "length",
        )

    def submit(self, chat: Chat, params: SamplingParams) -> Future[Generation]:
        """One chat's next turn, as a future (it runs on the engine's event loop)."""
        return asyncio.run_coroutine_threadsafe(self._generate_one(chat, params), self._loop)

    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]:
        futures = [
            self.submit(
                chat,
                params if params.seed is None else _replace_seed(params, _mix(params.seed, i)),
            )
            for i, chat in enumerate(chats)
        ]
        return [f.result() for f in futures]


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
