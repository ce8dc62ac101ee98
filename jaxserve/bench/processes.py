"""Child processes the benchmarks start (servers), stopped the same way everywhere."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Terminate ``proc``; kill it if it has not exited after ``grace_s`` seconds (a server
    finishing its requests gets that long)."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
