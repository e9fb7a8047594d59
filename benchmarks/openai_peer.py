"""Any OpenAI-compatible server as a `make bench` peer: vLLM, SGLang, TGI, llama-server's
/v1, Pagoda's own `pagoda-openai`, through one client.

Each workload's requests go on the load generator's schedule (the same arrival offsets) to
`POST {base}/v1/completions`: the same prompts as token ids (a list of ids is a valid
`prompt` for vLLM, llama-server and pagoda-openai), `max_tokens` = max new tokens,
`temperature` 0 (greedy; a seed per request when sampling), `ignore_eos` when the workload
asks (vLLM's extension, also taken by llama-server and pagoda-openai), `stream: true` with
`stream_options.include_usage`, and `return_token_ids` (vLLM's extension, also
pagoda-openai's; others ignore it). Every streamed event's arrival time is recorded with the
number of tokens it carried, so `summarize` computes TTFT, ITL and the rest exactly as for
the gRPC client:

- an event's `token_ids` (return_token_ids) give its count exactly;
- without them, an event whose text is not empty counts one token (vLLM and llama-server
  stream one token per event), and the final usage's `completion_tokens` puts any tokens
  not seen (text held back, e.g. an incomplete UTF-8 character) on the last event.

    --peer openai=http://127.0.0.1:8000                 # labelled "openai"
    --peer openai:pagoda-front=http://127.0.0.1:8000    # labelled "openai:pagoda-front"

The key, if the server wants one, is read from $OPENAI_API_KEY (sent as a bearer token).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from pagoda.client.bench_config import BenchConfig
from pagoda.client.bench_report import BenchReport, RequestResult
from pagoda.client.bench_workload import run_open_loop
from pagoda.client.results import Usage

PEER_OPENAI = "openai"
API_KEY_ENV = "OPENAI_API_KEY"
# Connecting and the non-streamed calls; a stream's own length is bounded by the run's
# duration_s, not by a read timeout.
CONNECT_TIMEOUT_S = 10.0


class OpenAIPeerError(RuntimeError):
    """The server refused a request, sent an error event, or broke the stream."""


@dataclass(frozen=True, slots=True)
class OpenAIPeer:
    """One server to drive: its label in the tables and its base URL (no /v1)."""

    label: str
    base_url: str


def parse_peer(text: str) -> OpenAIPeer:
    """`openai=URL` or `openai:LABEL=URL` (ValueError otherwise); a trailing / or /v1 of
    the URL is dropped."""
    name, sep, url = text.partition("=")
    kind, _, label = name.partition(":")
    if kind != PEER_OPENAI or not sep:
        raise ValueError(f"expected openai=URL or openai:LABEL=URL, got {text!r}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the URL of {name} must start with http:// or https://, got {url!r}")
    base_url = url.rstrip("/").removesuffix("/v1")
    return OpenAIPeer(label=name if label else PEER_OPENAI, base_url=base_url)


def completions_body(
    prompt_ids: Sequence[int], config: BenchConfig, index: int, model: str | None
) -> dict:
    """The /v1/completions request for request `index`: what the load generator asks for."""
    body: dict = {
        "prompt": list(prompt_ids),
        "max_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.temperature > 0:
        body["seed"] = config.seed + index
    return body


@dataclass(slots=True)
class EventCounter:
    """Turns one request's stream events into its RequestResult's chunks."""

    result: RequestResult
    num_prompt_tokens: int
    num_tokens_seen: int = 0

    def on_event(self, event: dict, now_s: float) -> None:
        if "error" in event:
            raise OpenAIPeerError(f"error event: {json.dumps(event['error'])[:300]}")
        for choice in event.get("choices") or ():
            token_ids = choice.get("token_ids")
            if isinstance(token_ids, list):
                num_tokens = len(token_ids)
            else:
                num_tokens = 1 if choice.get("text") else 0
            if num_tokens:
                self.result.chunk_times_s.append(now_s)
                self.result.chunk_num_tokens.append(num_tokens)
                self.num_tokens_seen += num_tokens
            if choice.get("finish_reason"):
                self.result.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            missing = int(usage.get("completion_tokens", 0)) - self.num_tokens_seen
            if missing > 0 and self.result.chunk_num_tokens:
                self.result.chunk_num_tokens[-1] += missing
                self.num_tokens_seen += missing
            details = usage.get("prompt_tokens_details") or {}
            self.result.usage = Usage(
                prompt_tokens=int(usage.get("prompt_tokens", self.num_prompt_tokens)),
                completion_tokens=self.num_tokens_seen,
                cached_prompt_tokens=int(details.get("cached_tokens") or 0),
            )

    def finish(self, now_s: float) -> None:
        """The stream ended: a request without a finish_reason broke off."""
        if self.result.finish_reason is None:
            raise OpenAIPeerError("the stream ended without a finish_reason")
        self.result.end_s = now_s
        if self.result.usage is None:  # a server that ignores include_usage
            self.result.usage = Usage(self.num_prompt_tokens, self.num_tokens_seen, 0)


async def stream_completion(
    client: httpx.AsyncClient, body: dict, counter: EventCounter, clock
) -> None:
    """POST /v1/completions and feed every `data:` event to `counter` with `clock()`'s time."""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread())[:300].decode(errors="replace")
            raise OpenAIPeerError(f"HTTP {response.status_code}: {text}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            counter.on_event(json.loads(data), clock())
    counter.finish(clock())


def http_client(base_url: str, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        # A burst opens every stream at once: no pool limit, no read timeout.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
    )


async def served_model(client: httpx.AsyncClient) -> str | None:
    """The first id of GET /v1/models (vLLM wants `model`); None if the list is empty."""
    try:
        response = await client.get("/v1/models", timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise OpenAIPeerError(f"GET {client.base_url}/v1/models: {exc!r}") from None
    if response.status_code != 200:
        raise OpenAIPeerError(f"GET /v1/models: HTTP {response.status_code}: {response.text[:300]}")
    models = response.json().get("data") or []
    return models[0]["id"] if models else None


async def run_workload_async(
    base_url: str,
    config: BenchConfig,
    prompt_ids: list[list[int]],
    run_tag: str,
    *,
    api_key: str | None = None,
) -> BenchReport:
    """Send `config`'s requests on its arrival schedule; its report, as the load generator's."""
    if config.arrival == "closed":
        raise ValueError("the OpenAI peer runs open-loop arrivals only")
    results: list[RequestResult] = []
    async with http_client(base_url, api_key) as client:
        model = await served_model(client)
        start = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - start

        async def one(index: int) -> None:
            result = RequestResult(index=index, send_s=now())
            results.append(result)
            counter = EventCounter(result, len(prompt_ids[index]))
            body = completions_body(prompt_ids[index], config, index, model)
            try:
                await stream_completion(client, body, counter, now)
            except (OpenAIPeerError, httpx.HTTPError, ValueError) as exc:
                print(f"  {base_url} request {index}: {exc}", file=sys.stderr)
                result.error_code = "INTERNAL"
                result.end_s = now()
            except asyncio.CancelledError:
                result.unfinished = True
                raise

        return await run_open_loop(config, run_tag, results, one, now)


def run_workload(
    base_url: str,
    config: BenchConfig,
    prompt_ids: list[list[int]],
    run_tag: str,
    *,
    api_key: str | None = None,
    warm_up: bool = True,
) -> BenchReport:
    """Warm the server up (two short requests, not measured), then run the workload."""
    if warm_up:
        # Reversed, so no measured request finds the warm-up's prompt in a prefix cache.
        short = BenchConfig(num_requests=2, max_new_tokens=4, ignore_eos=True)
        warm_ids = [prompt_ids[0][::-1]] * 2
        asyncio.run(run_workload_async(base_url, short, warm_ids, "warm-up", api_key=api_key))
    return asyncio.run(run_workload_async(base_url, config, prompt_ids, run_tag, api_key=api_key))
