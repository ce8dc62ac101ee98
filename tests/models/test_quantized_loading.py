"""Online --quantization at load: the quantized model matches the float one it came from."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy.special import log_softmax

from jaxserve.exceptions import ConfigError
from jaxserve.models.loader import load_model
from tests.models.paged_sequence import PagedSequence, prompt

PROJECTIONS = ("self_attn/qkv_proj", "self_attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj")


def _projections(model) -> dict[str, dict[str, np.ndarray]]:
    """Each projection of layer 0 as numpy: {"qkv_proj": {"kernel": ..., "kernel_scale": ...}}."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for path, value in nnx.to_flat_state(nnx.state(model)):
        names = [str(p) for p in path]
        if names[0] == "layers" and names[1] == "0" and "/".join(names[2:4]) in PROJECTIONS:
            out.setdefault(names[3], {})[names[4]] = np.asarray(value.get_value(), np.float32)
    return out


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints["LlamaForCausalLM"]


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_dequantized_weights_match_float_in_every_layout(llama, method, tp):
    """Same layout (tensor-parallel column order), each column within its quantization step; the
    row-split projections' scales come from whole columns, not from one shard's rows."""
    ref = _projections(load_model(llama, "float32", scan_layers=False, tensor_parallel_size=tp))
    quant = _projections(load_model(llama, "float32", scan_layers=False, tensor_parallel_size=tp,
                                    quantization=method))
    for name, parts in quant.items():
        w, scale = ref[name]["kernel"], parts["kernel_scale"]
        assert scale.shape == (w.shape[1],)
        assert np.allclose(scale, np.abs(w).max(axis=0) / (127 if method == "int8" else 448), rtol=1e-6)
        step = scale / 2 if method == "int8" else np.abs(w) / 16 + scale * 2.0**-9
        assert np.all(np.abs(parts["kernel"] * scale - w) <= step + 1e-7), name


def test_quantized_model_logits_close_to_float(llama):
    ids = prompt(24, seed=3)
    ref = PagedSequence(load_model(llama, "float32", scan_layers=True)).feed(ids)
    # int8 only: fp8's weights are checked above, and each model costs a compile.
    model = load_model(llama, "float32", scan_layers=True, quantization="int8")
    assert model.layers.stacked.mlp.down_proj.kernel[...].dtype == jnp.int8
    got = PagedSequence(model).feed(ids)
    assert np.abs(log_softmax(got, -1) - log_softmax(ref, -1)).max() < 0.05
    assert not np.allclose(got, ref)  # the weights really are quantized


def test_unknown_method_is_a_config_error(llama):
    with pytest.raises(ConfigError, match="quantization"):
        load_model(llama, quantization="int4")


def test_scales_are_sharded_with_their_columns():
    from jax.sharding import PartitionSpec

    from jaxserve.runner.mesh import TP_AXIS, param_spec

    # Scanned stacks carry a leading layer axis; the scale of a column-split kernel splits with it.
    assert param_spec(("layers", "stacked", "self_attn", "qkv_proj", "kernel_scale"), 2) == PartitionSpec(None, TP_AXIS)
    assert param_spec(("layers", 0, "mlp", "gate_up_proj", "kernel_scale"), 1) == PartitionSpec(TP_AXIS)
    for module in ("self_attn", "o_proj"), ("mlp", "down_proj"):  # row-split kernels: scales replicated
        assert param_spec(("layers", 0, *module, "kernel_scale"), 1) == PartitionSpec()
        assert param_spec(("layers", 0, *module, "kernel"), 2) == PartitionSpec(TP_AXIS, None)
