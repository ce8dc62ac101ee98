"""``LLM``: offline batched generation, as in vLLM (``from jaxserve import LLM, SamplingParams``)."""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from jaxserve.config import EngineConfig
from jaxserve.core.lora_request import LoRARequest
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.dp.placement import start_replica_engines
from jaxserve.engine.dp.replica_set import ReplicaSet
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.media import chat_images
from jaxserve.engine.metrics import Metric
from jaxserve.engine.outputs import RequestOutput, RequestOutputKind
from jaxserve.engine.pooling_llm import PoolingLLM, pooling_task_of
from jaxserve.engine.pooling_outputs import ClassificationRequestOutput, EmbeddingRequestOutput, ScoringRequestOutput
from jaxserve.engine.processor import PromptType
from jaxserve.engine.profiling import Profile, Profiler
from jaxserve.engine.step_records import StepRecord
from jaxserve.engine.timeline import RequestTimeline
from jaxserve.exceptions import ConfigError, InvalidRequestError

if TYPE_CHECKING:  # the runner imports jax; LLM loads it with the engine
    from jaxserve.runner.inspection import StepInputs, StepProgram


class LLM:
    """An engine for offline use.

    ``model`` is a checkpoint folder or hub id, None for the built-in demo model, or a model
    object: a Flax NNX module with the call contract of ``LlamaForCausalLM`` (``config``,
    ``__call__``, ``compute_logits``; see :mod:`jaxserve.models.contract`), served as it is.
    ``tokenizer`` is a folder or hub id, or a tokenizer object (transformers' interface); with a
    model object and no tokenizer, prompts must be token ids.

    Other keyword arguments are ``EngineConfig`` fields (``max_model_len``, ``max_num_seqs``,
    ``enforce_eager``, ``attention_backend`` ...). With ``data_parallel_size=M`` there are M
    engines (``llm_engines``; ``llm_engine`` is the first), each prompt goes where the data-parallel
    router sends it, and the engines step concurrently, one thread each.
    """

    def __init__(self, model: str | os.PathLike | Any | None = None, *, tokenizer: Any = None,
                 show_progress: bool = True, record_steps: bool = False, **engine_args: Any):
        model_object = None if model is None or isinstance(model, (str, os.PathLike)) else model
        tokenizer_object = None if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)) else tokenizer
        self.config = EngineConfig(
            model=None if model is None or model_object is not None else os.fspath(model),
            tokenizer=None if tokenizer is None or tokenizer_object is not None else os.fspath(tokenizer),
            **engine_args)
        self._counter = itertools.count()
        self._profiler = Profiler()
        # A pooling model (issue 34) runs without the generating engine; generate() refuses it.
        task = pooling_task_of(self.config) if model_object is None else None
        self.pooling: PoolingLLM | None = None
        if task is not None:
            self.pooling = PoolingLLM(self.config, task, tokenizer_object)
            self.llm_engines = []
            return
        if self.config.data_parallel_size > 1:
            if model_object is not None:
                raise ConfigError("data_parallel_size: a model object is one engine's; replicas load a "
                                  f"checkpoint each (got {self.config.data_parallel_size})")
            self.llm_engines = start_replica_engines(self.config, show_progress=show_progress,
                                                     record_steps=record_steps)
        else:
            self.llm_engines = [LLMEngine(self.config, show_progress=show_progress, record_steps=record_steps,
                                          model=model_object, tokenizer=tokenizer_object)]
        self.llm_engine = self.llm_engines[0]
        self.replica_set = ReplicaSet(self.llm_engines)  # routes and merges (also with one engine)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the order of ``prompts``.
        ``lora_request``: the LoRA adapter of every prompt, or a list of one per prompt (None:
        the base model), as in vLLM; the engine needs ``enable_lora=True``."""
        if self.pooling is not None:
            raise InvalidRequestError("model", f"a pooling model ({self.pooling.task}) does not generate; "
                                      "use embed, classify or score")
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        loras = _as_lora_list(lora_request, len(prompts))
        added: list[tuple[LLMEngine, str]] = []
        self.replica_set.reset_load()  # every earlier call ran to its end
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                engine = self._add_routed(rid, prompt, p, priority[i] if priority else 0, salt, loras[i])
                added.append((engine, rid))
        except Exception:
            for engine, rid in added:
                engine.abort_request([rid])
            raise
        return self._run([rid for _, rid in added], use_tqdm)

    def _pooling_model(self) -> PoolingLLM:
        if self.pooling is None:
            raise InvalidRequestError("model", "a generative model does not pool; serve it with --runner pooling "
                                      "or --convert embed|classify")
        return self.pooling

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], *,
              truncate_prompt_tokens: int | None = None, dimensions: int | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """vLLM's ``LLM.embed``: one embedding per prompt (text or token ids), in order."""
        return self._pooling_model().embed(_pooling_prompts(prompts), truncate_prompt_tokens, dimensions)

    def classify(self, prompts: str | list[int] | Sequence[str | list[int]], *,
                 truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
                 ) -> list[ClassificationRequestOutput]:
        """vLLM's ``LLM.classify``: class probabilities per prompt."""
        return self._pooling_model().classify(_pooling_prompts(prompts), truncate_prompt_tokens)

    def score(self, data_1: str, data_2: str | Sequence[str], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = False) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: the query ``data_1`` against each of ``data_2``."""
        docs = [data_2] if isinstance(data_2, str) else list(data_2)
        return self._pooling_model().score(data_1, docs, truncate_prompt_tokens)

    def _add_routed(self, rid: str, prompt: PromptType, params: SamplingParams, priority: int,
                    cache_salt: str | None, lora_request: LoRARequest | None = None) -> LLMEngine:
        """Add the request to the engine the router picks (the only one without data parallelism)."""
        engines = self.llm_engines
        processed = engines[0].process_request(rid, prompt, params, priority=priority, cache_salt=cache_salt,
                                               lora_request=lora_request)
        self.replica_set.prepare(processed)
        index = self.replica_set.route(processed)
        engines[index].add_processed_request(processed, output_kind=RequestOutputKind.FINAL_ONLY)
        self.replica_set.admit(index, processed)
        return engines[index]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (or ``chat_template``) to each conversation, then generate.

        ``tools`` (OpenAI tool objects) and ``chat_template_kwargs`` (``enable_thinking`` ...) go
        to the template. As in vLLM offline, the outputs are the raw text: tool calls and
        reasoning are not parsed out of it."""
        conversations: list[list[dict[str, Any]]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages)  # type: ignore[assignment]
        tok = self.get_tokenizer()
        # Image parts become the model's placeholders in the text; their images go beside it.
        mm = self.config.multimodal_config
        with_images = [chat_images(conv, mm.allowed_local_media_path, self.llm_engine.image_placeholder,
                                   limit=mm.limit_mm_per_prompt)
                       for conv in conversations]
        prompts = [tok.apply_chat_template([_template_message(m) for m in conv], tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
                   for conv, _ in with_images]
        # The template already holds any special tokens; do not add a BOS twice.
        token_prompts = [{"prompt": p, "prompt_token_ids": tok.encode(p, add_special_tokens=False),
                          **({"multi_modal_data": {"image": images}} if images else {})}
                         for p, (_, images) in zip(prompts, with_images)]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req") as bar:
            if len(self.llm_engines) == 1:
                _drain(self.llm_engine, results, bar)
            else:  # one thread per engine: a step's device work runs without the GIL
                with concurrent.futures.ThreadPoolExecutor(len(self.llm_engines)) as pool:
                    for future in [pool.submit(_drain, e, results, bar) for e in self.llm_engines]:
                        future.result()
        return [results[i] for i in ids]

    @property
    def step_records(self):
        """The ring of per-step records (who ran with how many tokens, who waited and why, blocks,
        bucket, timings); ``record_steps=True`` keeps it even with ``max_step_records=0``."""
        return self.llm_engine.step_records

    def get_step_records(self, limit: int | None = None) -> list[StepRecord]:
        """The newest ``limit`` step records (all kept with None) of all engines, oldest first."""
        return self.replica_set.get_step_records(limit)

    def get_request_timeline(self, request_id: str) -> RequestTimeline | None:
        """A request's timeline (``RequestOutput.request_id``), while the engine keeps it."""
        return self.replica_set.get_request_timeline(request_id)

    def export_trace(self, path: str | None = None, *, num_steps: int | None = None,
                     num_requests: int = 100) -> dict:
        """A Chrome/Perfetto trace of the newest steps and requests; written to ``path`` if given."""
        trace = self.replica_set.build_trace(num_steps, num_requests)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(trace, f)
        return trace

    def get_metrics(self) -> list[Metric]:
        """Every engine's metrics (label ``engine``); with several, their totals (``engine="total"``)."""
        return self.replica_set.metrics_snapshot()

    def stats(self) -> dict:
        if len(self.llm_engines) == 1:
            return self.llm_engine.stats()
        return self.replica_set.merged_stats()

    def reset_prefix_cache(self) -> bool:
        return all([e.reset_prefix_cache() for e in self.llm_engines])

    # ---- looking inside the step (docs/design.md, "Inspecting a step") ----------------------

    def get_step_program(self, bucket: int, *, decode_only: bool = False) -> StepProgram:
        """Token bucket ``bucket``'s compiled step as the engine runs it: jaxpr, StableHLO and
        optimized HLO text, XLA's ``cost_analysis()`` and ``memory_analysis()``."""
        from jaxserve.runner.inspection import find_variant, step_program

        runner = self.llm_engine.core.runner
        return step_program(runner.steps, find_variant(runner.variants(), bucket, decode_only))

    def get_last_step_inputs(self) -> StepInputs | None:
        """The packed inputs of the last launched step, decoded into named arrays (None before
        the first step). With async scheduling that step may still be running."""
        from jaxserve.runner.inspection import decode_step

        packed = self.llm_engine.core.runner.last_packed
        return None if packed is None else decode_step(packed)

    def start_profile(self, log_dir: str | None = None) -> Path:
        """Start a ``jax.profiler`` trace into ``log_dir`` (default ``$JAXSERVE_PROFILER_DIR``,
        else the cache's ``profiles`` folder); returns the folder."""
        return self._profiler.start(log_dir)

    def stop_profile(self) -> Profile:
        """Stop the trace; the ``Profile`` names its Perfetto and TensorBoard files."""
        return self._profiler.stop()


def _drain(engine: LLMEngine, results: dict[str, RequestOutput], bar) -> None:
    """Step ``engine`` until it has nothing left, keeping each finished output."""
    while engine.has_unfinished_requests():
        for _, out in engine.step():
            if out.finished:
                results[out.request_id] = out
                bar.update(1)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """The message as chat templates expect it: tool-call arguments as objects, not JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = dict(message, tool_calls=[dict(c) for c in calls])
    for call in out["tool_calls"]:
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call["function"] = dict(fn, arguments=json.loads(fn["arguments"]))
            except ValueError:
                raise InvalidRequestError("messages", "tool call arguments must be JSON text, got "
                                                      f"{fn['arguments'][:80]!r}") from None
    return out


def _pooling_prompts(prompts) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError("sampling_params", f"got {len(params)} for {n} prompts")
    return params


def _as_lora_list(lora_request, n: int) -> list[LoRARequest | None]:
    """One adapter for every prompt, or a list of one per prompt (vLLM's rule)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise InvalidRequestError("lora_request", f"{len(loras)} adapters for {n} prompts: pass one, or one per prompt")
    return loras
