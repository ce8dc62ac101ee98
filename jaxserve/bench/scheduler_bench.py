"""Host-side cost of one engine step in the core: ``schedule()`` + ``update_from_output()`` with
N requests decoding, no model (the runner's output is faked). The core must stay linear in N: a
``growth_ratio`` (cost per request at the largest N over that at the smallest) near 1 is linear.

    python -m jaxserve.bench.scheduler_bench      # prints JSON
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Sequence

from jaxserve.core import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from jaxserve.core.kv_cache_utils import cdiv


def _fake_output(so, token_id: int) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)},
                             [[token_id] for _ in req_ids])


def _bench_one(num_running: int, steps: int, block_size: int, prompt_len: int,
               warmup: int, repeats: int) -> dict:
    max_model_len = prompt_len + warmup + steps * repeats + 2 * block_size
    config = SchedulerConfig(max_num_batched_tokens=max(2048, num_running),
                             max_num_seqs=num_running, max_model_len=max_model_len)
    sched = Scheduler(config, num_blocks=num_running * cdiv(max_model_len, block_size) + 1,
                      block_size=block_size, enable_caching=True)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_running):
        # Distinct first token: no prefix sharing, every request pays for its own blocks.
        prompt = [i % 30000 + 1] + [7] * (prompt_len - 1)
        sched.add_request(Request(f"b{i}", prompt, params, eos_token_id=0, arrival_time=float(i)))
    # Prefill (and a few decodes) until every request is decoding one token a step.
    for _ in range(10_000):
        so = sched.schedule()
        sched.update_from_output(so, _fake_output(so, 5))
        if len(sched.running) == num_running and so.total_num_scheduled_tokens == num_running:
            break
    for _ in range(warmup):
        so = sched.schedule()
        sched.update_from_output(so, _fake_output(so, 5))

    # The best of several rounds: the host is shared, and noise only ever adds time.
    rounds = []
    gc.collect()
    for _ in range(repeats):
        t_sched = t_update = 0.0
        for _ in range(steps):
            t0 = time.process_time()
            so = sched.schedule()
            t1 = time.process_time()
            mro = _fake_output(so, 5)  # the runner's work, not timed
            t2 = time.process_time()
            outs = sched.update_from_output(so, mro)
            t3 = time.process_time()
            t_sched += t1 - t0
            t_update += t3 - t2
            assert so.total_num_scheduled_tokens == num_running and len(outs) == num_running
        rounds.append((t_sched + t_update, t_sched, t_update))
    total, t_sched, t_update = min(rounds)
    per_step = total / steps * 1e6
    return {
        "num_running": num_running,
        "us_per_step": round(per_step, 1),
        "schedule_us": round(t_sched / steps * 1e6, 1),
        "update_us": round(t_update / steps * 1e6, 1),
        "us_per_req": round(per_step / num_running, 3),
        "median_us_per_step": round(
            sorted(r[0] for r in rounds)[len(rounds) // 2] / steps * 1e6, 1),
    }


def run_scheduler_bench(num_running: Sequence[int] = (64, 256, 1024), steps: int = 50,
                        block_size: int = 16, prompt_len: int = 32, warmup: int = 5,
                        repeats: int = 5) -> dict:
    """Times ``steps`` decode steps ``repeats`` times per N and keeps the fastest round.
    Process CPU time, not wall time: the numbers hold on a busy shared host."""
    results = [_bench_one(n, steps, block_size, prompt_len, warmup, repeats) for n in num_running]
    lo = min(results, key=lambda r: r["num_running"])
    hi = max(results, key=lambda r: r["num_running"])
    growth = hi["us_per_req"] / lo["us_per_req"] if lo["us_per_req"] else float("nan")
    return {
        "bench": "scheduler",
        "clock": "process_time",
        "block_size": block_size,
        "steps": steps,
        "repeats": repeats,
        "prompt_len": prompt_len,
        "results": results,
        # Cost per request at the largest N / at the smallest: ~1 = linear, >> 1 = superlinear.
        "growth_ratio": round(growth, 3),
    }


def main() -> None:
    print(json.dumps(run_scheduler_bench(), indent=2))


if __name__ == "__main__":
    main()
