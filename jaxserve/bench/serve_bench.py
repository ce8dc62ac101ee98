"""``jaxserve bench serve``: a load generator against a running OpenAI-compatible server.

Like vLLM's ``benchmark_serving``: a seeded dataset of token-id prompts (``random`` or
``prefix-repetition``) is sent as streaming ``/v1/completions`` requests with ``ignore_eos``, so
every request produces exactly its output length; arrivals follow a Poisson process at
``--request-rate`` (``inf``: all at once), optionally capped at ``--max-concurrency`` in flight.
Per request it records time to first token (TTFT), the gaps between streamed chunks (ITL), time
per output token after the first (TPOT) and end-to-end latency; the result is a JSON-able dict.

Prompts are token ids drawn from ``--token-id-range`` (no tokenizer is needed on the client);
the default [10, 1000) is valid for any vocabulary of at least 1000 tokens, the built-in demo
model's included. Output token counts come from the server's usage report.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import time
from typing import Any

import numpy as np


@dataclasses.dataclass
class BenchRequest:
    prompt: list[int]
    output_len: int


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""


# ---- datasets --------------------------------------------------------------------------------


def _lens(mean: int, ratio: float, count: int, rng: np.random.Generator) -> np.ndarray:
    lo = max(1, int(mean * (1.0 - ratio)))
    hi = max(lo, int(mean * (1.0 + ratio)))
    return rng.integers(lo, hi + 1, count)


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   token_range: tuple[int, int], seed: int) -> list[BenchRequest]:
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lens = _lens(input_len, range_ratio, num_prompts, rng)
    out_lens = _lens(output_len, range_ratio, num_prompts, rng)
    return [BenchRequest(rng.integers(token_range[0], token_range[1], int(n)).tolist(), int(o))
            for n, o in zip(in_lens, out_lens)]


def prefix_repetition_dataset(num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int,
                              output_len: int, token_range: tuple[int, int], seed: int) -> list[BenchRequest]:
    """``num_prefixes`` shared prefixes, each followed by its own random suffix (prefix-cache load)."""
    if num_prefixes < 1:
        raise ValueError(f"prefix_repetition_num_prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(token_range[0], token_range[1], prefix_len).tolist() for _ in range(num_prefixes)]
    requests = [BenchRequest(prefixes[i % num_prefixes] + rng.integers(token_range[0], token_range[1],
                                                                      suffix_len).tolist(), output_len)
                for i in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


# ---- one request -----------------------------------------------------------------------------


async def _send(client, url: str, model: str, req: BenchRequest, headers: dict[str, str],
                temperature: float) -> RequestResult:
    result = RequestResult(prompt_len=len(req.prompt))
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "ignore_eos": True,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    result.error = str(payload["error"].get("message", payload["error"]))
                    return result
                now = time.perf_counter()
                if payload.get("choices"):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                usage = payload.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens", 0))
        result.latency = time.perf_counter() - start
        if result.output_tokens == 0:
            result.output_tokens = chunks
        result.success = chunks > 0
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---- the run ---------------------------------------------------------------------------------


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    ms = np.asarray(values, dtype=np.float64) * 1000.0 if values else np.zeros(1)
    return {f"mean_{prefix}_ms": float(ms.mean()), f"median_{prefix}_ms": float(np.median(ms)),
            f"std_{prefix}_ms": float(ms.std()), f"p99_{prefix}_ms": float(np.percentile(ms, 99))}


async def _resolve_model(client, base_url: str, headers: dict[str, str]) -> str:
    import httpx

    try:
        resp = await client.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot reach the server at {base_url}: {exc!r}") from None
    if resp.status_code != 200:
        raise ConnectionError(f"GET {base_url}/v1/models answered {resp.status_code}: {resp.text[:300]}")
    return resp.json()["data"][0]["id"]


async def run_serve_bench(*, base_url: str, requests: list[BenchRequest], model: str | None = None,
                          endpoint: str = "/v1/completions", request_rate: float = math.inf,
                          max_concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
                          temperature: float = 0.0, timeout: float = 600.0) -> dict[str, Any]:
    import httpx

    if not requests:
        raise ValueError("num_prompts must be at least 1")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    base_url = base_url.rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    arrivals = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as client:
        model = model or await _resolve_model(client, base_url, headers)
        url = f"{base_url}{endpoint}"
        gate = asyncio.Semaphore(limit)

        async def one(req: BenchRequest) -> RequestResult:
            async with gate:
                return await _send(client, url, model, req, headers, temperature)

        start = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(request_rate) and i + 1 < len(requests):
                await asyncio.sleep(arrivals.expovariate(request_rate))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out: dict[str, Any] = {
        "model": model,
        "endpoint": endpoint,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "max_concurrency": max_concurrency,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    out.update(_stats([r.ttft for r in ok], "ttft"))
    out.update(_stats(tpots, "tpot"))
    out.update(_stats([x for r in ok for x in r.itl], "itl"))
    out.update(_stats([r.latency for r in ok], "e2el"))
    errors = [r.error for r in results if not r.success]
    if errors:
        out["errors"] = errors[:5]
    return out


# ---- CLI -------------------------------------------------------------------------------------


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="server host when --base-url is not given (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="server port when --base-url is not given (default: 8000)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions"],
                   help="API route the requests go to (default: /v1/completions)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default: 100)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second, Poisson arrivals; inf sends all at once (default: inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--dataset-name", choices=["random", "prefix-repetition"], default="random",
                   help="random token prompts, or prompts sharing a few prefixes (default: random)")
    p.add_argument("--random-input-len", type=int, default=128, help="random dataset: prompt tokens (default: 128)")
    p.add_argument("--random-output-len", type=int, default=64,
                   help="random dataset: output tokens per request (default: 64)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default: 0, fixed lengths)")
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256,
                   help="prefix-repetition dataset: tokens of each shared prefix (default: 256)")
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256,
                   help="prefix-repetition dataset: tokens after the prefix, own to each request (default: 256)")
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                   help="prefix-repetition dataset: distinct prefixes (default: 10)")
    p.add_argument("--prefix-repetition-output-len", type=int, default=128,
                   help="prefix-repetition dataset: output tokens per request (default: 128)")
    p.add_argument("--token-id-range", type=int, nargs=2, default=[10, 1000], metavar=("LO", "HI"),
                   help="prompt token ids are drawn uniformly from [LO, HI) (default: 10 1000)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrival times (default: 0)")


def build_requests(args) -> list[BenchRequest]:
    if args.num_prompts < 1:
        raise ValueError(f"num_prompts must be at least 1, got {args.num_prompts}")
    lo, hi = args.token_id_range
    if not 0 <= lo < hi:
        raise ValueError(f"token_id_range must satisfy 0 <= LO < HI, got {lo} {hi}")
    if args.dataset_name == "random":
        return random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, (lo, hi), args.seed)
    return prefix_repetition_dataset(args.num_prompts, args.prefix_repetition_prefix_len,
                                     args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                     args.prefix_repetition_output_len, (lo, hi), args.seed)


def run_serve_bench_cli(args) -> dict[str, Any]:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    try:
        result = asyncio.run(run_serve_bench(
            base_url=base_url, requests=build_requests(args), model=args.model, endpoint=args.endpoint,
            request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
            api_key=args.api_key, temperature=args.temperature, timeout=args.timeout))
    except (ConnectionError, ValueError) as exc:
        raise SystemExit(f"jaxserve bench serve: {exc}") from None
    result["dataset_name"] = args.dataset_name
    return result
