"""Decode attention over an int8 KV pool against float32 and bfloat16 pools (the cpu kernel).

One decode step's attention for ``--layers`` layers of SmolLM2's shape (9 query heads, 3 KV
heads, head_dim 64): ``B`` sequences of ``C`` context tokens each, every layer's pages in the one
pool as the engine lays them out, so the step reads its K/V from memory (more bytes than the
last-level cache holds). The pools take turns in each round, so they see the same machine load;
JSON lines out, one per shape: per pool the step's milliseconds per round, their median and spread (docs/benchmarks.md).

``--engine``: whole decode steps instead, SmolLM2 served in float32 with a float32 and an int8 KV
cache (the same number of blocks), taking turns. Each engine prefills the ``B`` prompts once; a
round then times ``1 + n_gen`` tokens and 1 token over the cached prompts (prefix-cache hits), and
decode tokens/s is ``B * n_gen`` over the difference.

    python scripts/kv_int8_bench.py [--batch-sizes 32 64] [--contexts 1024 2048] [--layers 8] [--rounds 5]
    python scripts/kv_int8_bench.py --engine [--batch-sizes 32 64] [--contexts 1024] [--n-gen 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels.int8_kv import quantize_rows

HQ, HKV, D, BS = 9, 3, 64, 16


def _step(layers: int, nb: int):
    fn = pk.get_attention_fn("cpu")

    @jax.jit
    def step(q, k, v, kv_lens, tables, qsl, ns):
        def body(layer, acc):
            out = fn(q, k, v, kv_lens, tables + layer * nb, qsl, ns, sm_scale=D**-0.5)
            return acc + out[:, :, :1].astype(jnp.float32).sum()
        return jax.lax.fori_loop(0, layers, body, jnp.float32(0))

    return step


def _inputs(batch: int, context: int, layers: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    per_seq = -(-context // BS)
    nb = batch * per_seq + 1
    tables = (1 + rng.permutation(batch * per_seq)).reshape(batch, per_seq).astype(np.int32)
    k = rng.standard_normal((layers * nb, BS, HKV, D), np.float32)
    v = rng.standard_normal((layers * nb, BS, HKV, D), np.float32)
    q = rng.standard_normal((batch, HQ, D), np.float32)
    meta = (jnp.full((batch,), context, jnp.int32), jnp.asarray(tables), jnp.arange(batch + 1, dtype=jnp.int32),
            jnp.asarray([batch], jnp.int32))
    return nb, q, k, v, meta


def _seconds(step, args, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(batch: int, context: int, layers: int, rounds: int, repeats: int) -> dict:
    nb, q, k, v, meta = _inputs(batch, context, layers)
    pools = {"float32": (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)),
             "bfloat16": (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)),
             "int8": (jnp.asarray(q), quantize_rows(jnp.asarray(k)), quantize_rows(jnp.asarray(v)))}
    del k, v
    step = _step(layers, nb)
    for args in pools.values():
        step(*args, *meta).block_until_ready()  # compile and warm each
    ms: dict[str, list[float]] = {name: [] for name in pools}
    for _ in range(rounds):
        for name, args in pools.items():
            ms[name].append(1e3 * _seconds(step, (*args, *meta), repeats))
    out = {"batch": batch, "context": context, "layers": layers,
           "pool_bytes": {n: int(a[1].nbytes + a[2].nbytes) for n, a in pools.items()}}
    for name, values in ms.items():
        out[name] = {"median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values),
                     "per_round_ms": values}
    for name in ("float32", "bfloat16"):
        ratios = [a / b for a, b in zip(ms[name], ms["int8"], strict=True)]
        out[f"{name}_over_int8"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def run_engine(batch: int, context: int, n_gen: int, rounds: int) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.real_model import resolve_bench_model

    model = resolve_bench_model("smollm2")
    max_len = context + n_gen + BS
    blocks = batch * -(-max_len // BS) + 1
    engines = {d: LLM(model, dtype="float32", kv_cache_dtype=d, max_model_len=max_len, max_num_seqs=batch,
                      num_gpu_blocks_override=blocks, show_progress=False) for d in ("auto", "int8")}
    vocab = engines["auto"].get_tokenizer().vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, vocab - 10, context).tolist()} for _ in range(batch)]

    def timed(llm, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for llm in engines.values():
        timed(llm, 1 + n_gen)  # the prefill, once (cached from here on), and every decode bucket compiled
    tok_s: dict[str, list[float]] = {d: [] for d in engines}
    for _ in range(rounds):
        for d, llm in engines.items():
            total, prefill = timed(llm, 1 + n_gen), timed(llm, 1)
            tok_s[d].append(batch * n_gen / max(total - prefill, 1e-9))
    out: dict = {"batch": batch, "context": context, "n_gen": n_gen, "blocks": blocks,
                 "kv_cache_bytes": {d: llm.stats()["kv_cache_bytes"] for d, llm in engines.items()},
                 "preemptions": {d: llm.stats()["num_preemptions"] for d, llm in engines.items()}}
    for d, values in tok_s.items():
        out[f"{d}_decode_tok_s"] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                                    "per_round": values}
    ratios = [b / a for a, b in zip(tok_s["auto"], tok_s["int8"], strict=True)]
    out["int8_over_float32"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="steps timed per pool per round (their median)")
    p.add_argument("--engine", action="store_true", help="whole decode steps of SmolLM2 (see above)")
    p.add_argument("--n-gen", type=int, default=32, help="--engine: decode steps timed per round")
    args = p.parse_args()
    for c in args.contexts:
        for b in args.batch_sizes:  # one JSON line per shape as it completes: a long run reports as it goes
            result = run_engine(b, c, args.n_gen, args.rounds) if args.engine else run(b, c, args.layers, args.rounds,
                                                                                           args.repeats)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
