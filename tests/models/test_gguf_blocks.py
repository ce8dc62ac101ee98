"""``--quantization gguf``: a ``.gguf`` file's Q8_0 / Q4_0 / Q4_1 projections kept in their blocks
(``BlockQuantLinear``), giving the logits of the same file dequantized at load; and the settings
that cannot keep them refused, naming why."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.exceptions import ConfigError
from jaxserve.layers import block_quant_linear
from jaxserve.layers.block_quant_linear import (
    KERNEL_MAX_ROWS,
    BlockQuantEmbedding,
    BlockQuantLinear,
    int8_max_rows,
)
from jaxserve.models.loader import load_gguf_model, load_model
from pallas_kernels.block_quant_matmul import int8_dots_available
from tests.models.paged_sequence import PagedSequence
from tests.models.tiny_gguf import SHAPE, write_tiny_gguf


@pytest.mark.parametrize("qtype, embedding", [("Q8_0", "F32"), ("Q4_0", "Q8_0"), ("Q4_1", "Q4_1")])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_kept_blocks_give_the_dequantized_files_logits(tmp_path, monkeypatch, qtype, embedding, scan_layers):
    """The projections' blocks, and the tied embedding's when it is a block format (it is the LM
    head too), give the logits of the file dequantized at load (float activations: the int8 ones
    are the next test's)."""
    monkeypatch.setattr(block_quant_linear, "INT8_MAX_ROWS", 0)
    monkeypatch.setattr(block_quant_linear, "Q8_INT8_MAX_ROWS", 0)
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, overrides={"token_embd.weight": embedding})
    kept = load_gguf_model(path, scan_layers=scan_layers, quantization="gguf")
    floats = load_gguf_model(path, scan_layers=scan_layers)
    layer = kept.layers.stacked if scan_layers else kept.layers[0]
    assert isinstance(layer.mlp.down_proj, BlockQuantLinear) and layer.mlp.down_proj.qtype == qtype
    kept_embedding = isinstance(kept.embed_tokens, BlockQuantEmbedding)
    assert kept_embedding == (embedding != "F32")
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab"], 134).tolist()
    # a prefill chunk longer than KERNEL_MAX_ROWS (dequantized in the step), then rows the kernel takes
    chunks = [tokens[:130], tokens[130:131], tokens[131:134]]
    assert len(chunks[0]) > KERNEL_MAX_ROWS
    kept_seq, float_seq = PagedSequence(kept), PagedSequence(floats)
    for chunk in chunks:
        np.testing.assert_allclose(kept_seq.feed(chunk), float_seq.feed(chunk), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not int8_dots_available(), reason="no AVX-512 VNNI: the kernel keeps float activations")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_decode_rows_with_int8_activations_stay_close_to_the_dequantized_files(tmp_path, qtype):
    """Steps of up to int8_max_rows rows multiply the projections by int8 activations (llama.cpp's
    path; the tied Q8_0 head keeps float ones): their logits differ from the float ones by the
    activations' rounding, a few thousandths of their range, not more (a wrong scale would be of
    order one), and not less (the path ran)."""
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, overrides={"token_embd.weight": "Q8_0"})
    kept_seq = PagedSequence(load_gguf_model(path, scan_layers=True, quantization="gguf"))
    float_seq = PagedSequence(load_gguf_model(path, scan_layers=True))
    tokens = np.random.default_rng(2).integers(0, SHAPE["vocab"], 20).tolist()
    kept_seq.feed(tokens[:16]), float_seq.feed(tokens[:16])
    rows = min(4, int8_max_rows(BlockQuantLinear(32, 32, qtype=qtype).bits))
    for i in range(16, 20, rows):
        want = float_seq.feed(tokens[i:i + rows])
        error = np.abs(kept_seq.feed(tokens[i:i + rows]) - want).max() / np.abs(want).max()
        assert 1e-6 < error < 0.02


