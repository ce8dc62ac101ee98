"""Where a speculating engine's step time goes on the host: a ``jaxserve bench throughput`` run
(its arguments as given) with the scheduler's calls (``schedule``, ``update_from_output``), the
runner's host side of a step (``prepare``, ``launch``) and the draft model's proposals timed,
per engine (the speculating one and the plain one the bench alternates it with). JSON on stdout:
the bench's result and ``host_share``, milliseconds per step (docs/benchmarks.md, the draft-model
section). The scheduler and the runner's host side are what overlapping a speculating step with
the next (vLLM's async scheduling with drafts on the device) hides at most; a proposal's
forwards are device work, which that overlap does not take off the one device.

    python scripts/spec_host_share.py bench throughput smollm2 --workload copy ... --speculative-config ...
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections import defaultdict
from typing import Any

from jaxserve.core.scheduler import Scheduler
from jaxserve.runner.draft_runner import DraftModelProposer
from jaxserve.runner.model_runner import ModelRunner

SECONDS: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
STEPS: dict[str, int] = defaultdict(int)


def _engine_of(obj: Any) -> str:
    if isinstance(obj, Scheduler):
        return "spec" if obj.scheduler_config.num_speculative_tokens else "plain"
    if isinstance(obj, ModelRunner):
        return "spec" if obj.num_spec else "plain"
    return "spec"  # the draft model's proposer


def _timed(cls: type, name: str) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            engine = _engine_of(self)
            SECONDS[engine][name] += time.perf_counter() - start
            if name == "schedule":
                STEPS[engine] += 1

    setattr(cls, name, wrapper)


def main() -> int:
    from jaxserve.bench.throughput import run_throughput_cli
    from jaxserve_server.cli import build_parser

    for cls, name in ((Scheduler, "schedule"), (Scheduler, "update_from_output"), (ModelRunner, "prepare"),
                      (ModelRunner, "launch"), (DraftModelProposer, "propose")):
        _timed(cls, name)
    result = run_throughput_cli(build_parser().parse_args(sys.argv[1:]))
    result["host_share"] = {engine: {"steps": STEPS[engine],
                                     **{f"{k}_ms_per_step": 1e3 * v / max(1, STEPS[engine]) for k, v in parts.items()}}
                            for engine, parts in SECONDS.items()}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
