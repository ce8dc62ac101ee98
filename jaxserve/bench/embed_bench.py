"""``jaxserve bench embed``: texts/s and tokens/s of a pooling model against sentence-transformers.

Both embed the same token ids (random ids of random lengths), turn by turn, alternated, each warmed
up once first; the JSON holds every turn and the median ratio with its spread. Ours sends every text
as a request through the engine core (the scheduler packs them by its token budget);
sentence-transformers runs its batches longest first, as its ``encode`` does.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np


def add_embed_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a Sentence-Transformers checkpoint folder (decoder or BERT)")
    p.add_argument("--num-texts", type=int, default=256, help="texts per turn (default: 256)")
    p.add_argument("--min-len", type=int, default=16, help="shortest text, in tokens (default: 16)")
    p.add_argument("--max-len", type=int, default=512, help="longest text, in tokens (default: 512)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sentence-transformers' batch (default: 32); ours is the token budget")
    p.add_argument("--turns", type=int, default=3, help="alternated turns of each side (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random texts (default: 0)")


def run_embed_bench_cli(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from sentence_transformers import SentenceTransformer

    from jaxserve.config import EngineConfig
    from jaxserve.engine.pooling_llm import PoolingLLM, pooling_task_of

    config = EngineConfig(model=args.model, runner="pooling")
    pooling = PoolingLLM(config, pooling_task_of(config) or "embed")
    st = SentenceTransformer(args.model, device="cpu")
    rng = np.random.default_rng(args.seed)
    vocab = st.tokenizer.vocab_size
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_texts)
    prompts = [rng.integers(5, vocab, n).tolist() for n in lengths]
    tokens = int(lengths.sum())

    def ours() -> np.ndarray:  # every text a request: the scheduler batches them by its token budget
        return pooling.run(prompts)

    # Longest first, as SentenceTransformer.encode orders a batch (so each batch pads little).
    by_length = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))

    def theirs() -> np.ndarray:
        out = []
        with torch.inference_mode():
            for s in range(0, len(prompts), args.batch_size):
                part = [prompts[i] for i in by_length[s:s + args.batch_size]]
                width = max(len(p) for p in part)
                ids = torch.zeros((len(part), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for i, p in enumerate(part):
                    ids[i, :len(p)] = torch.tensor(p)
                    mask[i, :len(p)] = 1
                out.append(st({"input_ids": ids, "attention_mask": mask})["sentence_embedding"].numpy())
        rows = np.concatenate(out)
        return rows[np.argsort(by_length)]  # back in the prompts' order

    # Warm-up (compiles every bucket; fills torch's caches) and the agreement of the two sides.
    a, b = ours(), theirs()
    cos = float((np.sum(a * b, -1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).min())
    turns = []
    for _ in range(args.turns):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        theirs()
        t2 = time.perf_counter()
        turns.append({"jaxserve_s": t1 - t0, "sentence_transformers_s": t2 - t1, "ratio": (t2 - t1) / (t1 - t0)})
    ratios = [t["ratio"] for t in turns]
    best_ours = min(t["jaxserve_s"] for t in turns)
    best_st = min(t["sentence_transformers_s"] for t in turns)
    return {"model": args.model, "num_texts": args.num_texts, "tokens": tokens, "batch_size": args.batch_size,
            "min_cosine": cos, "turns": turns, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "jaxserve": {"texts_per_s": args.num_texts / best_ours, "tokens_per_s": tokens / best_ours},
            "sentence_transformers": {"texts_per_s": args.num_texts / best_st, "tokens_per_s": tokens / best_st}}
