"""PoolingModelRunner: runs a ``SchedulerOutput`` of pooling requests with one compiled step per bucket.

The engine core drives it as it drives the generating runner (``prepare``/``launch``/``collect``),
so pooling requests share the scheduler's token budget, chunked prefill and prefix cache. A step
packs the scheduled chunks end to end, padded to a token bucket (powers of two up to the budget);
each request's pooled state is carried on the host from one chunk to the next (LAST: the last
chunk's row; MEAN: a running sum; CLS: the first chunk's row), and the step whose chunk ends the
prompt hands the scheduler the request's vector: it finishes then, no sampler, no decode.

A decoder keeps a paged KV pool (its chunks and prefix hits read earlier keys); a BERT encoder
keeps none: the scheduler only books its blocks, and it never chunks (see ``pooling_core``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from jaxserve import envs
from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.exceptions import ConfigError
from jaxserve.models.bert import BERT_ARCHITECTURES, load_bert
from jaxserve.models.pooling_config import PoolerConfig
from jaxserve.runner.compile_stats import CompileStats
from jaxserve.runner.input_batch import group_block_ids
from jaxserve.runner.kv_cache import allocate_kv_cache, determine_num_blocks
from jaxserve.runner.pooling_step import make_decoder_step, make_encoder_step

logger = logging.getLogger("jaxserve")

MIN_BUCKET = 16


def is_encoder_folder(folder: str) -> bool:
    archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    return any(a in BERT_ARCHITECTURES for a in archs)


def token_buckets(budget: int) -> tuple[int, ...]:
    """Powers of two from 16 below ``budget``, then ``budget`` itself: a step pads to the next one."""
    out, t = [], MIN_BUCKET
    while t < budget:
        out.append(t)
        t *= 2
    return (*out, budget)


@dataclasses.dataclass
class _PoolingRequest:
    prompt: list[int]
    token_type_ids: tuple[int, ...] | None
    blocks: list[int]
    num_computed_tokens: int  # before the step being built
    carry: np.ndarray | None = None  # the pooled state its earlier chunks left


@dataclasses.dataclass(frozen=True)
class PoolingStep:
    """One step through the runner (the engine core reads ``scheduler_output``, ``out`` and ``plan``)."""

    scheduler_output: SchedulerOutput
    inputs: dict[str, np.ndarray] | None = None
    req_ids: tuple[str, ...] = ()
    ends: tuple[bool, ...] = ()  # the request's prompt ends in this step
    bucket: int = 0
    out: Any = None  # (out, carry) on the device once launched
    plan: None = None  # no sampled rows: nothing for a structured-output bitmask
    num_rows: int = 0


class PoolingModelRunner:
    """``budget``: the scheduler's token budget (the largest bucket). ``dtype``: the weights'."""

    decode_attn_fn = None  # no decode steps

    def __init__(self, config: EngineConfig, folder: str, task: str, pooler: PoolerConfig, max_model_len: int,
                 budget: int, dtype: str = "float32"):
        self.config, self.task, self.pooler = config, task, pooler
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_blocks_per_seq = cdiv(max_model_len, config.block_size)
        self.is_encoder = is_encoder_folder(folder)
        self.stats = CompileStats()
        self.requests: dict[str, _PoolingRequest] = {}
        self.num_partial_chunks = 0  # chunks that did not end their prompt (chunked prefill at work)
        self.mc: Any = None
        if self.is_encoder:
            bert_cfg, self.weights = load_bert(folder, dtype)
            self.hidden_size = bert_cfg.hidden_size
            self._fn = make_encoder_step(bert_cfg, task, pooler)
            self.kv: Any = ()
            self.attention_backend = "dense"  # bidirectional, masked per prompt, in the step itself
            # Blocks are booked by the scheduler only (nothing is stored): room for every sequence.
            self.num_blocks = config.num_gpu_blocks_override or self.max_num_seqs * self.max_blocks_per_seq + 1
        else:
            self._load_decoder(folder, dtype)
        self.buckets = token_buckets(min(budget, self.max_num_seqs * max_model_len,
                                         budget if self.is_encoder else (self.num_blocks - 1) * self.block_size))

    def _load_decoder(self, folder: str, dtype: str) -> None:
        from jaxserve.models import load_model
        from jaxserve.models.safetensors_io import open_checkpoint_files
        from jaxserve.runner.model_runner import resolve_attention_backend

        model = load_model(folder, dtype=dtype, quantization=self.config.quantization)
        self.mc = model.config
        self.hidden_size = self.mc.hidden_size
        cfg = self.config
        self.attention_backend = resolve_attention_backend(cfg.attention_backend, None, self.mc.dtype, mc=self.mc,
                                                           block_size=cfg.block_size,
                                                           kv_cache_dtype=cfg.kv_cache_dtype)
        interpret = cfg.interpret_kernels if cfg.interpret_kernels is not None else jax.default_backend() != "gpu"
        attn_fn = pallas_kernels.get_attention_fn(self.attention_backend, interpret=interpret,
                                                  build_dir=envs.kernel_build_dir())
        score = None
        if self.task == "classify":
            files = open_checkpoint_files(folder)
            if "score.weight" not in files:
                raise ConfigError("classify needs the checkpoint's score.weight head")
            score = (jnp.asarray(np.asarray(files["score.weight"].get("score.weight"), np.float32)), None)
        self._fn, self.weights = make_decoder_step(model, self.task, self.pooler, attn_fn, score)
        # The pool holds only prompts in flight (nothing stays for a decode): the CPU's sizing rule
        # on every platform, or the flags' explicit size.
        self.num_blocks = determine_num_blocks(self.mc, cfg, self.max_model_len, platform="cpu")
        self.kv = allocate_kv_cache(self.mc, self.num_blocks, self.block_size, 1, cfg.kv_cache_dtype)

    # ---- what the engine core reads ------------------------------------------------------------

    def num_compiled(self) -> int:
        return int(self._fn._cache_size())

    def pick_bucket(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.buckets[-1]}")

    def describe(self) -> dict:
        return {"num_gpu_blocks": self.num_blocks, "attention_backend": self.attention_backend,
                "token_buckets": list(self.buckets), "pooling_task": self.task,
                "pooling_type": self.pooler.pooling_type, "pooling_partial_chunks": self.num_partial_chunks}

    def warm_up(self, show_progress: bool = True) -> None:
        """Compile and run every bucket once on padding, so no request waits for a compile."""
        if self.config.enforce_eager:
            return
        start = time.perf_counter()
        for b in self.buckets:
            self._run(self._inputs([], b))
        jax.block_until_ready(self.kv)
        self.stats.warm_up_compile_seconds = time.perf_counter() - start
        self.stats.num_compiles = self.num_compiled()
        logger.info("pooling steps: %d buckets %s compiled in %.1f s (%s, %s pooling)", len(self.buckets),
                    list(self.buckets), self.stats.warm_up_compile_seconds, self.task, self.pooler.pooling_type)

    # ---- the step ------------------------------------------------------------------------------

    def prepare(self, so: SchedulerOutput) -> PoolingStep:
        for req_id in list(so.finished_req_ids) + list(so.preempted_req_ids):
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.pooling_params
            if params is None:
                raise ValueError(f"request {new.req_id}: a pooling model serves pooling requests only")
            self.requests[new.req_id] = _PoolingRequest(
                list(new.prompt_token_ids), params.token_type_ids, list(group_block_ids(new.block_ids, 1)[0]),
                new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            state.blocks += group_block_ids(new_blocks, 1)[0]
            state.num_computed_tokens = num_computed
        if so.total_num_scheduled_tokens == 0:
            return PoolingStep(so)
        req_ids = list(so.num_scheduled_tokens)
        chunks = [(self.requests[r], so.num_scheduled_tokens[r]) for r in req_ids]
        bucket = self.pick_bucket(so.total_num_scheduled_tokens)
        ends = tuple(s.num_computed_tokens + n == len(s.prompt) for s, n in chunks)
        return PoolingStep(so, self._inputs(chunks, bucket), tuple(req_ids), ends, bucket,
                           num_rows=self._rows(bucket))

    def _rows(self, bucket: int) -> int:
        return min(bucket, self.max_num_seqs)  # every scheduled request brings at least one token

    def _inputs(self, chunks: list[tuple[_PoolingRequest, int]], bucket: int) -> dict[str, np.ndarray]:
        """The packed step: request ``i`` feeds its tokens ``[computed, computed + n)`` at rows
        ``starts[i] : starts[i] + n``; the bucket's spare rows and tokens are owned by nobody."""
        rows, bs = self._rows(bucket), self.block_size
        x = {"input_ids": np.zeros(bucket, np.int32), "positions": np.zeros(bucket, np.int32),
             "slot_mapping": np.full(bucket, -1, np.int32), "block_tables": np.zeros((rows, self.max_blocks_per_seq),
                                                                                       np.int32),
             "kv_lens": np.zeros(rows, np.int32), "query_start_loc": np.zeros(rows + 1, np.int32),
             "num_seqs": np.asarray([len(chunks)], np.int32), "starts": np.zeros(rows, np.int32),
             "lens": np.zeros(rows, np.int32), "carry": np.zeros((rows, self.hidden_size), np.float32),
             "first": np.zeros(rows, np.bool_), "counts": np.zeros(rows, np.int32)}
        if self.is_encoder:
            x["token_type_ids"] = np.zeros(bucket, np.int32)
            x["segments"] = np.full(bucket, -1, np.int32)
        at = 0
        for i, (state, n) in enumerate(chunks):
            start = state.num_computed_tokens
            pos = np.arange(start, start + n, dtype=np.int32)
            blocks = np.asarray(state.blocks, np.int32)
            x["input_ids"][at:at + n] = state.prompt[start:start + n]
            x["positions"][at:at + n] = pos
            if self.is_encoder:
                x["segments"][at:at + n] = i
                if state.token_type_ids is not None:
                    x["token_type_ids"][at:at + n] = state.token_type_ids[start:start + n]
            else:
                x["slot_mapping"][at:at + n] = blocks[pos // bs] * bs + pos % bs
                x["block_tables"][i, :len(blocks)] = blocks
            x["kv_lens"][i] = x["counts"][i] = start + n
            x["starts"][i], x["lens"][i], x["first"][i] = at, n, start == 0
            if state.carry is not None:
                x["carry"][i] = state.carry
            at += n
            x["query_start_loc"][i + 1] = at
        x["query_start_loc"][len(chunks) + 1:] = at
        x["starts"][len(chunks):] = at
        return x

    def _run(self, inputs: dict[str, np.ndarray]):
        out, carry, self.kv = self._fn(self.weights, self.kv, inputs)
        return out, carry

    def launch(self, step: PoolingStep, bitmask: np.ndarray | None = None) -> PoolingStep:
        if step.inputs is None:
            return step
        if bitmask is not None:
            raise ValueError("a pooling step samples nothing: it takes no structured-output bitmask")
        self.stats.record_step(step.scheduler_output.total_num_scheduled_tokens, step.bucket)
        return dataclasses.replace(step, out=self._run(step.inputs))

    def collect(self, step: PoolingStep) -> ModelRunnerOutput:
        """The vectors of the requests whose prompt ended; the others keep their pooled state."""
        if step.out is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        t0 = time.perf_counter()
        out, carry = jax.device_get(step.out)
        self.stats.device_wait_seconds += time.perf_counter() - t0
        pooled: dict[str, np.ndarray] = {}
        for i, (req_id, end) in enumerate(zip(step.req_ids, step.ends)):
            if end:
                pooled[req_id] = np.array(out[i])
            elif req_id in self.requests:
                self.requests[req_id].carry = np.array(carry[i])
                self.num_partial_chunks += 1
        req_ids = list(step.req_ids)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=[[] for _ in req_ids], pooler_output=pooled)
