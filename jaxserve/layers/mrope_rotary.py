"""Multimodal rotary tables (M-RoPE, Qwen2-VL / Qwen2.5-VL's language model).

Each token has three positions (temporal, height, width; equal for text). The rotary frequencies
are split into ``mrope_section`` runs; run ``i`` is driven by position axis ``i % 3``. The tables
then rotate the two halves of the head as the plain rotary does (:func:`.rotary.apply_rope`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def mrope_cos_sin(positions: jax.Array, inv_freq: jax.Array,
                  mrope_section: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """``positions [3, T]``, ``inv_freq [head_dim / 2]`` -> ``(cos, sin)``, each ``[T, head_dim]``."""
    if sum(mrope_section) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {list(mrope_section)} must sum to head_dim / 2 = {inv_freq.shape[0]}")
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [3, T, head_dim / 2]
    parts, start = [], 0
    for i, size in enumerate(mrope_section):
        parts.append(freqs[i % 3, :, start:start + size])
        start += size
    angles = jnp.concatenate(parts, axis=-1)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)
