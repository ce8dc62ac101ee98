"""Session fixtures shared by the whole suite: tiny HF checkpoints and the demo model.

Nothing at module level imports jax (the core tests run without it): the builders are imported
inside the fixtures that need them. Shared shapes live in ``tests/shapes.py``.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAXSERVE_HASH_SEED", "0")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """One random tiny checkpoint folder per supported architecture."""
    from tests.tiny_models import build_tiny_checkpoints

    return build_tiny_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def qwen3_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["Qwen3ForCausalLM"]


@pytest.fixture(scope="session")
def demo_model() -> str:
    from jaxserve.models.demo import demo_model_path

    return str(demo_model_path())


@pytest.fixture(scope="session")
def installed_wheel(tmp_path_factory):
    """This checkout built as a wheel and installed into a venv of its own (``tests/wheel_install.py``)."""
    from tests.wheel_install import install_wheel

    return install_wheel(tmp_path_factory.mktemp("wheel"))
