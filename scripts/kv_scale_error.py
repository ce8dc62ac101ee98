"""How much an int8 KV cache's scale granularity costs, on SmolLM2's real keys and values.

Serves the held-out passages in float32 (float32 KV cache), reads the K/V rows the engine wrote,
and rounds them to int8 two ways: one scale per (layer, KV head) taken from these very rows (the
best a calibrated static per-head scale could do), and one scale per (position, layer, KV head)
(``--kv-cache-dtype int8``). Prints the relative RMS error of each, for K and V. JSON out
(docs/benchmarks.md).

    python scripts/kv_scale_error.py
"""

from __future__ import annotations

import json

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.bench.held_texts import HELD_TEXTS
from jaxserve.bench.real_model import resolve_bench_model


def _rel_rms(x: np.ndarray, scale: np.ndarray) -> float:
    q = np.clip(np.round(x / np.where(scale > 0, scale, 1.0)), -127, 127) * scale
    return float(np.sqrt(np.mean((q - x) ** 2) / np.mean(x**2)))


def main() -> None:
    llm = LLM(resolve_bench_model("smollm2"), dtype="float32", max_model_len=512, max_num_seqs=8,
              enable_prefix_caching=False, show_progress=False)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)[:500]} for t in HELD_TEXTS]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    result = {}
    for name, pool in zip(("k", "v"), llm.llm_engine.core.runner.kv_cache, strict=True):
        x = np.asarray(pool)  # [layers, blocks, block_size, Hkv, D]; freed blocks keep their rows
        layers, _, _, hkv, d = x.shape
        rows = x.reshape(layers, -1, hkv, d)
        rows = rows[:, np.abs(rows).max(axis=(0, 2, 3)) > 0]  # the positions written
        per_head = np.abs(rows).max(axis=(1, 3), keepdims=True) / 127.0
        per_row = np.abs(rows).max(axis=3, keepdims=True) / 127.0
        result[name] = {"positions": int(rows.shape[1]), "per_head_rel_rms": _rel_rms(rows, per_head),
                        "per_position_rel_rms": _rel_rms(rows, per_row)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
