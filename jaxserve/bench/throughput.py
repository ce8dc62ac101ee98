"""``jaxserve bench throughput``: offline throughput, side by side with transformers.

The workload is drawn once from a seeded generator (prompt lengths, output lengths, token ids)
and fed as token ids to each backend, every request producing exactly its output length
(``ignore_eos``). ``--backend jaxserve`` times ``LLM.generate`` after warm-up (compilation is
reported apart; text is detokenized unless ``--disable-detokenize``, vLLM's flag); ``--backend
hf`` runs transformers (PyTorch) greedy ``generate`` over left-padded static batches; ``--backend
both`` runs both in one process and reports the ratio. With ``--num-iters N`` each backend times
the workload N times, the two taking turns, and reports its median iteration; the ratio is that of
the medians, and ``iteration_ratios`` lists each turn's own.

``--structured json`` runs the jaxserve workload twice per iteration on one engine, taking turns:
as is and with every request constrained to ``BENCH_JSON_SCHEMA``, and reports the constrained
run as ``jaxserve_structured`` with ``structured_throughput_ratio`` (constrained over
unconstrained output tokens per second). A model without a tokenizer (the random presets) borrows
the demo model's byte-level BPE, whose 1024 tokens leave the rest of the model's vocabulary as
padding that the masks must keep out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import os
import sys
import time
from typing import Any

import numpy as np

# The --structured json constraint: nested objects, an array, an enum and bounded numbers, as a
# tool-calling or extraction schema would have. The records array cannot close before 64 items,
# so every request generates its whole output length and both runs produce the same tokens.
BENCH_JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "records": {"type": "array", "minItems": 64, "items": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                           "name": {"type": "string", "maxLength": 24},
                           "color": {"enum": ["red", "green", "blue"]},
                           "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 4}},
            "required": ["id", "name", "color", "scores"], "additionalProperties": False}},
    },
    "required": ["records"], "additionalProperties": False,
}


@dataclasses.dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return int(sum(self.output_lens))

    @property
    def num_prompt_tokens(self) -> int:
        return int(sum(len(p) for p in self.prompts))


def random_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_range: tuple[int, int], seed: int) -> Workload:
    """Lengths and ids drawn in one fixed order, so a seed names one workload everywhere."""
    rng = np.random.default_rng(seed)
    plens = rng.integers(input_range[0], input_range[1] + 1, num_prompts)
    olens = rng.integers(output_range[0], output_range[1] + 1, num_prompts)
    prompts = [rng.integers(vocab_range[0], vocab_range[1], n).tolist() for n in plens]
    return Workload(prompts, [int(o) for o in olens])


def copy_workload(tokenizer: Any, num_prompts: int, output_len: int) -> Workload:
    """Copy-heavy prompts (speculative decoding's n-gram case): each asks the model to repeat one
    of the held-out passages word for word, through the chat template when the tokenizer has one."""
    from jaxserve.bench.held_texts import HELD_TEXTS

    prompts = []
    for i in range(num_prompts):
        text = f"Repeat the following text exactly, word for word:\n\n{HELD_TEXTS[i % len(HELD_TEXTS)]}"
        if getattr(tokenizer, "chat_template", None):
            # The template holds any special tokens already (as LLM.chat encodes it).
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
            ids = tokenizer.encode(chat, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text)
        prompts.append(list(ids))
    return Workload(prompts, [output_len] * num_prompts)


def add_throughput_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["jaxserve", "hf", "both"], default="jaxserve",
                   help="jaxserve, transformers (hf; needs torch), or both in one process, taking turns "
                        "(default: jaxserve)")
    p.add_argument("--random-model", choices=["cpu-bench", "moe-bench", "qwen3-0.6b"], default=None,
                   help="benchmark a random-weight model of this shape (built once, cached)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests in the workload (default: 64)")
    p.add_argument("--input-len-range", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"),
                   help="prompt lengths, uniform in [MIN, MAX] (default: 32 256)")
    p.add_argument("--output-len-range", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                   help="output lengths, uniform in [MIN, MAX] (default: 32 128)")
    p.add_argument("--random-input-len", type=int, default=None,
                   help="vLLM style: mean prompt length (overrides --input-len-range)")
    p.add_argument("--random-output-len", type=int, default=None,
                   help="vLLM style: mean output length (overrides --output-len-range)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="with --random-*-len: lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")
    p.add_argument("--token-id-range", type=int, nargs=2, default=[10, 8000], metavar=("LO", "HI"),
                   help="prompt token ids, uniform in [LO, HI) (default: 10 8000)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="every request produces exactly its output length (default: on)")
    p.add_argument("--disable-detokenize", action="store_true",
                   help="vLLM's flag: return token ids only (no text), as the hf backend does")
    p.add_argument("--num-iters", type=int, default=1,
                   help="time the workload this many times per backend, the backends taking turns; "
                        "each backend reports its median iteration")
    p.add_argument("--hf-batch-size", type=int, default=16,
                   help="requests per static batch of the hf backend (default: 16)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads for the hf backend (default: torch's own choice)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the workload draw (default: 0)")
    p.add_argument("--structured", choices=["json"], default=None,
                   help="also run the workload with every request constrained to a JSON schema, taking turns "
                        "with the unconstrained run, and report the throughput ratio")
    p.add_argument("--workload", choices=["random", "real-model", "copy"], default="random",
                   help="random: the drawn requests (default); real-model: one stream (--one-stream-len "
                        "prompt and output tokens) then the drawn requests, each against the other backend, "
                        "next to the one-stream memory-bandwidth ceiling (MODEL may be 'smollm2')")
    p.add_argument("--one-stream-len", type=int, default=64,
                   help="with --workload real-model: the one stream's prompt and output tokens (default: 64)")
    p.add_argument("--profile", action="store_true", help="also report where the jaxserve step time goes")
    p.add_argument("--profile-ops", type=int, default=0, metavar="N",
                   help="also trace the run and report the N XLA operations that take the most time")


def _ranges(args) -> tuple[tuple[int, int], tuple[int, int]]:
    def around(mean, ratio):
        return max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))

    ratio = args.random_range_ratio
    inp = around(args.random_input_len, ratio) if args.random_input_len else tuple(args.input_len_range)
    out = around(args.random_output_len, ratio) if args.random_output_len else tuple(args.output_len_range)
    return inp, out


class JaxserveBench:
    """The engine built once; each ``run_once`` times ``LLM.generate`` over the whole workload."""

    def __init__(self, model_path: str, workload: Workload, engine_args: dict[str, Any], ignore_eos: bool,
                 profile: bool = False, detokenize: bool = True, structured: Any = None, llm: Any = None):
        from jaxserve import LLM, SamplingParams

        start = time.perf_counter()
        self.llm = llm or LLM(model_path, record_steps=profile, **engine_args)
        self.startup_s = time.perf_counter() - start
        # Timed runs measure the steady state: the buckets compiled in the background (decode
        # midpoints, small decode buckets) are in before the first one.
        for engine in getattr(self.llm, "llm_engines", []):
            steps = engine.core.runner.steps
            if steps.pending_buckets:  # minutes on a GPU host with a cold cache: say why nothing moves
                print(f"bench: waiting for the background compiles of buckets {sorted(steps.pending_buckets)} "
                      "before timing", file=sys.stderr, flush=True)
            steps.wait_for_deferred()
        self.background_compile_s = time.perf_counter() - start - self.startup_s
        # The bench process keeps this engine to its end, as a server does: its start-up heap is
        # frozen so that full collections skip it.
        gc.collect()
        gc.freeze()
        self.workload, self.detokenize, self.structured = workload, detokenize, structured
        self.params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos, detokenize=detokenize,
                                      structured_outputs=structured)
                       for n in workload.output_lens]
        self.prompts = [{"prompt_token_ids": p} for p in workload.prompts]

    def run_once(self) -> dict:
        # Every iteration starts from an empty prefix cache: a repeat must not reuse the KV of the
        # one before (the benchmark's prompts are the same each time).
        self.llm.reset_prefix_cache()
        before = self.llm.stats()
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        after = self.llm.stats()
        finished = [o.outputs[0].finish_reason for o in outputs]
        steps = after["compile_num_steps"] - before["compile_num_steps"]
        wait = after["compile_device_wait_seconds"] - before["compile_device_wait_seconds"]
        return {
            "elapsed_s": elapsed, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "num_requests": len(outputs), "num_steps": steps, "device_wait_s": wait,
            # The rest of elapsed is host work: scheduling, inputs, outputs (with async scheduling
            # it overlaps the device's work instead of adding to it).
            "host_ms_per_step": 1e3 * (elapsed - wait) / max(1, steps),
            "finished_stop": finished.count("stop"), "finished_length": finished.count("length"),
        }

    def summary(self, it: dict) -> dict:
        stats = self.llm.stats()
        return {
            "backend": "jaxserve", "elapsed_s": it["elapsed_s"], "startup_s": self.startup_s,
            "background_compile_s": self.background_compile_s,
            **_rates(it, self.workload), "requests_per_s": it["num_requests"] / it["elapsed_s"],
            "num_compiles": stats["compile_num_compiles"], "compile_s": stats["compile_compile_seconds"],
            "persistent_cache_hits": stats["compile_persistent_cache_hits"],
            "unexpected_compiles": stats["compile_unexpected_compiles"],
            "padding_ratio": stats["compile_padding_ratio"], "num_steps": it["num_steps"],
            "device_wait_s": it["device_wait_s"], "host_ms_per_step": it["host_ms_per_step"],
            "num_preemptions": stats["num_preemptions"], "attention_backend": stats["attention_backend"],
            "scan_layers": stats["scan_layers"],
            "token_buckets": stats["token_buckets"], "detokenize": self.detokenize,
            "structured": self.structured.kind if self.structured is not None else None,
            "finished_stop": it["finished_stop"], "finished_length": it["finished_length"],
        }


def _output_rate(it: dict) -> float:
    return it["output_tokens"] / it["elapsed_s"]


def _rates(it: dict, workload: Workload) -> dict:
    return {"output_tokens": it["output_tokens"], "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens_per_s": _output_rate(it),
            "total_tokens_per_s": (it["output_tokens"] + workload.num_prompt_tokens) / it["elapsed_s"]}


def _step_profile(llm) -> dict:
    """Step time split by token bucket (each step's host work and device time together), over the
    steps that ran a program."""
    records = [r for r in llm.step_records if r.token_bucket]
    by_bucket: dict[int, list[float]] = {}
    for r in records:
        by_bucket.setdefault(r.token_bucket, []).append(r.seconds)
    return {
        "steps": len(records),
        "step_seconds_total": sum(r.seconds for r in records),
        "by_token_bucket": {str(b): {"steps": len(v), "total_s": sum(v), "mean_ms": 1e3 * sum(v) / len(v)}
                            for b, v in sorted(by_bucket.items())},
    }


class HFBench:
    """transformers greedy ``generate`` over left-padded static batches of the workload, in order."""

    def __init__(self, model_path: str, workload: Workload, batch_size: int, threads: int | None,
                 model: Any = None):
        import torch
        import transformers

        from jaxserve.bench.real_model import hf_from_pretrained_args

        if threads:
            torch.set_num_threads(threads)
        if model is None:
            folder, kwargs = hf_from_pretrained_args(model_path)
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs).eval()
        self.model = model
        self.workload, self.batch_size = workload, batch_size

    def run_once(self) -> dict:
        import torch

        produced = 0
        start = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(self.workload.prompts), self.batch_size):
                batch = self.workload.prompts[b : b + self.batch_size]
                olens = self.workload.output_lens[b : b + self.batch_size]
                width = max(len(p) for p in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros((len(batch), width), dtype=torch.long)
                for i, p in enumerate(batch):  # left padding, as decoder-only batching needs
                    ids[i, width - len(p):] = torch.tensor(p)
                    mask[i, width - len(p):] = 1
                n = max(olens)
                self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                    min_new_tokens=n, pad_token_id=0)
                produced += sum(olens)  # tokens past a request's own length are not counted
        return {"elapsed_s": time.perf_counter() - start, "output_tokens": produced}

    def summary(self, it: dict) -> dict:
        import torch

        return {"backend": "hf", "elapsed_s": it["elapsed_s"], **_rates(it, self.workload),
                "batch_size": self.batch_size, "torch_threads": torch.get_num_threads()}


def _median(iterations: list[dict]) -> dict:
    """The iteration of median speed (the slower middle one when there are two)."""
    return sorted(iterations, key=lambda it: it["elapsed_s"])[len(iterations) // 2]


def run_iterations(benches: dict[str, Any], num_iters: int) -> dict[str, list[dict]]:
    """Each bench's ``run_once`` ``num_iters`` times, the backends taking turns (A B A B ...), so
    that a slow spell of a shared machine lands on both instead of on one backend's only run."""
    runs: dict[str, list[dict]] = {name: [] for name in benches}
    for _ in range(num_iters):
        for name, bench in benches.items():
            # Neither backend pays for the other's garbage, and with the counts reset no full
            # collection can land inside a timed iteration.
            gc.collect()
            runs[name].append(bench.run_once())
    return runs


def run_throughput_cli(args) -> dict:
    from jaxserve import envs
    from jaxserve.bench import op_profile
    from jaxserve.bench.real_model import resolve_bench_model
    from jaxserve.config import EngineConfig
    from jaxserve.engine.llm_engine import has_tokenizer_files

    if args.profile_ops:
        op_profile.request_cpu_op_events()  # before anything starts the XLA backend

    model = resolve_bench_model(args.model) if args.model else None
    if args.random_model:
        from jaxserve.bench.random_model import build_random_checkpoint

        model = str(build_random_checkpoint(envs.cache_dir() / "models" / f"random-{args.random_model}",
                                            args.random_model))
    if model is None:
        from jaxserve.models.demo import demo_model_path

        model = str(demo_model_path())
    inp, out = _ranges(args)
    workload = random_workload(args.num_prompts, inp, out, tuple(args.token_id_range), args.bench_seed)
    overrides = {}
    if args.structured and not args.tokenizer and not has_tokenizer_files(model):
        from jaxserve.models.demo import demo_model_path

        overrides["tokenizer"] = str(demo_model_path())
    config = EngineConfig.from_cli_args(args, model=model, **overrides)
    engine_args = {k: v for k, v in config.as_kwargs().items() if k != "model"}
    if args.workload == "copy":
        from jaxserve.engine.llm_engine import load_tokenizer

        workload = copy_workload(load_tokenizer(config.tokenizer or model), args.num_prompts,
                                 args.random_output_len or out[1])
    result: dict[str, Any] = {
        "model": model, "num_prompts": args.num_prompts, "input_len_range": list(inp),
        "output_len_range": list(out), "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens, "cpu_count": os.cpu_count(),
    }
    if args.workload == "real-model":
        result.update(_run_real_model(args, model, workload, engine_args))
        return result
    benches: dict[str, Any] = {}
    if args.backend in ("jaxserve", "both"):
        benches["jaxserve"] = JaxserveBench(model, workload, engine_args, args.ignore_eos, args.profile,
                                            detokenize=not args.disable_detokenize)
        if config.spec_decode_config.spec is not None:  # alternated against the same engine without it
            benches["jaxserve_no_spec"] = JaxserveBench(model, workload, {**engine_args, "speculative_config": None,
                                                                                 "speculative_auto_off": False},
                                                        args.ignore_eos, detokenize=not args.disable_detokenize)
        if args.structured:
            from jaxserve import StructuredOutputsParams

            benches["jaxserve_structured"] = JaxserveBench(
                model, workload, engine_args, args.ignore_eos, detokenize=not args.disable_detokenize,
                structured=StructuredOutputsParams(json=BENCH_JSON_SCHEMA), llm=benches["jaxserve"].llm)
    if args.backend in ("hf", "both"):
        benches["hf"] = HFBench(model, workload, args.hf_batch_size, args.torch_threads)
    ops: dict[str, Any] = {}
    runs: dict[str, list[dict]] = {}

    def steps_of() -> int:  # read when the trace ends: every traced jaxserve iteration's steps
        return sum(it["num_steps"] for it in runs.get("jaxserve", []))

    tracing = (op_profile.trace_ops(ops, args.profile_ops, steps_of)
               if args.profile_ops and "jaxserve" in benches else contextlib.nullcontext())
    with tracing:  # the trace's own overhead lands in elapsed: compare traced runs with traced runs
        runs.update(run_iterations(benches, args.num_iters))
    result["num_iters"] = args.num_iters
    result.update(_summaries(benches, runs))
    if "jaxserve_structured" in benches:
        result["structured_throughput_ratio"] = (result["jaxserve_structured"]["output_tokens_per_s"]
                                                 / result["jaxserve"]["output_tokens_per_s"])
        result["structured_iteration_ratios"] = [
            a / b for a, b in zip(result["jaxserve_structured"]["iterations_output_tokens_per_s"],
                                  result["jaxserve"]["iterations_output_tokens_per_s"])]
    if "jaxserve_no_spec" in benches:
        result.update(_spec_summary(result, benches["jaxserve"].llm))
    if "jaxserve" in benches:
        if args.profile:
            result["jaxserve"]["profile"] = _step_profile(benches["jaxserve"].llm)
        if args.profile_ops:
            result["jaxserve"]["op_profile"] = ops
    return result


def _spec_summary(result: dict, llm: Any) -> dict:
    """Speculation against none: the ratio of the medians, each turn's ratio, and the acceptance."""
    spec, plain = result["jaxserve"], result["jaxserve_no_spec"]
    stats = llm.llm_engine.core.scheduler.spec_decoding_stats
    return {
        "spec_throughput_ratio": spec["output_tokens_per_s"] / plain["output_tokens_per_s"],
        "spec_iteration_ratios": [a / b for a, b in zip(spec["iterations_output_tokens_per_s"],
                                                        plain["iterations_output_tokens_per_s"])],
        "spec_decode": {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                        "num_accepted_tokens": stats.num_accepted_tokens,
                        "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos,
                        "acceptance_rate": stats.acceptance_rate,
                        "mean_acceptance_length": stats.mean_acceptance_length},
    }


def _summaries(benches: dict[str, Any], runs: dict[str, list[dict]]) -> dict:
    """Each bench's median iteration and every iteration's rate; with both backends, the ratio of
    the medians and each turn's own ratio (their spread)."""
    result: dict[str, Any] = {}
    for name, bench in benches.items():
        result[name] = bench.summary(_median(runs[name]))
        result[name]["iterations_output_tokens_per_s"] = [_output_rate(it) for it in runs[name]]
    if "jaxserve" in result and "hf" in result:
        ours, hf = result["jaxserve"], result["hf"]
        result["output_throughput_ratio"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        result["iteration_ratios"] = [a / b for a, b in zip(ours["iterations_output_tokens_per_s"],
                                                            hf["iterations_output_tokens_per_s"])]
    return result


def _run_real_model(args, model: str, batched: Workload, engine_args: dict[str, Any]) -> dict:
    """One stream, then the batch, each phase timed ``--num-iters`` times with the backends taking
    turns; one engine and one transformers model serve both phases."""
    from jaxserve.bench.real_model import ceiling, read_bandwidth_bytes_per_s

    n = args.one_stream_len
    rng = np.random.default_rng(args.bench_seed)
    one = Workload([rng.integers(args.token_id_range[0], args.token_id_range[1], n).tolist()], [n])
    phases: dict[str, dict[str, Any]] = {"one_stream": {}, "batched": {}}
    llm: Any = None
    hf_model: Any = None
    for name, workload in (("one_stream", one), ("batched", batched)):
        if args.backend in ("jaxserve", "both"):
            bench = JaxserveBench(model, workload, engine_args, args.ignore_eos, args.profile,
                                  detokenize=not args.disable_detokenize, llm=llm)
            llm = bench.llm
            phases[name]["jaxserve"] = bench
        if args.backend in ("hf", "both"):
            hf = HFBench(model, workload, args.hf_batch_size, args.torch_threads, model=hf_model)
            hf_model = hf.model
            phases[name]["hf"] = hf
    if llm is not None:  # the weights one decode step reads, as the engine holds them
        weight_bytes = sum(x.nbytes for x in llm.llm_engine.core.runner.model_state)
    else:
        weight_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    result: dict[str, Any] = {"workload": "real-model", "num_iters": args.num_iters,
                              "one_stream_len": n, **ceiling(weight_bytes, read_bandwidth_bytes_per_s())}
    for name, benches in phases.items():
        result[name] = _summaries(benches, run_iterations(benches, args.num_iters))
        if "jaxserve" in benches and args.profile:
            result[name]["jaxserve"]["profile"] = _step_profile(benches["jaxserve"].llm)
    if "jaxserve" in result["one_stream"]:
        result["one_stream_share_of_ceiling"] = (result["one_stream"]["jaxserve"]["output_tokens_per_s"]
                                                 / result["one_stream_ceiling_tokens_per_s"])
    return result
