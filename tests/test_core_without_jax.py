"""The core (scheduler, KV cache manager) needs no accelerator stack: ``pytest tests/core`` passes
in a process where jax, jaxlib, Triton and torch cannot be imported.

The block is a ``sitecustomize`` on ``PYTHONPATH`` that puts a refusing finder first on
``sys.meta_path``, so it holds before pytest, its plugins or any conftest imports anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]
BLOCKED = ("jax", "jaxlib", "triton", "torch")

SITECUSTOMIZE = f'''
import importlib.abc
import sys

class _Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError(f"{{name}} is blocked: the core must not need it")
        return None

sys.meta_path.insert(0, _Refuse())
'''


def _blocked_env(folder: Path) -> dict[str, str]:
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def test_the_blocker_refuses_jax(tmp_path):
    """Guards the test below: without this, a blocker that silently stopped working would let it
    pass whatever the core imports."""
    env = _blocked_env(tmp_path)
    for name in BLOCKED:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and f"{name} is blocked" in proc.stderr, (name, proc.stderr[-2000:])


def test_core_tests_pass_without_jax(tmp_path):
    env = _blocked_env(tmp_path)
    report = tmp_path / "core.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/core", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={report}"], env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail  # 0: collected, and every test passed or skipped
    suite = ElementTree.parse(report).getroot().find("testsuite")
    assert int(suite.get("tests")) > 0 and suite.get("failures") == suite.get("errors") == "0", tail
    # an importorskip would hide a dependency behind a skip
    reasons = [s.get("message", "") for s in suite.iter("skipped")]
    assert not any("is blocked" in r for r in reasons), reasons


def test_reading_a_model_config_and_writing_random_weights_need_no_jax(tmp_path):
    """``ModelConfig`` and the random weights (how the demo model is built, before the engine
    starts) are plain Python and numpy: they run where jax and flax cannot be imported."""
    env = _blocked_env(tmp_path)
    folder = tmp_path / "model"
    folder.mkdir()
    config = dict(architectures=["Qwen3ForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  tie_word_embeddings=True, rope_theta=10000.0, dtype="float32")
    (folder / "config.json").write_text(json.dumps(config))
    script = ("from jaxserve.models.config import ModelConfig\n"
              "from jaxserve.models.random_weights import write_random_weights\n"
              f"write_random_weights({str(folder)!r}, seed=0, std=0.05)\n"
              f"print(ModelConfig.from_pretrained({str(folder)!r}).num_hidden_layers)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["2"] and list(folder.glob("*.safetensors")), proc.stdout
