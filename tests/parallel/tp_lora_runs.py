"""LoRA engines split over fake CPU devices, run in a process of their own (as :mod:`.tp_runs`).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.parallel.tp_lora_runs OUT.json

Each case builds an ``LLM`` with two LoRA slots at ``tensor_parallel_size`` 1 or 2 and runs one
mixed batch (the base model and two random adapters of different ranks and targets, one with
rsLoRA) that needs chunked prefill, then a prompt extending an earlier one (a prefix hit). The JSON
holds per case the greedy tokens, their top logprobs, how each slot table is split over the devices
and the collectives of the compiled LoRA step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.parallel.device_runs import run_module

DEVICES = 2
# Qwen3: q/k norms and a head_dim apart from hidden; Mistral: one key/value head, stored twice at TP=2.
CASES = [("Qwen3ForCausalLM", 1), ("Qwen3ForCausalLM", 2), ("MistralForCausalLM", 1), ("MistralForCausalLM", 2)]
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=64,
              compilation_cache_dir="off", attention_backend="xla", enable_lora=True, max_loras=2, max_lora_rank=8)
LOGPROBS = 4


def prompts() -> list[list[int]]:
    first = [list(range(3, 40)), [5, 6, 7], list(range(100, 120)), list(range(200, 225))]
    return first + [first[0] + [41, 42, 43, 44, 45]]


def build(root: Path, arch: str) -> tuple[str, dict[str, str]]:
    from jaxserve.models.demo import build_checkpoint
    from tests.models.test_lora_adapter import make_peft_adapter
    from tests.parallel.tp_runs import HEADS
    from tests.tiny_models import TINY_CONFIGS

    base = str(build_checkpoint(root / arch, arch, {**TINY_CONFIGS[arch], "num_attention_heads": HEADS}, seed=1))
    make_peft_adapter(base, root / f"{arch}-a0", seed=3, r=8)
    make_peft_adapter(base, root / f"{arch}-a1", seed=4, r=4, targets=["q_proj", "k_proj", "o_proj", "up_proj",
                                                                      "down_proj"], use_rslora=True, lora_alpha=5)
    return base, {n: str(root / f"{arch}-{n}") for n in ("a0", "a1")}


def run_case(base: str, adapters: dict[str, str], tp: int) -> dict:
    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.bench.hlo_collectives import count_collectives

    llm = LLM(base, tensor_parallel_size=tp, show_progress=False, **ENGINE)
    loras = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=LOGPROBS)
    ps = prompts()
    which = [loras[0], None, loras[1], loras[1], loras[0]]  # the last extends the first, on its adapter
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps[:4]], params, use_tqdm=False, lora_request=which[:4])
    outputs += llm.generate([{"prompt_token_ids": ps[4]}], params, use_tqdm=False, lora_request=which[4])
    core = llm.llm_engine.core
    runner = core.runner
    lora_variant = next(v for v in runner.variants() if v.lora)
    table = runner.lora.table
    return {
        "arch": Path(base).name, "tp": tp, "device_ids": [d.id for d in runner.devices],
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[{str(k): v.logprob for k, v in row.items()} for row in o.outputs[0].logprobs]
                     for o in outputs],
        "adapter_steps": sum(1 for r in llm.step_records if r.schedule.lora_adapters),
        "prefix_hits": core.scheduler.make_stats().prefix_cache_hits,
        "unexpected_compiles": llm.stats()["compile_unexpected_compiles"],
        # each table: its spec and the shape of the block one device holds
        "tables": {f"{ab}.{k}": [list(map(str, t.sharding.spec)), list(t.shape),
                                 list(t.addressable_shards[0].data.shape)]
                   for ab, tables in (("a", table.a), ("b", table.b)) for k, t in tables.items()},
        "num_layers": runner.mc.num_hidden_layers,
        **count_collectives(runner.steps.get(lora_variant).as_text()).as_dict(),
    }


def main(out: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        built = {arch: build(Path(tmp), arch) for arch in dict.fromkeys(a for a, _ in CASES)}
        results = [run_case(*built[arch], tp) for arch, tp in CASES]
    Path(out).write_text(json.dumps(results))


def run_in_subprocess(out: Path, timeout: float) -> list[dict]:
    return run_module("tests.parallel.tp_lora_runs", out, DEVICES, timeout)


if __name__ == "__main__":
    main(sys.argv[1])
