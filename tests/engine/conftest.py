"""Fixtures of the engine tests that need no compiled model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A byte-level BPE tokenizer trained on the demo corpus (no torch needed). Its small vocabulary
    leaves CJK characters and emoji split over several byte tokens."""
    from jaxserve.models.demo import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"), vocab_size=512)
