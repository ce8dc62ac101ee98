"""Routing of float products to the small-row CPU kernel (``jaxserve/layers/dense_matmul.py``):
few rows on a CPU lower to the kernel and more rows to XLA's dot; a scanned model's projections
read their layer of the stack in place, and its logits match the unrolled model's."""

from __future__ import annotations

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.dense_matmul import KERNEL_MAX_ROWS, dense_product
from jaxserve.layers.linear import linear
from jaxserve.models.loader import load_model
from tests.models.paged_sequence import PagedSequence, prompt
from tests.tiny_models import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None, reason="no C++ compiler")
TARGET = "jaxserve_dense_matmul_cpu"


def hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


@pytest.mark.parametrize("transposed", [False, True])
def test_few_rows_take_the_kernel_and_more_rows_the_dot(transposed):
    w = jnp.ones((40, 24), jnp.float32)
    k = 24 if transposed else 40
    few, many = jnp.ones((KERNEL_MAX_ROWS, k)), jnp.ones((KERNEL_MAX_ROWS + 1, k))
    assert TARGET in hlo(lambda x, w: dense_product(x, w, transposed=transposed), few, w)
    assert TARGET not in hlo(lambda x, w: dense_product(x, w, transposed=transposed), many, w)


def test_a_gpu_lowering_never_sees_the_kernel():
    x, w = jnp.ones((4, 40)), jnp.ones((40, 24))
    text = jax.jit(lambda x, w: dense_product(x, w)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert TARGET not in text and "dot" in text


def test_a_stacked_linear_with_its_bias_matches_the_sliced_dot():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((3, 40, 24), np.float32))
    b = jnp.asarray(rng.standard_normal((3, 24), np.float32))
    x = jnp.asarray(rng.standard_normal((4, 40), np.float32))
    got = jax.jit(lambda x, w, b, i: linear(x, w, b, layer=i))(x, w, b, 1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w[1] + b[1]), rtol=1e-5, atol=1e-5)


def test_a_scanned_model_reads_each_projection_in_place_and_matches_the_unrolled_one(tmp_path):
    """The decode step of a scanned float model hands the kernel each projection's whole stack
    (no layer's weight sliced out), and its logits equal the unrolled model's within float32
    rounding (both take the kernel at these row counts)."""
    folder = build_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", num_hidden_layers=3)
    scanned, unrolled = load_model(folder, scan_layers=True), load_model(folder, scan_layers=False)
    stacked = scanned.layers.stacked
    shapes = [tuple(p.kernel.shape) for p in (stacked.self_attn.qkv_proj, stacked.self_attn.o_proj,
                                               stacked.mlp.gate_up_proj, stacked.mlp.down_proj)]
    assert all(s[0] == 3 for s in shapes)
    seq = PagedSequence(scanned)
    ids, md = seq.inputs([5])
    text = seq.step.lower(seq.state, ids, seq.kv, md).compile().as_text()
    operands = re.findall(rf"custom_call_target=\"{TARGET}\".*?operand_layout_constraints="
                          r"\{f32\[[\d,]+\]\{[\d,]+\}, f32\[([\d,]+)\]", text)
    read = {tuple(int(v) for v in s.split(",")) for s in operands}
    assert set(shapes) <= read, (shapes, read)
    for _, k, n in shapes:
        assert not re.search(rf"= f32\[(1,)?{k},{n}\]", text), f"a [{k}, {n}] slice of a projection stack"
    tokens = prompt(6)
    a, b = PagedSequence(scanned), PagedSequence(unrolled)
    for chunk in (tokens[:4], tokens[4:5], tokens[5:6]):
        np.testing.assert_allclose(a.feed(chunk), b.feed(chunk), rtol=1e-5, atol=1e-5)
