"""Every configuration the runner may choose lowers for CUDA on CPU, via Triton (not Mosaic)."""

from __future__ import annotations

import functools

import pytest

import pallas_kernels as pk

CONFIGS = pk.lowerable_configs()


@pytest.fixture(scope="module")
def cuda_device():
    """Keywords placing a lowering on a CUDA device: none needed before jax 0.11; from 0.11 on, a
    compile-only H200 (the CUDA plugin required), else the tests skip with the reason."""
    from pallas_kernels.ragged_paged_attention import CUDA_LOWERING_NEEDS_DEVICE

    if not CUDA_LOWERING_NEEDS_DEVICE:
        return {}
    from jaxserve.bench import gpu_aot, gpu_targets

    try:
        return {"sharding": gpu_aot.compile_only_sharding(gpu_targets.target_config_path("h200").read_text())}
    except RuntimeError as e:
        pytest.skip(f"jax >= 0.11 lowers Pallas Triton kernels for a CUDA device, and none can be made here: {e}")


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
def test_lowers_for_cuda_with_triton(config, cuda_device):
    assert _is_triton(pk.lower_for_cuda(config, **cuda_device))


@pytest.mark.parametrize("mode", ["mixed", "decode"])
@pytest.mark.parametrize("shape", [dict(num_q_heads=32, num_kv_heads=8),  # Llama-style GQA 4
                                   dict(num_q_heads=12, num_kv_heads=4),  # non power-of-two group
                                   dict(num_q_heads=8, num_kv_heads=8)])  # MHA
def test_lowers_with_window_softcap_and_other_groups(mode, shape, cuda_device):
    config = dict(mode=mode, dtype="bfloat16", head_dim=128, block_size=16)
    assert _is_triton(pk.lower_for_cuda(config, sliding_window=128, soft_cap=50.0, **shape, **cuda_device))


def test_lowers_auto_mode_and_big_buckets(cuda_device):
    """auto (lax.cond of both kernels) and a large decode/prefill bucket shape."""
    assert _is_triton(pk.lower_for_cuda(
        dict(mode="auto", dtype="bfloat16", head_dim=128, block_size=16), **cuda_device))
    assert _is_triton(pk.lower_for_cuda(
        dict(mode="decode", dtype="bfloat16", head_dim=128, block_size=16), num_tokens=256,
        num_seqs=256, num_blocks=4096, max_blocks=128, **cuda_device))
    assert _is_triton(pk.lower_for_cuda(
        dict(mode="mixed", dtype="bfloat16", head_dim=128, block_size=16), num_tokens=8192,
        num_seqs=8, num_blocks=4096, max_blocks=128, **cuda_device))


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_whole_decoder_lowers_for_cuda_in_both_layer_layouts(qwen3_checkpoint, scan_layers, cuda_device):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxserve.layers.attention import AttentionMetadata
    from jaxserve.models import load_model

    model = load_model(qwen3_checkpoint, scan_layers=scan_layers)
    graphdef, state = nnx.split(model)
    cfg = model.config
    attn = pk.get_attention_fn("pallas", interpret=False)
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=cuda_device.get("sharding"))
    tokens, rows, max_blocks = 32, 8, 16
    md = AttentionMetadata(
        positions=sds((tokens,), jnp.int32), slot_mapping=sds((tokens,), jnp.int32),
        block_tables=sds((rows, max_blocks), jnp.int32), kv_lens=sds((rows,), jnp.int32),
        query_start_loc=sds((rows + 1,), jnp.int32), num_seqs=sds((1,), jnp.int32))
    pool = sds((cfg.num_hidden_layers, 64, 16, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)

    def step(state, ids, kv, md):
        model = nnx.merge(graphdef, state)
        hidden, kv = model(ids, kv, md, attn)
        return model.compute_logits(hidden), kv

    if cuda_device:
        state = jax.tree.map(lambda x: sds(x.shape, x.dtype), state)
    traced = jax.jit(step).trace(state, sds((tokens,), jnp.int32), (pool, pool), md)
    text = (traced.lower() if cuda_device else traced.lower(lowering_platforms=("cuda",))).as_text()
    assert _is_triton(text)
    # The scan body holds the one kernel call; unrolled, each layer has its own.
    calls = text.count("custom_call @__gpu$xla.gpu.triton") + text.count("custom_call @triton_kernel_call")
    assert calls == (1 if scan_layers else cfg.num_hidden_layers)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_block_kernel_lowers_reading_the_half_scales_as_stored(qtype, cuda_device):
    """The GGUF block matmul's GPU kernel lowers via Triton with the scales handed over as the
    file keeps them: ``d`` (and Q4_1's ``m``) float16, no minimums for Q8_0 / Q4_0, no float32
    copy of either made before the call."""
    import re

    import jax
    import jax.numpy as jnp

    from pallas_kernels.block_quant_matmul import BLOCK_FORMATS
    from pallas_kernels.block_quant_matmul_triton import block_quant_matmul_triton

    bits, offset, has_min = BLOCK_FORMATS[qtype]
    n, k = 128, 256
    sds = functools.partial(jax.ShapeDtypeStruct, sharding=cuda_device.get("sharding"))
    scales = [sds((n, k // 32), jnp.float16)] * (2 if has_min else 1)
    traced = jax.jit(lambda x, qs, d, *m: block_quant_matmul_triton(x, qs, d, m[0] if m else None, bits=bits,
                                                                     offset=offset)).trace(
        sds((4, k), jnp.float32), sds((n, k * bits // 8), jnp.uint8), *scales)
    text = traced.lower() if cuda_device else traced.lower(lowering_platforms=("cuda",))
    text = text.as_text()
    assert _is_triton(text)
    call = re.search(r"custom_call @\S+\((%[^)]*)\)", text)
    assert call and len(call.group(1).split(",")) == 2 + len(scales)
    assert f"tensor<{n}x{k // 32}xf16>" in text and f"tensor<{n}x{k // 32}xf32>" not in text
