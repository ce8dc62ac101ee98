"""Two hosts on one machine: two ``jaxserve serve`` processes x 4 CPU devices, joined by
``jax.distributed`` on the loopback address, one model split 8 ways across both (TP=8, gloo
collectives between the processes), against one process on one device (TP=1).

Both processes run the built wheel installed into a venv of its own (``tests/wheel_install.py``),
so the test also shows that a non-editable install can run multi-host. Rank 0 serves HTTP and
schedules; rank 1 runs headless and replays its steps. The group must
give the single process's greedy tokens, and when rank 1 is killed mid-request, rank 0 must fail
that request naming the lost node and turn ``/health`` to 503 within the heartbeat limit.
Every process is killed at the end whatever happens (each also runs under a hard deadline).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from jaxserve.bench.processes import stop_process
from jaxserve.models.demo import DEMO_ARCH, DEMO_SHAPE, build_checkpoint

# One token bucket, a small pool: each process compiles a single step program.
SHAPE = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=16, num_gpu_blocks_override=80)
DEVICES_PER_HOST = 4
TENSOR_PARALLEL_SIZE = 2 * DEVICES_PER_HOST
# The demo model's shape with 8 query heads, so that 8 shards split them; its 2 key/value heads
# are replicated 4 ways.
MODEL_SHAPE = dict(DEMO_SHAPE, num_attention_heads=8, head_dim=16)
HEARTBEAT_TIMEOUT_S = 3
START_TIMEOUT_S = 240
PROMPTS = ["Hello, my name is", "The capital of France is", "JAX compiles", "one two three four five six"]
MAX_TOKENS = 12


def shape_flags() -> list[str]:
    flags = []
    for key, value in SHAPE.items():
        flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TwoHosts:
    """Rank 0 (HTTP on a free port) and rank 1 (headless), each logging to its own file."""

    def __init__(self, model: str, log_dir: Path, extra: list[str], python: str = sys.executable,
                 cwd: Path | None = None):
        port = free_port()
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_HOST}")
        env.pop("JAXSERVE_API_KEY", None)
        common = [str(python), "-m", "jaxserve_server.cli", "serve", model, *shape_flags(), "--nnodes", "2",
                  "--master-addr", "127.0.0.1", "--master-port", str(port),
                  "--node-heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S), *extra]
        self.logs = [log_dir / "rank0.log", log_dir / "rank1.log"]
        self.procs = []
        for rank, log in enumerate(self.logs):
            cmd = common + ["--node-rank", str(rank)]
            if rank == 0:
                cmd += ["--host", "127.0.0.1", "--port", "0", "--uvicorn-log-level", "warning"]
            self.procs.append(subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,
                                              cwd=cwd))
        self.base = self._wait_for_url()

    def log_text(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace")

    def tails(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{self.log_text(r)[-3000:]}" for r in range(2))

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            m = re.search(r"jaxserve: serving \S+ at (http://127\.0\.0\.1:\d+)/v1", self.log_text(0))
            if m:
                return m.group(1)
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the two hosts did not start:\n{self.tails()}")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                stop_process(proc, grace_s=10)


def completion_ids(base: str, prompt: str) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


@pytest.fixture(scope="module")
def eight_head_model(tmp_path_factory) -> str:
    return str(build_checkpoint(tmp_path_factory.mktemp("eight_heads") / "model", DEMO_ARCH, MODEL_SHAPE, seed=5))


@pytest.fixture(scope="module")
def one_process_ids(eight_head_model) -> dict[str, list[int]]:
    """Greedy tokens of one process on one device (TP=1): the reference."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(eight_head_model, **SHAPE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {out.prompt: out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)}


@pytest.fixture(scope="module")
def two_hosts(eight_head_model, tmp_path_factory, installed_wheel):
    """Served from the built wheel (not the checkout): what a multi-host deployment installs."""
    hosts = TwoHosts(eight_head_model, tmp_path_factory.mktemp("two_hosts"),
                     ["--served-model-name", "m", "--tensor-parallel-size", str(TENSOR_PARALLEL_SIZE)],
                     python=str(installed_wheel.python), cwd=installed_wheel.cwd)
    try:
        yield hosts
    finally:
        hosts.stop()


def test_two_hosts_give_the_greedy_tokens_of_one_process(two_hosts, one_process_ids):
    for prompt in PROMPTS:
        assert completion_ids(two_hosts.base, prompt) == one_process_ids[prompt], prompt
    # rank 1 really replayed the steps: it runs no server and logged no error so far
    assert two_hosts.procs[1].poll() is None, two_hosts.tails()
    assert "jaxserve: serving" not in two_hosts.log_text(1)


def test_killing_rank_1_mid_request_fails_it_and_health_turns_503(two_hosts):
    """Runs last on the group: it kills rank 1."""
    base = two_hosts.base
    body = {"model": "m", "prompt": "count on and on", "max_tokens": SHAPE["max_model_len"] - 16,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    started = None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 3:  # mid-request: rank 1 has stepped along so far
                two_hosts.procs[1].send_signal(signal.SIGKILL)
                started = time.monotonic()
    assert started is not None, events
    failed_after = time.monotonic() - started
    error = json.loads(events[-2] if events[-1] == "[DONE]" else events[-1])
    assert "error" in error, events[-3:]
    assert "node 1 of 2" in error["error"]["message"], error
    assert failed_after < HEARTBEAT_TIMEOUT_S + 5, failed_after
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 503
    assert "node 1 of 2" in health.json()["error"]["message"]
    # a new request is refused at once, with the same cause
    resp = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=10)
    assert resp.status_code == 503 and "node 1 of 2" in resp.text
    assert two_hosts.procs[0].poll() is None  # rank 0 lives on to say so
