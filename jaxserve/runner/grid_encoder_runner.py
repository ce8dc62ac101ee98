"""The image side of a model whose encoder takes each image's own patch grid (Qwen2.5-VL).

A step's images are packed (patches one image after another; a pack needs no larger bucket than
its largest image alone) and padded to a patch-count bucket; what their grids fix (window order,
rotary angles, window and image ids, merged-token order) is computed on the host and passed as
data (:func:`.pack_plan`), so there is one program per bucket, all compiled ahead of time at
warm-up, and an image of a new grid never compiles. The buckets are
16, 32, 64, ... merged tokens up to the encoder budget (an image above it is refused by the
processor, and the scheduler encodes at most the budget a step). The outputs are held and
gathered by content hash as :class:`.EncoderRunner` does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.qwen2_5_vl_vision import Qwen25VisionTower, pack_arrays, pack_plan
from jaxserve.runner.encoder_runner import EncoderRunner

SMALLEST_BUCKET_TOKENS = 16


def token_buckets(max_tokens: int) -> list[int]:
    """Merged-token buckets: 16, 32, ... below ``max_tokens``, then ``max_tokens``."""
    out, b = [], SMALLEST_BUCKET_TOKENS
    while b < max_tokens:
        out.append(b)
        b *= 2
    return [*out, max_tokens]


class GridEncoderRunner(EncoderRunner):
    def __init__(self, encoder: Qwen25VisionTower, max_tokens: int):
        cfg = encoder.cfg
        self.cfg = cfg
        self.merge_size = cfg.spatial_merge_size  # M-RoPE positions read it (model_runner)
        self.unit = cfg.spatial_merge_size ** 2
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.graphdef, self.state = nnx.split(encoder)
        self.buckets = token_buckets(max_tokens)
        graphdef = self.graphdef

        def run(state: Any, px: jax.Array, *plan: jax.Array) -> jax.Array:
            tower = nnx.merge(graphdef, state)
            assert isinstance(tower, Qwen25VisionTower)
            return tower.packed(px, *plan)

        self._jitted = jax.jit(run)
        self._compiled: dict[int, Any] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.num_images_encoded = 0
        self.num_calls = 0  # packs run: fewer than the images when small ones share a call
        self.encoder_seconds = 0.0

    def warm_up(self) -> None:
        """Compile every bucket's program now (the encoder budget bounds the largest)."""
        for tokens in self.buckets:
            if tokens not in self._compiled:
                plan = pack_plan([], tokens * self.unit, self.cfg)
                specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in pack_arrays(plan)]
                px = jax.ShapeDtypeStruct((tokens * self.unit, self.patch_dim), jnp.float32)
                self._compiled[tokens] = self._jitted.lower(self.state, px, *specs).compile()

    def _bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def _packs(self, todo: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
        """Images in order, cut into packs that need no larger bucket than their largest image
        alone: attention is dense over the bucket, so a pack only fills padding that image's call
        would compute anyway (small images share a call; large ones run one a call)."""
        packs: list[list[tuple[str, Any]]] = []
        used = largest = 0
        for item in todo:
            _, (_, gh, gw) = item[1]
            n = gh * gw // self.unit
            grown = self._bucket(used + n)
            if not packs or grown is None or grown > (self._bucket(max(largest, n)) or 0):
                packs.append([])
                used = largest = 0
            packs[-1].append(item)
            used, largest = used + n, max(largest, n)
        return packs

    def encode(self, items: Sequence[tuple[str, Any]]) -> None:
        """Encode ``(hash, (patches, (t, grid_h, grid_w)))`` pairs not held yet, packed per bucket."""
        start = time.perf_counter()
        todo = [(h, data) for h, data in dict(items).items() if h not in self.outputs]
        for pack in self._packs(todo):
            grids = [(gh, gw) for _, (_, (_, gh, gw)) in pack]
            need = sum(gh * gw for gh, gw in grids) // self.unit
            bucket = self._bucket(need)
            if bucket is None or bucket not in self._compiled:
                raise RuntimeError(f"no encoder program compiled at warm-up for {need} image tokens "
                                   f"(buckets {self.buckets})")
            plan = pack_plan(grids, bucket * self.unit, self.cfg)
            px = np.zeros((bucket * self.unit, self.patch_dim), np.float32)
            row = 0
            for _, (patches, _) in pack:
                px[row:row + len(patches)] = patches
                row += len(patches)
            out = np.asarray(self._compiled[bucket](self.state, px, *pack_arrays(plan)))  # numpy in: no staging compile
            row = 0
            for (h, _), n in zip(pack, plan.num_tokens):
                self.outputs[h] = out[row:row + n].copy()  # not a view holding the pack
                row += n
            self.num_images_encoded += len(pack)
            self.num_calls += 1
        self.encoder_seconds += time.perf_counter() - start
