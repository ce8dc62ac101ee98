"""Pre-quantized compressed-tensors checkpoints (int8/fp8, per-channel/per-tensor) load as stored
into QuantizedLinear, detected from config.json; what jaxserve cannot serve is a ConfigError.

The checkpoints are written by hand with jaxserve's safetensors writer, in the layout the
``compressed-tensors`` package writes (``x.weight`` int8/F8_E4M3 ``[out, in]``, ``x.weight_scale``
float32 ``[out, 1]`` per channel or ``[1]`` per tensor, ``quantization_config`` in config.json):
that package would install here (torch 2.13 satisfies it) but pulls loguru and pydantic into the
shared environment for a few lines of numpy.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from scipy.special import log_softmax

from jaxserve import LLM, SamplingParams
from jaxserve.exceptions import ConfigError
from jaxserve.models.loader import load_model
from jaxserve.models.quantize import FP8_E4M3_MAX, quantize_columns
from jaxserve.models.safetensors_io import open_checkpoint_files, save_file
from tests.models.paged_sequence import PagedSequence, prompt

_TYPES = {"int8": ("int", "int-quantized", 127.0), "fp8": ("float", "float-quantized", FP8_E4M3_MAX)}


def quantization_config(method: str, strategy: str, activations: bool = False) -> dict:
    kind, fmt, _ = _TYPES[method]
    inputs = ({"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True, "dynamic": True}
              if activations else None)
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "input_activations": inputs, "output_activations": None,
                "weights": {"num_bits": 8, "type": kind, "strategy": strategy, "symmetric": True,
                            "dynamic": False, "group_size": None, "block_structure": None, "actorder": None}}}}


def write_compressed(src: str, dst: Path, method: str, strategy: str, **kw) -> Path:
    """``src``'s float checkpoint with each decoder projection quantized as llm-compressor stores it."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    files = open_checkpoint_files(src)
    tensors: dict[str, np.ndarray] = {}
    for name, f in files.items():
        w = np.asarray(f.get(name))
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            tensors[name] = w
            continue
        if strategy == "channel":  # the online quantizer's own columns: [in, out] -> one scale per out
            q, scale = quantize_columns(w.T, method)
            q, scale = q.T, scale[:, None]
        else:
            amax = float(np.abs(w.astype(np.float32)).max())
            scale = np.array([amax / _TYPES[method][2]], np.float32)
            q = w.astype(np.float32) / scale
            q = (np.clip(np.rint(q), -127, 127).astype(np.int8) if method == "int8"
                 else q.astype(ml_dtypes.float8_e4m3fn))
        tensors[name], tensors[name + "_scale"] = np.ascontiguousarray(q), scale.astype(np.float32)
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(method, strategy, **kw)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _state(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, k)): np.asarray(v.get_value(), np.float32)
            for k, v in nnx.to_flat_state(nnx.state(model))}


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints["LlamaForCausalLM"]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_channel_checkpoint_is_the_online_quantized_model(llama, tmp_path, method):
    """Same int8/fp8 values and scales as --quantization METHOD of the float model, in TP order too."""
    folder = write_compressed(llama, tmp_path / method, method, "channel")
    for tp in (1, 2):
        got = load_model(folder, "float32", scan_layers=False, tensor_parallel_size=tp)
        ref = load_model(llama, "float32", scan_layers=False, tensor_parallel_size=tp, quantization=method)
        assert got.layers[0].mlp.down_proj.kernel[...].dtype == jnp.dtype(_STORED[method])
        a, b = _state(got), _state(ref)
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


_STORED = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


