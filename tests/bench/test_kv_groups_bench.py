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


def test_a_checkpoint_config_as_the_runner_groups_it(tmp_path):
    """``--model``: a Gemma 3 config.json (hub form: every sixth layer global), its specs from the
    runner's own ``layer_kv_specs``; what the runner allocates per block is the managers' figure."""
    import json

    from jaxserve.bench.kv_groups_bench import run_kv_groups_model_bench

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 12, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
        "sliding_window": 24, "sliding_window_pattern": 6, "torch_dtype": "float32"}))
    r = run_kv_groups_model_bench(str(tmp_path), block_size=4, prompt_len=200, max_tokens=10,
                                  max_num_batched_tokens=16)
    sliding, full = r["sliding"], r["full_attention"]
    assert (sliding["num_groups"], sliding["group_size"]) == (6, 2) and full["group_size"] == 12
    for side in (sliding, full):
        assert side["kv_cache_bytes_per_block"] == side["bytes_per_block"]
        assert side["runner_blocks_per_request"] == side["bound_blocks_per_request"]
    assert r["windows"] == [0, 24] and r["bytes_ratio"] > 1 and r["last_step_bytes_ratio"] > r["bytes_ratio"]
