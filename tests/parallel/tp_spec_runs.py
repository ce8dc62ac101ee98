"""Speculating engines split over two fake CPU devices, run in a process of their own (as
:mod:`.tp_runs`).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m tests.parallel.tp_spec_runs OUT.json [KIND...]

The target is a tiny Llama (4 query and 2 key/value heads) on a vocabulary two devices do not
divide, so its split embedding and LM head, which the EAGLE head reads, carry a padding row. Each
case builds an ``LLM`` at ``tensor_parallel_size`` 1 or 2 with one proposer:

- "draft": the target as its own draft (``draft_model``): split like the target;
- "odd_draft": a 3-head random draft that two devices do not divide: replicated;
- "eagle": a near-pass-through EAGLE-1 head (split as one target layer, its pool on the key/value
  heads);
- "eagle3": a random EAGLE-3 head over a 256-token draft vocabulary (reading the target's two
  layers' inputs), split as "eagle";
- "eagle_whole" (two devices only): "eagle"'s head with ``draft_tensor_parallel_size`` 1, replicated
  (its one-device reference is "eagle"'s).
- "mtp" (its own module's test, not in ``CASES``): a tiny tied MiMo target (a Qwen2 on the same
  odd vocabulary, 4 query and 2 key/value heads, q/k/v biases) whose near-pass-through MTP layer
  drafts, split as "eagle".

Each runs one batch that needs chunked prefill (a 16-token budget), then a prompt extending an
earlier one (a prefix hit). The JSON holds per case the greedy tokens and their top logprobs, the
drafts proposed and accepted (per position), the compiles counted after warm-up, how the
proposer's weights and pool are placed and the collectives of its compiled programs. Naming kinds
after OUT.json runs only those.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tests.parallel.device_runs import run_module

DEVICES = 2
KINDS = ("draft", "odd_draft", "eagle", "eagle3")
CASES = [(kind, tp) for kind in KINDS for tp in (1, DEVICES)] + [("eagle_whole", DEVICES)]
METHODS = {"draft": "draft_model", "odd_draft": "draft_model", "eagle": "eagle", "eagle3": "eagle3",
           "eagle_whole": "eagle", "mtp": "mtp"}
REFERENCE = {"eagle_whole": "eagle"}  # a kind run on two devices only: the one-device case it must equal
VOCAB = 509  # not a multiple of DEVICES
K = 3
ENGINE = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=64,
              attention_backend="xla")
LOGPROBS = 4


def prompts() -> list[list[int]]:
    first = [list(range(3, 40)), [5, 6, 7], list(range(100, 120)), list(range(200, 225))]
    return first + [first[0] + [41, 42, 43, 44, 45]]


def build(root: Path) -> dict[str, str]:
    """The target and each case's draft or head, as checkpoint folders."""
    from jaxserve.models.demo import build_checkpoint
    from tests.eagle_heads import make_near_pass_through, write_eagle_head
    from tests.mtp_models import write_mimo
    from tests.tiny_models import TINY_CONFIGS, build_tiny_checkpoint

    target = str(build_checkpoint(root / "target", "LlamaForCausalLM", TINY_CONFIGS["LlamaForCausalLM"], seed=1,
                                  vocab_size=VOCAB))
    odd = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1)
    paths = {
        "target": target, "draft": target,
        "odd_draft": str(build_checkpoint(root / "odd", "LlamaForCausalLM", odd, seed=2, vocab_size=VOCAB)),
        "eagle": make_near_pass_through(write_eagle_head(root / "eagle", target, "eagle", seed=1, fc_bias=True)),
        "eagle3": write_eagle_head(root / "eagle3", target, "eagle3", seed=1, draft_vocab_size=256,
                                   eagle_aux_hidden_state_layer_ids=[0, 1, 1]),
    }
    paths["eagle_whole"] = paths["eagle"]
    qwen2 = build_tiny_checkpoint(root / "qwen2", "Qwen2ForCausalLM", seed=3, vocab_size=VOCAB,
                                  tie_word_embeddings=True)
    paths["mtp"] = write_mimo(root / "mimo", qwen2)  # the target; its MTP layer is the proposer
    return paths


def _placement(arrays) -> list[list]:
    """Each array's spec and the shape of the block one device holds."""
    import jax

    return [[list(map(str, x.sharding.spec)), list(x.shape), list(x.addressable_shards[0].data.shape)]
            for x in jax.tree.leaves(arrays)]


def run_case(paths: dict[str, str], kind: str, tp: int) -> dict:
    from jaxserve import LLM, SamplingParams
    from jaxserve.bench.hlo_collectives import count_collectives

    method = METHODS[kind]
    spec = {"method": method, "num_speculative_tokens": K,
            **({"draft_tensor_parallel_size": 1} if kind == "eagle_whole" else {})}
    target = paths["target"]
    if method == "mtp":
        target = paths[kind]  # the layer is the target's own
    else:
        spec["model"] = paths[kind]
    llm = LLM(target, tensor_parallel_size=tp, show_progress=False, **ENGINE, speculative_config=spec)
    core = llm.llm_engine.core
    runner = core.runner
    proposer = runner.eagle if method != "draft_model" else runner.drafter
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=LOGPROBS)
    compiles = llm.stats()["compile_num_compiles"]
    ps = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps[:4]], params, use_tqdm=False)
    outputs += llm.generate([{"prompt_token_ids": ps[4]}], params, use_tqdm=False)
    spec = core.scheduler.spec_decoding_stats
    weights = list(proposer.weights.values() if method != "draft_model" else proposer.weights)
    # every compiled proposer program: its collectives summed, the shapes its all-gathers make
    found = [count_collectives(program.as_text()) for program in proposer._compiled.values()]
    return {
        "kind": kind, "tp": tp, "device_ids": [d.id for d in runner.devices],
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "logprobs": [[{str(k): v.logprob for k, v in row.items()} for row in o.outputs[0].logprobs]
                     for o in outputs],
        "drafted": spec.num_draft_tokens, "accepted": spec.num_accepted_tokens,
        "accepted_per_pos": list(spec.num_accepted_tokens_per_pos),
        # the most prefill steps one request took (its prompt in chunks of the budget)
        "max_prefill_steps": max(Counter(r for rec in llm.step_records for r in rec.schedule.prefill_ids).values()),
        "prefix_hits": core.scheduler.make_stats().prefix_cache_hits,
        "new_compiles": llm.stats()["compile_num_compiles"] - compiles,
        "unexpected_compiles": llm.stats()["compile_unexpected_compiles"] + proposer.unexpected_compiles,
        "split": proposer.split,
        "pool": _placement(proposer.kv),
        "weights": _placement(weights),
        "weight_names": list(proposer.weights) if method != "draft_model" else [],  # a head's, in order
        "collectives": {op: sum(c.counts[op] for c in found) for op in found[0].counts},
        "all_gather_shapes": [list(s) for c in found for s in c.all_gather_shapes],
        "weight_shapes": [list(x.shape) for x in [*weights, *runner.model_state]],
        "vocab": runner.mc.vocab_size,
    }


def main(out: str, kinds: list[str]) -> None:
    cases = [(kind, tp) for kind in kinds for tp in (1, DEVICES)] if kinds else CASES
    with tempfile.TemporaryDirectory() as tmp:
        paths = build(Path(tmp))
        results = [run_case(paths, kind, tp) for kind, tp in cases]
    Path(out).write_text(json.dumps(results))


def run_in_subprocess(out: Path, timeout: float) -> list[dict]:
    return run_module("tests.parallel.tp_spec_runs", out, DEVICES, timeout)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
