"""``jaxserve bench soak``: many requests against a real server, the way clients misbehave.

It starts ``jaxserve serve`` with the given engine flags (by default a KV pool small enough that
requests are preempted), warms it up, notes the server's resident memory, then sends
``--num-requests`` requests at ``--concurrency``: completions with token-id prompts and chats,
streamed or not, a ``--disconnect-ratio`` share of them abandoned at a random moment. At the end
it waits for the server to be idle and reports errors by type, the resident memory before and
after, and the running/waiting/KV-usage gauges, which must be back at 0.

``--scenario stop-strings`` measures instead what one streaming request with many long stop
strings costs the others: the median latency of short requests alone, then while that request
streams (the server is started with stop-string limits raised to allow it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from jaxserve.bench import prom
from jaxserve.bench.processes import drain_lines, stop_process, wait_for_url

# A pool of this many KV blocks forces preemptions at the default concurrency.
DEFAULT_SOAK_BLOCKS = 64
CHAT_TEXTS = ("Tell me a story about a fox.", "What is two plus two?", "Name three colours.", "Say hello.")


def add_soak_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=["soak", "stop-strings"], default="soak",
                   help="soak: many misbehaving clients; stop-strings: others' latency beside one request with "
                        "many long stop strings (default: soak)")
    p.add_argument("--num-requests", type=int, default=1000, help="requests to send (default: 1000)")
    p.add_argument("--concurrency", type=int, default=48, help="requests in flight (default: 48)")
    p.add_argument("--disconnect-ratio", type=float, default=0.3,
                   help="share of requests the client abandons at a random moment (default: 0.3)")
    p.add_argument("--max-output-len", type=int, default=48, help="largest max_tokens of a request (default: 48)")
    p.add_argument("--max-prompt-len", type=int, default=96, help="longest token-id prompt (default: 96)")
    p.add_argument("--num-stop-strings", type=int, default=2000, help="stop-strings scenario (default: 2000)")
    p.add_argument("--stop-string-chars", type=int, default=4000, help="stop-strings scenario (default: 4000)")
    p.add_argument("--mix-seed", type=int, default=0, help="seed of the request mix (default: 0)")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds to wait for the server (default: 600)")


# ---- the server --------------------------------------------------------------------------------


class ServerProcess:
    """``jaxserve serve`` in a subprocess; ``url`` once it accepts connections."""

    def __init__(self, flags: list[str], timeout: float):
        cmd = [sys.executable, "-m", "jaxserve_server.cli", "serve", *flags, "--host", "127.0.0.1", "--port", "0",
               "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=drain_lines, args=(self.proc, self.lines), daemon=True).start()
        self.log: list[str] = []
        url = wait_for_url(self.lines, self.log, time.monotonic() + timeout)
        if url is None:
            self.stop()
            raise SystemExit("jaxserve bench soak: the server did not start:\n" + "".join(self.log[-40:]))
        self.base = url.removesuffix("/v1")

    def rss_mb(self) -> float:
        """Resident memory of the server process (Linux /proc), in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def log_problems(self) -> int:
        """Lines of the server's log so far that report an error or a traceback."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.log.append(line)
        return sum(1 for line in self.log if "Traceback" in line or line.startswith("ERROR"))

    def stop(self) -> None:
        stop_process(self.proc)


def _metrics(client, base: str) -> dict[str, float]:
    """Samples of /metrics summed over labels, plus request_success by finished_reason."""
    samples = prom.read_samples(client.get(f"{base}/metrics", timeout=30).text)
    out = collections.defaultdict(float, prom.summed(samples))
    for s in samples:
        if (s.name == "jaxserve:request_success_total" and "finished_reason" in s.labels
                and s.labels.get("engine") != "total"):
            out[f"finished:{s.labels['finished_reason']}"] += s.value
    return out


def wait_until_idle(base: str, timeout: float = 120.0) -> dict[str, float]:
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            m = _metrics(client, base)
            gauges = {k: m.get(f"jaxserve:{k}", 0.0)
                      for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
            if not any(gauges.values()) or time.monotonic() > deadline:
                return {**gauges, "metrics": m}  # type: ignore[dict-item]
            time.sleep(0.2)


# ---- one request -------------------------------------------------------------------------------


def _request(rng: random.Random, args) -> tuple[str, dict]:
    """A random request: the path and the body."""
    max_tokens = rng.randint(1, args.max_output_len)
    stream = rng.random() < 0.5
    common = {"max_tokens": max_tokens, "stream": stream, "temperature": rng.choice([0.0, 0.8]),
              "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.8:
        prompt = [rng.randrange(10, 1000) for _ in range(rng.randint(1, args.max_prompt_len))]
        return "/v1/completions", {"prompt": prompt, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": rng.choice(CHAT_TEXTS)}], **common}


async def _send(client, path: str, body: dict) -> str:
    """Send one request and read its whole answer; returns "ok" or the error's type."""
    if body["stream"]:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return f"HTTP {resp.status_code}"
            async for line in resp.aiter_lines():
                if line.startswith("data: {\"error\""):
                    return "error event: " + json.loads(line[6:])["error"].get("code", "")
        return "ok"
    resp = await client.post(path, json=body)
    return "ok" if resp.status_code == 200 else f"HTTP {resp.status_code}"


