"""Shared helpers for the sampler tests: parameter objects, metadata, numpy references.

Each new (rows, vocab, logprobs, cap) combination costs a ~3 s CPU compile of `sample`, so the
tests share a few shapes: DRAWS rows for statistics and K logprobs everywhere.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.sample import SamplingMetadata, sample, sampling_arrays

DRAWS = 8000  # draws per statistical test (rows of one request at positions 0..DRAWS-1)
K = 5  # logprobs returned by default


def params(**fields) -> SamplingParams:
    """SamplingParams seeded by default, so a random row always has its seed."""
    fields.setdefault("seed", 0)
    return SamplingParams(**fields)


def metadata(params_list, vocab_size: int, num_rows: int | None = None, positions=None, **widths) -> SamplingMetadata:
    """The sampler's metadata for ``params_list`` (``vocab_size`` is the logits' width; the
    tables do not depend on it)."""
    num_rows = len(params_list) if num_rows is None else num_rows
    positions = [0] * len(params_list) if positions is None else positions
    arrays = sampling_arrays(params_list, num_rows, positions=positions, **widths)
    return SamplingMetadata.from_arrays({k: jnp.asarray(v) for k, v in arrays.items()})


@partial(jax.jit, static_argnames=("max_num_logprobs", "top_k_cap"))
def _sample_jit(logits, md, counts, prompt_mask, *, max_num_logprobs, top_k_cap):
    return sample(logits, md, counts, prompt_mask, max_num_logprobs=max_num_logprobs, top_k_cap=top_k_cap)


def run_sample(logits, md, counts=None, prompt_mask=None, *, num_logprobs: int = K, top_k_cap: int = 256):
    """Jitted `sample`; counts and prompt mask default to all-zero (no history)."""
    logits = jnp.asarray(logits)
    if counts is None:
        counts = jnp.zeros(logits.shape, jnp.int32)
    if prompt_mask is None:
        prompt_mask = jnp.zeros(logits.shape, jnp.bool_)
    return _sample_jit(
        logits, md, jnp.asarray(counts), jnp.asarray(prompt_mask), max_num_logprobs=num_logprobs, top_k_cap=top_k_cap
    )


def draw_tokens(logits_row, vocab_size: int, n: int = DRAWS, top_k_cap: int = 256, **fields) -> np.ndarray:
    """n draws for one request: n identical rows at positions 0..n-1 (one seed)."""
    md = metadata([params(**fields)] * n, vocab_size, positions=list(range(n)))
    logits = np.broadcast_to(np.asarray(logits_row, np.float32), (n, vocab_size))
    return np.asarray(run_sample(logits, md, top_k_cap=top_k_cap).sampled_token_ids)


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def np_softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(np_log_softmax(x))


def np_penalize(logits, counts, prompt_mask, presence, frequency, repetition) -> np.ndarray:
    """vLLM's apply_penalties, in float64."""
    logits = logits.astype(np.float64)
    generated = counts > 0
    rep = np.where(prompt_mask | generated, repetition[:, None], 1.0)
    logits = np.where(logits > 0, logits / rep, logits * rep)
    return logits - frequency[:, None] * counts - presence[:, None] * generated


def np_keep_mask(scaled_row: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """vLLM V1's support after min-p, top-k, then top-p on temperature-scaled logits (one row)."""
    probs = np_softmax(scaled_row)
    keep = probs >= min_p * probs.max()
    top_p = 2.0 if top_p >= 1.0 else top_p  # off: the float64 cumsum can reach 1.0 before the tail
    order = np.argsort(-scaled_row, kind="stable")
    if 0 < top_k < len(scaled_row):
        keep[order[top_k:]] = False
    kept_probs = np.where(keep, probs, 0.0)
    kept_probs = kept_probs / kept_probs.sum()
    sorted_probs = kept_probs[order]
    mass_before = np.cumsum(sorted_probs) - sorted_probs
    keep_sorted = keep[order] & (mass_before < top_p)
    keep_sorted[0] = True
    result = np.zeros_like(keep)
    result[order] = keep_sorted
    return result
