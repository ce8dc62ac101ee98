"""The mosaic kernel's time model: its schedule's bytes and steps, split-K on a lone long decode."""

import dataclasses
import math

from jaxserve.bench import gpu_targets
from jaxserve.bench.mosaic_time_model import estimate_layer
from jaxserve.bench.presets import preset_config
from jaxserve.bench.roofline import mosaic_columns, step_shape
from jaxserve.models.config import ModelConfig

MC = ModelConfig.from_dict(preset_config("qwen3-0.6b"))  # 16 query heads, 8 KV heads, head_dim 128
SPEC = gpu_targets.gpu_spec("h200", gpu_targets.target_config_path("h200").read_text())
KV_PER_TOKEN_LAYER = 2 * 8 * 128 * 2  # K and V of every KV head, bf16


def test_a_lone_long_decode_is_split_across_the_sms():
    """One sequence in the engine's smallest decode bucket (16 rows): 8 KV heads x 16 splits."""
    est = estimate_layer(MC, SPEC, [(1, 40960)], num_tokens=16, num_seqs=16, block_size=16, max_model_len=40960)
    assert est.ctas == 8 * 16 and est.waves == 1  # 128 of the 132 SMs, one wave
    assert est.max_steps == math.ceil(40960 / 64 / 16)
    short = estimate_layer(MC, SPEC, [(1, 1024)] * 16, num_tokens=16, num_seqs=16, block_size=16,
                           max_model_len=40960)
    assert short.ctas == 16 * 8 * 2 and short.max_steps == 8  # 16 steps: two splits of min_split_steps
    assert est.stage_bytes == 2 * 64 * 128 * 2 and est.wgmma_per_step == 128 // 16 + 64 // 16
    kv = 40960 * KV_PER_TOKEN_LAYER
    assert kv <= est.hbm_bytes < 1.1 * kv  # the KV once, plus small Q tiles and partials
    assert est.bound == "memory" and est.seconds < 1.2 * kv / SPEC.hbm_bytes_per_s + 5e-6


def test_prefill_tiles_reread_the_pages_they_share():
    est = estimate_layer(MC, SPEC, [(1024, 1024)], num_tokens=1024, num_seqs=256, block_size=16,
                         max_model_len=40960)
    tiles = 1024 // 32  # 32 tokens x a GQA group of 2 per 64-row tile
    steps = sum(math.ceil((t + 1) * 32 / 64) for t in range(tiles))  # causal: up to each tile's last token
    assert est.loaded_bytes == 8 * steps * est.stage_bytes + tiles * 8 * 64 * 128 * 2
    assert est.hbm_bytes < est.loaded_bytes


def test_roofline_columns_put_the_model_next_to_the_ideal():
    for bucket in (16, 256, 2048):
        row = mosaic_columns(MC, SPEC, step_shape(bucket, 256, 1024), context_len=1024, max_num_seqs=256,
                             block_size=16, max_model_len=40960)
        assert 0 < row["ideal_attn_ms"] < row["mosaic_attn_ms"]
        assert row["mosaic_smem_kib"] * 1024 <= 232448


def test_fp8_pools_halve_the_kv_bytes_and_windows_cut_the_steps():
    """An fp8 pool moves half the K/V bytes of a long decode; a 4096-token window reads only the
    steps that hold the window (the rest is never loaded), so its time is the window's, not the context's."""
    kw = dict(num_tokens=16, num_seqs=16, block_size=16, max_model_len=40960)
    bf16 = estimate_layer(MC, SPEC, [(1, 40960)], **kw)
    fp8 = estimate_layer(MC, SPEC, [(1, 40960)], kv_itemsize=1, **kw)
    assert fp8.stage_bytes * 2 == bf16.stage_bytes and fp8.smem_bytes < bf16.smem_bytes
    kv = 40960 * KV_PER_TOKEN_LAYER
    assert kv / 2 <= fp8.hbm_bytes < 0.55 * kv and fp8.seconds < 0.6 * bf16.seconds
    windowed = estimate_layer(dataclasses.replace(MC, sliding_window=4096), SPEC, [(1, 40960)], **kw)
    assert 4096 * KV_PER_TOKEN_LAYER <= windowed.hbm_bytes < 1.1 * (4096 + 64) * KV_PER_TOKEN_LAYER
    assert windowed.loaded_bytes < bf16.loaded_bytes / 9
