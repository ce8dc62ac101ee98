"""A tiny llama-architecture ``.gguf`` written with the ``gguf`` package: random weights, its
decoder projections in one llama.cpp block format (Q8_0, Q4_0, Q4_1, or F32), no tokenizer
(the loader tests feed token ids). The layout is llama.cpp's own, so jaxserve reads it as it reads
a converted checkpoint."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

SHAPE = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=256)
_PROJECTIONS = {"attn_q": ("hidden", "hidden"), "attn_k": ("kv", "hidden"), "attn_v": ("kv", "hidden"),
                "attn_output": ("hidden", "hidden"), "ffn_gate": ("intermediate", "hidden"),
                "ffn_up": ("intermediate", "hidden"), "ffn_down": ("hidden", "intermediate")}


def write_tiny_gguf(path: str | Path, projections: str = "Q8_0", seed: int = 0,
                    overrides: dict[str, str] | None = None, vocab: int | None = None) -> Path:
    """The file at ``path``; ``overrides`` gives some tensors (GGUF names) another type; ``vocab``
    rows instead of SHAPE's (to match a tokenizer served beside it)."""
    rng = np.random.default_rng(seed)
    s = {**SHAPE, "vocab": vocab or SHAPE["vocab"]}
    dims = {"hidden": s["hidden"], "intermediate": s["intermediate"],
            "kv": s["kv_heads"] * s["hidden"] // s["heads"]}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(s["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["intermediate"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s["vocab"])
    types = dict(overrides or {})

    def add(name: str, values: np.ndarray, qtype: str) -> None:
        kind = gguf.GGMLQuantizationType[types.get(name, qtype)]
        data = values if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(values, kind)
        writer.add_tensor(name, data, raw_dtype=kind)

    add("token_embd.weight", rng.standard_normal((s["vocab"], s["hidden"]), np.float32) * 0.5, "F32")
    add("output_norm.weight", 1 + 0.1 * rng.standard_normal(s["hidden"], np.float32), "F32")
    for i in range(s["layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            add(f"blk.{i}.{norm}.weight", 1 + 0.1 * rng.standard_normal(s["hidden"], np.float32), "F32")
        for name, (out, inp) in _PROJECTIONS.items():
            w = rng.standard_normal((dims[out], dims[inp]), np.float32) / np.sqrt(dims[inp])
            add(f"blk.{i}.{name}.weight", w, projections)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
