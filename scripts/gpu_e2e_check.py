#!/usr/bin/env python
"""End-to-end GPU check: greedy generation with each attention backend must match ``xla``.

Prints one JSON object: per backend, whether its greedy tokens equal the xla backend's on the
random demo model (``jaxserve-demo``: the default SmolLM2 would try pip on a machine with no
network; bfloat16 and float32), and the steps' compile counts; ``pallas+async`` is the pallas
backend with async scheduling (decode inputs fed from the device). ``mosaic`` (bf16, head_dim a
multiple of 64) runs on the demo model's shape widened to head_dim 64, against xla and pallas
there (``mosaic-d64/...`` keys), and ``auto``'s choice on this GPU is reported. The object so far
is rewritten to ``--partial PATH`` after each engine, so a run cut by its timeout still reports.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import numpy as np

from jaxserve import LLM, SamplingParams
from jaxserve.models.demo import DEMO_ARCH, DEMO_MODEL_NAME, DEMO_SHAPE, build_checkpoint

ENGINE = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, num_gpu_blocks_override=512)


class Report(dict):
    """The result so far; each ``save`` rewrites the partial file (one JSON object)."""

    def __init__(self, path: str | None):
        super().__init__()
        self.path = path

    def save(self) -> None:
        if self.path:
            with open(self.path + ".tmp", "w") as f:
                json.dump(self, f, indent=1)
            os.replace(self.path + ".tmp", self.path)


def main() -> None:
    partial = sys.argv[sys.argv.index("--partial") + 1] if "--partial" in sys.argv else None
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 1000, int(n)).tolist()} for n in rng.integers(1, 300, 12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    result = Report(partial)
    # bf16 first (what a GPU serves), then the mosaic model, then float32: a cut run keeps the most.
    demo_check("bfloat16", prompts, params, result)
    mosaic_check(prompts, params, result)
    demo_check("float32", prompts, params, result)
    print(json.dumps(result, indent=1))


def demo_check(dtype: str, prompts, params, result: Report) -> None:
    """Every backend against xla on the demo model in ``dtype``."""
    tokens = {}
    for backend in ("xla", "pallas", "triton", "pallas+async"):
        try:
            llm = LLM(DEMO_MODEL_NAME, show_progress=False, attention_backend=backend.split("+")[0], dtype=dtype,
                      async_scheduling=backend.endswith("+async"), **ENGINE)
            tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            result[f"{dtype}/{backend}/compiles"] = llm.stats()["compile_num_compiles"]
            del llm
        except Exception as exc:  # noqa: BLE001 - keep going: report every backend
            result[f"{dtype}/{backend}/error"] = repr(exc)[:500]
            traceback.print_exc(file=sys.stderr)
        if backend != "xla" and backend in tokens and "xla" in tokens:
            same = sum(a == b for a, b in zip(tokens[backend], tokens["xla"]))
            result[f"{dtype}/{backend}/greedy_equal_to_xla"] = f"{same}/{len(prompts)}"
        result.save()


def record_step_args(result: Report, key: str) -> None:
    """When a warm-up step fails, record the step's arguments in flattened order (path, shape,
    dtype, device address modulo 256): a GPU program may demand aligned inputs."""
    import jax

    from jaxserve.runner.model_runner import ModelRunner

    original = ModelRunner._run_padding_step

    def run(self, variant):
        leaves = jax.tree_util.tree_flatten_with_path((self.model_state, self.state))[0]
        rows = []
        for path, leaf in leaves:
            try:
                address = leaf.unsafe_buffer_pointer() % 256
            except Exception:  # noqa: BLE001 - not a single-device array
                address = None
            rows.append([jax.tree_util.keystr(path), list(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", "")),
                         address])
        try:
            return original(self, variant)
        except Exception:
            result[key] = {"first": rows[:8], "unaligned": [r for r in rows if r[3]][:20], "num_leaves": len(rows)}
            result.save()
            raise

    ModelRunner._run_padding_step = run


def mosaic_check(prompts, params, result: Report) -> None:
    """mosaic against xla and pallas on a head_dim-64 variant of the demo model, in bf16."""
    record_step_args(result, "mosaic-d64/failed_step_args")
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
        result.save()
    for other in ("xla", "pallas"):
        if "mosaic" in tokens and other in tokens:
            same = sum(a == b for a, b in zip(tokens["mosaic"], tokens[other]))
            result[f"mosaic-d64/greedy_equal_to_{other}"] = f"{same}/{len(prompts)}"


if __name__ == "__main__":
    main()
