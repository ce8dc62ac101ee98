"""The image side of a model whose encoder takes an image's own patch grid (Qwen2.5-VL): each
image is encoded alone by a program compiled once per ``(grid_h, grid_w)`` and kept, so a grid
seen before never compiles again (a new grid compiles once: images are not padded to buckets).
The outputs are held and gathered by content hash as :class:`.EncoderRunner` does."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.runner.encoder_runner import EncoderRunner


class GridEncoderRunner(EncoderRunner):
    def __init__(self, encoder: nnx.Module, merge_size: int):
        self.graphdef, self.state = nnx.split(encoder)
        self.merge_size = merge_size
        self.buckets = []
        self._compiled: dict[Any, Any] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.num_images_encoded = 0
        self.encoder_seconds = 0.0

    def warm_up(self) -> None:
        """Nothing to compile ahead: a grid's program is compiled when its first image comes."""

    def _program(self, grid_h: int, grid_w: int) -> Any:
        if (grid_h, grid_w) not in self._compiled:
            graphdef = self.graphdef
            self._compiled[grid_h, grid_w] = jax.jit(lambda state, px: nnx.merge(graphdef, state)(px, grid_h, grid_w))
        return self._compiled[grid_h, grid_w]

    def encode(self, items: Sequence[tuple[str, Any]]) -> None:
        """Encode ``(hash, (patches, (t, grid_h, grid_w)))`` pairs not held yet, one image a call."""
        start = time.perf_counter()
        for h, (patches, (_, gh, gw)) in dict(items).items():
            if h in self.outputs:
                continue
            self.outputs[h] = np.asarray(self._program(gh, gw)(self.state, jnp.asarray(patches)))
            self.num_images_encoded += 1
        self.encoder_seconds += time.perf_counter() - start
