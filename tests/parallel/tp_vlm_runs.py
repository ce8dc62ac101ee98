"""Vision-language engines split over two fake CPU devices, run in a process of their own (as
:mod:`.tp_runs`).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.parallel.tp_vlm_runs OUT.json

Each case builds an ``LLM`` on a tiny LLaVA or Qwen2.5-VL folder at ``tensor_parallel_size`` 1 or
2 and runs one batch (image prompts of several sizes, one with two images, and a text prompt) in
chunks of 16 tokens that cut through the images, then the first prompt again (a prefix hit through
its image). The JSON holds per case the greedy tokens, their top logprobs, the devices, the bytes
each holds of the language model's weights, and the compile and hit counts.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.parallel.device_runs import run_module

DEVICES = 2
CASES = [("llava", 1), ("llava", 2), ("qwen2_5_vl", 1), ("qwen2_5_vl", 2)]
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, max_num_encoder_input_tokens=64,
              block_size=4, attention_backend="xla", enable_prefix_caching=True)
LOGPROBS = 3


def image(seed: int, h: int, w: int):
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def prompts(family: str) -> list:
    tag = "<image>\n" if family == "llava" else "<|vision_start|><|image_pad|><|vision_end|>"
    one, two, three = image(1, 20, 28), image(2, 28, 16), image(3, 16, 16)
    return [{"prompt": f"{tag}what is it", "multi_modal_data": {"image": one}},
            {"prompt": f"look {tag}and {tag}compare", "multi_modal_data": {"image": [two, three]}},
            "a text-only prompt with a few words"]


def build(root: Path, family: str) -> str:
    from tests.tiny_vlms import build_tiny_llava, build_tiny_qwen2_5_vl

    folder = root / family
    folder.mkdir()
    (build_tiny_llava if family == "llava" else build_tiny_qwen2_5_vl)(folder)
    return str(folder)


def run_case(folder: str, family: str, tp: int) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.runner.mesh import bytes_per_device

    llm = LLM(folder, tensor_parallel_size=tp, show_progress=False, **ENGINE)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=LOGPROBS)
        ps = prompts(family)
        outputs = llm.generate(ps, params, use_tqdm=False)
        again = llm.generate(ps[:1], params, use_tqdm=False)[0]
        runner = llm.llm_engine.core.runner
        return {
            "family": family, "tp": tp, "device_ids": [d.id for d in runner.devices],
            "tokens": [o.outputs[0].token_ids for o in outputs],
            "logprobs": [[{str(k): v.logprob for k, v in row.items()} for row in o.outputs[0].logprobs]
                         for o in outputs],
            "again_tokens": again.outputs[0].token_ids, "again_cached": again.num_cached_tokens,
            "images_encoded": runner.encoder.num_images_encoded,
            "unexpected_compiles": llm.stats()["compile_unexpected_compiles"],
            "weight_bytes": sorted(bytes_per_device(runner.model_state).values()),
        }
    finally:
        llm.llm_engine.shutdown()


def main(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        built = {family: build(Path(tmp), family) for family in dict.fromkeys(f for f, _ in CASES)}
        results = [run_case(built[family], family, tp) for family, tp in CASES]
    Path(out).write_text(json.dumps(results))


def run_in_subprocess(out: Path, timeout: float) -> list[dict]:
    return run_module("tests.parallel.tp_vlm_runs", out, DEVICES, timeout)


if __name__ == "__main__":
    main(sys.argv[1])
