"""Model definitions and the Hugging Face checkpoint loader."""

from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.loader import load_model
from jaxserve.models.registry import SUPPORTED_ARCHITECTURES

__all__ = ["ModelConfig", "LlamaForCausalLM", "load_model", "SUPPORTED_ARCHITECTURES"]
