"""Rotary position embeddings (the "rotate half" layout that Hugging Face checkpoints use)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.layers.mrope_rotary import mrope_cos_sin
from jaxserve.layers.rope_config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies in float32, with Llama 3's wavelength-dependent scaling when asked."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape ``[T, head_dim]`` (each frequency repeated for both halves)."""
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` of shape ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class RotaryEmbedding(nnx.Module):
    """cos/sin tables for a step's positions. No parameters: the inverse frequencies are computed
    from the config at trace time, so they enter the compiled step as a constant."""

    def __init__(self, rope: RopeConfig, head_dim: int):
        self.rope = rope
        self.head_dim = head_dim

    def __call__(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``positions [T]``, or ``[3, T]`` (t, h, w) for an M-RoPE model."""
        inv_freq = jnp.asarray(rope_inv_freq(self.rope, self.head_dim))
        if positions.ndim == 2:
            if not self.rope.mrope_section:
                raise ValueError("positions [3, T] need a rope config with mrope_section")
            return mrope_cos_sin(positions, inv_freq, self.rope.mrope_section)
        return rope_cos_sin(positions, inv_freq)