@pytest.mark.skipif(not int8_dots_available(), reason="no AVX-512 VNNI: the kernel keeps float activations")
def test_the_tied_q8_0_head_keeps_float_activations_where_projections_take_int8():
    """At a decode row count a Q8_0 projection's kernel call asks for int8 activations and the
    tied Q8_0 head's does not (int8 there changed SmolLM2's greedy answer); above
    Q8_INT8_MAX_ROWS the projection's does not either."""
    embedding = BlockQuantEmbedding(96, 64, qtype="Q8_0")
    proj = BlockQuantLinear(64, 96, qtype="Q8_0")

    def asks_int8(fn, rows: int) -> bool:
        text = jax.jit(fn).lower(jnp.ones((rows, 64), jnp.float32)).as_text()
        flags = {flag for flag in ("int8_activations = 0", "int8_activations = 1") if flag in text}
        assert len(flags) == 1, flags  # exactly one kernel call, with the attribute
        return flags == {"int8_activations = 1"}

    assert asks_int8(proj, 1) and asks_int8(proj, block_quant_linear.Q8_INT8_MAX_ROWS)
    assert not asks_int8(proj, block_quant_linear.Q8_INT8_MAX_ROWS + 1)
    assert not asks_int8(embedding.attend, 1)


@pytest.mark.skipif(not int8_dots_available(), reason="no AVX-512 VNNI: the kernel keeps float activations")
def test_a_drafts_q8_0_head_takes_int8_activations_when_set(tmp_path):
    """A served Q8_0 file's tied head keeps float activations (its projections take int8 ones);
    ``set_int8_activations`` (a draft model's) switches the head too, once: then the logits move
    from the served model's by the head's activation rounding, and stay close to the float file's."""
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q8_0", overrides={"token_embd.weight": "Q8_0"})
    served = load_gguf_model(path, scan_layers=True, quantization="gguf")
    draft = load_gguf_model(path, scan_layers=True, quantization="gguf")
    assert block_quant_linear.set_int8_activations(draft) == 1  # the tied head, the one float product
    assert block_quant_linear.set_int8_activations(draft) == 0
    float_seq = PagedSequence(load_gguf_model(path, scan_layers=True))
    served_seq, draft_seq = PagedSequence(served), PagedSequence(draft)
    tokens = np.random.default_rng(3).integers(0, SHAPE["vocab"], 20).tolist()
    for seq in (float_seq, served_seq, draft_seq):
        seq.feed(tokens[:16])
    want, served_logits = float_seq.feed(tokens[16:]), served_seq.feed(tokens[16:])
    drafted = draft_seq.feed(tokens[16:])
    scale = np.abs(want).max()
    assert np.abs(drafted - served_logits).max() / scale > 1e-6  # the head's path changed
    assert np.abs(drafted - want).max() / scale < 0.02


def test_kept_blocks_hold_a_quarter_of_the_float_bytes(tmp_path):
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    kept = load_gguf_model(path, quantization="gguf")
    proj = kept.layers[0].mlp.gate_up_proj
    nbytes = sum(int(np.prod(p.shape)) * jnp.dtype(p.dtype).itemsize for p in (proj.qs, proj.d, proj.m))
    assert nbytes * 4 < 2 * SHAPE["intermediate"] * SHAPE["hidden"] * 4  # float32: 4 bytes a weight


def test_settings_that_cannot_keep_blocks_are_refused_naming_why(tmp_path, qwen3_checkpoint):
    mixed = write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_1", overrides={"blk.1.ffn_down.weight": "Q8_0"})
    with pytest.raises(ConfigError, match="Q4_1, Q8_0"):
        load_gguf_model(mixed, quantization="gguf")
    with pytest.raises(ConfigError, match="F32"):
        load_gguf_model(write_tiny_gguf(tmp_path / "f32.gguf", "F32"), quantization="gguf")
    # four shards would cut o_proj's 64 inputs into 16 a device: half a block
    with pytest.raises(ConfigError, match="tensor_parallel_size 4: self_attn.o_proj splits its 64 inputs into 16"):
        load_gguf_model(write_tiny_gguf(tmp_path / "q8.gguf", "Q8_0"), quantization="gguf", tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="not a .gguf"):
        load_model(qwen3_checkpoint, quantization="gguf")


