"""``jaxserve diagnose URL``: watch a running server for a window and say which failure rows apply.

It reads the server's own records (``--enable-debug-endpoints``): the step records and request
timelines of the window. Each finding names the module to look at, the flag to try, what not to
do first, and the evidence (the numbers that triggered it). A healthy window prints no finding.

Rows (the seed's failure-to-module map):

* ``api_bound``: the API is slow while the device idles (tokenizer, API worker, CPU scheduling);
* ``prefill_stall``: long inputs stall other requests (token budget, chunked prefill, queue);
* ``kv_pressure``: memory tight, repeated preemption (cache usage, actual lengths, concurrency);
* ``spec_not_paying``: speculative drafts are mostly rejected, or a speculating step costs more per
  token than a plain one (acceptance, batch size, ``--speculative-auto-off``);
* ``compiled_differs`` (``--compare-eager``): wrong output only when compiled;
* tool fields or broken streams (template, tool/reasoning parser): not diagnosed yet, jaxserve has
  no tool or reasoning parser to blame.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from .trace_cli import get_json, server_root

# Thresholds of the rules; each finding reports the measured value next to its threshold.
API_SHARE = 0.3  # share of a request's life spent before the engine queued it
API_MIN_S = 0.005  # ... and at least this long, so that tiny requests do not trip it
ENGINE_IDLE_SHARE = 0.5  # share of the window's steps' span the engine spent between steps
PREFILL_SHARE_OF_BUDGET = 0.5  # a "large" prefill chunk: this share of the step's tokens or more
STALL_RATIO = 1.5  # inter-token interval of steps with a large prefill chunk over decode-only ones
MIN_MIXED_STEPS = 3
KV_USED_SHARE = 0.9  # the pool this full at some step
SPEC_MIN_ACCEPTANCE = 0.3  # share of the window's draft tokens accepted
SPEC_MIN_DRAFTS = 20  # draft tokens in the window before acceptance is judged
SPEC_COST_RATIO = 1.1  # time per output token of speculating decode steps over plain decode steps
SPEC_MIN_STEPS = 5  # decode-only steps of each kind before their costs are compared


@dataclasses.dataclass
class Finding:
    id: str
    title: str
    module: str
    try_: str
    not_first: str
    evidence: dict

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["try"] = d.pop("try_")
        return d


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def api_bound(steps: list[dict], requests: list[dict]) -> tuple[dict, Finding | None]:
    """Requests spend a large share of their life before the engine, while the engine idles
    between its steps for most of the window."""
    pre, share = [], []
    for t in requests:
        m = t["metrics"]
        start = m["received_time"] if m["received_time"] is not None else m["arrival_time"]
        if m["queued_time"] is None or m["finished_time"] is None or m["finished_time"] <= start:
            continue
        pre.append(m["queued_time"] - start)
        share.append(pre[-1] / (m["finished_time"] - start))
    # The first step's gap began before the window: only the gaps between the window's steps count.
    span = steps[-1]["end"] - steps[0]["start"] if steps else 0.0
    idle_share = sum(s["idle_gap_s"] for s in steps[1:]) / span if span > 0 else 1.0
    evidence = {"median_pre_engine_s": round(_median(pre), 4), "median_pre_engine_share": round(_median(share), 3),
                "threshold_share": API_SHARE, "engine_idle_share": round(idle_share, 3),
                "threshold_idle_share": ENGINE_IDLE_SHARE, "requests": len(share)}
    if not share or _median(share) < API_SHARE or _median(pre) < API_MIN_S or idle_share < ENGINE_IDLE_SHARE:
        return evidence, None
    return evidence, Finding(
        "api_bound", "API slow while the device idles",
        "server: tokenizer and chat template (server/serving_*.py), the API worker's event loop, CPU scheduling",
        "send token ids instead of long text (or shorter text: truncate before sending), fewer concurrent "
        "clients per server, more CPU for the server process; check /debug/requests/{id}: received -> queued",
        "do not tune KV cache or batching flags (--max-num-seqs, --gpu-memory-utilization) or the attention "
        "kernel first: the engine is waiting for the API, not the other way round", evidence)


def prefill_stall(steps: list[dict]) -> tuple[dict, Finding | None]:
    """The inter-token latency of running requests spikes in steps that carry a large prefill chunk:
    the interval between a step's results and the previous step's, mixed steps against decode-only."""
    largest = max((s["num_tokens"] for s in steps), default=0)
    mixed, decode_only = [], []
    for prev, s in zip(steps, steps[1:]):
        if not (prev["num_tokens"] and s["num_decode_tokens"]) or s["step"] != prev["step"] + 1:
            continue
        interval = s["end"] - prev["end"]
        prefill = s["num_prefill_tokens"]
        if not prefill:
            decode_only.append(interval)
        elif prefill >= PREFILL_SHARE_OF_BUDGET * max(s["num_tokens"], largest):
            mixed.append((interval, s))
    ratio = _median([i for i, _ in mixed]) / max(1e-9, _median(decode_only)) if mixed and decode_only else 0.0
    evidence = {"mixed_steps": len(mixed), "decode_only_steps": len(decode_only),
                "median_mixed_interval_ms": round(1e3 * _median([i for i, _ in mixed]), 3),
                "median_decode_interval_ms": round(1e3 * _median(decode_only), 3), "ratio": round(ratio, 2),
                "threshold_ratio": STALL_RATIO, "decodes_delayed": sum(s["num_decode_tokens"] for _, s in mixed),
                "largest_prefill_chunk": max((s["num_prefill_tokens"] for _, s in mixed), default=0)}
    if len(decode_only) < 3 or len(mixed) < MIN_MIXED_STEPS or ratio < STALL_RATIO:
        return evidence, None
    return evidence, Finding(
        "prefill_stall", "Long inputs stall other requests",
        "scheduler: token budget and chunked prefill (jaxserve/core/scheduler.py), the waiting queue",
        "--long-prefill-token-threshold N (cap one request's chunk per step), a smaller "
        "--max-num-batched-tokens, or --scheduling-policy priority for latency-sensitive requests",
        "do not add KV memory or raise --max-num-seqs first: the decodes wait for the prefill chunk in "
        "their own step, not for blocks", evidence)


def kv_pressure(steps: list[dict], requests: list[dict]) -> tuple[dict, Finding | None]:
    """Preemptions while the KV pool is (nearly) full."""
    preemptions = sum(len(s["preempted_ids"]) for s in steps)
    used = max((s["blocks"]["used"] / max(1, s["blocks"]["total"]) for s in steps), default=0.0)
    lengths = [t["num_prompt_tokens"] + sum(x["num_output_tokens"] for x in t["samples"]) for t in requests]
    evidence = {"preemptions": preemptions, "steps": len(steps), "max_kv_used_share": round(used, 3),
                "threshold_used_share": KV_USED_SHARE,
                "steps_waiting_for_kv": sum(1 for s in steps if s["waiting_reason"] in ("kv_blocks", "preemption")),
                "median_request_tokens": _median([float(n) for n in lengths]), "requests": len(requests)}
    if not preemptions or used < KV_USED_SHARE:
        return evidence, None
    return evidence, Finding(
        "kv_pressure", "Memory tight: repeated preemption",
        "KV cache manager and scheduler (jaxserve/core/kv_cache_manager.py, scheduler.py): cache usage, "
        "actual sequence lengths, concurrency",
        "a lower --max-num-seqs, more KV memory (--gpu-memory-utilization, --kv-cache-memory, "
        "--num-gpu-blocks-override), or a smaller --max-model-len / max_tokens if the requests allow it",
        "do not change the attention kernel, compilation or --block-size first: preemption is a capacity "
        "problem, and recomputation hides it as slowness", evidence)


def spec_not_paying(steps: list[dict]) -> tuple[dict, Finding | None]:
    """Speculation that does not pay: few drafts accepted, or decode-only steps that verify drafts
    cost more time per output token than those that do not (a step's interval: its end to the
    previous step's end)."""
    drafts = accepted = 0
    per_token: dict[bool, list[float]] = {True: [], False: []}
    for prev, s in zip([None, *steps], steps):
        spec = s.get("spec_decode") or {}
        drafts += spec.get("num_draft_tokens", 0)
        accepted += spec.get("num_accepted_tokens", 0)
        out = sum(len(t) for t in s["sampled"].values())
        # A decode step: every request computes its one token and its drafts (no prompt chunk).
        decode = all(n == 1 + spec.get("drafts", {}).get(r, 0) for r, n in s["scheduled"].items())
        if prev is None or s["step"] != prev["step"] + 1 or not decode or not out:
            continue
        per_token[bool(spec.get("num_draft_tokens"))].append((s["end"] - prev["end"]) / out)
    acceptance = accepted / drafts if drafts else 0.0
    spec_ms, plain_ms = _median(per_token[True]), _median(per_token[False])
    enough = min(len(per_token[True]), len(per_token[False])) >= SPEC_MIN_STEPS
    ratio = spec_ms / plain_ms if enough and plain_ms > 0 else 0.0
    evidence = {"draft_tokens": drafts, "accepted_tokens": accepted, "acceptance": round(acceptance, 3),
                "threshold_acceptance": SPEC_MIN_ACCEPTANCE,
                "speculating_decode_steps": len(per_token[True]), "plain_decode_steps": len(per_token[False]),
                "median_ms_per_token_speculating": round(1e3 * spec_ms, 3),
                "median_ms_per_token_plain": round(1e3 * plain_ms, 3), "cost_ratio": round(ratio, 2),
                "threshold_cost_ratio": SPEC_COST_RATIO,
                "auto_off_steps_off": sum(1 for s in steps
                                          if (s.get("spec_decode") or {}).get("auto_off", "").startswith("off"))}
    low = drafts >= SPEC_MIN_DRAFTS and acceptance < SPEC_MIN_ACCEPTANCE
    if not (low or ratio > SPEC_COST_RATIO):
        return evidence, None
    return evidence, Finding(
        "spec_not_paying", "Speculative decoding costs more than it saves",
        "speculative decoding: the proposer (jaxserve/spec_decode/), the auto-off rule "
        "(jaxserve/spec_decode/auto_off.py), the verification in the runner",
        "--speculative-auto-off (skips drafts per step when acceptance and batch size say they do not pay), "
        "fewer num_speculative_tokens or a larger prompt_lookup_min in --speculative-config, or no "
        "speculation for this workload (it pays on copy-heavy prompts at low concurrency)",
        "do not raise --max-num-batched-tokens or --max-num-seqs first: more concurrency makes each "
        "verified draft cost more, and rejected drafts are pure waste", evidence)


def analyse(steps: list[dict], requests: list[dict]) -> tuple[dict[str, dict], list[Finding]]:
    """Every rule's measurements, and the findings, of a window's step records (in step order) and
    finished requests' timelines (JSON dicts)."""
    checks = {"api_bound": api_bound(steps, requests), "prefill_stall": prefill_stall(steps),
              "kv_pressure": kv_pressure(steps, requests), "spec_not_paying": spec_not_paying(steps)}
    return ({name: evidence for name, (evidence, _) in checks.items()},
            [finding for _, finding in checks.values() if finding is not None])


def watch(url: str, window_s: float, api_key: str | None = None) -> dict:
    """Read the server's records of the next ``window_s`` seconds and analyse them."""
    root = server_root(url)
    last = get_json(f"{root}/debug/steps?last=1", api_key)["steps"]
    since_step = last[-1]["step"] if last else 0
    since_time = last[-1]["end"] if last else float("-inf")
    time.sleep(window_s)
    steps = [s for s in get_json(f"{root}/debug/steps?last=10000", api_key)["steps"] if s["step"] > since_step]
    requests = [t for t in get_json(f"{root}/debug/requests?limit=10000", api_key)["requests"]
                if t["finished"] and t["metrics"]["finished_time"] is not None
                and t["metrics"]["finished_time"] > since_time]
    checks, findings = analyse(sorted(steps, key=lambda s: s["step"]), requests)
    return {"url": root, "window_s": window_s, "steps": len(steps), "requests": len(requests),
            "findings": [f.as_dict() for f in findings], "checks": checks,
            "not_diagnosed": ["tool fields or broken streams: the step records do not show them; look at the chat "
                              "template, the tool/reasoning parser and the finish reasons"]}


# ---- --compare-eager ------------------------------------------------------------------------------


def first_difference(compiled: list[dict], eager: list[dict]) -> dict | None:
    """The first position where two greedy runs of one prompt chose different tokens, with the
    logit gap there: ``{position, compiled_token, eager_token, logprob_gap, ...}``; None if equal.
    Each run is a list of ``{token: logprob}`` dicts, one per position, chosen token first."""
    for pos, (a, b) in enumerate(zip(compiled, eager)):
        ta, tb = next(iter(a)), next(iter(b))
        if ta != tb:
            # How far apart the two choices are in each run: how close the race was.
            gap_compiled = a[ta] - a.get(tb, float("-inf"))
            gap_eager = b[tb] - b.get(ta, float("-inf"))
            return {"position": pos, "compiled_token": ta, "eager_token": tb,
                    "compiled_margin": gap_compiled, "eager_margin": gap_eager,
                    "logprob_gap": abs(a[ta] - b.get(ta, float("-inf")))}
    return None


def _greedy_logprobs(llm, prompts: list, max_tokens: int, top: int) -> list[list[dict]]:
    from jaxserve import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=top,
                                                ignore_eos=True), use_tqdm=False)
    runs = []
    for out in outs:
        c = out.outputs[0]
        runs.append([{tok: pos[tok].logprob, **{t: lp.logprob for t, lp in pos.items()}}
                     for tok, pos in zip(c.token_ids, c.logprobs or [])])
    return runs


