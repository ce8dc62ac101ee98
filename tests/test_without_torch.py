"""``pip install jaxserve`` then ``jaxserve serve`` needs no torch: the runtime dependencies leave it
out, and a server started in a virtual environment where torch and triton are not installed builds
the demo model and answers.

That environment is this one's site-packages linked entry by entry into a new venv, all but torch
and its companions: for the interpreter, and for ``importlib.metadata``, they do not exist.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest

from jaxserve import envs
from tests.shapes import DEMO_MODEL, SERVER_SHAPE

REPO = Path(__file__).resolve().parents[1]
TORCH_FAMILY = ("torch", "torchgen", "functorch", "triton", "nvidia")


def test_runtime_dependencies_leave_torch_out():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]]
    assert "jax" in names and "transformers" in names  # the list is the one pip installs
    assert not [n for n in names if n.startswith(TORCH_FAMILY)], names
    assert any(dep.startswith("torch") for dep in project["optional-dependencies"]["test"])  # the tests use it


def _is_torch_family(entry: str) -> bool:
    return re.split(r"[-_.]", entry.lower(), maxsplit=1)[0] in TORCH_FAMILY


def make_venv_without_torch(root: Path) -> Path:
    """A venv whose site-packages links every entry of this one's except the torch family;
    returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    skipped = []
    for entry in ours.iterdir():
        if _is_torch_family(entry.name):
            skipped.append(entry.name)
        elif not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    assert any(s.startswith("torch") for s in skipped), skipped  # this environment has torch: it is left out
    return python


def test_serve_the_demo_model_without_torch(tmp_path):
    python = make_venv_without_torch(tmp_path / "venv")
    probe = subprocess.run([str(python), "-c", "import importlib.util, importlib.metadata as m\n"
                            "print(importlib.util.find_spec('torch'), importlib.util.find_spec('triton'))\n"
                            "print(sorted(d.metadata['Name'].lower() for d in m.distributions()))"],
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    specs, dists = probe.stdout.splitlines()
    assert specs == "None None" and "jaxserve" in dists and "torch" not in dists

    cache = tmp_path / "cache"  # the demo model is built afresh; compiled programs come from the suite's cache
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SERVER_SHAPE.items()]
    cmd = [str(python), "-m", "jaxserve_server.cli", "serve", DEMO_MODEL, *flags, "--port", "0",
           "--uvicorn-log-level", "warning", "--compilation-cache-dir", str(envs.cache_dir() / "xla")]
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        env = {k: v for k, v in os.environ.items() if k != envs.JAXSERVE_API_KEY}
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**env, envs.JAXSERVE_CACHE_DIR: str(cache), "PYTHONUNBUFFERED": "1"})
        try:
            url = _wait_for_url(proc, log_path, timeout_s=600)
            body = {"model": "jaxserve-demo", "prompt": "Hello, my name is", "max_tokens": 4, "temperature": 0,
                    "ignore_eos": True}
            resp = httpx.post(f"{url}/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 4
            card = httpx.get(f"{url}/models", timeout=30).json()["data"][0]
            assert Path(card["root"]).parent == cache / "models"  # the demo model this process built
        finally:
            proc.terminate()
            proc.wait(30)
    text = log_path.read_text(errors="replace")
    assert "demo model: built in" in text and "Traceback" not in text, text[-3000:]
    assert "PyTorch was not found" not in text, text[-3000:]  # torch is not needed: saying so is noise


def _wait_for_url(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = re.search(r"jaxserve: serving \S+ at (http://\S+/v1)", log_path.read_text(errors="replace"))
        if m:
            return m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError("the server did not start:\n" + log_path.read_text(errors="replace")[-4000:])

