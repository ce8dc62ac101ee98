"""Engine shapes shared by several test files: ``LLM`` / ``jaxserve serve`` keyword arguments.

A shape fixes the compiled programs' token buckets and the KV cache's size, so every engine built
with one after the first is served by the persistent compilation cache; changing a value makes the
next run compile again. The server suite also asserts on them (``max_model_len``). The shapes are
read-only: a test that needs a variant spreads one into a new dict.
"""

from __future__ import annotations

from types import MappingProxyType

# The random tiny demo model, by name: with no model, jaxserve serves the 30-layer SmolLM2.
DEMO_MODEL = "jaxserve-demo"

# The engine tests (tests/engine): every LLM they build shares these buckets.
ENGINE_TESTS_SHAPE = MappingProxyType(
    dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_gpu_blocks_override=160))

# The server suite's `jaxserve serve` and the in-process LLM that checks its answers: one shape,
# so the compilation cache serves both processes.
SERVER_SHAPE = MappingProxyType(
    dict(max_model_len=256, max_num_seqs=32, max_num_batched_tokens=128, num_gpu_blocks_override=512))

# Attention-backend comparisons, which run interpreted kernels: a small engine keeps them short.
BACKEND_COMPARISON_SHAPE = MappingProxyType(
    dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, num_gpu_blocks_override=40))