async def _one(client, rng: random.Random, args, outcomes: collections.Counter) -> None:
    path, body = _request(rng, args)
    abandon_after = rng.uniform(0.0, 0.5) if rng.random() < args.disconnect_ratio else None
    try:
        if abandon_after is None:
            outcomes[await _send(client, path, body)] += 1
        else:
            outcomes[await asyncio.wait_for(_send(client, path, body), abandon_after)] += 1
    except asyncio.TimeoutError:
        outcomes["disconnected"] += 1  # the client hung up: the server must abort and free it
    except Exception as exc:  # noqa: BLE001 - every failure is counted by type
        outcomes[f"client {type(exc).__name__}"] += 1


async def run_load(base: str, num: int, args, seed: int) -> collections.Counter:
    import httpx

    outcomes: collections.Counter = collections.Counter()
    rng = random.Random(seed)
    rngs = [random.Random(rng.random()) for _ in range(num)]
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        sem = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int) -> None:
            async with sem:
                await _one(client, rngs[i], args, outcomes)

        await asyncio.gather(*(bounded(i) for i in range(num)))
    return outcomes


# ---- the scenarios -----------------------------------------------------------------------------


def run_soak(server: ServerProcess, args) -> dict[str, Any]:
    asyncio.run(run_load(server.base, 2 * args.concurrency, args, seed=args.mix_seed + 1))  # warm-up
    wait_until_idle(server.base)
    rss_before = server.rss_mb()
    before = wait_until_idle(server.base)["metrics"]
    started = time.monotonic()
    outcomes = asyncio.run(run_load(server.base, args.num_requests, args, seed=args.mix_seed))
    seconds = time.monotonic() - started
    idle = wait_until_idle(server.base)
    after = idle.pop("metrics")
    errors = {k: v for k, v in outcomes.items() if k not in ("ok", "disconnected")}
    return {
        "num_requests": args.num_requests, "concurrency": args.concurrency,
        "disconnect_ratio": args.disconnect_ratio, "seconds": round(seconds, 1),
        "requests_per_s": round(args.num_requests / seconds, 1),
        "completed": outcomes["ok"], "disconnected": outcomes["disconnected"], "errors_by_type": errors,
        "preemptions": after.get("jaxserve:num_preemptions_total", 0) - before.get("jaxserve:num_preemptions_total", 0),
        "finished_by_reason": {k.split(":", 1)[1]: after[k] - before.get(k, 0.0)
                               for k in sorted(after) if k.startswith("finished:")},
        "rss_mib_before": round(rss_before, 1), "rss_mib_after": round(server.rss_mb(), 1),
        "after_idle": idle, "server_log_errors": server.log_problems(),
    }


async def _latencies(base: str, count: int, concurrency: int) -> list[float]:
    import httpx

    body = {"prompt": [5, 6, 7, 8], "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    times: list[float] = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                start = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                times.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(count)))
    return times


async def _with_stop_string_stream(base: str, stops: list[str], count: int,
                                   concurrency: int) -> tuple[list[float], int]:
    """Latencies of short requests while one request with ``stops`` streams; and its chunk count."""
    import httpx

    chunks = 0
    body = {"prompt": [11, 12, 13], "max_tokens": 200, "ignore_eos": True, "stream": True, "stop": stops}
    running = asyncio.Event()

    async def attacker() -> None:
        nonlocal chunks
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            while True:  # one after the other, so it streams through the whole measurement
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            chunks += 1
                            running.set()

    task = asyncio.create_task(attacker())
    await running.wait()
    try:
        times = await _latencies(base, count, concurrency)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return times, chunks


def run_stop_strings(server: ServerProcess, args) -> dict[str, Any]:
    rng = random.Random(args.mix_seed)
    stops = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.stop_string_chars))
             for _ in range(args.num_stop_strings)]
    count, concurrency = max(8, args.num_requests), min(args.concurrency, 8)
    asyncio.run(_latencies(server.base, count, concurrency))  # warm-up
    baseline = asyncio.run(_latencies(server.base, count, concurrency))
    beside, chunks = asyncio.run(_with_stop_string_stream(server.base, stops, count, concurrency))
    p50_alone, p50_beside = statistics.median(baseline), statistics.median(beside)
    return {"num_stop_strings": len(stops), "stop_string_chars": args.stop_string_chars,
            "requests_timed": count, "concurrency": concurrency,
            "p50_ms_alone": round(1000 * p50_alone, 1), "p50_ms_beside_stop_strings": round(1000 * p50_beside, 1),
            "ratio": round(p50_beside / p50_alone, 2), "stop_string_stream_chunks": chunks,
            "after_idle": {k: v for k, v in wait_until_idle(server.base).items() if k != "metrics"}}


def run_soak_cli(args: argparse.Namespace, config: Any) -> dict[str, Any]:
    """``config`` is the EngineConfig the flags describe; its non-default fields are passed on."""
    if config.num_gpu_blocks_override is None and args.scenario == "soak":
        config.num_gpu_blocks_override = DEFAULT_SOAK_BLOCKS
    flags = ([args.model] if args.model else []) + config.cli_flags(skip=("model",))
    if args.scenario == "stop-strings":
        flags += ["--max-stop-strings", str(args.num_stop_strings), "--max-stop-str-chars",
                  str(args.stop_string_chars)]
    server = ServerProcess(flags, args.start_timeout)
    try:
        result = run_soak(server, args) if args.scenario == "soak" else run_stop_strings(server, args)
    finally:
        server.stop()
    return {"scenario": args.scenario, "serve_flags": flags, **result}
