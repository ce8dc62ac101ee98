"""Structured outputs with llguidance: grammars for one tokenizer (``backend``) and the matchers of
the requests that use them (``manager``). Imports numpy and llguidance, never jax."""
