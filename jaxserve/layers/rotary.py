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
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, rope, head_dim)
    elif rope.rope_type == "linear":
        inv_freq = (inv_freq / np.float32(rope.factor)).astype(np.float32)
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


def _yarn_scale(inv_freq: np.ndarray, rope: RopeConfig, head_dim: int) -> np.ndarray:
    # Dimensions that rotate more than beta_fast times over the original context keep their frequency,
    # those under beta_slow are divided by factor, a linear ramp between (transformers' yarn).
    old_len = rope.original_max_position_embeddings
    assert old_len is not None, "yarn needs original_max_position_embeddings"

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the extrapolated (unscaled) frequency's share
    return (inv_freq / np.float32(rope.factor) * (1 - keep) + inv_freq * keep).astype(np.float32)


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
            cos, sin = mrope_cos_sin(positions, inv_freq, self.rope.mrope_section)
        else:
            cos, sin = rope_cos_sin(positions, inv_freq)
        if self.rope.attention_factor != 1.0:  # yarn scales the rotated q and k, hence the scores
            cos, sin = cos * self.rope.attention_factor, sin * self.rope.attention_factor
        return cos, sin
