"""Shared fixtures: tiny HF checkpoints built once per test session (needs torch)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAXSERVE_HASH_SEED", "0")

from jaxserve.testing import TINY_CONFIGS, build_tiny_checkpoint  # noqa: E402

ARCHITECTURES = tuple(TINY_CONFIGS)


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
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(build_tiny_checkpoint(root / arch, arch, seed=1)) for arch in ARCHITECTURES}


@pytest.fixture(scope="session")
def qwen3_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["Qwen3ForCausalLM"]


# One engine shape for the engine tests: every LLM built with it after the first is served by
# the persistent compilation cache.
ENGINE_ARGS = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_gpu_blocks_override=160)


@pytest.fixture(scope="session")
def demo_model() -> str:
    from jaxserve.models.demo import demo_model_path

    return str(demo_model_path())
