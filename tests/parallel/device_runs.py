"""A multi-device check's cases in a fresh process with fake CPU devices: jax fixes the device
count when it starts, so each such module runs itself under ``python -m`` with its own count and
writes its results as JSON, which the test reads back.

The child inherits the environment, so its engines use the suite's persistent compilation cache
(``JAXSERVE_CACHE_DIR`` or the default folder): a program another case or an earlier run compiled
is read back. The runners count compiles after warm-up whether or not the cache served them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_module(module: str, out: Path, devices: int, timeout: float, *args: str) -> Any:
    """``python -m module OUT args...`` with ``devices`` CPU devices; the JSON it wrote to ``out``."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", module, str(out), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{module.rsplit('.', 1)[-1]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())
