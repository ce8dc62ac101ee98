"""The model runner's image side: a compiled encoder per image-count bucket, the encoder outputs
kept by content hash, and the per-step rows that replace image placeholder embeddings.

Compiled ahead of time at warm-up (``jit(...).lower(...).compile()``) for 1, 2, 4, ... images up
to ``max_images_per_batch``; a batch is padded to its bucket with zero images, so serving never
compiles. Outputs are kept on the host (``[tokens_per_image, hidden]`` each) until the scheduler's
``free_encoder_mm_hashes`` names them: a prefill chunk may end inside an image and the next chunk
reads the rest, and a preempted request reuses them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.core.multimodal import MultiModalFeatureSpec


def image_buckets(max_images: int) -> list[int]:
    out, b = [], 1
    while b < max_images:
        out.append(b)
        b *= 2
    return [*out, max_images]


class EncoderRunner:
    def __init__(self, encoder: nnx.Module, image_shape: tuple[int, ...], max_images_per_batch: int = 4):
        self.graphdef, self.state = nnx.split(encoder)
        self.image_shape = tuple(image_shape)
        self.buckets = image_buckets(max_images_per_batch)
        self._jitted = jax.jit(lambda state, px: nnx.merge(self.graphdef, state)(px))
        self._compiled: dict[int, object] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.num_images_encoded = 0
        self.encoder_seconds = 0.0

    def warm_up(self) -> None:
        for b in self.buckets:
            if b not in self._compiled:
                spec = jax.ShapeDtypeStruct((b, *self.image_shape), jnp.float32)
                self._compiled[b] = self._jitted.lower(self.state, spec).compile()

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def encode(self, items: Sequence[tuple[str, np.ndarray]]) -> None:
        """Encode ``(hash, pixel_values)`` pairs not held yet, in bucket-sized batches."""
        import time

        todo = [(h, px) for h, px in dict(items).items() if h not in self.outputs]
        start = time.perf_counter()
        top = self.buckets[-1]
        for lo in range(0, len(todo), top):
            batch = todo[lo:lo + top]
            bucket = next(b for b in self.buckets if b >= len(batch))
            if bucket not in self._compiled:
                raise RuntimeError(f"encoder bucket {bucket} was not compiled at warm-up")
            px = np.zeros((bucket, *self.image_shape), np.float32)
            for i, (_, p) in enumerate(batch):
                px[i] = p
            # numpy in: a jnp.asarray here would compile a staging program per new shape
            out = np.asarray(self._compiled[bucket](self.state, px))  # type: ignore[operator]
            for i, (h, _) in enumerate(batch):
                self.outputs[h] = out[i]
            self.num_images_encoded += len(batch)
        self.encoder_seconds += time.perf_counter() - start

    def free(self, hashes: Sequence[str]) -> None:
        for h in hashes:
            self.outputs.pop(h, None)

    def gather(self, requests: Sequence[tuple[Sequence[MultiModalFeatureSpec], int, int]], num_rows: int,
               hidden: int) -> tuple[np.ndarray, np.ndarray]:
        """The step's ``(embeds [num_rows, hidden], mask [num_rows])``: for each request's tokens
        ``[start, start + count)``, laid out one request after another, the rows that fall in an
        image's placeholders take that image's output rows."""
        embeds = np.zeros((num_rows, hidden), np.float32)
        mask = np.zeros((num_rows,), np.bool_)
        row = 0
        for features, start, count in requests:
            end = start + count
            for f in features:
                lo, hi = max(start, f.placeholder.offset), min(end, f.placeholder.end)
                if lo >= hi:
                    continue
                out = self.outputs[f.identifier]
                embeds[row + lo - start: row + hi - start] = out[lo - f.placeholder.offset: hi - f.placeholder.offset]
                mask[row + lo - start: row + hi - start] = True
            row += count
        return embeds, mask
