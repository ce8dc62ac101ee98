"""The ``jaxserve`` command: ``serve``, ``generate`` and ``bench {throughput,scheduler,serve,roofline}``.

It lives with the server because ``serve`` needs it, and the server sits above the engine.
Engine flags come from ``EngineConfig`` one-to-one (``--max-num-seqs`` ...), so every entry point
accepts the same names as vLLM's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jaxserve import EngineConfig


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF checkpoint folder (config.json + *.safetensors); default: the built-in demo model")


def _engine_parser(sub, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand that builds an engine: the MODEL argument plus every EngineConfig flag."""
    p = sub.add_parser(name, help=help)
    _add_model_arg(p)
    EngineConfig.add_cli_args(p)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA reimplementation of the vLLM V1 engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = _engine_parser(sub, "serve", "OpenAI-compatible HTTP server")
    from .serve import add_server_args

    add_server_args(serve)

    gen = _engine_parser(sub, "generate", "generate for a few prompts offline and print the results")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)

    bench = sub.add_parser("bench", help="benchmarks (JSON on stdout)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    tp = _engine_parser(bsub, "throughput", "offline throughput, optionally side by side with transformers")
    from jaxserve.bench.throughput import add_throughput_args

    add_throughput_args(tp)
    sched = bsub.add_parser("scheduler", help="microseconds per schedule+update step, no model")
    sched.add_argument("--num-running", type=int, nargs="+", default=[64, 256, 1024])
    sched.add_argument("--steps", type=int, default=200)
    from jaxserve.bench.serve_bench import add_serve_bench_args

    add_serve_bench_args(bsub.add_parser("serve", help="load generator against a running server"))
    from jaxserve.bench.roofline import add_roofline_args

    add_roofline_args(bsub.add_parser("roofline", help="the fastest each step bucket can run on a GPU (model)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        from .serve import run_serve

        return run_serve(args) or 0
    if args.command == "generate":
        return _generate(args)
    if args.bench_command == "throughput":
        from jaxserve.bench.throughput import run_throughput_cli

        result = run_throughput_cli(args)
    elif args.bench_command == "roofline":
        from jaxserve.bench.roofline import run_roofline_cli

        result = run_roofline_cli(args)
    elif args.bench_command == "scheduler":
        from jaxserve.bench.scheduler_bench import run_scheduler_bench

        result = run_scheduler_bench(num_running=tuple(args.num_running), steps=args.steps)
    else:
        from jaxserve.bench.serve_bench import run_serve_bench_cli

        result = run_serve_bench_cli(args)
    print(json.dumps(result, indent=2))
    return 0


def _generate(args) -> int:
    from jaxserve import LLM, SamplingParams

    config = EngineConfig.from_cli_args(args, model=args.model)
    llm = LLM(**vars(config))
    prompts = args.prompt or ["Hello, my name is", "The capital of France is", "JAX compiles"]
    outputs = llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
    for out in outputs:
        print(json.dumps({"prompt": out.prompt, "text": out.outputs[0].text,
                          "finish_reason": out.outputs[0].finish_reason}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
