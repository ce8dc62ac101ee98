"""``pytorch_model.bin`` read without torch (jaxserve.models.torch_pickle); torch only writes the files."""

from __future__ import annotations

import pickle
import zipfile

import numpy as np
import pytest

from jaxserve.exceptions import ConfigError
from jaxserve.models.torch_pickle import TorchBinFile, open_state_dict_files

torch = pytest.importorskip("torch")


def test_tensors_read_as_torch_wrote_them(tmp_path):
    """Dtypes, views sharing a storage (offsets, transposes, strided columns), parameters and an
    empty tensor read back equal to torch's own values."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    state = {
        "w": base, "w_t": base.t(), "column": base[:, 3], "rows": base[2:5], "every_other": base[::2, 1::3],
        "bf16": torch.randn(5, 3, generator=g).to(torch.bfloat16), "f16": torch.randn(4, generator=g).half(),
        "ids": torch.arange(7) - 3, "int32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "mask": torch.tensor([True, False, True]), "param": torch.nn.Parameter(torch.randn(3, 2, generator=g)),
        "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5),
    }
    torch.save(state, tmp_path / "pytorch_model.bin")
    f = TorchBinFile(tmp_path / "pytorch_model.bin")
    assert f.keys() == list(state)
    for name, t in state.items():
        want = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
        got = f.get(name)
        assert f.shape(name) == tuple(t.shape) == got.shape
        if t.dtype == torch.bfloat16:
            assert str(got.dtype) == "bfloat16"
            got = got.astype(np.float32)
        else:
            assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert set(open_state_dict_files(tmp_path)) == set(state)


def test_a_pickle_naming_other_callables_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    with zipfile.ZipFile(tmp_path / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"w": Payload()}, protocol=2))
        z.writestr("archive/byteorder", "little")
    with pytest.raises(ConfigError, match=r"pickle names (posix|os|nt)\.system.*Convert the file to model\."):
        TorchBinFile(tmp_path / "pytorch_model.bin")
    assert not marker.exists()


def test_other_contents_are_refused_by_name(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(ConfigError, match=r"not a zip file \(torch's legacy format"):
        TorchBinFile(tmp_path / "legacy.bin")
    torch.save({"nested": {"w": torch.ones(2)}}, tmp_path / "nested.bin")
    with pytest.raises(ConfigError, match="not a flat state dict of tensors"):
        TorchBinFile(tmp_path / "nested.bin")
