#!/usr/bin/env python
"""End-to-end GPU check: greedy generation with each attention backend must match ``xla``.

Prints one JSON object: per backend, whether its greedy tokens equal the xla backend's on the
demo model (bfloat16 and float32), and the steps' compile counts; ``pallas+async`` is the pallas
backend with async scheduling (decode inputs fed from the device). ``mosaic`` (bf16, head_dim a
multiple of 64) runs on the demo model's shape widened to head_dim 64, against xla and pallas
there (``mosaic-d64/...`` keys), and ``auto``'s choice on this GPU is reported.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.models.demo import DEMO_ARCH, DEMO_SHAPE, build_checkpoint

ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks_override=512)


def main() -> None:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 1000, int(n)).tolist()} for n in rng.integers(1, 300, 12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    result: dict = {}
    for dtype in ("float32", "bfloat16"):
        tokens = {}
        for backend in ("xla", "pallas", "triton", "pallas+async"):
            try:
                llm = LLM(show_progress=False, attention_backend=backend.split("+")[0], dtype=dtype,
                          async_scheduling=backend.endswith("+async"), **ENGINE)
                tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                result[f"{dtype}/{backend}/compiles"] = llm.stats()["compile_num_compiles"]
                del llm
            except Exception as exc:  # noqa: BLE001 - keep going: report every backend
                result[f"{dtype}/{backend}/error"] = repr(exc)[:500]
                traceback.print_exc(file=sys.stderr)
        for backend in ("pallas", "triton", "pallas+async"):
            if backend in tokens and "xla" in tokens:
                same = sum(a == b for a, b in zip(tokens[backend], tokens["xla"]))
                result[f"{dtype}/{backend}/greedy_equal_to_xla"] = f"{same}/{len(prompts)}"
    mosaic_check(prompts, params, result)
    print(json.dumps(result, indent=1))


def mosaic_check(prompts, params, result: dict) -> None:
    """mosaic against xla and pallas on a head_dim-64 variant of the demo model, in bf16."""
    try:
        folder = build_checkpoint("/tmp/jaxserve-demo-d64", DEMO_ARCH, {**DEMO_SHAPE, "head_dim": 64}, seed=0,
                                  vocab_size=1024, max_position_embeddings=2048)
    except Exception as exc:  # noqa: BLE001
        result["mosaic-d64/error"] = repr(exc)[:500]
        return
    tokens = {}
    for backend in ("xla", "pallas", "mosaic", "auto"):
        try:
            llm = LLM(str(folder), show_progress=False, attention_backend=backend, dtype="bfloat16", **ENGINE)
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            if backend == "auto":
                result["mosaic-d64/auto_picks"] = llm.stats()["attention_backend"]
            del llm
        except Exception as exc:  # noqa: BLE001 - keep going: report every backend
            result[f"mosaic-d64/{backend}/error"] = repr(exc)[:500]
            traceback.print_exc(file=sys.stderr)
    for other in ("xla", "pallas"):
        if "mosaic" in tokens and other in tokens:
            same = sum(a == b for a, b in zip(tokens["mosaic"], tokens[other]))
            result[f"mosaic-d64/greedy_equal_to_{other}"] = f"{same}/{len(prompts)}"


if __name__ == "__main__":
    main()
