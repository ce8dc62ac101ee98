import json

from jaxserve.bench.scheduler_bench import run_scheduler_bench


def test_bench_smoke():
    out = run_scheduler_bench(num_running=(4, 16), steps=3, repeats=1)
    json.dumps(out)
    assert [r["num_running"] for r in out["results"]] == [4, 16]
    assert all(r["us_per_step"] > 0 for r in out["results"]) and out["growth_ratio"] > 0
