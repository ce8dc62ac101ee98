"""LoRA engines split over fake CPU devices, run in a process of their own (as :mod:`.tp_runs`).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.parallel.tp_lora_runs OUT.json

Each case builds an ``LLM`` at ``tensor_parallel_size`` 1 or 2 and runs one mixed batch that needs
chunked prefill, then a prompt extending an earlier one (a prefix hit). A "layers" case has two
LoRA slots, the base model and two random adapters of different ranks and targets (one with
rsLoRA); a "heads" case allocates the LM head's and the embedding's tables too (three slots) and
mixes an adapter on the head, one on the embedding (rsLoRA), a layers-only one and the base, on a
vocabulary that two devices do not divide (the last device's rows are padding), its prompts
reaching the last token ids, and then asks two adapters' prompt logprobs. The JSON holds per case
the greedy tokens, their top logprobs (and the prompt logprobs), how each slot table is split over
the devices and the collectives of the compiled LoRA step.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.parallel.device_runs import run_module

DEVICES = 2
# (architecture, tensor_parallel_size, kind). Layers: Qwen3 (q/k norms and a head_dim apart from
# hidden) and Mistral (one key/value head, stored twice at TP=2). Heads: Llama (an untied head) and
# Qwen3 (tied).
CASES = [(arch, tp, "layers") for arch in ("Qwen3ForCausalLM", "MistralForCausalLM") for tp in (1, DEVICES)]
CASES += [(arch, tp, "heads") for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") for tp in (1, DEVICES)]
ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=64,
              attention_backend="xla", enable_lora=True, max_loras=2, max_lora_rank=8)
HEADS_ENGINE = {**ENGINE, "max_loras": 3, "lora_lm_head": True, "lora_embedding": True}
ODD_VOCAB = 509  # the heads cases' vocabulary: not a multiple of DEVICES
# the heads cases' adapters: name -> (seed, rank, target_modules, extra LoraConfig fields)
HEAD_ADAPTERS = {
    "head": (31, 4, ["q_proj", "lm_head"], {}),
    "emb": (32, 8, ["embed_tokens", "v_proj"], {"use_rslora": True, "lora_alpha": 6}),
    "plain": (33, 8, ["o_proj", "down_proj"], {}),
}
LOGPROBS = 4


def prompts(kind: str, vocab: int) -> list[list[int]]:
    first = [list(range(3, 40)), [5, 6, 7], list(range(100, 120)), list(range(200, 225))]
    if kind == "heads":  # the top of the vocabulary: ids on the last device's slice of the embedding
        first[1] = list(range(vocab - 9, vocab)) + [5, 6, 7]
    return first + [first[0] + [41, 42, 43, 44, 45]]


def build(root: Path, arch: str, kind: str) -> tuple[str, dict[str, str]]:
    from jaxserve.models.demo import build_checkpoint
    from tests.models.test_lora_adapter import make_peft_adapter
    from tests.parallel.tp_runs import HEADS
    from tests.tiny_models import TINY_CONFIGS

    shape = {**TINY_CONFIGS[arch], "num_attention_heads": HEADS}
    if kind == "heads":
        base = str(build_checkpoint(root / f"{arch}-{kind}", arch, shape, seed=1, vocab_size=ODD_VOCAB))
        for name, (seed, r, targets, extra) in HEAD_ADAPTERS.items():
            pm = make_peft_adapter(base, root / f"{arch}-{name}", seed=seed, r=r, targets=targets, **extra)
            pm.save_pretrained(str(root / f"{arch}-{name}"), save_embedding_layers=False)  # no copy of the base's
        return base, {n: str(root / f"{arch}-{n}") for n in HEAD_ADAPTERS}
    base = str(build_checkpoint(root / f"{arch}-{kind}", arch, shape, seed=1))
    make_peft_adapter(base, root / f"{arch}-a0", seed=3, r=8)
    make_peft_adapter(base, root / f"{arch}-a1", seed=4, r=4, targets=["q_proj", "k_proj", "o_proj", "up_proj",
                                                                      "down_proj"], use_rslora=True, lora_alpha=5)
    return base, {n: str(root / f"{arch}-{n}") for n in ("a0", "a1")}


def run_case(base: str, adapters: dict[str, str], arch: str, tp: int, kind: str) -> dict:
    from jaxserve import LLM, LoRARequest, SamplingParams
    from jaxserve.bench.hlo_collectives import count_collectives

    llm = LLM(base, tensor_parallel_size=tp, show_progress=False, **(HEADS_ENGINE if kind == "heads" else ENGINE))
    loras = [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(adapters.items())]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=LOGPROBS)
    vocab = llm.llm_engine.core.runner.mc.vocab_size
    ps = prompts(kind, vocab)
    # the last extends the first, on its adapter
    which = ([loras[0], loras[1], None, loras[2], loras[0]] if kind == "heads"
             else [loras[0], None, loras[1], loras[1], loras[0]])
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps[:4]], params, use_tqdm=False, lora_request=which[:4])
    outputs += llm.generate([{"prompt_token_ids": ps[4]}], params, use_tqdm=False, lora_request=which[4])
    prompt_logprobs = []
    if kind == "heads":  # the prompt-logprobs program takes the head's table and every token's slot
        plp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=LOGPROBS)
        outs = llm.generate([{"prompt_token_ids": p} for p in ps[1:3]], plp, use_tqdm=False, lora_request=loras[:2])
        prompt_logprobs = [[{str(k): v.logprob for k, v in row.items()} for row in o.prompt_logprobs[1:]]
                           for o in outs]
    core = llm.llm_engine.core
    runner = core.runner
    lora_variant = next(v for v in runner.variants() if v.lora)
    table = runner.lora.table
    return {
        "arch": arch, "tp": tp, "kind": kind, "vocab": vocab, "device_ids": [d.id for d in runner.devices],
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[{str(k): v.logprob for k, v in row.items()} for row in o.outputs[0].logprobs]
                     for o in outputs],
        "prompt_logprobs": prompt_logprobs,
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
        built = {(arch, kind): build(Path(tmp), arch, kind) for arch, _, kind in CASES}
        results = [run_case(*built[(arch, kind)], arch, tp, kind) for arch, tp, kind in CASES]
    Path(out).write_text(json.dumps(results))


def run_in_subprocess(out: Path, timeout: float) -> list[dict]:
    return run_module("tests.parallel.tp_lora_runs", out, DEVICES, timeout)


if __name__ == "__main__":
    main(sys.argv[1])
