"""The README's commands work as written from the clone: every ``make`` line names a target that
runs, and every ``.venv/bin/jaxserve`` line parses with the command's own parser."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from tests.make_dry_run import make_dry_run

REPO = Path(__file__).resolve().parents[1]


def readme_commands(program: str) -> list[list[str]]:
    """The argv of each line of the README's bash blocks that runs ``program`` (comments dropped)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    lines = [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith(program + " ")]


def test_jaxserve_commands_parse():
    from jaxserve_server.cli import build_parser

    commands = readme_commands(".venv/bin/jaxserve")
    assert len(commands) >= 6, commands
    for argv in commands:
        args = build_parser().parse_args(argv[1:])  # exits (a failed test) on an unknown flag
        assert args.command in ("serve", "bench", "generate", "trace", "diagnose"), argv


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_commands_name_real_targets(tmp_path):
    commands = readme_commands("make")
    assert {"serve", "test"} <= {argv[1] for argv in commands}, commands
    for argv in commands:
        out = make_dry_run(*argv[1:], f"VENV={tmp_path / 'venv'}")
        assert out.returncode == 0, (argv, out.stderr)
        if argv[1:] == ["serve", "ARGS=--port 9000"]:
            assert out.stdout.splitlines()[-1].endswith("jaxserve serve --port 9000")
    assert ["make", "serve", "ARGS=--port 9000"] in commands


def test_the_curl_example_is_the_tested_one():
    from tests.server.test_cli_and_bench import README_CURL

    assert README_CURL in (REPO / "README.md").read_text()
