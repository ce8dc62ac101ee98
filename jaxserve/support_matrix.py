"""The support matrix: which features combine, as the last run of ``tests/matrix`` found them.

A feature is a set of ``LLM`` keyword arguments over a plain base engine. The test suite builds a
few *combination engines* that together hold every allowed pair of features (and the triples users
run), runs one short workload on each, and compares it with a *reference engine* that keeps only
the features that change the numbers (a model, a weight or cache format, a kernel) on one device
with every scheduling feature off. The page is rendered from those results, never written by hand:

- ✅ a pair some combination engine held, and every engine holding it passed;
- ⛔ a pair refused by design: building its configuration raises a ``ConfigError`` naming both
  settings (the suite checks that refusal);
- ❌ a pair held by an engine whose checks failed.

Nothing here imports jax: ``jaxserve support-matrix`` renders a page from a results file.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jaxserve import envs

PASS, REFUSED, FAIL = "✅", "⛔", "❌"
EXCLUSIVE, NOT_RUN = "—", "?"  # alternatives of one feature; a pair the results hold no engine for


@dataclasses.dataclass(frozen=True)
class Feature:
    """One axis of the matrix: what it turns on, and how the reference engine treats it."""

    name: str
    label: str
    engine: Mapping[str, Any]  # LLM keyword arguments over BASE_ENGINE that turn it on
    group: str | None = None  # features of one group exclude one another (one weight format, ...)
    numerics: bool = False  # changes the numbers: the reference engine keeps it
    in_workload: bool = False  # a request-side feature: every engine's workload exercises it
    model: str | None = None  # a tiny checkpoint of its own (tests/matrix builds it by this name)
    pools: bool = False  # a pooling model: its workload embeds, so request-side sampling features do not apply


def _kw(**kwargs: Any) -> Mapping[str, Any]:
    return MappingProxyType(kwargs)


# Every feature off: the scheduling features are explicitly disabled, so a feature's own keywords
# are the whole difference it makes. block_size 4 makes short prompts span several blocks.
BASE_ENGINE = _kw(max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                  enable_chunked_prefill=False, enable_prefix_caching=False, async_scheduling=False,
                  num_gpu_blocks_override=256, attention_backend="xla", compilation_cache_dir="off")

FEATURES: tuple[Feature, ...] = (
    Feature("chunked_prefill", "chunked prefill", _kw(enable_chunked_prefill=True, max_num_batched_tokens=16)),
    Feature("prefix_caching", "prefix caching", _kw(enable_prefix_caching=True)),
    Feature("async_scheduling", "async scheduling", _kw(async_scheduling=True)),
    Feature("preemption", "preemption", _kw(num_gpu_blocks_override=18)),
    Feature("n_gt_1", "n > 1 (seeded)", _kw(), in_workload=True),
    Feature("structured_outputs", "structured outputs", _kw(), in_workload=True),
    Feature("int8", "int8 weights", _kw(quantization="int8"), group="quantization", numerics=True),
    Feature("fp8", "fp8 weights", _kw(quantization="fp8"), group="quantization", numerics=True),
    Feature("gguf", "GGUF Q4_1 blocks kept", _kw(quantization="gguf"), group="quantization", numerics=True,
            model="gguf"),
    Feature("fp8_kv", "fp8 KV cache", _kw(kv_cache_dtype="fp8"), numerics=True),
    Feature("cpu_backend", "cpu attention (C++)", _kw(attention_backend="cpu"), numerics=True),
    Feature("tp2", "tensor parallel 2", _kw(tensor_parallel_size=2), group="parallel"),
    Feature("dp2", "data parallel 2", _kw(data_parallel_size=2), group="parallel"),
    Feature("sliding_window", "sliding-window model", _kw(), group="model", numerics=True, model="sliding_window"),
    # expert parallelism is how a MoE model splits over devices (a no-op on one device)
    Feature("moe", "mixture-of-experts model", _kw(enable_expert_parallel=True), group="model", numerics=True,
            model="moe"),
    Feature("pooling", "pooling model (embed)", _kw(), group="model", numerics=True, model="pooling", pools=True),
    # The workload then spreads its requests over the base model and two random adapters.
    Feature("lora", "LoRA adapters (2 slots)", _kw(enable_lora=True, max_loras=2, max_lora_rank=8), numerics=True),
    # Qwen2.5-VL: each workload prompt starts with an image (a repeated prefix repeats its image).
    Feature("vlm", "vision-language model (images)", _kw(), group="model", numerics=True, model="vlm"),
)
FEATURES_BY_NAME = MappingProxyType({f.name: f for f in FEATURES})

# Pairs refused by design, with why; the configuration raises a ConfigError naming both.
REFUSED_PAIRS: Mapping[frozenset[str], str] = MappingProxyType({
    frozenset(("pooling", "tp2")): "a pooling model runs on one device for now",
    frozenset(("pooling", "lora")): "a pooling model serves no LoRA adapters yet",
    frozenset(("pooling", "dp2")): "a pooling model runs one engine for now (no replicas)",
    frozenset(("vlm", "int8")): "a vision-language model is served unquantized for now",
    frozenset(("vlm", "fp8")): "a vision-language model is served unquantized for now",
    frozenset(("vlm", "lora")): "a vision-language model serves no LoRA adapters yet",
})

# Pairs that exist but that no engine of this matrix can show, with why; drawn as alternatives.
UNREACHED_PAIRS: Mapping[frozenset[str], str] = MappingProxyType({
    frozenset(("pooling", "preemption")): "a pooling request holds blocks only while its prompt runs and the oldest "
                                          "takes the whole token budget, so the small pool never preempts one",
    frozenset(("pooling", "async_scheduling")): "a pooling engine schedules synchronously, as vLLM's does: there is "
                                                "no sampled token for a next step to overlap",
})

# Combinations users run together, each held whole by one combination engine.
USER_TRIPLES: tuple[tuple[str, ...], ...] = (
    ("chunked_prefill", "prefix_caching", "async_scheduling"),
    ("tp2", "int8", "fp8_kv"),
    ("prefix_caching", "preemption", "structured_outputs"),
    ("dp2", "prefix_caching", "fp8"),
    ("sliding_window", "chunked_prefill", "preemption"),
    ("cpu_backend", "fp8_kv", "chunked_prefill"),
)


def pairs(features: Iterable[str]) -> set[frozenset[str]]:
    return {frozenset(p) for p in itertools.combinations(sorted(features), 2)}


def alternatives(a: str, b: str) -> bool:
    """Two settings of one thing (one weight format, one parallelism), or features of two different
    test models: no engine can hold both, by construction rather than by refusal."""
    fa, fb = FEATURES_BY_NAME[a], FEATURES_BY_NAME[b]
    if (fa.pools and fb.in_workload) or (fb.pools and fa.in_workload):
        return True  # a pooling model takes no sampling requests
    if frozenset((a, b)) in UNREACHED_PAIRS:
        return True
    return bool((fa.group and fa.group == fb.group) or (fa.model and fb.model and fa.model != fb.model))


def compatible(a: str, b: str) -> bool:
    """Whether one engine may hold both features."""
    return a != b and not alternatives(a, b) and frozenset((a, b)) not in REFUSED_PAIRS


def allowed_pairs() -> set[frozenset[str]]:
    """Every pair an engine may hold; the request-side features ride along in every workload."""
    engine_side = [f.name for f in FEATURES if not f.in_workload]
    return {p for p in pairs(engine_side) if compatible(*p)}


def covering_engines() -> list[tuple[str, ...]]:
    """Combination engines (their engine-side features) that together hold every allowed pair and
    every user triple. Greedy and deterministic: each engine starts from the first uncovered pair
    and takes, in the features' order, each feature compatible with what it holds that adds a pair
    not yet held. A user triple that no engine holds whole then gets an engine of its own, and an
    engine whose features another one holds is dropped."""
    order = [f.name for f in FEATURES if not f.in_workload]
    uncovered = allowed_pairs()
    engines: list[tuple[str, ...]] = []
    while uncovered:
        held = sorted(min(uncovered, key=sorted), key=order.index)
        for name in order:
            if name not in held and all(compatible(name, h) for h in held) and any(
                    frozenset((name, h)) in uncovered for h in held):
                held.append(name)
        engines.append(tuple(sorted(held, key=order.index)))
        uncovered -= pairs(held)
    for triple in USER_TRIPLES:
        engine_side = {f for f in triple if not FEATURES_BY_NAME[f].in_workload}
        if not any(engine_side <= set(e) for e in engines):
            engines.append(tuple(sorted(engine_side, key=order.index)))
    # An engine whose features another engine holds too adds nothing.
    return [e for i, e in enumerate(engines) if not any(set(e) < set(o) for o in engines[i + 1:] + engines[:i])]


def engine_kwargs(features: Iterable[str]) -> dict[str, Any]:
    """BASE_ENGINE with each feature's keywords applied, in the features' order."""
    kwargs = dict(BASE_ENGINE)
    for name in features:
        kwargs.update(FEATURES_BY_NAME[name].engine)
    return kwargs


def reference_features(features: Iterable[str]) -> tuple[str, ...]:
    """What the reference of an engine holding ``features`` keeps: the features that change numbers."""
    return tuple(f for f in features if FEATURES_BY_NAME[f].numerics)


def model_of(features: Iterable[str]) -> str:
    """The tiny checkpoint an engine with ``features`` serves ('dense' unless a feature names one)."""
    return next((FEATURES_BY_NAME[f].model for f in features if FEATURES_BY_NAME[f].model), None) or "dense"


# ---- results and rendering ---------------------------------------------------------------------


def pair_statuses(results: Mapping[str, Any]) -> dict[frozenset[str], str]:
    """Each pair's status from a run's results: ``{"engines": [{"features": [...], "passed": bool}],
    "refusals": {"a+b": bool}}``. A request-side feature pairs with every engine's features."""
    statuses: dict[frozenset[str], str] = {}
    workload = [f.name for f in FEATURES if f.in_workload]
    for engine in results["engines"]:
        riding = [] if any(FEATURES_BY_NAME[f].pools for f in engine["features"]) else workload
        held = pairs([*engine["features"], *riding])
        held |= {frozenset((f,)) for f in [*engine["features"], *riding]}  # the diagonal: the feature at all
        for pair in held:
            if not engine["passed"]:
                statuses[pair] = FAIL
            else:
                statuses.setdefault(pair, PASS)
    for key, refused_as_claimed in results.get("refusals", {}).items():
        statuses[frozenset(key.split("+"))] = REFUSED if refused_as_claimed else FAIL
    return statuses


