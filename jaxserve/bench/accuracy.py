"""``jaxserve bench accuracy``: what each weight and KV-cache format costs in accuracy.

Every format scores the same held-out texts (``held_texts.py``) by teacher forcing: the prompt
logprobs of each text's own tokens (``prompt_logprobs=1`` gives the actual token's logprob and the
top-1 token at every position). Each format is compared with the float32 reference (the same
checkpoint, dequantized to float32, full-precision KV):

- ``top1_agreement``: the fraction of positions whose most likely next token equals the reference's;
- ``mean_abs_dlogprob`` / ``max_abs_dlogprob``: |logprob(actual token) - reference's| over positions;
- ``perplexity``: exp of the mean negative logprob of the actual tokens, over all texts.

A wrong scale or a transposed quantization block shows as a collapse of top-1 agreement and a
perplexity in the thousands, which is what the tests bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .held_texts import HELD_TEXTS

# Each format as LLM keywords over the same engine; "f32" is the reference. "gguf-q8_0" and
# "gguf-q4_0" serve the .gguf model re-encoded in that block format (gguf_requantize.py).
FORMATS: dict[str, dict[str, Any]] = {
    "f32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "gguf": {"dtype": "float32", "quantization": "gguf"},
    "gguf-q8_0": {"dtype": "float32", "quantization": "gguf"},
    "gguf-q4_0": {"dtype": "float32", "quantization": "gguf"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "fp8": {"dtype": "float32", "quantization": "fp8"},
    "fp8-kv": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "int8-kv": {"dtype": "float32", "kv_cache_dtype": "int8"},
}
REFERENCE = "f32"
# A small engine: two token buckets compile quickly, and long texts are prefilled in chunks.
SCORING_ENGINE: dict[str, Any] = dict(max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)


@dataclasses.dataclass
class TextScores:
    """One text under one format: per position after the first, the actual token's logprob and the
    most likely token's id."""

    chosen_logprobs: np.ndarray
    top1_ids: np.ndarray


def tokenize_texts(tokenizer, texts: Sequence[str] = HELD_TEXTS) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def score_texts(llm, token_lists: Sequence[Sequence[int]]) -> list[TextScores]:
    """Teacher-forced scores of every text (one engine call, all texts batched)."""
    from jaxserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": list(ids)} for ids in token_lists],
                        SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    scores = []
    for ids, out in zip(token_lists, outs):
        rows = out.prompt_logprobs[1:]  # position 0 has no prediction
        chosen = [row[t].logprob for row, t in zip(rows, ids[1:])]
        top1 = [next(t for t, lp in row.items() if lp.rank == 1) for row in rows]
        scores.append(TextScores(np.asarray(chosen, np.float64), np.asarray(top1, np.int64)))
    return scores


def perplexity(scores: Sequence[TextScores]) -> float:
    chosen = np.concatenate([s.chosen_logprobs for s in scores])
    return float(math.exp(-chosen.mean()))


def compare(reference: Sequence[TextScores], other: Sequence[TextScores]) -> dict[str, float]:
    """``other`` against ``reference`` over the same texts (see the module docstring)."""
    d = np.concatenate([np.abs(o.chosen_logprobs - r.chosen_logprobs) for r, o in zip(reference, other)])
    agree = np.concatenate([o.top1_ids == r.top1_ids for r, o in zip(reference, other)])
    return {"top1_agreement": float(agree.mean()), "mean_abs_dlogprob": float(d.mean()),
            "max_abs_dlogprob": float(d.max()), "perplexity": perplexity(other), "positions": int(d.size)}


def run_accuracy(model: str, formats: Sequence[str], engine: dict[str, Any] | None = None,
                 texts: Sequence[str] = HELD_TEXTS, log=print) -> dict[str, Any]:
    """Score ``texts`` under the reference and each of ``formats``; one engine at a time."""
    from jaxserve import LLM

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"formats: unknown {unknown}; known: {sorted(FORMATS)}")
    engine = {**SCORING_ENGINE, **(engine or {})}
    token_lists: list[list[int]] | None = None
    ref_scores: list[TextScores] | None = None
    results: dict[str, Any] = {}
    for name in [REFERENCE, *(f for f in formats if f != REFERENCE)]:
        start = time.perf_counter()
        llm = LLM(_model_file(model, name), show_progress=False, **{**engine, **FORMATS[name]})
        if token_lists is None:
            token_lists = tokenize_texts(llm.get_tokenizer(), texts)
        scores = score_texts(llm, token_lists)
        stats = llm.stats()
        del llm
        gc.collect()  # one engine's buffers at a time
        if ref_scores is None:
            ref_scores = scores
        row = compare(ref_scores, scores)
        row.update(weight_bytes=stats["weight_bytes"], kv_cache_bytes=stats["kv_cache_bytes"],
                   kv_cache_dtype=stats["kv_cache_dtype"], weight_format=stats["quantization"],
                   seconds=round(time.perf_counter() - start, 1))
        results[name] = row
        log(f"{name}: top-1 {row['top1_agreement']:.4f}, mean |dlogprob| {row['mean_abs_dlogprob']:.4f}, "
            f"perplexity {row['perplexity']:.3f}")
    return {"model": model, "reference": REFERENCE, "texts": len(texts), "engine": engine, "formats": results}


def _model_file(model: str, name: str) -> str:
    if not name.startswith("gguf-"):
        return model
    from jaxserve.models.gguf_loader import is_gguf
    from jaxserve.models.gguf_requantize import cached_requantized

    if not is_gguf(model):
        raise ValueError(f"formats: {name} re-encodes a .gguf model; {model} is not one")
    return str(cached_requantized(model, name.split("-", 1)[1].upper()))


def add_accuracy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS),
                   help=f"formats to score against {REFERENCE} (default: all)")


def run_accuracy_cli(args) -> dict[str, Any]:
    import sys

    from .real_model import resolve_bench_model

    return run_accuracy(resolve_bench_model(args.model or "smollm2"), args.formats,
                        log=lambda line: print(line, file=sys.stderr, flush=True))
