"""How the rotary frequencies are built: plain data, without jax, so that reading a model's
``config.json`` (``ModelConfig``) imports no jax."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """How the rotary frequencies are built; ``llama3`` adds Llama 3's wavelength-dependent scaling."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default", "llama3", or "linear" (every frequency divided by factor)
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