def _cell(statuses: Mapping[frozenset[str], str], a: str, b: str) -> str:
    if a != b and alternatives(a, b):
        return EXCLUSIVE
    return statuses.get(frozenset((a, b)), NOT_RUN)


def render_markdown(results: Mapping[str, Any]) -> str:
    """The page ``docs/support-matrix.md``: the pair table, the refusals' reasons and the engines."""
    statuses = pair_statuses(results)
    names = [f.name for f in FEATURES]
    short = {name: str(i + 1) for i, name in enumerate(names)}
    lines = [
        "# Support matrix",
        "",
        "Generated by `jaxserve support-matrix --write docs/support-matrix.md` from the last run of",
        "`tests/matrix` (`make support-matrix`); never edited by hand. The suite fails when this page",
        "disagrees with its run. What each status means is in `jaxserve/support_matrix.py`.",
        "",
        f"{PASS} tested and passing · {REFUSED} refused by design (reason below) · {FAIL} failing · "
        f"{EXCLUSIVE} alternatives (one weight format, one parallelism, two test models, sampling "
        "features with a pooling model, or a pair not reached, below) · "
        f"{NOT_RUN} not in this run",
        "",
        "| feature | " + " | ".join(short[n] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for a in names:
        row = [_cell(statuses, a, b) for b in names]
        lines.append(f"| {short[a]}. {FEATURES_BY_NAME[a].label} | " + " | ".join(row) + " |")
    lines += ["", "## Refused by design", ""]
    if REFUSED_PAIRS:
        for pair, why in sorted(REFUSED_PAIRS.items(), key=lambda kv: sorted(kv[0])):
            a, b = sorted(pair)
            lines.append(f"- {FEATURES_BY_NAME[a].label} with {FEATURES_BY_NAME[b].label}: {why}")
    else:
        lines.append("- none")
    lines += ["", "## Not reached by this matrix", ""]
    for pair, why in sorted(UNREACHED_PAIRS.items(), key=lambda kv: sorted(kv[0])):
        a, b = sorted(pair)
        lines.append(f"- {FEATURES_BY_NAME[a].label} with {FEATURES_BY_NAME[b].label}: {why}")
    lines += ["", "## The combination engines of the last run", "",
              "Each is compared with its reference: the same model, weight and cache formats and attention",
              "kernel on one device, with chunked prefill, prefix caching, async scheduling and preemption",
              "off. Every workload also asks for `n > 1` seeded samples and a regex-constrained output; a",
              "pooling engine embeds the same prompts instead, compared with its reference's vectors.", "",
              "| engine | features | result |", "|---|---|---|"]
    for i, engine in enumerate(results["engines"]):
        labels = ", ".join(FEATURES_BY_NAME[f].label for f in engine["features"])
        verdict = PASS if engine["passed"] else f"{FAIL} " + "; ".join(engine.get("failures", []))
        lines.append(f"| {i + 1} | {labels} | {verdict} |")
    return "\n".join(lines) + "\n"


def render_text(results: Mapping[str, Any]) -> str:
    """The pair table for a terminal: one row per feature, one column per feature by number."""
    statuses = pair_statuses(results)
    names = [f.name for f in FEATURES]
    width = max(len(f.label) for f in FEATURES) + 4
    out = [" " * width + " ".join(f"{i + 1:>2}" for i in range(len(names)))]
    for i, a in enumerate(names):
        cells = " ".join(f"{_cell(statuses, a, b):>2}" for b in names)
        out.append(f"{i + 1:>2}. {FEATURES_BY_NAME[a].label:<{width - 4}}{cells}")
    return "\n".join(out)


def any_failing(results: Mapping[str, Any]) -> bool:
    return FAIL in pair_statuses(results).values()


def last_run_path() -> Path:
    """Where the last run of tests/matrix on this machine left its results."""
    return envs.cache_dir() / "support-matrix" / "last-run.json"


def load_results(path: str | Path | None = None) -> dict[str, Any]:
    with open(path or last_run_path(), encoding="utf-8") as f:
        return json.load(f)
