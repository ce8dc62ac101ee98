"""What to load and how: the checkpoint, its tokenizer, where it comes from, its dtype and length
(vLLM's ``ModelConfig`` and ``LoadConfig`` in one; ``ModelConfig`` here is the checkpoint's
architecture, ``jaxserve.models.config``)."""

from __future__ import annotations

import dataclasses

from jaxserve.config.base import SubConfig
from jaxserve.models.config import QUANTIZATION_METHODS


@dataclasses.dataclass
class LoadConfig(SubConfig):
    model: str | None = None
    """HF checkpoint folder or hub id (Qwen/Qwen3-0.6B); None = the built-in demo model."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to the model's."""
    revision: str | None = None
    """Hub revision of the model (branch, tag or commit); default: main."""
    download_dir: str | None = None
    """Hub cache folder to download into and read from; default: HF_HUB_CACHE (~/.cache/huggingface/hub)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (the checkpoint's), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; defaults to the model's max_position_embeddings."""
    seed: int = 0
    """Seed of the engine's RNG (draws seeds for unseeded requests)."""
    quantization: str | None = None
    """Quantize the decoder layers' weights as they load (vLLM's flag): int8 (per output channel;
    on a CPU the activations are quantized per token for XLA's int8 dot) or fp8 (e4m3, per output
    channel); or gguf, for a .gguf file: keep its Q8_0/Q4_0/Q4_1 projections in their blocks as
    stored (and a tied embedding in a block format), dequantized inside the matmul. int8 and fp8
    leave the embedding and the LM head in dtype; or compressed-tensors, for a pre-quantized
    checkpoint (int8/fp8 weights with their scales, loaded as stored; detected from its
    config.json's quantization_config without the flag). Default: none (a .gguf file is
    dequantized at load)."""

    def validate(self) -> None:
        # The one check of max_model_len >= 2 on the engine's path (the core's classes keep their own).
        if self.max_model_len is not None and self.max_model_len < 2:
            raise self.bad("max_model_len", "must be >= 2")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise self.bad("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)}")
        if self.dtype != "auto":
            from jaxserve.models.config import normalize_dtype_name

            self.dtype = normalize_dtype_name(self.dtype)
