"""Shared fixtures: tiny HF checkpoints built once per test session (needs torch)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAXSERVE_HASH_SEED", "0")

from tests.tiny_models import build_tiny_checkpoints  # noqa: E402


def pytest_sessionstart(session):
    """Without a GPU, Triton can only interpret, and it fixes its mode at its first import. The
    CUDA-lowering tests import it indirectly (through Pallas), so whichever test ran first would
    decide; importing the interpreted kernels now makes any subset of the suite behave alike."""
    import jax

    from pallas_kernels import triton_attention

    if jax.default_backend() == "cpu" and triton_attention.triton_interpret_available()[0]:
        triton_attention._interpreted_kernels()


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """One random tiny checkpoint folder per supported architecture."""
    return build_tiny_checkpoints(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def qwen3_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["Qwen3ForCausalLM"]


@pytest.fixture(scope="session")
def demo_model() -> str:
    from jaxserve.models.demo import demo_model_path

    return str(demo_model_path())
