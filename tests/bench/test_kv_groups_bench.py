"""The sliding-window block figure: what the bench reports is what the managers hold."""

from jaxserve.bench.kv_groups_bench import run_kv_groups_bench
from jaxserve.core.kv_cache_utils import cdiv


def test_sliding_layers_hold_their_window_only():
    window, bs, budget = 24, 4, 16
    r = run_kv_groups_bench(num_layers=12, global_every=6, window=window, block_size=bs,
                            num_kv_heads=1, head_size=8, dtype="float32", prompt_len=200,
                            max_tokens=10, max_num_batched_tokens=budget)
    sliding, full = r["sliding"], r["full_attention"]
    # 10 local layers in groups of 2 (the global layers' count): 5 sliding groups and 1 full.
    assert (sliding["num_groups"], sliding["group_size"]) == (6, 2)
    *local, global_ = sliding["last_step_blocks_per_group"]
    # At the last decode: the blocks the window's W - 1 tokens and the new one touch.
    assert all(n <= cdiv(window - 1, bs) + 1 for n in local)
    assert global_ == full["last_step_blocks"] == cdiv(200 + 10 - 1, bs)
    assert sliding["peak_blocks"] <= sliding["bound_blocks_per_request"]
    assert sliding["peak_bytes"] < full["peak_bytes"] and r["bytes_ratio"] > 1