def compare_eager(config, prompts: list, max_tokens: int, top: int = 5) -> dict:
    """Run ``prompts`` greedily on ``config``'s model (an ``EngineConfig``) compiled and eager;
    report each prompt's first differing token."""
    from jaxserve import LLM

    results = {}
    for mode, eager in (("compiled", False), ("eager", True)):
        llm = LLM(show_progress=False, **dict(config.as_kwargs(), enforce_eager=eager))
        results[mode] = _greedy_logprobs(llm, prompts, max_tokens, top)
        del llm
    diffs = [first_difference(a, b) for a, b in zip(results["compiled"], results["eager"])]
    findings = []
    if any(d is not None for d in diffs):
        findings.append(Finding(
            "compiled_differs", "Wrong output only when compiled",
            "runner: the compiled step (jaxserve/runner/compilation.py, model_runner.py) and the attention "
            "backend it uses",
            "--enforce-eager to confirm, then another --attention-backend (xla is the reference), then "
            "float32 (--dtype float32) to tell a real bug from rounding (see the margins)",
            "do not change sampling parameters or the scheduler first: the same inputs give different "
            "logits; a small logprob_gap at a near tie (small margins) is rounding, not a bug",
            {"prompts": len(prompts), "differing": sum(d is not None for d in diffs)}).as_dict())
    return {"model": config.model or "jaxserve-demo", "max_tokens": max_tokens, "first_differences": diffs,
            "findings": findings}


