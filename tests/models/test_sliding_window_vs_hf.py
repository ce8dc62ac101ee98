"""Mistral with its sliding window (``sliding_window`` in config.json) against transformers, on a
context several windows long, fed in chunks that end mid-block, then decoded greedily."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from jaxserve.models import load_model
from tests.models.paged_sequence import PagedSequence, prompt
from tests.models.test_model_vs_hf import hf_greedy, hf_logits
from tests.tiny_models import build_tiny_checkpoint

WINDOW = 6  # not a multiple of the test block size (4): windows start mid-block


def test_mistral_window_matches_transformers(tmp_path):
    folder = str(build_tiny_checkpoint(tmp_path / "mistral", "MistralForCausalLM", seed=3,
                                       sliding_window=WINDOW))
    model = load_model(folder)
    assert model.config.sliding_window == WINDOW
    ids = prompt(41, seed=11)
    theirs = hf_logits(folder, ids)
    seq = PagedSequence(model)
    parts = [seq.feed(ids[:18]), seq.feed(ids[18:])]  # the second chunk starts mid-block
    np.testing.assert_allclose(np.concatenate(parts), theirs, atol=1e-4, rtol=0)
    # The window matters here: transformers without it gives other logits.
    full_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, sliding_window=None).eval()
    with torch.no_grad():
        full = full_model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(full[-1] - theirs[-1]).max() > 1e-3
    # Decoding on, one token a step, the window sliding over blocks.
    ours, logits = [], parts[-1]
    for _ in range(12):
        ours.append(int(logits[-1].argmax()))
        logits = seq.feed([ours[-1]])
    assert ours == hf_greedy(folder, ids, 12)
