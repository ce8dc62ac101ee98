"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): three position ids per token, (temporal, height, width).

A text token's three ids are equal and count up by one. An image's tokens (after the patch merger:
``t x h/m x w/m`` of them) take ``start + (t index, row, column)``; the text after it resumes at
``start + max(h/m, w/m)``, so an image advances the positions by its longer side, not its token
count. Decoded tokens continue from the prompt's largest id: position ``i + delta``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def mrope_positions(num_tokens: int, images: Sequence[tuple[int, tuple[int, int, int]]],
                    merge_size: int) -> tuple[np.ndarray, int]:
    """``images``: ``(offset of its first placeholder, (t, h, w) patch grid)`` in prompt order.

    Returns ``(positions [3, num_tokens] int32, delta)`` where a later token ``i`` (decoded) has all
    three ids ``i + delta``."""
    pos = np.zeros((3, num_tokens), np.int64)
    cur, tok = 0, 0
    for offset, (t, h, w) in images:
        n_text = offset - tok
        pos[:, tok:offset] = cur + np.arange(n_text)
        cur += n_text
        lh, lw = h // merge_size, w // merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        n = t * lh * lw
        pos[:, offset:offset + n] = cur + np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
        cur += max(lh, lw)
        tok = offset + n
    pos[:, tok:] = cur + np.arange(num_tokens - tok)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos.astype(np.int32), delta
