"""The tiny test checkpoints: their architectures and a builder for one folder of each.

Imports jax (through ``jaxserve.models``), so the root conftest imports this module only inside
its fixtures: the core tests must run without jax.
"""

from __future__ import annotations

from pathlib import Path

from jaxserve.testing import TINY_CONFIGS, build_tiny_checkpoint

ARCHITECTURES = tuple(TINY_CONFIGS)


def build_tiny_checkpoints(root: Path) -> dict[str, str]:
    """One random-init checkpoint folder per supported architecture, under ``root``."""
    return {arch: str(build_tiny_checkpoint(root / arch, arch, seed=1)) for arch in ARCHITECTURES}
