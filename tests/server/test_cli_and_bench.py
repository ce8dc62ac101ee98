"""The README's curl example, ``jaxserve bench serve`` against the fixture server, CLI flags."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from jaxserve.bench.serve_bench import prefix_repetition_dataset, random_dataset
from jaxserve_server.serve import load_chat_template

# Pasted verbatim into the README; the test only swaps in the fixture server's port.
README_CURL = """curl http://127.0.0.1:8000/v1/completions \\
  -H "Content-Type: application/json" \\
  -d '{"model": "jaxserve-demo", "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0}'"""

README_CURL_CHAT = """curl http://127.0.0.1:8000/v1/chat/completions \\
  -H "Content-Type: application/json" \\
  -d '{"model": "jaxserve-demo", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16}'"""


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("command", [README_CURL, README_CURL_CHAT], ids=["completions", "chat"])
def test_readme_curl_example(server, command):
    port = server.base.rsplit(":", 1)[1]
    cmd = command.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", cmd + " --silent --show-error --max-time 60"], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["model"] == "jaxserve-demo"
    assert body["usage"]["completion_tokens"] <= 16
    choice = body["choices"][0]
    assert isinstance(choice.get("text", choice.get("message", {}).get("content")), str)


def test_bench_serve_against_the_server(server):
    cmd = [sys.executable, "-m", "jaxserve_server.cli", "bench", "serve", "--base-url", server.url,
           "--num-prompts", "20", "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.5",
           "--request-rate", "50", "--max-concurrency", "8", "--seed", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["completed"] == 20 and result["failed"] == 0
    assert result["model"] == "jaxserve-demo"
    assert result["total_output_tokens"] == sum(r.output_len for r in random_dataset(20, 32, 8, 0.5, (10, 1000), 1))
    assert result["duration_s"] > 0 and result["request_throughput"] > 0
    assert result["output_throughput"] > 0 and result["total_token_throughput"] > result["output_throughput"]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        mean, median, p99 = (result[f"{k}_{metric}_ms"] for k in ("mean", "median", "p99"))
        assert 0 < median <= p99 and mean > 0 and math.isfinite(p99), (metric, result)
    assert result["mean_ttft_ms"] <= result["mean_e2el_ms"]


def test_bench_serve_prefix_repetition(server):
    import asyncio

    from jaxserve.bench.serve_bench import run_serve_bench

    requests = prefix_repetition_dataset(12, 48, 8, 2, 4, (10, 1000), seed=0)
    result = asyncio.run(run_serve_bench(base_url=server.base, requests=requests, request_rate=math.inf))
    assert result["completed"] == 12 and result["total_output_tokens"] == 48
    assert result["total_input_tokens"] == 12 * 56


def test_datasets_are_seeded():
    a = random_dataset(10, 16, 4, 0.25, (10, 100), seed=3)
    b = random_dataset(10, 16, 4, 0.25, (10, 100), seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert all(12 <= len(r.prompt) <= 20 and 3 <= r.output_len <= 5 for r in a)
    assert all(10 <= t < 100 for r in a for t in r.prompt)
    reqs = prefix_repetition_dataset(9, 8, 3, 3, 5, (10, 100), seed=0)
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 3 and all(len(r.prompt) == 11 for r in reqs)


def test_serve_flags_parse():
    from jaxserve_server.cli import build_parser

    args = build_parser().parse_args([
        "serve", "/some/model", "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "m",
        "--api-key", "k", "--chat-template", "{{ x }}", "--uvicorn-log-level", "debug", "--max-waiting", "7",
        "--max-request-body-bytes", "1234", "--max-model-len", "128"])
    assert (args.model, args.host, args.port, args.served_model_name, args.api_key) == ("/some/model", "0.0.0.0",
                                                                                       9000, "m", "k")
    assert (args.max_waiting, args.max_request_body_bytes, args.uvicorn_log_level) == (7, 1234, "debug")
    assert args.max_model_len == 128
    defaults = build_parser().parse_args(["serve"])
    assert (defaults.host, defaults.port, defaults.model) == ("127.0.0.1", 8000, None)


def test_chat_template_flag(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith("{% for")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError):
        load_chat_template("/no/such/template.jinja")


def test_bench_serve_reports_an_unreachable_server():
    import socket

    from jaxserve.bench.serve_bench import run_serve_bench_cli
    from jaxserve_server.cli import build_parser

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = build_parser().parse_args(["bench", "serve", "--port", str(port), "--num-prompts", "2"])
    with pytest.raises(SystemExit, match="cannot reach"):
        run_serve_bench_cli(args)
