"""``packing.decode`` reads a packed buffer back on the host exactly as the step unpacks it."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.runner.packing import PackLayout, decode, pack, unpack


def _groups():
    rng = np.random.default_rng(0)
    return {
        "model": {"positions": rng.integers(0, 99, 7).astype(np.int32),
                  "block_tables": rng.integers(0, 9, (3, 4)).astype(np.int32),
                  "flags": np.array([True, False, True])},
        "sampling": {"temperature": rng.random(3).astype(np.float32),
                     "seeds": np.array([0, 2**32 - 1, 12345], np.uint32)},
    }


def test_decode_round_trips_every_dtype_and_matches_unpack():
    groups = _groups()
    layout = PackLayout.of(groups)
    buf = pack(groups, layout)
    host, device = decode(buf, layout), unpack(buf, layout)
    for group, arrays in groups.items():
        for name, arr in arrays.items():
            got = host[group][name]
            assert got.dtype == arr.dtype and got.shape == arr.shape and np.array_equal(got, arr)
            assert np.array_equal(np.asarray(device[group][name]), got)
    host["model"]["positions"][0] = -5  # a copy: the buffer is untouched
    assert decode(buf, layout)["model"]["positions"][0] == groups["model"]["positions"][0]


def test_decode_refuses_a_buffer_of_another_layout():
    groups = _groups()
    layout = PackLayout.of(groups)
    with pytest.raises(ValueError, match="does not match the layout"):
        decode(np.zeros(layout.total + 1, np.int32), layout)