def test_kept_blocks_come_from_the_start_up_cache_without_parsing_the_file(tmp_path, monkeypatch):
    from flax import nnx

    from jaxserve.models import loader

    monkeypatch.setenv("JAXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    first = nnx.state(load_gguf_model(path, quantization="gguf"))
    assert list((tmp_path / "cache" / "gguf").glob("*/blocks-float32/manifest.json"))

    def no_parse(*_args, **_kwargs):
        raise AssertionError("a cache hit parsed the .gguf file")

    monkeypatch.setattr(loader, "GGUFCheckpoint", no_parse)
    again = load_gguf_model(path, quantization="gguf")
    assert isinstance(again.layers[0].mlp.gate_up_proj, BlockQuantLinear)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(nnx.state(again)), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_scanned_step_reads_each_layers_blocks_in_place(tmp_path):
    """A scanned model's block matmuls get the whole (layers, ...) stack and the layer index: the
    compiled decode step copies no layer's blocks out of the stack (on XLA:CPU the scan's slice
    feeding a custom call is a copy of the blocks, every layer, every step)."""
    import re

    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1")
    model = load_gguf_model(path, scan_layers=True, quantization="gguf")
    seq = PagedSequence(model)
    ids, md = seq.inputs([5])
    hlo = seq.step.lower(seq.state, ids, seq.kv, md).compile().as_text()
    stacked = model.layers.stacked
    shapes = [tuple(p.qs.shape) for p in (stacked.self_attn.qkv_proj, stacked.self_attn.o_proj,
                                           stacked.mlp.gate_up_proj, stacked.mlp.down_proj)]
    assert all(s[0] == SHAPE["layers"] for s in shapes)
    operands = re.findall(r"custom_call_target=\"jaxserve_block_quant_matmul_cpu\".*?"
                          r"operand_layout_constraints=\{f32\[[\d,]+\]\{[\d,]+\}, u8\[([\d,]+)\]", hlo)
    read = {tuple(int(v) for v in s.split(",")) for s in operands}
    assert set(shapes) <= read, (shapes, read)  # each projection's kernel reads the stack itself
    for _, n, width in shapes:  # and no layer's blocks are sliced out (copied) anywhere
        assert not re.search(rf"= u8\[(1,)?{n},{width}\]", hlo), f"a [{n}, {width}] slice of the blocks"


def test_a_scanned_decode_step_moves_no_kv_pool_or_blocks(tmp_path):
    """The one-row decode step of a scanned GGUF model, compiled as the engine runs it on a CPU
    (the C++ attention, the KV pools donated), materialises no copy, transpose or slice as large
    as one layer's share of a KV pool, nor any layer's blocks. A one-token KV write used to copy
    both whole pools every layer: XLA made the scatter a dynamic-update-slice, and behind the
    flat view of the pool its dropped-slot check read the old row apart from the update."""
    from flax import nnx

    import pallas_kernels
    from jaxserve import envs
    from jaxserve.bench.hlo_stats import analyze_hlo, large_moves

    ok, reason = pallas_kernels.cpu_attention_available(envs.kernel_build_dir())
    if not ok:
        pytest.skip(f"the cpu attention backend: {reason}")
    path = write_tiny_gguf(tmp_path / "m.gguf", "Q4_1", overrides={"token_embd.weight": "Q8_0"})
    model = load_gguf_model(path, scan_layers=True, quantization="gguf")
    seq = PagedSequence(model)

    def step(state, ids, kv, md):
        merged = nnx.merge(seq.graphdef, state)
        hidden, kv = merged(ids, kv, md, pallas_kernels.ragged_paged_attention_cpu)
        return merged.compute_logits(hidden), kv

    ids, md = seq.inputs([5])
    hlo = jax.jit(step, donate_argnums=(2,)).lower(seq.state, ids, seq.kv, md).compile().as_text()
    pool = seq.kv[0]
    layer_pool_bytes = pool.nbytes // pool.shape[0]
    assert not large_moves(hlo, layer_pool_bytes), large_moves(hlo, layer_pool_bytes)
    blocks = {(str(p.dtype).replace("uint8", "u8").replace("float32", "f32"), tuple(p.shape))
              for p in jax.tree.leaves(nnx.state(model.layers.stacked)) if p.ndim == 3}
    assert blocks and not analyze_hlo(hlo, blocks, set()).weight_copies
