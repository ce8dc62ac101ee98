"""``jaxserve bench sampler``: the sampler under jit, and the design alternatives it was chosen over.

    jaxserve bench sampler                          # R=64 V=8192 and R=256 V=151936
    jaxserve bench sampler --rows 64 --vocab 8192 --repeats 20

Scenarios: all-greedy; top_k=50; top_p=0.9 on peaked logits (nucleus inside the top-256 fast
path) and on flat logits (forces the full-sort fallback); temperature only; all penalties on.
Variants: the shipped `sample`; `full_sort` (always sort V, no top-256 fast path); `no_greedy_cond`
(always run the random path); `no_proc_conds` (always apply allowed/bias/penalties); other caps.
Only the cells that answer a question are timed (`--all` times every cell). Times are the minimum
over repeats: on a shared CPU the minimum is the least disturbed by other processes. The result
is JSON (milliseconds per shape, scenario and variant; null for a cell not timed); the figures
are quoted in docs/benchmarks.md ("The sampler").
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxserve.core.sampling_params import SamplingParams
from jaxserve.sample.metadata import SamplingMetadata, sampling_arrays
from jaxserve.sample.processors import apply_allowed_token_ids, apply_logit_bias, penalize
from jaxserve.sample.sampler import (
    SamplerOutput,
    draw,
    first_argmax,
    gather_logprobs,
    greedy_rows,
    process_logits,
    row_keys,
    sample,
)
from jaxserve.sample.truncation import effective_top_k, full_sort_threshold, truncate, truncation_threshold

NUM_LOGPROBS = 5


def sample_variant(logits, md, counts, prompt_mask, *, cap=256, full_sort=False, greedy_cond=True, proc_conds=True):
    """`sample` with one design choice switched, to measure what each choice buys."""
    logits = logits.astype(jnp.float32)
    if proc_conds:
        processed = process_logits(logits, md, counts, prompt_mask)
    else:
        processed = apply_logit_bias(apply_allowed_token_ids(logits, md.allowed_token_ids, md.has_allowed),
                                     md.bias_token_ids, md.bias_values)
        processed = penalize(processed, counts, prompt_mask, md.presence_penalty, md.frequency_penalty,
                             md.repetition_penalty)
    greedy = greedy_rows(md.temperature)
    greedy_ids = first_argmax(processed)

    def random_ids():
        scaled = processed / jnp.where(greedy, 1.0, md.temperature)[:, None]
        if full_sort:
            thr = full_sort_threshold(scaled, effective_top_k(md.top_k, scaled.shape[-1]), md.top_p, md.min_p)
        else:
            thr = truncation_threshold(scaled, md.top_k, md.top_p, md.min_p, skip=greedy, cap=cap)
        return jnp.where(greedy, greedy_ids, draw(row_keys(md.seeds, md.positions), truncate(scaled, thr)))

    sampled = lax.cond(jnp.all(greedy), lambda: greedy_ids, random_ids) if greedy_cond else random_ids()
    return SamplerOutput(sampled, *gather_logprobs(logits, sampled, NUM_LOGPROBS))


def make_logits(rows: int, vocab: int, peaked: bool) -> jax.Array:
    """Flat: N(0, 1). Peaked: 20 tokens per row lifted by 12 (~93% of the mass), like a confident LM."""
    key_noise, key_head = jax.random.split(jax.random.PRNGKey(0))
    logits = jax.random.normal(key_noise, (rows, vocab), jnp.float32)
    if peaked:
        head = jax.random.randint(key_head, (rows, 20), 0, vocab)
        logits = logits.at[jnp.arange(rows)[:, None], head].add(12.0)
    return logits


def scenario_metadata(name: str, rows: int, vocab: int) -> SamplingMetadata:
    fields = {
        "greedy": dict(temperature=0.0),
        "top_k=50": dict(temperature=0.8, top_k=50),
        "top_p=0.9 peaked": dict(temperature=0.8, top_p=0.9),
        "top_p=0.9 flat": dict(temperature=0.8, top_p=0.9),
        "temperature only": dict(temperature=0.8),
        "penalties+top_k=50": dict(temperature=0.8, top_k=50, presence_penalty=0.5, frequency_penalty=0.5,
                                   repetition_penalty=1.2),
    }[name]
    params = [SamplingParams(seed=i, **fields) for i in range(rows)]
    arrays = sampling_arrays(params, rows, positions=[0] * rows)
    return SamplingMetadata.from_arrays({k: jnp.asarray(v) for k, v in arrays.items()})


SCENARIOS = ["greedy", "top_k=50", "top_p=0.9 peaked", "top_p=0.9 flat", "temperature only", "penalties+top_k=50"]

# Which variants answer a question for each scenario (the rest print "-" unless --all).
RELEVANT = {
    "greedy": {"sample (cap 256)", "no_greedy_cond", "no_proc_conds"},
    "top_k=50": {"sample (cap 256)", "cap 64", "cap 1024", "full_sort"},
    "top_p=0.9 peaked": {"sample (cap 256)", "full_sort"},
    "top_p=0.9 flat": {"sample (cap 256)", "full_sort"},
    "temperature only": {"sample (cap 256)", "no_proc_conds", "full_sort"},
    "penalties+top_k=50": {"sample (cap 256)"},
}


def variants():
    shipped = jax.jit(lambda l, m, c, p: sample(l, m, c, p, max_num_logprobs=NUM_LOGPROBS))
    return {
        "sample (cap 256)": shipped,
        "cap 64": jax.jit(lambda *a: sample_variant(*a, cap=64)),
        "cap 1024": jax.jit(lambda *a: sample_variant(*a, cap=1024)),
        "full_sort": jax.jit(lambda *a: sample_variant(*a, full_sort=True)),
        "no_greedy_cond": jax.jit(lambda *a: sample_variant(*a, greedy_cond=False)),
        "no_proc_conds": jax.jit(lambda *a: sample_variant(*a, proc_conds=False)),
    }


def time_call(fn, args, repeats: int) -> float:
    """Minimum wall time in ms after one compile-and-run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.min(times))


def run(rows: int, vocab: int, repeats: int, every_cell: bool) -> dict[str, dict[str, float | None]]:
    """Milliseconds per scenario and variant at one shape (None: a cell not timed)."""
    counts = jnp.asarray(np.random.default_rng(0).integers(0, 2, (rows, vocab)), jnp.int32)
    prompt_mask = counts > 0
    logits = {peaked: make_logits(rows, vocab, peaked) for peaked in (True, False)}
    fns = variants()
    table: dict[str, dict[str, float | None]] = {}
    for scenario in SCENARIOS:
        md = scenario_metadata(scenario, rows, vocab)
        args = (logits["flat" not in scenario], md, counts, prompt_mask)
        table[scenario] = {name: round(time_call(fn, args, repeats), 3) if every_cell or name in RELEVANT[scenario]
                           else None for name, fn in fns.items()}
    return table


def run_sampler_bench_cli(args: argparse.Namespace) -> dict:
    """The flags are in ``jaxserve_server.cli`` (building the parser imports no jax)."""
    shapes = [(args.rows, args.vocab or 8192)] if args.rows else [(64, 8192), (256, 151936)]
    return {"platform": jax.devices()[0].platform, "repeats": args.repeats, "unit": "ms (minimum over repeats)",
            "shapes": [{"rows": rows, "vocab": vocab, "ms": run(rows, vocab, args.repeats, args.all)}
                       for rows, vocab in shapes]}
