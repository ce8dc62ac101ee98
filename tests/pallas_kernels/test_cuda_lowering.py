"""Every configuration the runner may choose lowers for CUDA on CPU, via Triton (not Mosaic)."""

from __future__ import annotations

import pytest

import pallas_kernels as pk

CONFIGS = pk.lowerable_configs()


def _is_triton(text: str) -> bool:
    # jaxlib <= 0.10.2 emits the XLA Triton custom call; newer jaxlibs compile at lowering time and
    # emit the triton_kernel_call FFI target. Mosaic GPU would be "mosaic_gpu".
    return ("__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text) and "mosaic" not in text


def _name(c):
    return "-".join(f"{k}={v}" for k, v in c.items())


def test_config_list_covers_the_runner_choices():
    modes = {c["mode"] for c in CONFIGS}
    assert modes == {"mixed", "decode"}
    assert {c["dtype"] for c in CONFIGS} == {"float32", "bfloat16", "float16"}
    assert {c["head_dim"] for c in CONFIGS} == {64, 128}
    assert {c["block_size"] for c in CONFIGS} == {16, 32}


@pytest.mark.parametrize("config", CONFIGS, ids=_name)
def test_lowers_for_cuda_with_triton(config):
    assert _is_triton(pk.lower_for_cuda(config))


@pytest.mark.parametrize("mode", ["mixed", "decode"])
@pytest.mark.parametrize("shape", [dict(num_q_heads=32, num_kv_heads=8),  # Llama-style GQA 4
                                   dict(num_q_heads=12, num_kv_heads=4),  # non power-of-two group
                                   dict(num_q_heads=8, num_kv_heads=8)])  # MHA
def test_lowers_with_window_softcap_and_other_groups(mode, shape):
    config = dict(mode=mode, dtype="bfloat16", head_dim=128, block_size=16)
    assert _is_triton(pk.lower_for_cuda(config, sliding_window=128, soft_cap=50.0, **shape))


def test_lowers_auto_mode_and_big_buckets():
    """auto (lax.cond of both kernels) and a large decode/prefill bucket shape."""
    assert _is_triton(pk.lower_for_cuda(
        dict(mode="auto", dtype="bfloat16", head_dim=128, block_size=16)))
    assert _is_triton(pk.lower_for_cuda(
        dict(mode="decode", dtype="bfloat16", head_dim=128, block_size=16), num_tokens=256,
        num_seqs=256, num_blocks=4096, max_blocks=128))
    assert _is_triton(pk.lower_for_cuda(
        dict(mode="mixed", dtype="bfloat16", head_dim=128, block_size=16), num_tokens=8192,
        num_seqs=8, num_blocks=4096, max_blocks=128))
