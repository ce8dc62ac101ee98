"""How the rotary frequencies are built: plain data, without jax, so that reading a model's
``config.json`` (``ModelConfig``) imports no jax."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How the rotary frequencies are built; ``llama3`` adds Llama 3's wavelength-dependent scaling."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): the frequency runs driven by the (t, h, w) position axes; empty: plain.
    mrope_section: tuple[int, ...] = ()
