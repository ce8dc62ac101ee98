"""``make -n`` as a user at a shell runs it, also when the suite itself runs under ``make test``:
the outer make's variables would turn the inner one into a sub-make that prints
"Entering/Leaving directory" lines around the commands."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTER_MAKE_VARIABLES = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")


def make_dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in OUTER_MAKE_VARIABLES}
    return subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
