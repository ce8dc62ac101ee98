"""Accuracy of the quantized formats against float32 on one checkpoint (docs/benchmarks.md).

For each format (weights x KV cache), one engine scores the same token windows of texts this repo
ships (prompt logprobs, greedy, one token out): top-1 agreement with float32 at every position,
mean and max |delta logprob| of the text's own tokens, and the perplexity of each text. JSON out.

    python scripts/quant_accuracy.py MODEL_FOLDER [--formats none/auto int8/auto fp8/auto none/fp8]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from jaxserve import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent
TEXTS = ("README.md", "docs/design.md")  # shipped with the repo: the held set


def windows(tokenizer, length: int, per_text: int) -> list[list[int]]:
    out = []
    for name in TEXTS:
        ids = tokenizer.encode((REPO / name).read_text(encoding="utf-8"))
        step = max(length, (len(ids) - length) // max(1, per_text - 1))
        out += [ids[i : i + length] for i in range(0, len(ids) - length + 1, step)][:per_text]
    return out


def score(llm: LLM, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per position (all windows concatenated): the text token's logprob and the top-1 token."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    logprobs, top1 = [], []
    for out, ids in zip(llm.generate(prompts, params), prompts):
        for tok, entry in zip(ids[1:], out.prompt_logprobs[1:]):
            logprobs.append(entry[tok].logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return np.array(logprobs), np.array(top1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--formats", nargs="+", default=["none/auto", "int8/auto", "fp8/auto", "none/fp8", "int8/fp8"],
                   help="WEIGHTS/KV pairs: quantization (none, int8, fp8) / kv_cache_dtype (auto, fp8)")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--per-text", type=int, default=3)
    args = p.parse_args()
    results, ref = [], None
    for fmt in args.formats:
        weights, kv = fmt.split("/")
        llm = LLM(args.model, quantization=None if weights == "none" else weights, kv_cache_dtype=kv,
                  max_model_len=args.window + 16, max_num_seqs=8, enable_prefix_caching=False, show_progress=False)
        prompts = windows(llm.get_tokenizer(), args.window, args.per_text)
        logprobs, top1 = score(llm, prompts)
        stats = llm.stats()
        row = {"weights": weights, "kv_cache": kv, "weight_bytes": stats["weight_bytes"],
               "kv_bytes_per_token": stats["kv_cache_bytes"] // (stats["num_gpu_blocks"] * 16),
               "positions": len(logprobs), "perplexity": math.exp(-logprobs.mean())}
        if ref is None:
            ref = (logprobs, top1)
        else:
            delta = np.abs(logprobs - ref[0])
            row.update(top1_agreement=float((top1 == ref[1]).mean()), mean_abs_dlogprob=float(delta.mean()),
                       max_abs_dlogprob=float(delta.max()))
        results.append(row)
        print(json.dumps(row), flush=True)
        del llm


if __name__ == "__main__":
    main()