@pytest.fixture(scope="module")
def float_logits(llama):
    ids = prompt(24, seed=3)
    return ids, PagedSequence(load_model(llama, "float32", scan_layers=True)).feed(ids)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_tensor_checkpoint_close_to_float(llama, float_logits, tmp_path, method):
    folder = write_compressed(llama, tmp_path / method, method, "tensor", activations=method == "int8")
    model = load_model(folder, "float32", scan_layers=True, quantization="compressed-tensors")
    scale = np.asarray(model.layers.stacked.self_attn.qkv_proj.kernel_scale[...])
    cfg = model.config
    q_cols, kv_cols = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    # one scale per tensor, broadcast over its own columns: q, k and v each keep theirs
    for lo, hi in ((0, q_cols), (q_cols, q_cols + kv_cols), (q_cols + kv_cols, q_cols + 2 * kv_cols)):
        assert np.all(scale[:, lo:hi] == scale[:, lo:lo + 1])
    assert not np.all(scale == scale[:, :1])
    ids, ref = float_logits
    got = PagedSequence(model).feed(ids)
    bound = 0.1 if method == "int8" else 0.3  # a whole tensor's step is coarser than a column's
    assert np.abs(log_softmax(got, -1) - log_softmax(ref, -1)).max() < bound
    assert not np.allclose(got, ref)


def test_greedy_generation_through_llm(llama, tmp_path):
    """Detected with no flag: the engine serves it, and greedy tokens follow the online int8 model's."""
    folder = write_compressed(llama, tmp_path / "ct", "int8", "channel")
    params = SamplingParams(max_tokens=8, temperature=0)
    ids = prompt(12, seed=7)
    kw = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, show_progress=False)
    llm = LLM(str(folder), **kw)
    got = llm.generate([ids], params)[0].outputs[0].token_ids
    assert llm.stats()["quantization"] == "int8"  # the stored format, though no flag named it
    ref = LLM(llama, quantization="int8", **kw).generate([ids], params)[0].outputs[0].token_ids
    assert len(got) == 8 and list(got) == list(ref)


def _with_config(llama: str, tmp_path: Path, edit) -> Path:
    folder = write_compressed(llama, tmp_path / "bad", "int8", "channel")
    cfg = json.loads((folder / "config.json").read_text())
    qc = copy.deepcopy(cfg["quantization_config"])
    edit(qc, qc["config_groups"]["group_0"])
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("edit,field", [
    (lambda qc, g: g["weights"].update(strategy="group", group_size=128), "weights.strategy = 'group'"),
    (lambda qc, g: g["weights"].update(strategy="block"), "weights.strategy = 'block'"),
    (lambda qc, g: g["weights"].update(symmetric=False), "weights.symmetric = False"),
    (lambda qc, g: (g["weights"].update(num_bits=4), qc.update(format="pack-quantized")), "format = 'pack-quantized'"),
    (lambda qc, g: g["weights"].update(num_bits=4), "weights.num_bits = 4"),
    (lambda qc, g: g.update(input_activations={"num_bits": 8, "type": "int", "strategy": "tensor",
                                               "symmetric": True, "dynamic": False}),
     "input_activations.dynamic = False"),
    (lambda qc, g: qc.update(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore = 'model.layers.0"),
    (lambda qc, g: qc.update(quant_method="awq"), "quant_method = 'awq'"),
])
def test_unsupported_schemes_are_config_errors(llama, tmp_path, edit, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(".", r"\.")):
        load_model(_with_config(llama, tmp_path, edit), "float32")


def test_flag_mismatches_are_config_errors(llama, tmp_path):
    folder = write_compressed(llama, tmp_path / "ct", "fp8", "channel")
    with pytest.raises(ConfigError, match="pre-quantized"):
        load_model(folder, quantization="int8")
    with pytest.raises(ConfigError, match="no quantization_config"):
        load_model(llama, quantization="compressed-tensors")


def test_weights_stored_in_another_dtype_are_refused(llama, tmp_path):
    """An int8 checkpoint whose config says float (fp8) is never cast silently."""
    def to_float(qc, g):
        qc["format"] = "float-quantized"
        g["weights"]["type"] = "float"
    with pytest.raises(ConfigError, match="stored as int8, quantization_config says fp8"):
        load_model(_with_config(llama, tmp_path, to_float), "float32")
