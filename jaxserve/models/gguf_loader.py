"""Read a GGUF file (llama.cpp's single-file checkpoint) as a Hugging Face checkpoint, as vLLM does.

``GGUFCheckpoint`` maps the file's metadata to an HF-style ``config.json`` dict and its tensors
to HF parameter names, one :class:`GGUFTensor` at a time: the blocks as stored (memory-mapped,
still quantized), with llama.cpp's rotary reordering of the query/key rows already undone.
:func:`dequantize` turns one into floats. A loader is a loop over ``tensors()`` calling one
function per tensor (``dequantize`` by default), so another policy (keeping some tensors
quantized) plugs in before the floats exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxserve.exceptions import ConfigError

# GGUF architecture -> the HF architecture jaxserve's decoder serves it as.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter interleaves the query/key rows of these (its rotary is GPT-J style).
_PERMUTED_ARCHITECTURES = ("llama", "mistral")

# Tensor types jaxserve dequantizes: floats, the legacy block quants and the K-quants, all of
# which the ``gguf`` package decodes in numpy.
SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str  # the HF parameter name, e.g. model.layers.0.self_attn.q_proj.weight
    qtype: str  # "F32", "Q4_1", ...
    shape: tuple[int, ...]  # logical HF shape (out, in)
    data: np.ndarray  # raw blocks as stored (one row per output row), Q/K rows already un-permuted


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(".gguf")


def hf_tensor_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _PER_LAYER:
        return f"model.layers.{parts[1]}.{_PER_LAYER[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_LEVEL:
        return f"{_TOP_LEVEL[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's ``permute`` of a query/key tensor's output rows: within each
    head it stores the rotary pairs interleaved (row ``2i`` and ``2i+1`` are HF's ``i`` and
    ``i + d/2``). Rows may be raw quant blocks: those run along the input dimension."""
    head_rows = rows.shape[0] // n_head
    return (rows.reshape(n_head, head_rows // 2, 2, *rows.shape[1:])
            .swapaxes(1, 2).reshape(rows.shape))


class GGUFCheckpoint:
    """One ``.gguf`` file, memory-mapped: its config (``hf_config``) and its tensors under HF
    names (``tensors``)."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"model: no such GGUF file: {path}")
        try:
            self._reader = gguf.GGUFReader(str(self.path), "r")
        except (ValueError, OSError) as exc:
            raise ConfigError(f"model: {path} is not a readable GGUF file: {exc}") from exc
        self.architecture = str(self._field("general.architecture"))
        if self.architecture not in _ARCHITECTURES:
            raise ConfigError(f"model: {path} is a GGUF of architecture {self.architecture!r}; jaxserve "
                              f"reads {', '.join(sorted(_ARCHITECTURES))}")

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture}.{key}", default)

    def _gguf_names(self) -> set[str]:
        return {t.name for t in self._reader.tensors}

    def hf_config(self) -> dict[str, Any]:
        """The file's metadata as a Hugging Face ``config.json`` dict (what transformers builds
        from it), which :meth:`ModelConfig.from_dict` reads."""
        heads = int(self._arch_field("attention.head_count"))
        hidden = int(self._arch_field("embedding_length"))
        names = self._gguf_names()
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._arch_field("vocab_size") or (len(tokens.data) if tokens is not None else None)
        if vocab is None:
            vocab = int(self._reader.get_tensor(self._index("token_embd.weight")).shape[-1])
        head_dim = self._arch_field("attention.key_length") or self._arch_field("rope.dimension_count")
        cfg: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_field("feed_forward_length")),
            "num_hidden_layers": int(self._arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv", heads)),
            "head_dim": int(head_dim or hidden // heads),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_output.bias" in names,
            "mlp_bias": "blk.0.ffn_gate.bias" in names,
            "dtype": self._file_dtype(),
        }
        scaling = self._arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            raise ConfigError(f"model: {self.path.name} uses rope scaling {scaling!r}, which jaxserve does "
                              "not read from a GGUF")
        window = self._arch_field("attention.sliding_window")
        if window:
            cfg.update(sliding_window=int(window), use_sliding_window=True)
        for hf_key, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                            ("pad_token_id", "padding_token_id")):
            value = self._field(f"tokenizer.ggml.{key}")
            if value is not None:
                cfg[hf_key] = int(value)
        return cfg

    def _file_dtype(self) -> str:
        """The dtype the weights were stored in before quantization: float32 unless every matrix is
        float16 or bfloat16 (a quantized file dequantizes to float32, as transformers does)."""
        kinds = {t.tensor_type.name for t in self._reader.tensors if len(t.shape) > 1}
        return {"F16": "float16", "BF16": "bfloat16"}.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"

    def _index(self, name: str) -> int:
        for i, t in enumerate(self._reader.tensors):
            if t.name == name:
                return i
        raise KeyError(name)

    @property
    def chat_template(self) -> str | None:
        return self._field("tokenizer.chat_template")

    def tensor_types(self) -> dict[str, str]:
        """HF name -> GGUF tensor type ("Q4_1", "F32", ...) of every tensor, without reading any data."""
        return {t.name: t.qtype for t in self._tensor_headers()}

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> logical HF shape of every tensor, without reading any data."""
        return {t.name: t.shape for t in self._tensor_headers()}

    def _tensor_headers(self) -> Iterator[GGUFTensor]:
        for t in self._reader.tensors:
            name = hf_tensor_name(t.name)
            if name is None:
                raise ConfigError(f"model: {self.path.name} holds tensor {t.name!r}, which jaxserve cannot "
                                  f"map to a {_ARCHITECTURES[self.architecture]} parameter")
            # ggml lists dimensions innermost first: (in, out) for a matrix.
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            yield GGUFTensor(name, t.tensor_type.name, shape, t.data)

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor under its HF name, its raw data memory-mapped; query/key rows back in HF's
        order for the architectures llama.cpp permutes."""
        cfg = self.hf_config() if self.architecture in _PERMUTED_ARCHITECTURES else None
        for t in self._tensor_headers():
            if cfg is not None and t.name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                    "self_attn.q_proj.bias", "self_attn.k_proj.bias")):
                heads = cfg["num_attention_heads"] if ".q_proj." in t.name else cfg["num_key_value_heads"]
                t = dataclasses.replace(t, data=unpermute_rows(np.asarray(t.data), heads))
            yield t


def dequantize(t: GGUFTensor, dtype: Any) -> np.ndarray:
    """``t``'s values in ``dtype`` (a numpy dtype or its name, ml_dtypes' bfloat16 included), in
    its logical HF shape. A type jaxserve cannot read is a ConfigError naming the tensor."""
    import gguf

    if t.qtype not in SUPPORTED_QTYPES:
        raise ConfigError(f"model: GGUF tensor {t.name} has type {t.qtype}, which jaxserve cannot read "
                          f"(it reads {', '.join(SUPPORTED_QTYPES)})")
    if t.qtype == "F32":
        values = np.asarray(t.data, np.float32)
    elif t.qtype == "F16":
        values = np.asarray(t.data).view(np.float16)
    else:
        values = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType[t.qtype])
    return values.reshape(t.shape).astype(np_dtype(dtype), copy=False)


def np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)
