"""GGUF blocks kept (``--quantization gguf``) under tensor parallelism, on two fake CPU devices,
in a process of their own (as :mod:`tests.parallel.tp_runs`):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.parallel.tp_gguf_runs OUT.json

Two files, each served at tensor_parallel_size 1 and 2: Q8_0 projections with a float embedding,
through the C++ block kernel; Q4_1 projections and the tied embedding (the LM head) kept as Q4_1
blocks, through the dequantized dot (the kernel's row limit set to 0 in this process). Each is a
tiny ``.gguf`` written by :mod:`tests.models.tiny_gguf`, served by an ``LLM`` with chunked prefill;
the JSON holds each case's greedy tokens, their top logprobs, and the shapes each device holds of
the blocks. The Q8_0 file is also served scanned at tensor_parallel_size 2 (``"scanned": true``):
each layer's kernel then reads its blocks from the split (layers, ...) stack in place.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.parallel.device_runs import run_module

DEVICES = 2
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4,
              num_gpu_blocks_override=48, quantization="gguf")
LOGPROBS = 4
# (projections, token embedding, the C++ kernel's row limit: 0 sends every product to the dequantized dot)
FILES = (("Q8_0", "F32", None), ("Q4_1", "Q4_1", 0))


def run_case(path: str, tokenizer: str, tp: int, scanned: bool = False) -> dict:
    from jaxserve import LLM, SamplingParams

    llm = LLM(path, tokenizer=tokenizer, tensor_parallel_size=tp, show_progress=False, scan_layers=scanned,
              **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=LOGPROBS)
    prompts = [list(range(3, 40)), [5, 6, 7], list(range(100, 121))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.core.runner
    blocks = {".".join(map(str, path)): [list(s.data.shape) for s in x.addressable_shards]
              for path, x in _flat_blocks(runner)}
    return {
        "tp": tp,
        "scanned": scanned,
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[{str(k): v.logprob for k, v in row.items()} for row in o.outputs[0].logprobs]
                     for o in outputs],
        "block_shards": blocks,
    }


def _flat_blocks(runner) -> list:
    """The kept blocks' (path, array) as the runner holds them (its state, in graph order)."""
    from flax import nnx

    _, flat = nnx.flatten(nnx.merge(runner.graphdef, runner.model_state), with_paths=True)
    return [(path, x) for (path, _), x in zip(flat, runner.model_state, strict=True) if path[-1] in ("qs", "d", "m")]


def main(out: str) -> None:
    from jaxserve.layers import block_quant_linear
    from tests.models.tiny_gguf import write_tiny_gguf
    from tests.tiny_models import build_tiny_checkpoint

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = str(build_tiny_checkpoint(root / "dense", "LlamaForCausalLM", seed=3))
        default_rows = block_quant_linear.KERNEL_MAX_ROWS
        for qtype, embedding, kernel_rows in FILES:
            block_quant_linear.KERNEL_MAX_ROWS = default_rows if kernel_rows is None else kernel_rows
            path = str(write_tiny_gguf(root / f"{qtype}.gguf", qtype, seed=3, vocab=512,
                                       overrides={"token_embd.weight": embedding}))
            runs = [(1, False), (2, False)] + ([(2, True)] if kernel_rows is None else [])
            for tp, scanned in runs:
                results.append({"file": f"{qtype}/{embedding}", "kernel_rows": block_quant_linear.KERNEL_MAX_ROWS,
                                **run_case(path, tokenizer, tp, scanned)})
    Path(out).write_text(json.dumps(results))


def run_in_subprocess(out: Path, timeout: float) -> list[dict]:
    return run_module("tests.parallel.tp_gguf_runs", out, DEVICES, timeout)


if __name__ == "__main__":
    main(sys.argv[1])
