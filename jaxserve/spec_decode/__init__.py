"""Speculative decoding's proposers (vLLM's ``v1/spec_decode``). Pure Python and numpy: drafts are
proposed on the host from the tokens the scheduler already holds. The configuration is
``jaxserve.config.speculative``."""

from jaxserve.spec_decode.ngram_proposer import NgramProposer

__all__ = ["NgramProposer"]
