"""The HLO collective counter on the text forms XLA prints: synchronous ops (CPU) and the
asynchronous start/done pairs (GPU), each counted once, with the all-gathers' result shapes."""

from jaxserve.bench.hlo_collectives import count_collectives

CPU_TEXT = """
  %all-reduce.1 = f32[16,64]{1,0} all-reduce(f32[16,64]{1,0} %dot.1), channel_id=1, to_apply=%add
  %all-reduce.2 = f32[16,64]{1,0} all-reduce(f32[16,64]{1,0} %dot.2), channel_id=2, to_apply=%add
  %all-gather.3 = f32[4,512]{1,0} all-gather(f32[4,256]{1,0} %dot.3), channel_id=3, dimensions={1}
"""
GPU_TEXT = """
  %all-reduce-start = bf16[16,1024]{1,0} all-reduce-start(bf16[16,1024]{1,0} %fusion.2), to_apply=%add
  %all-reduce-done = bf16[16,1024]{1,0} all-reduce-done(bf16[16,1024]{1,0} %all-reduce-start)
  %all-gather-start = (bf16[1024,512]{1,0}, bf16[1024,4096]{1,0}) all-gather-start(bf16[1024,512]{1,0} %p), dims={1}
  %all-gather-done = bf16[1024,4096]{1,0} all-gather-done(%all-gather-start)
"""


def test_synchronous_collectives_are_counted_with_gather_shapes():
    found = count_collectives(CPU_TEXT)
    assert found.counts["all-reduce"] == 2 and found.counts["all-gather"] == 1
    assert found.all_gather_shapes == ((4, 512),)
    assert found.weight_all_gathers([(1024, 4096)]) == []


def test_async_pairs_count_once_and_a_gathered_weight_is_named():
    found = count_collectives(GPU_TEXT)
    assert found.counts["all-reduce"] == 1 and found.counts["all-gather"] == 1
    assert found.weight_all_gathers([(1024, 4096), (64,)]) == [(1024, 4096)]
    assert found.weight_all_gathers([(4096, 1024)]) == [(1024, 4096)]  # a tied head: the embedding, transposed


def test_text_without_collectives_counts_nothing():
    assert not any(count_collectives("%dot = f32[2,2]{1,0} dot(%a, %b)").counts.values())


# A 256-row bucket's logits gathered over the vocabulary have the shape of a 256-wide tied
# embedding transposed; what they gather was made by a matmul (as XLA prints it on a GPU, a gemm
# fusion; on a CPU, a dot), a weight by none.
PRODUCT_TEXT = """
  %gemm_fusion.7 = bf16[256,512]{0,1} fusion(%p.1, %p.2), kind=kCustom, metadata={op_name="jit(f)/dot_general"}
  %all-gather-start = (bf16[256,512]{0,1}, bf16[256,1024]{0,1}) all-gather-start(%gemm_fusion.7), dimensions={1}
  %all-gather-done = bf16[256,1024]{0,1} all-gather-done(%all-gather-start)
  %dot.2 = f32[256,512]{1,0} dot(f32[256,64]{1,0} %x, f32[64,512]{1,0} %w), lhs_contracting_dims={1}
  %all-gather.3 = f32[256,1024]{1,0} all-gather(f32[256,512]{1,0} %dot.2), channel_id=3, dimensions={1}
  %copy.4 = bf16[512,256]{1,0} copy(bf16[512,256]{1,0} %embedding), metadata={op_name="jit(f)/transpose"}
  %all-gather.5 = bf16[1024,256]{1,0} all-gather(bf16[512,256]{1,0} %copy.4), channel_id=5, dimensions={0}
"""


def test_a_gathered_matmul_product_is_no_weight_even_with_a_weights_shape():
    found = count_collectives(PRODUCT_TEXT)
    assert found.counts["all-gather"] == 3
    assert found.gathered_products == (True, True, False)
    # the embedding [1024, 256] gathered whole is named; the two logits gathers are not
    assert found.weight_all_gathers([(1024, 256)]) == [(1024, 256)]
    assert count_collectives(PRODUCT_TEXT.split("%copy.4")[0]).weight_all_gathers([(1024, 256)]) == []