def add_diagnose_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("url", nargs="?", default=None,
                   help="the server to watch (needs --enable-debug-endpoints); optional with --compare-eager")
    p.add_argument("--window", type=float, default=10.0, help="seconds to watch (default: 10)")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--compare-eager", action="store_true",
                   help="run --prompt greedily compiled and eager (locally, on MODEL or the server's model) and "
                        "report the first differing token and the logit gap")
    p.add_argument("--model", default=None,
                   help="with --compare-eager: the model (default: the server's, else the demo model)")
    from jaxserve import EngineConfig

    EngineConfig.add_cli_args(p.add_argument_group("engine (with --compare-eager)"))
    p.add_argument("--prompt", action="append", default=None,
                   help="with --compare-eager: a prompt (repeatable; default: three built-in ones)")
    p.add_argument("--max-tokens", type=int, default=32, help="with --compare-eager: tokens per prompt (default: 32)")


def run_diagnose_cli(args: argparse.Namespace) -> dict:
    from jaxserve import ConfigError, EngineConfig

    if args.url is None and not args.compare_eager:
        raise ConfigError("diagnose: give the server's URL (or --compare-eager)")
    result: dict[str, Any] = {}
    if args.url is not None:
        result["watch"] = watch(args.url, args.window, args.api_key)
    if args.compare_eager:
        model = args.model
        if model is None and args.url is not None:  # the server's model folder or hub id
            model = get_json(f"{server_root(args.url)}/v1/models", args.api_key)["data"][0]["root"]
        prompts = args.prompt or ["Hello, my name is", "The capital of France is", "JAX compiles"]
        config = EngineConfig.from_cli_args(args, model=model)
        result["compare_eager"] = compare_eager(config, prompts, args.max_tokens)
    result["findings"] = (result.get("watch", {}).get("findings", [])
                          + result.get("compare_eager", {}).get("findings", []))
    return result

