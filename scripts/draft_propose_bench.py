"""The draft model's own cost, alternated with the plain engine's one-stream step in one process
(docs/benchmarks.md, the draft-model section): JSON lines out, one per turn.

    python scripts/draft_propose_bench.py [--k 3] [--turns 4] [--prompt-len 131]

A turn times, wall and process CPU (the CPU seconds are steadier than the wall on a shared
machine): the plain engine serving the same GGUF file in its blocks (ms a decoded token, the
first token's step taken off); the draft's ``propose`` after full acceptance (a 2-token catch-up,
then K-1 one-token forwards in one program); each of those two programs alone (block_until_ready);
and the catch-up of a whole prompt (its first ``propose``). The target is the file served in float32.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.bench.real_model import resolve_bench_model
from jaxserve.runner.draft_runner import DraftModelProposer, _DraftSeq


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall ms, process CPU ms) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def median(pairs: list[tuple[float, float]]) -> dict:
    return {"wall_ms": round(float(np.median([w for w, _ in pairs])), 2),
            "cpu_ms": round(float(np.median([c for _, c in pairs])), 2)}


def plain_step(plain: LLM, prompt: list[int], tokens: int = 48) -> dict:
    """ms a decoded token: a ``tokens``-token generation less a one-token one (the prefill)."""
    one = timed(lambda: plain.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False))
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    whole = timed(lambda: plain.generate([prompt], params, use_tqdm=False))
    per_token = [(w - w1) / (tokens - 1) for w, w1 in zip(whole, one)]
    return {"wall_ms": round(per_token[0], 2), "cpu_ms": round(per_token[1], 2)}


def proposes(d: DraftModelProposer, prompt: list[int], rng: np.random.Generator, calls: int = 12) -> tuple[dict, dict]:
    """The prompt's catch-up, then ``calls`` proposes each after every draft was accepted."""
    d.free("bench")
    ctx = np.asarray(prompt, np.int32)
    last: list[list[int]] = []
    first = timed(lambda: last.append(d.propose(["bench"], [ctx])[0]))
    times = []
    for _ in range(calls):
        ctx = np.concatenate([ctx, np.asarray([*last[-1], int(rng.integers(100, 40000))], np.int32)])
        times.append(timed(lambda ctx=ctx: last.append(d.propose(["bench"], [ctx])[0])))
    d.free("bench")
    return {"wall_ms": round(first[0], 1), "cpu_ms": round(first[1], 1)}, median(times)


def programs(d: DraftModelProposer, reps: int = 12) -> dict:
    """The 2-token catch-up and the decode loop alone, on a scratch request's blocks."""
    bs = d.block_size
    seq = _DraftSeq()
    d.seqs["scratch"] = seq
    d._reserve(seq, 200)
    tables = d._tables(["scratch"], 1)
    ids, pos, slots, _, kv_lens, qsl, num_seqs, logits_idx = d._catch_up_args(2)
    p = np.arange(100, 102)
    ids[:2], pos[:2], slots[:2] = 500, p, tables[0, p // bs] * bs + p % bs
    kv_lens[0], qsl[1:], num_seqs[0], logits_idx[0] = 102, 2, 1, 1
    tokens, starts, _, num_real = d._decode_args(1)
    tokens[0], starts[0], num_real[0] = 500, 102, 1
    out = {}
    for name, kind, size, args in (("catch_up_2", "catch_up", 2, (ids, pos, slots, tables, kv_lens, qsl, num_seqs,
                                                                   logits_idx)),
                                   ("decode_loop", "decode", 1, (tokens, starts, tables, num_real))):
        program, placed = d._program(kind, size), [jax.device_put(a) for a in args]

        def once(program: Any = program, placed: list = placed) -> None:  # bound per program
            d.kv, result = program(d.weights, d.kv, *placed)
            result.block_until_ready()

        once()
        out[name] = median([timed(once) for _ in range(reps)])
    d.free("scratch")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=131, help="the bench's copy workload's prompt")
    args = parser.parse_args()
    path = resolve_bench_model("smollm2")
    shape = dict(max_model_len=512, max_num_batched_tokens=512, max_num_seqs=1, show_progress=False)
    spec = LLM(path, dtype="float32", **shape, speculative_config={  # type: ignore[arg-type]
        "method": "draft_model", "model": path, "num_speculative_tokens": args.k, "quantization": "gguf"})
    plain = LLM(path, quantization="gguf", **shape)  # type: ignore[arg-type]
    drafter = spec.llm_engine.core.runner.drafter
    prompt = [(i * 37) % 4000 + 100 for i in range(args.prompt_len)]
    rng = np.random.default_rng(0)
    plain_step(plain, prompt), proposes(drafter, prompt, rng)  # warm
    for turn in range(args.turns):
        step = plain_step(plain, prompt)
        prompt_catch_up, propose = proposes(drafter, prompt, rng)
        print(json.dumps({"turn": turn, "k": args.k, "plain_q4_1_step": step, "propose": propose,
                          "draft_forward_cpu_ms": round(propose["cpu_ms"] / args.k, 2),
                          **programs(drafter), "prompt_catch_up": prompt_catch_up,
                          "draft_passes": drafter.num_passes, "load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
