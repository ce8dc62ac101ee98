"""``--quantization gguf`` holds a ``.gguf`` file's blocks in the file's own bytes: the engine's
weight-bytes stat is the kept tensors' bytes as stored plus the float tensors' (the scales stay
float16, and Q8_0 / Q4_0 keep no minimums)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from jaxserve import LLM
from tests.models.tiny_gguf import write_tiny_gguf
from tests.tiny_models import build_tiny_checkpoint

# bytes a block of 32 weights takes in a .gguf file: float16 scale (and minimum), then the quants
FILE_BYTES_PER_32 = {"Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16, "Q8_0": 2 + 32}
# the projections the engine keeps in blocks, as a .gguf file names them
KEPT_GGUF_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.mark.parametrize("qtype, embedding", [("Q4_1", "Q8_0"), ("Q4_0", "Q4_0"), ("Q8_0", "F32")])
def test_weight_bytes_are_the_files_blocks_and_the_float_tensors(tmp_path, qtype, embedding):
    path = write_tiny_gguf(tmp_path / "m.gguf", qtype, seed=3, vocab=512,
                           overrides={"token_embd.weight": embedding})
    tokenizer = str(build_tiny_checkpoint(tmp_path / "dense", "LlamaForCausalLM", seed=3))
    llm = LLM(str(path), tokenizer=tokenizer, quantization="gguf", show_progress=False, max_model_len=64,
              max_num_seqs=2, num_gpu_blocks_override=24, block_size=4, compilation_cache_dir="off")
    kept_weights: dict[str, int] = {}
    kept_bytes = float_bytes = 0
    for t in gguf.GGUFReader(str(path)).tensors:
        kind = t.tensor_type.name
        if kind in FILE_BYTES_PER_32 and (t.name.split(".")[-2] in KEPT_GGUF_NAMES or t.name == "token_embd.weight"):
            kept_bytes += int(t.n_bytes)
            kept_weights[kind] = kept_weights.get(kind, 0) + int(t.n_elements)
        else:  # served in float32 on a CPU
            float_bytes += int(t.n_elements) * np.dtype(np.float32).itemsize
    # the table above is the file's: each kept tensor's stored bytes, 32 weights at a time
    assert kept_bytes == sum(FILE_BYTES_PER_32[k] * n // 32 for k, n in kept_weights.items())
    assert set(kept_weights) == {qtype} | ({embedding} - {"F32"})
    assert llm.stats()["weight_bytes"] == kept_bytes + float_bytes
