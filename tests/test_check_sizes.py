"""``scripts/check_sizes.py`` (run by ``make lint``): a tracked file over the limit fails lint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_sizes.py"


def check(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True)


def test_a_tracked_file_over_the_limit_fails_and_is_named(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "small.py").write_text("x = 1\n")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 3 * 1024)
    (tmp_path / "untracked.bin").write_bytes(b"\0" * 8 * 1024)  # not tracked: not this check's business
    subprocess.run(["git", "-C", str(tmp_path), "add", "small.py", "weights.bin"], check=True)
    assert check(tmp_path, "--max-kib", "4").returncode == 0
    failed = check(tmp_path, "--max-kib", "2")
    assert failed.returncode == 1 and "weights.bin: 3 KiB" in failed.stdout and "untracked" not in failed.stdout


def test_this_checkout_passes():
    assert check(SCRIPT.parents[1]).returncode == 0
