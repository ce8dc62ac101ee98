"""The typed step inputs and their one-transfer packing: ``pack`` lays a ``StepArrays`` out in one
int32 buffer, ``unpack`` (in a jitted function) and ``decode`` (on the host) rebuild it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.packing import PackLayout, decode, pack, unpack
from jaxserve.runner.step_inputs import ModelInputs, StepArrays, flag
from jaxserve.sample.metadata import SamplingMetadata, padding_arrays

T, R, P = 7, 3, 4


def _step_arrays(seed: int = 0) -> StepArrays:
    rng = np.random.default_rng(seed)
    ints = {f.name: rng.integers(-9, 99, T).astype(np.int32) for f in dataclasses.fields(ModelInputs)}
    model = ModelInputs(**{**ints, "token_is_output": rng.random(T) < 0.5,
                           "block_tables": rng.integers(0, 9, (R, P)).astype(np.int32),
                           "kv_lens": np.arange(R, dtype=np.int32), "query_start_loc": np.arange(R + 1, dtype=np.int32),
                           "num_seqs": np.asarray([2], np.int32), "logits_indices": np.arange(R, dtype=np.int32),
                           "row_slots": np.asarray([4, 1, 6], np.int32)})
    sampling = padding_arrays(R, max_logit_bias=2, max_allowed_tokens=3)
    sampling["temperature"] = np.asarray([0.5, -1.25, 3e-8], np.float32)
    sampling["seeds"] = np.asarray([0, 2**32 - 1, 12345], np.uint32)
    sampling["has_allowed"] = np.asarray([True, False, True])
    return StepArrays(model, SamplingMetadata.from_arrays(sampling), need_logprobs=flag(True), use_bitmask=flag(False))


def _assert_same(got: StepArrays, want: StepArrays) -> None:
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    want_leaves, want_def = jax.tree_util.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)


def test_the_layout_names_every_field_in_order_and_sizes_one_buffer():
    inputs = _step_arrays()
    layout = PackLayout.of(inputs)
    names = [f.name for f in layout.fields]
    assert names[:3] == ["model.input_ids", "model.prev_rows", "model.positions"]
    assert names[-2:] == ["need_logprobs", "use_bitmask"]
    assert "sampling.temperature" in names and "model.block_tables" in names
    # Every leaf starts on a 256-byte boundary (a Mosaic GPU kernel refuses an operand that does
    # not), the leaves do not overlap, and the buffer ends on a boundary too.
    assert all(f.offset * 4 % 256 == 0 for f in layout.fields)
    assert all(a.offset + a.size <= b.offset for a, b in zip(layout.fields, layout.fields[1:]))
    last = layout.fields[-1]
    assert layout.total * 4 % 256 == 0 and last.offset + last.size <= layout.total < last.offset + last.size + 64
    assert layout.total >= sum(np.asarray(x).size for x in jax.tree_util.tree_leaves(inputs))
    assert hash(layout) == hash(PackLayout.of(_step_arrays(1)))  # a static argument: same shapes, same program


def test_unpack_in_a_jitted_step_and_decode_on_the_host_rebuild_the_typed_inputs():
    inputs = _step_arrays()
    layout = PackLayout.of(inputs)
    buf = pack(inputs, layout)
    assert buf.dtype == np.int32 and buf.shape == (layout.total,)
    device = jax.jit(lambda b: unpack(b, layout))(jnp.asarray(buf))
    host = decode(buf, layout)
    assert isinstance(device, StepArrays) and isinstance(host.model, ModelInputs)
    assert isinstance(host.sampling, SamplingMetadata)
    _assert_same(device, inputs)
    _assert_same(host, inputs)
    host.model.positions[0] = -5  # a copy: the buffer is untouched
    assert decode(buf, layout).model.positions[0] == inputs.model.positions[0]


def test_a_flag_joins_by_replace_and_the_prepared_inputs_stay_as_built():
    inputs = _step_arrays()
    layout = PackLayout.of(inputs)
    with_mask = dataclasses.replace(inputs, use_bitmask=flag(True))
    assert decode(pack(with_mask, layout), layout).use_bitmask.tolist() == [True]
    assert inputs.use_bitmask.tolist() == [False]
    with pytest.raises(dataclasses.FrozenInstanceError):
        inputs.use_bitmask = flag(True)  # type: ignore[misc]


def test_pack_refuses_a_wrong_shape_another_structure_and_decode_another_buffer():
    inputs = _step_arrays()
    layout = PackLayout.of(inputs)
    short = dataclasses.replace(inputs, model=dataclasses.replace(inputs.model, positions=np.zeros(T - 1, np.int32)))
    with pytest.raises(ValueError, match=r"model\.positions: shape \(6,\)"):
        pack(short, layout)
    with pytest.raises(ValueError, match="do not match the layout"):
        pack(inputs.model, layout)
    with pytest.raises(ValueError, match="does not match the layout"):
        decode(np.zeros(layout.total + 1, np.int32), layout)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _WithExtra:
    """A step input group with one more field, as a later feature adds one."""

    model: ModelInputs
    lora_slots: np.ndarray  # i32[R]


def test_a_new_field_is_packed_and_unpacked_with_no_other_change():
    inputs = _WithExtra(_step_arrays().model, np.asarray([2, -1, 0], np.int32))
    layout = PackLayout.of(inputs)
    assert layout.fields[-1].name == "lora_slots" and layout.fields[-1].shape == (R,)
    out = jax.jit(lambda b: unpack(b, layout))(jnp.asarray(pack(inputs, layout)))
    assert isinstance(out, _WithExtra) and out.lora_slots.tolist() == [2, -1, 0]
