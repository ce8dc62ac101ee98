"""How the rotary frequencies are built: plain data, without jax, so that reading a model's
``config.json`` (``ModelConfig``) imports no jax."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How the rotary frequencies are built; ``llama3`` adds Llama 3's wavelength-dependent scaling,
    ``yarn`` YaRN's ramp between interpolated and extrapolated frequencies (gpt-oss)."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default", "llama3", "yarn" or "linear" (every frequency divided by factor)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn: the ramp's bounds in rotations, whether its dimension range is rounded outward, and the
    # factor cos and sin are multiplied by (1 elsewhere)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): the frequency runs driven by the (t, h, w) position axes; empty: plain.
    mrope_section: tuple[int, ...] = ()
