"""Speculative decoding's proposers and configuration (vLLM's ``v1/spec_decode``). Pure Python and
numpy: drafts are proposed on the host from the tokens the scheduler already holds."""

from jaxserve.spec_decode.config import SpeculativeConfig
from jaxserve.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer", "SpeculativeConfig"]
