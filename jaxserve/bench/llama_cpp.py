"""``jaxserve bench llama-cpp``: jaxserve against llama.cpp on the same model file, in rounds.

Each round runs, in turn, llama.cpp's ``llama-bench`` (one stream: a prompt, then generation),
jaxserve on the same shape, llama.cpp's ``llama-batched-bench`` (``B`` sequences decoding
together) and jaxserve on that shape, so both see the same machine load; the result holds each
round's figures, the medians with their spread, and the ratio jaxserve / llama.cpp per round.

llama.cpp is not a dependency: ``scripts/build_llama_cpp.sh`` builds its two bench programs from
the ``llama-cpp-python`` source distribution's vendored copy, and ``--llama-cpp-dir`` points at it.
jaxserve's figures separate prefill from decode the way llama.cpp's do. Prompt speed: fresh
prompts (prefix cache reset) run for one token. Decode speed: the same prompts then run for
``1 + n_gen`` tokens with the prompts' full blocks in the prefix cache, so that run is the decode
(its first step recomputes only each prompt's last partial block), and ``n_gen * B`` tokens are
divided by the window from the first request's first token to the last request's last token,
read from the outputs' own token times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np


def add_llama_cpp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-cpp-dir", required=True,
                   help="llama.cpp build folder holding bin/llama-bench and bin/llama-batched-bench "
                        "(scripts/build_llama_cpp.sh prints it)")
    p.add_argument("--rounds", type=int, default=2, help="alternated rounds (default: 2)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default: 2, this machine's cores)")
    p.add_argument("--n-prompt", type=int, default=144, help="one stream's prompt tokens (default: 144)")
    p.add_argument("--n-gen", type=int, default=80, help="one stream's generated tokens (default: 80)")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[16, 32, 64],
                   help="parallel sequences of the batched decode (default: 16 32 64)")
    p.add_argument("--batch-prompt", type=int, default=128, help="each batched sequence's prompt (default: 128)")
    p.add_argument("--batch-gen", type=int, default=32, help="each batched sequence's generated tokens (default: 32)")


def llama_bench(bin_dir: Path, model: str, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    """llama-bench's prompt and generation speeds (tokens/s, the mean of its repetitions)."""
    out = _run([str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(n_prompt),
                "-n", str(n_gen), "-r", "2", "-o", "json"])
    tests = json.loads(out)
    by_kind = {"prompt_tok_s" if t["n_gen"] == 0 else "gen_tok_s": float(t["avg_ts"]) for t in tests}
    return by_kind


def llama_batched_bench(bin_dir: Path, model: str, threads: int, batch: int, n_prompt: int,
                        n_gen: int) -> float:
    """llama-batched-bench's generation speed over ``batch`` sequences (tokens/s, all together)."""
    ctx = batch * (n_prompt + n_gen) + 64
    out = _run([str(bin_dir / "llama-batched-bench"), "-m", model, "-t", str(threads), "-c", str(ctx),
                "-b", "2048", "-ub", "512", "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", str(batch),
                "--output-format", "jsonl"])
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"])


def _run(argv: list[str]) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


class JaxserveDecode:
    """One engine, timed on llama.cpp's shapes: prefill alone, then prefill plus decode."""

    def __init__(self, llm: Any, seed: int = 0):
        self.llm = llm
        self.rng = np.random.default_rng(seed)
        self.vocab = llm.get_tokenizer().vocab_size

    def _generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
        from jaxserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    def run(self, batch: int, n_prompt: int, n_gen: int) -> dict[str, float]:
        prompts = [self.rng.integers(10, self.vocab - 10, n_prompt).tolist() for _ in range(batch)]
        self.llm.reset_prefix_cache()
        prefill, _ = self._generate(prompts, 1)
        _, outputs = self._generate(prompts, 1 + n_gen)  # the prompts' blocks are cached: decode
        first = min(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.last_token_time for o in outputs)
        if not last > first:
            raise RuntimeError(f"jaxserve bench llama-cpp: no decode window ({first} -> {last}) for {n_gen} tokens")
        return {"prompt_tok_s": batch * n_prompt / prefill, "gen_tok_s": batch * n_gen / (last - first)}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_llama_cpp_bench(args: argparse.Namespace, llm: Any, model_file: str) -> dict[str, Any]:
    bin_dir = Path(args.llama_cpp_dir)
    bin_dir = bin_dir / "bin" if (bin_dir / "bin").is_dir() else bin_dir
    ours = JaxserveDecode(llm)
    ours.run(1, 16, 4)  # the first steps of each shape run on padding: not counted
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        row: dict[str, Any] = {"round": r}
        row["llama_cpp_one_stream"] = llama_bench(bin_dir, model_file, args.threads, args.n_prompt, args.n_gen)
        row["jaxserve_one_stream"] = ours.run(1, args.n_prompt, args.n_gen)
        for b in args.batch_sizes:
            row[f"llama_cpp_batch_{b}_gen_tok_s"] = llama_batched_bench(bin_dir, model_file, args.threads, b,
                                                                      args.batch_prompt, args.batch_gen)
            row[f"jaxserve_batch_{b}_gen_tok_s"] = ours.run(b, args.batch_prompt, args.batch_gen)["gen_tok_s"]
        rounds.append(row)
    summary: dict[str, Any] = {}
    one = [r["jaxserve_one_stream"]["gen_tok_s"] / r["llama_cpp_one_stream"]["gen_tok_s"] for r in rounds]
    summary["one_stream_gen_ratio"] = {**_spread(one), "per_round": one}
    for key in ("jaxserve", "llama_cpp"):
        summary[f"{key}_one_stream_gen_tok_s"] = _spread([r[f"{key}_one_stream"]["gen_tok_s"] for r in rounds])
    for b in args.batch_sizes:
        ratio = [r[f"jaxserve_batch_{b}_gen_tok_s"] / r[f"llama_cpp_batch_{b}_gen_tok_s"] for r in rounds]
        summary[f"batch_{b}_gen_ratio"] = {**_spread(ratio), "per_round": ratio}
    stats = llm.stats()
    return {"model": model_file, "threads": args.threads,
            "jaxserve_weights": {k: stats.get(k) for k in ("quantization", "weight_bytes", "attention_backend")},
            "rounds": rounds, "summary": summary}


def run_llama_cpp_cli(args: argparse.Namespace) -> dict[str, Any]:
    from jaxserve import LLM
    from jaxserve.bench.real_model import resolve_bench_model
    from jaxserve.config import EngineConfig

    model = resolve_bench_model(args.model or "smollm2")
    if not model.endswith(".gguf"):
        raise SystemExit("jaxserve bench llama-cpp: MODEL must be a .gguf file (or smollm2): llama.cpp reads it too")
    config = EngineConfig.from_cli_args(args, model=model)
    llm = LLM(**config.as_kwargs())
    return run_llama_cpp_bench(args, llm, model)
