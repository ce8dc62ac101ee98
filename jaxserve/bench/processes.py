"""Child processes the benchmarks start (servers): started, read and stopped the same way everywhere."""

from __future__ import annotations

import queue
import re
import subprocess
import time

_URL = re.compile(r"jaxserve: serving \S+ at (http://\S+)/v1")


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Terminate ``proc``; kill it if it has not exited after ``grace_s`` seconds (a server
    finishing its requests gets that long)."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def drain_lines(proc: subprocess.Popen, lines: queue.Queue) -> None:
    """Read a child's output into ``lines`` (a reader thread's target); None marks its end."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    lines.put(None)


def wait_for_url(lines: queue.Queue, log: list[str], deadline: float) -> str | None:
    """The base URL a ``jaxserve serve`` child announces once it accepts connections, logging
    every line it printed until then; None if it ended or the deadline passed first."""
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            return None
        log.append(line)
        m = _URL.search(line)
        if m:
            return m.group(1)
