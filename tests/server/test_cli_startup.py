"""The ``jaxserve`` command on first contact: one-line errors with exit code 2, the port checked
before anything loads, ``--help`` without jax, help text on every bench flag, a quiet start-up
and ``/v1/models`` naming the real source."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.server_testing import start_server, stop_server

# Runs the command in-process and reports which heavy modules it imported, on stdout's last line.
RUN_MAIN = """
import json, sys
from jaxserve_server.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help
    rc = exc.code
heavy = ("jax", "jaxlib", "flax", "transformers", "torch", "fastapi", "uvicorn")
print(json.dumps({"rc": rc, "imported": [m for m in heavy if m in sys.modules]}))
sys.exit(rc)
"""


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> tuple[int, str, dict]:
    """``jaxserve ARGS`` in a fresh interpreter: exit code, stderr, and the report of RUN_MAIN."""
    out = subprocess.run([sys.executable, "-c", RUN_MAIN, *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == out.returncode
    return out.returncode, out.stderr, report


@pytest.fixture
def listening_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def broken_checkpoints(tmp_path, demo_model) -> dict[str, Path]:
    pickled = Path(shutil.copytree(demo_model, tmp_path / "pickled"))
    for weights in pickled.glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    unknown = Path(shutil.copytree(demo_model, tmp_path / "gpt2"))
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    (tmp_path / "empty").mkdir()
    return {"pickled": pickled, "unknown": unknown, "empty": tmp_path / "empty"}


CASES = {
    "missing folder": (lambda c: ["/no/such/folder"], "model: no such folder: /no/such/folder"),
    "no config.json": (lambda c: [str(c["empty"])], "no config.json in"),
    "pickle-only": (lambda c: [str(c["pickled"])], "holds only pickle files (model.bin)"),
    "max-model-len 0": (lambda c: ["--max-model-len", "0"], "max_model_len: must be >= 2, got 0"),
    "unknown architecture": (lambda c: [str(c["unknown"])], "unsupported model architecture ['GPT2LMHeadModel']"),
    "hub id not cached, offline": (lambda c: ["nobody/nothing"], "nobody/nothing is not in the hub cache"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_code_2(case, broken_checkpoints, tmp_path):
    args, message = CASES[case]
    rc, stderr, _ = run_cli(["serve", *args(broken_checkpoints), "--port", "0"],
                            env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert rc == 2, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("jaxserve: error: "), stderr
    assert message in stderr


def test_busy_port_fails_before_anything_loads(listening_port):
    rc, stderr, report = run_cli(["serve", "--port", str(listening_port)])
    assert rc == 2 and stderr == (f"jaxserve: error: --host/--port: cannot listen on 127.0.0.1:{listening_port}: "
                                  "the port is in use\n")
    assert report["imported"] == []  # not even jax: no weights, no compile before the check


@pytest.mark.parametrize("how", [["--debug"], "JAXSERVE_LOG_LEVEL=debug"], ids=["flag", "env"])
def test_debug_shows_the_traceback(how):
    flags, env = (how, {}) if isinstance(how, list) else ([], dict([how.split("=")]))
    rc, stderr, _ = run_cli(["serve", "/no/such/folder", *flags], env=env)
    assert rc == 2
    assert "Traceback (most recent call last)" in stderr and "ConfigError" in stderr
    assert stderr.splitlines()[-1] == "jaxserve: error: model: no such folder: /no/such/folder"


@pytest.mark.parametrize("args", [["--help"], ["serve", "--help"], ["bench", "startup", "--help"]],
                         ids=["jaxserve", "serve", "bench-startup"])
def test_help_imports_neither_jax_nor_the_web_stack(args):
    rc, _, report = run_cli(args)
    assert rc == 0 and report["imported"] == []


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def test_every_bench_flag_has_help_text():
    from jaxserve_server.cli import build_parser

    bench = _subcommands(build_parser())["bench"]
    commands = _subcommands(bench)
    assert {"throughput", "startup", "scheduler", "serve"} <= set(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            assert action.help and action.help.strip(), (name, action.option_strings or action.dest)


def test_quiet_startup_and_the_models_card(tmp_path, demo_model):
    handle = start_server(["--served-model-name", "my-demo"], tmp_path / "server.log")
    try:
        card = httpx.get(f"{handle.url}/models", timeout=30).json()["data"][0]
    finally:
        stop_server(handle)
    assert (card["id"], card["root"]) == ("my-demo", str(Path(demo_model).resolve()))
    log = handle.log_tail(1_000_000)
    assert "Unable to initialize backend" not in log, log
    lines = log.splitlines()
    for summary in ("INFO jaxserve: step variants:", "INFO jaxserve: engine ready in", "jaxserve: serving"):
        assert sum(line.startswith(summary) for line in lines) == 1, (summary, log)
    assert "nanobind" not in log and "leaked" not in log and "Traceback" not in log, log
