"""ModelRunner: turns a ``SchedulerOutput`` into sampled tokens with one compiled step.

One step = forward (paged attention + KV write) -> logits at each request's last scheduled token
-> on-device sampler. It is ``jax.jit``-compiled once per token bucket at start-up
(:mod:`.compilation`), with the device state (KV cache, penalty tables) donated so XLA updates it
in place. Inputs arrive packed in one transfer; only sampled ids (and logprobs when asked) come
back. ``enforce_eager`` runs the very same Python function op by op, for comparison.

``dispatch`` launches a step and returns at once (JAX runs it asynchronously); ``collect`` waits
for its sampled tokens. ``dispatch`` is ``prepare`` (request states and host inputs) then
``launch``, which the engine calls apart when a structured-output bitmask must be filled in
between. The bitmask is the step's one input outside the packed buffer: a step without a
constrained row passes a device-resident all-ones mask of its shape (no transfer, the same
program) and a packed flag that skips applying it.

Async scheduling dispatches step N+1 before collecting step N: a decode row whose input token is
still in flight reads it from step N's sampled tokens on the device (``prev_rows``), so the host
never waits for it. With an EAGLE/EAGLE-3/MTP head (``overlap``) a speculating step overlaps too:
N+1 is built as if N accepted every draft, its drafts placeholders; the step corrects itself on
the device from N's counts and the head's drafts after N, carried in ``DeviceState``
(:mod:`.spec_in_flight`), and the head proposes right after each launch (:mod:`.spec_overlap`).

Every array lives on the runner's mesh (:mod:`.mesh`) over exactly its devices: with one device
that is where everything goes, with ``tensor_parallel_size`` N the weights and the KV cache are
split N ways as the plan says and the inputs replicated. The step's host side is the same.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from jaxserve import envs
from jaxserve.config import EngineConfig
from jaxserve.config.speculative import HEAD_METHODS
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.core.multimodal import MultiModalFeatureSpec
from jaxserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from jaxserve.exceptions import ConfigError
from jaxserve.layers.lora import LoRABatch
from jaxserve.models.config import ModelConfig
from jaxserve.models.eagle import EagleConfig, Weights
from jaxserve.models.forward_context import KVGroups
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.tp_layout import TPLayout
from jaxserve.runner.buckets import BucketTable
from jaxserve.runner.compilation import CompiledSteps, StepVariant
from jaxserve.runner.compile_stats import CompileStats
from jaxserve.runner.device_state import DeviceState, StepOutput
from jaxserve.runner.draft_runner import DraftModelProposer, draft_pool_kv, load_draft_model
from jaxserve.runner.eagle_runner import EagleProposer, head_pool_kv, load_eagle_head, target_tables
from jaxserve.runner.encoder_runner import EncoderRunner
from jaxserve.runner.input_batch import (
    CachedRequestState,
    PersistentBatch,
    SlotAllocator,
    StepPlan,
    build_spec_inputs,
    build_step_arrays,
    group_block_ids,
    write_drafts,
)
from jaxserve.runner.inspection import PackedStep
from jaxserve.runner.kv_cache import (
    KV_CACHE_DTYPES,
    ProposerKV,
    allocate_kv_cache,
    determine_num_blocks,
    gpu_device_memory,
    kv_cache_groups,
    num_kv_slots,
)
from jaxserve.runner.lora_state import RunnerLoRA
from jaxserve.runner.mesh import kv_cache_sharding, make_mesh, replicated, select_devices, weight_shardings
from jaxserve.runner.packing import PackLayout, pack, unpack
from jaxserve.runner.prompt_logprobs import PromptLogprobsWorker
from jaxserve.runner.serving_dtype import backend_takes
from jaxserve.runner.spec_in_flight import correct_in_flight, overlaps_speculation
from jaxserve.runner.spec_overlap import next_known_tokens, placeholder_rows, row_starts
from jaxserve.runner.step_inputs import ModelInputs, StepArrays, flag
from jaxserve.runner.target import StepTarget
from jaxserve.sample.metadata import SamplingMetadata, SamplingTable
from jaxserve.sample.penalties import (
    PenaltyTables,
    add_accepted_drafts,
    update_penalty_tables,
    uses_penalties,
    write_penalty_row,
)
from jaxserve.sample.sampler import SamplerOutput, sample
from jaxserve.sample.spec_verify import earlier_drafts, position_rows, verified_output
from jaxserve.spec_decode import NgramProposer

logger = logging.getLogger("jaxserve")


@dataclasses.dataclass(frozen=True)
class RunnerStep:
    """One step through the runner. ``prepare`` builds it (request states applied, host inputs in
    ``inputs``); ``launch`` returns a copy carrying the device's output ``out``, not yet read back;
    ``collect`` reads it. ``inputs`` None: nothing was scheduled; ``out`` None: not on the device."""

    scheduler_output: SchedulerOutput
    inputs: StepArrays[np.ndarray] | None = None
    plan: StepPlan | None = None
    states: list[CachedRequestState] = dataclasses.field(default_factory=list)
    out: SamplerOutput | None = None
    # Images: the step's encoder-output rows and their mask ([bucket, hidden], [bucket]); None
    # when no scheduled token is an image placeholder (the text-only program runs).
    mm: tuple[np.ndarray, np.ndarray] | None = None
    expert_load: jax.Array | None = None  # a MoE model's routed pairs per expert [E], on the device
    draft_hidden: jax.Array | None = None  # EAGLE: the hidden states its head reads, on the device
    # Overlapped speculation: the step's inputs as corrected on the device, and the drafts and
    # proposing flags the head's program left on the device after it (read at collect)
    corrected: ModelInputs[jax.Array] | None = None
    head_drafts: tuple[jax.Array, jax.Array] | None = None

    @property
    def num_rows(self) -> int:
        """Rows of the step's padded batch."""
        return 0 if self.inputs is None else self.inputs.num_rows

    @property
    def num_mask_rows(self) -> int:
        """The bitmask's first dimension: the rows, or with speculation the verified positions."""
        return 0 if self.inputs is None else self.inputs.num_mask_rows


# The two stages' names, kept for the engine, lockstep and their readers: one type.
PreparedStep = RunnerStep
InFlightStep = RunnerStep


# The attention backends that take attention sinks (a model with them is refused any other).
SINK_BACKENDS = ("xla", "cpu")
# The backends that read an int8 pool's rows and scales (pallas_kernels.int8_kv).
INT8_KV_BACKENDS = ("xla", "cpu")


def resolve_attention_backend(requested: str, platform: str | None = None, dtype: str = "float32", *,
                              mc: ModelConfig | None = None, block_size: int = 16,
                              abstract: bool = False, kv_cache_dtype: str = "auto") -> str:
    """``auto`` made concrete for ``platform`` and the model's ``dtype``; any other name must be
    built in or registered. ``mosaic`` needs a model it supports (``mc``) and, on a GPU that can
    run it (not a compile-only target: ``abstract``), passes its self-check over the pool's dtype
    (``--kv-cache-dtype``) or is refused at start-up. A model with attention sinks (gpt-oss) runs
    on the backends that fold them in, and ``auto`` picks one of those. An int8 pool is read by
    the CPU backends only (:data:`INT8_KV_BACKENDS`)."""
    platform = platform or jax.default_backend()
    on_gpu = platform == "gpu"
    if kv_cache_dtype == "int8":
        if platform != "cpu":  # vLLM has no int8 KV cache on accelerators; fp8 is theirs
            raise ConfigError(f"kv_cache_dtype: int8 is a CPU format (this platform is {platform}); "
                              "use fp8 or auto")
        if requested not in ("auto", *INT8_KV_BACKENDS):
            raise ConfigError(f"kv_cache_dtype: int8 is read by the {' and '.join(INT8_KV_BACKENDS)} attention "
                              f"backends only, got attention_backend={requested}")
    if mc is not None and mc.attention_sinks:  # gpt-oss: only some backends fold the sinks in
        if requested not in ("auto", *SINK_BACKENDS):
            raise ConfigError(f"attention_backend: {requested} has no attention sinks, which this model "
                              f"({mc.architecture}) needs; use one of {', '.join(SINK_BACKENDS)}")
        if requested != "auto":
            return requested
        ok = platform == "cpu" and pallas_kernels.cpu_attention_available(envs.kernel_build_dir())[0]
        return "cpu" if ok and backend_takes("cpu", dtype) else "xla"
    if requested != "auto":
        if requested not in pallas_kernels.available_backends():
            raise ConfigError(f"attention_backend: not built in nor registered in this process (known: "
                              f"{', '.join(pallas_kernels.available_backends())}), got {requested!r}")
        if requested == "mosaic" and mc is not None:
            ok, reason = pallas_kernels.mosaic_supports(mc.dtype, mc.head_dim, block_size, mc.sliding_window)
            if ok and on_gpu and not abstract:
                ok, reason = pallas_kernels.mosaic_self_check(kv_dtype=KV_CACHE_DTYPES.get(kv_cache_dtype))
            if not ok:
                raise ConfigError(f"attention_backend: mosaic cannot serve this model: {reason}")
        return requested
    if on_gpu:
        # pallas on every GPU, mosaic opt-in: on an H200 mosaic ran at 0.73x pallas on decode-heavy
        # and 0.79x on prefill-heavy batches (docs/benchmarks.md, "A lent H200").
        return "pallas"
    ok, reason = pallas_kernels.cpu_attention_available(envs.kernel_build_dir())
    if ok and not backend_takes("cpu", dtype):
        ok, reason = False, f"it takes no {dtype}"
    if ok:
        return "cpu"
    logger.warning("attention backend auto: using xla, since the cpu kernel is unavailable (%s)", reason)
    return "xla"


def max_step_tokens(config: EngineConfig, max_model_len: int, num_blocks: int | None = None) -> int:
    """The most tokens one step can ever schedule: the token budget, unless every request at full
    length or the KV pool of ``num_blocks`` (block 0 is reserved; None: not sized yet) holds fewer.
    Buckets above it are never used, so they are neither compiled nor warmed up."""
    pool_tokens = config.max_num_batched_tokens if num_blocks is None else (num_blocks - 1) * config.block_size
    return min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len, pool_tokens)


def _nbytes(x) -> int:
    """Bytes of an array or of an array's shape."""
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize


def _with_shardings(tree, shardings):
    """Shapes of ``tree``'s arrays carrying ``shardings`` (a prefix of ``tree``); no memory."""
    return jax.tree.map(lambda s, sub: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), sub), shardings, tree)


class ModelRunner:
    """``target`` (default: the local device) decides the step's control flow (``cond_free``, see
    :mod:`.target`); an abstract target builds a runner that only lowers and compiles, on the
    target's mesh. ``devices``: the local devices to run on, ``config.tensor_parallel_size`` of
    them (default: the first ones of ``jax.devices()``); ``model``'s layout must be of that size.
    ``draft``: speculative_config's draft model, or an EAGLE head as (EagleConfig, weights), given
    instead of loaded from ``speculative_config.model``; a compile-only runner needs one (shapes)."""

    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, max_model_len: int,
                 target: StepTarget | None = None, devices: Sequence[jax.Device] | None = None,
                 encoder: EncoderRunner | None = None, draft: Any = None):
        self.config = config
        self._given_draft = draft
        # A vision-language model's image side (None: text only); its outputs are merged into the
        # step's embeddings at the image placeholder tokens.
        self.encoder = encoder
        self._mm_features: dict[str, list[MultiModalFeatureSpec]] = {}
        # The last prepare's encoder work: seconds, and images per request (step records, timelines).
        self.last_encoder_seconds = 0.0
        self.last_encoder_images: dict[str, int] = {}
        self.target = target or StepTarget.local()
        # Read at trace time by the sampler and the penalty update: no conditional, no
        # data-dependent loop in the compiled step.
        self.cond_free = self.target.cond_free
        self.mc = model.config
        # An M-RoPE model (Qwen2.5-VL): each request's prompt positions [3, prompt_len] and the
        # delta its later tokens add (all three axes at i + delta), computed once at admission.
        self.mrope = bool(model.config.rope.mrope_section)
        self._mrope: dict[str, tuple[np.ndarray, int]] = {}
        # The weights' storage format: the flag's, else the model's own (a pre-quantized checkpoint's int8/fp8).
        self.weight_format = config.quantization or getattr(model, "quantization", None) or "none"
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.max_blocks_per_seq = cdiv(max_model_len, config.block_size)
        # vLLM's hybrid KV cache: the layers grouped by attention type, a block table per group.
        self.kv_cache_groups = kv_cache_groups(self.mc, config.block_size, max_model_len, config.kv_cache_dtype)
        self.num_kv_slots = num_kv_slots(self.kv_cache_groups)
        self._layer_group_slot = self._layer_groups()
        # The phases, in order; each reads only what the earlier ones set.
        self._init_mesh_and_weights(model, devices)
        self._init_attention()
        self._init_request_state()
        self._init_step()
        self._init_kv_cache()
        self._init_draft_model()
        self._log_layout(model)

    def _init_mesh_and_weights(self, model: LlamaForCausalLM, devices: Sequence[jax.Device] | None) -> None:
        """The mesh over exactly the runner's devices, and the model's weights placed on it."""
        tp = self.config.tensor_parallel_size
        self.mesh = (self.target.mesh if self.target.is_abstract
                     else make_mesh(select_devices(tp, devices), tp))
        model_tp = getattr(model, "tensor_parallel_size", 1)  # optional on a model object
        if self.mesh.size != tp or model_tp != tp:
            raise ValueError(f"tensor_parallel_size {tp}: the model is laid out for {model_tp} "
                             f"shards and the mesh has {self.mesh.size} devices")
        self._replicated = replicated(self.mesh)
        # The model's calls get the mesh only when it splits them: a model object served on one
        # device keeps the plain contract (jaxserve.models.contract).
        self._split_args = (self.mesh,) if self.mesh.size > 1 else ()
        # The step is a pure function of the weights: the module is split once into its graph and
        # its state, the state passed to the compiled step and merged with the graph inside the
        # trace. The state as nnx.flatten gives it, a list of arrays in graph order: a call passes
        # a list on faster than nnx.State (Variables flatten through Python) or nested dicts.
        self.graphdef, flat = nnx.flatten(model, with_paths=True)
        self._weight_paths = [path for path, _ in flat]
        self.weight_shardings = weight_shardings(self.mesh, list(flat))
        self.model_state = self._place([value for _, value in flat], self.weight_shardings)
        self.scan_layers = bool(getattr(model, "scan_layers", False))  # optional on a model object

    def _init_attention(self) -> None:
        """The attention backend's functions (and Pallas's decode-only one)."""
        config = self.config
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.target.platform, self.mc.dtype, mc=self.mc,
            block_size=config.block_size,
            abstract=self.target.is_abstract, kv_cache_dtype=config.kv_cache_dtype)
        interpret = config.interpret_kernels
        if interpret is None:
            interpret = self.target.platform != "gpu"
        tuning = ({"compute_capability": self.target.compute_capability}
                  if self.attention_backend == "triton" and self.target.compute_capability else {})
        self.attn_fn = pallas_kernels.get_attention_fn(self.attention_backend, interpret=interpret,
                                                       build_dir=envs.kernel_build_dir(), **tuning)
        # Pallas has a decode-only kernel (split-K over pages); steps where every request advances
        # one token get their own compiled variant that uses it.
        self.decode_attn_fn = (pallas_kernels.get_attention_fn("pallas", interpret=interpret, mode="decode")
                               if self.attention_backend == "pallas" else None)

    def _init_request_state(self) -> None:
        """The host side of the running requests: slots, the persistent batch, the sampling rows."""
        config = self.config
        self.num_logprobs = max(1, config.max_logprobs)
        self.bitmask_width = cdiv(self.mc.vocab_size, 32)
        self._all_allowed: dict[int, jax.Array] = {}  # rows -> a device-resident all-ones bitmask
        slots = config.max_num_seqs
        self.slots = SlotAllocator(slots)
        self.batch = PersistentBatch(slots, self.max_model_len, self.max_blocks_per_seq, len(self.kv_cache_groups))
        self.sampling_table = SamplingTable(slots)
        self.requests: dict[str, CachedRequestState] = {}
        self._prev_row_of: dict[str, int] = {}  # each request's row in state.prev_sampled
        self._rng = np.random.default_rng(config.seed)
        lora = config.lora_config
        self.lora = (RunnerLoRA(self.mc, lora.max_loras, self.target.lora_table_rank(lora.max_lora_rank), self.mesh,
                                TPLayout.of(self.mc, self.config.tensor_parallel_size), self._place,
                                abstract=self.target.is_abstract, lm_head=lora.lora_lm_head,
                                embedding=lora.lora_embedding)
                     if lora.enable_lora else None)
        # Speculative decoding: K (static, 0: off) and the proposer run after each step (the
        # draft model's is built once the attention backend and the pool are known).
        spec = config.spec_decode_config.spec
        self.num_spec = 0 if spec is None else spec.num_speculative_tokens
        self.proposer = (None if spec is None or spec.method != "ngram" else
                         NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max))
        self.drafter: DraftModelProposer | None = None
        self.eagle: EagleProposer | None = None
        # EAGLE under async scheduling: drafts proposed on the device right after each step, and
        # the next step (scheduled with placeholders) corrected there from this one's verification
        self.overlap = self.num_spec > 0 and overlaps_speculation(config)
        # EAGLE: the head, read now because the step hands it what it reads ("final": the last
        # hidden state after the norm, or the layers EAGLE-3 reads), fixed before any step is traced
        self._eagle_head = None if spec is None or spec.method not in HEAD_METHODS else self._load_eagle_head()
        self._eagle_reads: str | tuple[int, ...] | None = (
            None if self._eagle_head is None else self._eagle_head[0].aux_layers or "final")
        # The draft model, loaded before the pool is sized: its weights are then held, and the
        # target's pool leaves room for the draft's (_proposer_kv).
        self._draft_model = None if spec is None or spec.method != "draft_model" else self._load_draft_model()
        self.prompt_logprobs = PromptLogprobsWorker(self.graphdef, self._split_args, self.num_logprobs,
                                                    self.target.sampler_policy(), self._replicated,
                                                    config.enforce_eager)

    def _init_step(self) -> None:
        """The jitted step and its compiled variants (none compiled yet)."""
        self.stats = CompileStats()
        self._layouts: dict[int, PackLayout] = {}
        self.last_packed: PackedStep | None = None  # the last launched step's inputs, for inspection
        # The arguments carry their shardings (a fresh numpy input is replicated over the mesh of
        # the others); the outputs are pinned so that the donated state comes back as it went in.
        self._jitted = jax.jit(self._step, static_argnames=("layout", "decode_only", "all_greedy", "use_lora",
                                                           "use_mm"),
                               donate_argnums=(1,), out_shardings=self._replicated_except_state())
        self.steps = CompiledSteps(self._jitted, self._trace_args, self.stats)
        self._write_penalty_row = jax.jit(write_penalty_row, donate_argnums=(0,))

    def _init_kv_cache(self) -> None:
        """The pool sized (on a local GPU by compiling the largest step first), the bucket table
        up to what a step can then schedule, and the device state allocated."""
        self.num_blocks = self._size_kv_cache()
        self.buckets = BucketTable.build(
            max_step_tokens(self.config, self.max_model_len, self.num_blocks), self.config.max_num_seqs,
            min_decode_tokens=self.config.compilation_config.resolved_min_decode_bucket(
                self.target.platform, self.memory_weight_bytes()),
            decode_tokens_per_seq=self.num_spec + 1)
        abstract = self.target.is_abstract
        self.state = self._state_shapes(self.num_blocks) if abstract else self._allocate_state(self.num_blocks)
        # What a step is traced with: the state's shapes and placement, never its arrays, which
        # each step donates (a background compile may trace while a step runs).
        self._state_spec = self._state_shapes(self.num_blocks)

    def _init_draft_model(self) -> None:
        """speculative_config's draft model, its pool and programs (compiled at warm-up)."""
        spec = self.config.spec_decode_config.spec
        if spec is None or spec.method == "ngram":
            return
        if spec.method in HEAD_METHODS:
            self._init_eagle()
            return
        draft, self._draft_model = self._draft_model, None  # the proposer holds the weights now
        self.drafter = DraftModelProposer(self.config, draft, self.max_model_len, spec.num_speculative_tokens,
                                          self.attn_fn, self.mesh, self.num_blocks, self.target.is_abstract)
        logger.info("draft model %s: %d KV blocks, %d token buckets, %d row buckets", spec.model,
                    self.drafter.num_blocks, len(self.drafter.token_buckets), len(self.drafter.row_buckets))

    def _load_draft_model(self) -> Any:
        draft, self._given_draft = self._given_draft, None
        if draft is None and self.target.is_abstract:
            raise ConfigError("speculative_config.method=draft_model: a compile-only runner loads no draft; "
                              "pass ModelRunner(draft=...)")
        return draft if draft is not None else load_draft_model(self.config, self.mc, self.mesh)

    def _proposer_kv(self) -> ProposerKV | None:
        """The draft's or the EAGLE head's pool, which the KV budget holds with the target's."""
        if self._draft_model is not None:
            return draft_pool_kv(self.config, self._draft_model.config, self.max_model_len, self.num_spec)
        return None if self._eagle_head is None else head_pool_kv(self.config, self._eagle_head[0])

    def _load_eagle_head(self) -> tuple[EagleConfig, Weights]:
        spec = self.config.spec_decode_config.spec
        assert spec is not None
        if len(self.kv_cache_groups) != 1:  # the head's KV follows the target's one block table
            raise ConfigError(f"speculative_config.method={spec.method}: a target with sliding-window or hybrid "
                              "attention layers is not supported")
        if not hasattr(nnx.merge(self.graphdef, self.model_state), "forward_with_aux"):
            raise ConfigError(f"speculative_config.method={spec.method}: the target ({self.mc.architecture}) "
                              "does not hand over hidden states; EAGLE needs a Llama-family decoder")
        if self._given_draft is not None:
            head, self._given_draft = self._given_draft, None
            return head
        if self.target.is_abstract:
            raise ConfigError(f"speculative_config.method={spec.method}: a compile-only runner loads no head; "
                              "pass ModelRunner(draft=...)")
        return load_eagle_head(self.config, self.mc)

    def _init_eagle(self) -> None:
        """The EAGLE head's proposer: a program per token bucket (compiled at warm-up)."""
        spec = self.config.spec_decode_config.spec
        assert spec is not None and self._eagle_head is not None
        cfg, weights = self._eagle_head
        self._eagle_head = None  # the proposer holds the weights now
        tables = target_tables(self._weight_paths, self.model_state, spec.method)
        step_rows = {b: self._num_rows(b) for b in self.buckets.token_buckets}
        self.eagle = EagleProposer(self.config, cfg, weights, tables, spec.num_speculative_tokens, self.attn_fn,
                                   self.mesh, self.num_blocks, self.max_blocks_per_seq, step_rows,
                                   self._replicated, self.target.is_abstract)
        self.eagle.on_device = self.overlap
        logger.info("%s head %s: %d programs; reads %s", spec.method, spec.model or "(the target's)",
                    len(step_rows),
                    "the final hidden state" if not cfg.aux_layers else f"layers {list(cfg.aux_layers)}")

    def _log_layout(self, model: LlamaForCausalLM) -> None:
        max_concurrency = self.num_blocks * self.block_size / self.max_model_len
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens); max concurrency %.1fx at %d tokens/request; "
            "attention backend: %s", self.num_blocks, self.block_size, self.num_blocks * self.block_size,
            max_concurrency, self.max_model_len, self.attention_backend)
        tp = self.config.tensor_parallel_size
        if tp > 1:
            layout = model.layout
            logger.info("tensor parallel over %d devices (%s): %d query and %d key/value heads per device",
                        tp, ", ".join(map(str, self.devices)), layout.q_heads_per_shard, layout.kv_heads_per_shard)
            if layout.kv_replicas > 1:
                logger.info("the model's %d key/value heads are fewer than tensor_parallel_size %d: each is "
                            "stored %d times, one copy per device", layout.num_kv_heads, tp, layout.kv_replicas)

    @property
    def kv_cache(self):
        return self.state.kv_cache

    @property
    def devices(self) -> list[jax.Device]:
        """The devices this runner's arrays live on, in mesh order."""
        return list(self.mesh.devices.flat)

    def _place(self, tree, shardings):
        """``tree``'s arrays on the mesh with ``shardings`` (a matching tree), or for an abstract
        target their shapes carrying those shardings."""
        return _with_shardings(tree, shardings) if self.target.is_abstract else jax.device_put(tree, shardings)

    def _state_shardings(self) -> DeviceState:
        """The KV cache split on its key/value heads, the rest replicated."""
        kv = kv_cache_sharding(self.mesh)
        # The same dataclass as a tree of shardings (jit's out_shardings), not of arrays.
        leaves: dict[str, Any] = dict(kv_cache=(kv, kv), penalties=self._replicated, prev_sampled=self._replicated)
        if self.overlap:
            leaves.update(prev_drafts=self._replicated, prev_num_emitted=self._replicated,
                          prev_num_drafts=self._replicated)
        return DeviceState(**leaves)

    def _replicated_except_state(self) -> StepOutput:
        replicated: list[Any] = [self._replicated, self._replicated, self._replicated if self.mc.is_moe else None,
                                 self._replicated if self._eagle_reads is not None else None,
                                 self._replicated if self.overlap else None]
        return StepOutput(self._state_shardings(), *replicated)

    def _zero_state(self, num_blocks: int) -> DeviceState:
        slots = self.config.max_num_seqs
        return DeviceState(kv_cache=allocate_kv_cache(self.mc, num_blocks, self.block_size,
                                                      self.config.tensor_parallel_size, self.config.kv_cache_dtype,
                                                      self.num_kv_slots),
                           penalties=PenaltyTables.zeros(slots, self.mc.vocab_size),
                           prev_sampled=jnp.zeros((slots,), jnp.int32),
                           **(dict(prev_drafts=jnp.zeros((slots, self.num_spec), jnp.int32),
                                   prev_num_emitted=jnp.ones((slots,), jnp.int32),
                                   prev_num_drafts=jnp.zeros((slots,), jnp.int32)) if self.overlap else {}))

    def _allocate_state(self, num_blocks: int) -> DeviceState:
        """The zero device state made in place on the mesh (no device ever holds the whole pool)."""
        return jax.jit(lambda: self._zero_state(num_blocks), out_shardings=self._state_shardings())()

    def _state_shapes(self, num_blocks: int) -> DeviceState:
        """The device state's shapes, no memory, with their shardings."""
        return _with_shardings(jax.eval_shape(lambda: self._zero_state(num_blocks)), self._state_shardings())

    def _size_kv_cache(self) -> int:
        """KV blocks; on a local GPU sized by vLLM's gpu_memory_utilization, which needs the
        largest step's temporary memory, read from compiling the largest bucket first."""
        cfg = self.config
        local_gpu = self.target.platform == "gpu" and not self.target.is_abstract
        if not local_gpu or cfg.num_gpu_blocks_override is not None or cfg.kv_cache_memory is not None:
            return determine_num_blocks(self.mc, cfg, self.max_model_len, platform=self.target.platform,
                                        proposer=self._proposer_kv())
        memory = gpu_device_memory(self.devices[0])
        return determine_num_blocks(self.mc, cfg, self.max_model_len, platform="gpu", memory=memory,
                                    peak_temp_bytes=self.peak_temp_bytes(self.max_blocks_per_seq + 1),
                                    proposer=self._proposer_kv())

    def peak_temp_variant(self) -> StepVariant:
        """The variant with the most temporary memory: the most tokens a step can schedule (the
        largest bucket; read before the pool bounds it, since sizing the pool needs it), with the
        general attention (not decode-only) and, on a GPU, the random sampler (its full sort)."""
        return StepVariant(max_step_tokens(self.config, self.max_model_len),
                           all_greedy=False if self.cond_free else None, lora=self.lora is not None)

    def peak_temp_bytes(self, num_blocks: int) -> int:
        """The temporary memory of ``peak_temp_variant``, compiled (one program) against a pool
        of ``num_blocks`` (the temporaries do not depend on the pool, which is aliased)."""
        variant = self.peak_temp_variant()
        traced = self._jitted.trace(*self._step_args(variant, self._state_shapes(num_blocks)),
                                    **self._static_args(variant))
        return int(traced.lower().compile().memory_analysis().temp_size_in_bytes)

    def describe(self) -> dict:
        """What this runner was built with: pool size, backend, layer layout, token buckets, and the
        bytes its weights and KV cache hold (all devices together) in their formats."""
        return {"num_gpu_blocks": self.num_blocks, "attention_backend": self.attention_backend,
                "scan_layers": self.scan_layers, "token_buckets": list(self.buckets.token_buckets),
                **self.memory()}

    def memory_weight_bytes(self) -> int:
        return sum(_nbytes(x) for x in jax.tree.leaves(self.model_state))

    def memory(self) -> dict:
        """Weight and KV cache bytes, and the formats they are stored in."""
        return {"weight_bytes": self.memory_weight_bytes(),
                "kv_cache_bytes": sum(_nbytes(x) for x in self._state_spec.kv_cache),
                "quantization": self.weight_format,
                "kv_cache_dtype": str(self._state_spec.kv_cache[0].dtype)}

    # ---- the step ------------------------------------------------------------------------------

    def _step(self, model_state, state: DeviceState, buf, bitmask, lora_tables=None, mm_inputs=None, *,
              layout: PackLayout, decode_only: bool = False, all_greedy: bool | None = None, use_lora: bool = False,
              use_mm: bool = False) -> StepOutput:
        inputs: StepArrays[jax.Array] = unpack(buf, layout)
        overlap = state.prev_drafts is not None
        if state.prev_drafts is not None:  # scheduled before the step before was verified: corrected here
            assert state.prev_num_emitted is not None and state.prev_num_drafts is not None
            prev_tokens = jnp.concatenate([state.prev_sampled[:, None], state.prev_drafts], axis=1)
            inputs = correct_in_flight(inputs, prev_tokens, state.prev_num_emitted, state.prev_num_drafts,
                                       self.block_size)
        x = inputs.model
        input_ids = jnp.where(x.prev_rows >= 0, state.prev_sampled[jnp.maximum(x.prev_rows, 0)], x.input_ids)
        attn_fn = self.decode_attn_fn if decode_only else self.attn_fn
        assert attn_fn is not None  # a decode-only variant exists only with a decode kernel
        model = nnx.merge(self.graphdef, model_state)
        extra: dict[str, Any] = {}  # the model call's optional inputs
        if x.group_block_tables is not None and x.group_slot_mapping is not None:
            layer_group, layer_slot = self._layer_group_slot
            extra["kv_groups"] = KVGroups(x.group_block_tables, x.group_slot_mapping, layer_group, layer_slot)
        if use_lora:  # the slot tables and each token's slot (-1: the base model)
            assert inputs.lora_slot_ids is not None
            extra["lora"] = LoRABatch(slot_ids=inputs.lora_slot_ids, a=lora_tables[0], b=lora_tables[1])
        if use_mm:  # encoder outputs replace the image placeholders' token embeddings
            extra["mm_embeds"], extra["mm_mask"] = mm_inputs
        if inputs.mrope_positions is not None:
            extra["mrope_positions"] = inputs.mrope_positions
        args = (input_ids, state.kv_cache, x.attention_metadata(), attn_fn, *self._split_args)
        draft_hidden = None
        if isinstance(self._eagle_reads, tuple):  # EAGLE-3: the residual stream entering its layers
            extra["aux_layers"] = self._eagle_reads
            hidden, kv_cache, loads, draft_hidden = model.forward_with_aux(*args, **extra)
        elif hasattr(model, "forward"):  # ours: (hidden, kv, per-expert load or None)
            hidden, kv_cache, loads = model.forward(*args, **extra)
        else:  # a user's model object keeps the plain protocol: __call__ gives (hidden, kv)
            (hidden, kv_cache), loads = model(*args, **extra), None
        expert_load = None if loads is None else loads.sum(axis=0)  # a MoE model's pairs per expert
        spec = inputs.spec
        md, row_slots = inputs.sampling, x.row_slots
        extra_outputs = None
        # with speculation, each row at its d+1 positions: one sampler row each (jaxserve.sample.spec_verify)
        logits_indices = x.logits_indices if spec is None else spec.logits_indices
        head: dict[str, Any] = {}
        if use_lora and "lm_head" in lora_tables[0]:  # a logits row is its token's: it carries that token's slot
            assert inputs.lora_slot_ids is not None
            head["lora"] = LoRABatch(slot_ids=inputs.lora_slot_ids[logits_indices], a=lora_tables[0], b=lora_tables[1])
        logits = model.compute_logits(hidden[logits_indices], *self._split_args, **head)
        if spec is not None:
            md = position_rows(md, spec.position_rows, spec.position_offsets)
            row_slots = row_slots[spec.position_rows]  # the bitmask has a row per position already
            extra_outputs = earlier_drafts(spec.draft_token_ids, spec.position_rows, spec.position_offsets)
        # The drafts' token slots are the padding slot (build_step_arrays): accepted ones are added below.
        penalties = update_penalty_tables(state.penalties, token_slots=x.token_slots, input_ids=input_ids,
                                          token_is_output=x.token_is_output)
        out = sample(logits, md, penalties.output_counts,
                     penalties.prompt_mask, max_num_logprobs=self.num_logprobs, row_slots=row_slots,
                     need_logprobs=inputs.need_logprobs[0], token_bitmask=bitmask, use_bitmask=inputs.use_bitmask[0],
                     policy=self.target.sampler_policy(all_greedy), extra_outputs=extra_outputs)
        last = out.sampled_token_ids
        if spec is not None:
            out, num = verified_output(out, spec.flat_index, spec.draft_token_ids, spec.num_draft_tokens)
            last = jnp.take_along_axis(out.sampled_token_ids, (num - 1)[:, None], axis=1)[:, 0]
            penalties = add_accepted_drafts(penalties, x.row_slots, spec.draft_token_ids, num - 1)
        prev_sampled = state.prev_sampled.at[: last.shape[0]].set(last)
        if self._eagle_reads == "final":  # EAGLE-1 reads the last hidden state after the final norm
            draft_hidden = model.norm(hidden)
        carried: dict[str, Any] = {}
        if overlap:  # what the next step corrects itself from (the head's program adds its drafts)
            assert spec is not None and state.prev_num_emitted is not None and state.prev_num_drafts is not None
            carried = dict(prev_drafts=state.prev_drafts,
                           prev_num_emitted=state.prev_num_emitted.at[: num.shape[0]].set(num),
                           prev_num_drafts=state.prev_num_drafts.at[: num.shape[0]].set(spec.num_draft_tokens))
        return StepOutput(DeviceState(kv_cache, penalties, prev_sampled, **carried), out, hidden, expert_load,
                          draft_hidden, x if overlap else None)

    def _layer_groups(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Each layer's KV cache group and KV slot (layer j of a group uses slot j)."""
        where = {layer: (gid, j) for gid, g in enumerate(self.kv_cache_groups) for j, layer in enumerate(g.layer_names)}
        pairs = [where[layer] for layer in range(self.mc.num_hidden_layers)]
        return tuple(g for g, _ in pairs), tuple(j for _, j in pairs)

    def _num_rows(self, bucket: int) -> int:
        """Rows of a step of ``bucket`` tokens (the table's rule; also before the table is built)."""
        return BucketTable.rows_of(bucket, self.config.max_num_seqs)

    def _mask_rows(self, bucket: int) -> int:
        """The bitmask's rows in a step of this bucket: one per verified position with speculation."""
        rows = self._num_rows(bucket)
        return rows if not self.num_spec else min(bucket, rows * (self.num_spec + 1))

    def _layout_for(self, bucket: int) -> PackLayout:
        if bucket not in self._layouts:
            self._layouts[bucket] = PackLayout.of(self._padding_inputs(bucket))
        return self._layouts[bucket]

    def _padding_inputs(self, bucket: int) -> StepArrays[np.ndarray]:
        rows = self._num_rows(bucket)
        model, _ = build_step_arrays(self.batch, [], [], [], [], bucket, rows, self.block_size,
                                     self.slots.padding_slot)
        lora_slots = np.full(bucket, -1, np.int32) if self.lora is not None else None
        spec = build_spec_inputs(model.query_start_loc, [], rows, self.num_spec, bucket) if self.num_spec else None
        mrope = np.zeros((3, bucket), np.int32) if self.mrope else None
        return StepArrays(model, SamplingMetadata.from_arrays(self.sampling_table.padding(rows)),
                          need_logprobs=flag(False), use_bitmask=flag(False), lora_slot_ids=lora_slots, spec=spec,
                          mrope_positions=mrope)

    def _mrope_of(self, prompt_len: int, features: Sequence[MultiModalFeatureSpec]) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions and decode delta from its images' offsets and grids."""
        from jaxserve.models.mrope import mrope_positions

        images = [(f.placeholder.offset, f.data[1]) for f in features]
        merge = getattr(self.encoder, "merge_size", 1)
        return mrope_positions(prompt_len, images, merge)

    def _mrope_inputs(self, req_ids: Sequence[str], starts: Sequence[int], counts: Sequence[int],
                      bucket: int) -> np.ndarray:
        """The step's [3, bucket] rotary positions, rows laid end to end (padding: 0)."""
        out = np.zeros((3, bucket), np.int32)
        row = 0
        for r, start, count in zip(req_ids, starts, counts):
            pos, delta = self._mrope[r]
            p = np.arange(start, start + count)
            in_prompt = p < pos.shape[1]
            out[:, row:row + count] = np.where(in_prompt, pos[:, np.minimum(p, pos.shape[1] - 1)], p + delta)
            row += count
        return out

    def variants(self) -> list[StepVariant]:
        """Every step variant compiled at warm-up: per token bucket, a decode-only one for the
        decode kernel, and on a GPU a greedy and a random sampler program of each."""
        out = [StepVariant(b) for b in self.buckets.token_buckets]
        if self.decode_attn_fn is not None:
            # A decode step has at most max_num_seqs tokens, padded to that bucket or, while the
            # midpoints compile, to the next power of two.
            top = self.buckets.pick(self.buckets.max_num_seqs, pending=self.buckets.deferred)
            out += [StepVariant(b, True) for b in self.buckets.token_buckets if b <= top]
        if self.cond_free:
            out = [dataclasses.replace(v, all_greedy=g) for v in out for g in (True, False)]
        if self.lora is not None:
            out += [dataclasses.replace(v, lora=True) for v in out]
        if self.encoder is not None:  # a step with image tokens is a prefill: no decode-only variant
            out += [dataclasses.replace(v, mm=True) for v in out if not v.decode_only]
        return out

    def pick_bucket(self, num_tokens: int) -> int:
        """The bucket a step of ``num_tokens`` runs in: the smallest compiled one that holds it."""
        pending = () if self.config.enforce_eager else self.steps.pending_buckets
        return self.buckets.pick(num_tokens, pending)

    def _trace_args(self, variant: StepVariant) -> tuple[tuple, dict]:
        return self._step_args(variant, self._state_spec), self._static_args(variant)

    def _step_args(self, variant: StepVariant, state) -> tuple:
        buf = jax.ShapeDtypeStruct((self._layout_for(variant.bucket).total,), jnp.int32)
        bitmask = jax.ShapeDtypeStruct((self._mask_rows(variant.bucket), self.bitmask_width), jnp.int32)
        buf, bitmask = _with_shardings((buf, bitmask), (self._replicated, self._replicated))
        mm = None
        if variant.mm:
            mm = _with_shardings((jax.ShapeDtypeStruct((variant.bucket, self.mc.hidden_size), jnp.float32),
                                  jax.ShapeDtypeStruct((variant.bucket,), jnp.bool_)),
                                 (self._replicated, self._replicated))
        return self.model_state, state, buf, bitmask, *self._extra_args(mm)

    def _extra_args(self, mm=None) -> tuple:
        """The step's optional trailing arguments: the LoRA tables, then the image rows."""
        lora = None if self.lora is None else self.lora.tables
        if mm is None:
            return () if lora is None else (lora,)
        return lora, mm

    def _padding_mm(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros((bucket, self.mc.hidden_size), np.float32), np.zeros((bucket,), np.bool_)

    def _static_args(self, variant: StepVariant) -> dict:
        return {"layout": self._layout_for(variant.bucket), "decode_only": variant.decode_only,
                "all_greedy": variant.all_greedy, "use_lora": variant.lora, "use_mm": variant.mm}

    def _executable(self, variant: StepVariant):
        if self.config.enforce_eager:
            return functools.partial(self._step, **self._static_args(variant))
        return self.steps.get(variant)

    def warm_up(self, show_progress: bool = True) -> None:
        """Compile every variant of the table now, so no request ever waits for a compile."""
        if self.encoder is not None:
            self.encoder.warm_up()
        if self.drafter is not None:  # compiled even in eager mode: its own few programs
            self.drafter.warm_up()
        if self.eagle is not None:
            self.eagle.warm_up(jnp.dtype(self.mc.dtype))
        if self.config.enforce_eager:
            return
        # Every host of a multi-node group must run the same program each step, so none defers.
        later = () if self.config.is_multi_node else self.buckets.deferred
        variants = [v for v in self.variants() if v.bucket not in later]
        deferred = [v for v in self.variants() if v.bucket in later]
        self.steps.warm_up(variants, self._run_padding_step, show_progress, deferred=deferred)
        self._set_penalty_row(self.slots.padding_slot, 0)  # compiles the admission-time row write now
        s = self.stats
        logger.info("step variants: %d (token buckets %s; %d more compiling in the background), %d from the "
                    "persistent cache; ready in %.1f s (tracing %.1f s, XLA %.1f s in %d threads), first runs "
                    "%.1f s; attention backend %s; layers %s", len(variants), list(self.buckets.token_buckets),
                    len(deferred), s.persistent_cache_hits,
                    s.warm_up_compile_seconds, s.lower_seconds, s.compile_seconds, s.compile_threads,
                    s.warm_up_run_seconds, self.attention_backend, "scanned" if self.scan_layers else "unrolled")

    def start_deferred_compiles(self) -> None:
        """Compile the small decode buckets and the midpoints in the background (see :mod:`.compilation`)."""
        self.steps.start_deferred()

    def _run_padding_step(self, variant: StepVariant) -> None:
        """Execute a compiled variant once on padding only: no request, no KV write, no sample used."""
        buf = pack(self._padding_inputs(variant.bucket), self._layout_for(variant.bucket))
        bitmask = self._allowed_all_bitmask(self._mask_rows(variant.bucket))
        mm = self._padding_mm(variant.bucket) if variant.mm else None
        jax.block_until_ready(self._launch(self.steps.get(variant), buf, bitmask, mm).sampler)

    def _allowed_all_bitmask(self, rows: int) -> jax.Array:
        """The bitmask of a step without constrained rows: all ones, made once per row count and
        kept on the device."""
        if rows not in self._all_allowed:
            self._all_allowed[rows] = jax.device_put(np.full((rows, self.bitmask_width), -1, np.int32),
                                                     self._replicated)
        return self._all_allowed[rows]

    def _launch(self, fn, buf, bitmask, mm=None) -> StepOutput:
        """Run a step function on a packed input buffer; the donated state is replaced by its
        updated version."""
        result = fn(self.model_state, self.state, buf, bitmask, *self._extra_args(mm))
        self.state = result.state
        return result

    # ---- state updates from the scheduler --------------------------------------------------

    def _set_penalty_row(self, slot: int, num_known: int) -> None:
        """Write slot ``slot``'s penalty row from its first ``num_known`` tokens (those the steps
        will not feed: the prefix-cache hit), replacing whatever the slot held."""
        width = self.batch.token_ids.shape[1]
        token_ids = np.full(width, -1, np.int32)
        token_ids[:num_known] = self.batch.token_ids[slot, :num_known]
        token_is_output = np.arange(width) >= self.batch.num_prompt_tokens[slot]
        penalties = self._write_penalty_row(self.state.penalties, np.int32(slot), token_ids, token_is_output)
        self.state = dataclasses.replace(self.state, penalties=penalties)

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in list(so.finished_req_ids) + list(so.preempted_req_ids):
            state = self.requests.pop(req_id, None)
            self._mm_features.pop(req_id, None)
            self._mrope.pop(req_id, None)
            if state is not None:
                self.slots.release(state.slot)
            if self.drafter is not None:
                self.drafter.free(req_id)
            if self.eagle is not None:
                self.eagle.free(req_id)
            if self.lora is not None:
                self.lora.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self.slots.release(old.slot)
            if self.drafter is not None:  # a resumed request: the draft recomputes it from its tokens
                self.drafter.free(new.req_id)
            if self.eagle is not None:
                self.eagle.free(new.req_id)
            params = new.sampling_params
            seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**32))
            slot = self.slots.allocate()
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                output_token_ids=list(new.output_token_ids or []), sampling_params=params,
                num_computed_tokens=new.num_computed_tokens, slot=slot)
            PromptLogprobsWorker.start_rows(self.requests[new.req_id])
            if new.mm_features:
                self._mm_features[new.req_id] = list(new.mm_features)
            if self.mrope:
                self._mrope[new.req_id] = self._mrope_of(len(new.prompt_token_ids), new.mm_features or [])
            if self.lora is not None:
                self.lora.add_request(new.req_id, new.lora_name, new.lora_weights)
            self.batch.add_request(slot, new.prompt_token_ids, new.output_token_ids or [],
                                   group_block_ids(new.block_ids, self.batch.num_groups))
            self.sampling_table.set_row(slot, params, seed)
            if uses_penalties(params):
                self._set_penalty_row(slot, new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            self.batch.append_blocks(state.slot, group_block_ids(new_blocks, self.batch.num_groups))
            state.num_computed_tokens = num_computed

    # ---- execute -------------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens (the synchronous engine loop)."""
        return self.collect(self.dispatch(so))

    def dispatch(self, so: SchedulerOutput) -> InFlightStep:
        """Launch the step for ``so`` (no structured-output bitmask) without waiting for it."""
        return self.launch(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        """Apply ``so`` to the request states and build the step's host inputs."""
        self._update_states(so)
        if self.encoder is not None:
            self._run_encoder(so)
        if so.total_num_scheduled_tokens == 0:
            return RunnerStep(so)
        inputs, plan, states = self._prepare_inputs(so)
        mm = self._gather_mm(so, plan, states) if self.encoder is not None else None
        return RunnerStep(so, inputs, plan, states, mm=mm)

    def _run_encoder(self, so: SchedulerOutput) -> None:
        """Drop the outputs the encoder cache evicted, then encode the images the scheduler chose
        (each once, by content hash) before the step that reads them."""
        assert self.encoder is not None
        self.encoder.free(so.free_encoder_mm_hashes)
        items = []
        for req_id, indices in so.scheduled_encoder_inputs.items():
            features = self._mm_features[req_id]
            items += [(features[i].identifier, features[i].data) for i in indices]
        self.last_encoder_images = {r: len(i) for r, i in so.scheduled_encoder_inputs.items() if i}
        before = self.encoder.encoder_seconds
        if items:
            self.encoder.encode(items)
        self.last_encoder_seconds = self.encoder.encoder_seconds - before

    def _gather_mm(self, so: SchedulerOutput, plan: StepPlan,
                   states: list[CachedRequestState]) -> tuple[np.ndarray, np.ndarray] | None:
        """The step's image rows, or None when no scheduled token is an image placeholder."""
        assert self.encoder is not None
        chunks = [(self._mm_features.get(r, []), s.num_computed_tokens, so.num_scheduled_tokens[r])
                  for r, s in zip(plan.req_ids, states)]
        if not any(f for f, _, _ in chunks):
            return None
        embeds, mask = self.encoder.gather(chunks, plan.token_bucket, self.mc.hidden_size)
        return (embeds, mask) if mask.any() else None

    def launch(self, prepared: PreparedStep, bitmask: np.ndarray | None = None) -> InFlightStep:
        """Launch a prepared step without waiting for it. ``bitmask`` [num_mask_rows, bitmask_width]:
        the structured-output masks of its rows, or with speculation of its verified positions
        (all ones for an unconstrained row), or None."""
        so, plan, states = prepared.scheduler_output, prepared.plan, prepared.states
        if prepared.inputs is None or plan is None:
            return prepared
        # The prepared inputs stay as prepare built them: the bitmask flag joins a copy.
        inputs = dataclasses.replace(prepared.inputs, use_bitmask=flag(bitmask is not None))
        buf = pack(inputs, self._layout_for(plan.token_bucket))
        self.last_packed = PackedStep(buf, self._layout_for(plan.token_bucket), plan.token_bucket, plan.num_tokens,
                                      tuple(plan.req_ids), self.block_size)
        device_mask: Any = self._allowed_all_bitmask(prepared.num_mask_rows) if bitmask is None else bitmask
        if self.config.enforce_eager:  # op by op, every numpy slice would be its own transfer
            buf, device_mask = jax.device_put((buf, device_mask), self._replicated)
        # Compiled: the executable takes the fresh numpy buffer as its one transfer (an explicit
        # device_put first costs several times as much host time per step).
        mm = prepared.mm
        decode_only = self.decode_attn_fn is not None and plan.num_tokens == len(plan.req_ids) and mm is None
        all_greedy = self.sampling_table.all_greedy(inputs.model.row_slots) if self.cond_free else None
        use_lora = inputs.lora_slot_ids is not None and bool(np.any(inputs.lora_slot_ids >= 0))
        variant = StepVariant(plan.token_bucket, decode_only, all_greedy, use_lora, mm is not None)
        if mm is not None and self.config.enforce_eager:
            mm = jax.device_put(mm, self._replicated)
        result = self._launch(self._executable(variant), buf, device_mask, mm)
        head_drafts = self._propose_on_device(inputs, plan, states, result) if self.overlap else None
        self._prev_row_of = {r: i for i, r in enumerate(plan.req_ids)}
        self.stats.record_step(plan.num_tokens, plan.token_bucket)
        head_lora = None  # the LM head's slot tables and each token's slot, for its prompt logprobs
        if self.lora is not None and self.lora.has_lm_head:
            head_lora = (self.lora.tables, inputs.lora_slot_ids)
        self.prompt_logprobs.accumulate(self.model_state, result.hidden, plan, states, so, head_lora)
        return dataclasses.replace(prepared, out=result.sampler, expert_load=result.expert_load,
                                   draft_hidden=result.draft_hidden, corrected=result.corrected,
                                   head_drafts=head_drafts)

    def _propose_on_device(self, inputs: StepArrays[np.ndarray], plan: StepPlan, states: list[CachedRequestState],
                           result: StepOutput) -> tuple[jax.Array, jax.Array]:
        """Overlapped speculation: the head's catch-up and drafts right after the step, from its
        device outputs; the drafts (padded to max_num_seqs in the head's program) become the
        carried state the next step reads its placeholder drafts from."""
        assert self.eagle is not None and result.corrected is not None and result.draft_hidden is not None
        assert inputs.spec is not None
        n = len(plan.req_ids)
        counts = np.diff(inputs.model.query_start_loc[: n + 1]).tolist()
        next_known = next_known_tokens(self.batch, [s.slot for s in states], row_starts(inputs.model, n),
                                       counts, plan.samples)
        drafts, proposing = self.eagle.propose_on_device(
            plan.req_ids, plan.samples, next_known, result.corrected, result.draft_hidden,
            result.sampler.sampled_token_ids, inputs.spec.num_draft_tokens[:n].tolist(), [True] * n)
        self.state = dataclasses.replace(self.state, prev_drafts=self.eagle.carried_drafts)
        return drafts, proposing

    def sampled_tokens(self, step: InFlightStep) -> dict[str, int]:
        """Wait for a dispatched step's sampled ids only: request id -> token, for the rows that
        sample (the tokens ``collect`` will hand the scheduler; its own read is then cached)."""
        if step.out is None or step.plan is None:
            return {}
        start = time.perf_counter()
        sampled = np.asarray(step.out.sampled_token_ids)
        self.stats.device_wait_seconds += time.perf_counter() - start
        plan = step.plan
        return {r: t for r, ok, t in zip(plan.req_ids, plan.samples, sampled[: len(plan.req_ids)].tolist()) if ok}

    def collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """Wait for a dispatched step and hand its tokens to the host-side request states."""
        if step.out is None or step.plan is None:
            return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        output = self._collect(step.out, step.plan, step.states, step.scheduler_output, step)
        if step.expert_load is not None:  # E int32s, read after the sampled tokens (already waited for)
            output.expert_load = np.asarray(step.expert_load).tolist()
            self.stats.record_expert_load(output.expert_load)
        return output

    def _prepare_inputs(self, so: SchedulerOutput) -> tuple[StepArrays[np.ndarray], StepPlan, list[CachedRequestState]]:
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        counts = [so.num_scheduled_tokens[r] for r in req_ids]
        total = so.total_num_scheduled_tokens
        bucket = self.pick_bucket(total)
        rows = self._num_rows(bucket)
        slots = [s.slot for s in states]
        if not np.array_equal(self.batch.num_tokens[slots], [s.num_tokens for s in states]):
            # a stale table row would feed wrong tokens, or never let its request sample again
            raise RuntimeError("runner state out of sync: a slot's token row disagrees with its request")
        starts = [s.num_computed_tokens for s in states]
        prev = [self._prev_row_of.get(r, -1) for r in req_ids]
        drafts = [so.scheduled_spec_decode_tokens.get(r, []) for r in req_ids] if self.num_spec else None
        # Placeholder drafts (overlapped speculation) are proposed on the device: in flight, not written.
        flying = placeholder_rows(drafts) if drafts is not None and self.overlap else None
        if drafts is not None:
            written = drafts if flying is None else [[] if f else d for f, d in zip(flying, drafts)]
            write_drafts(self.batch, slots, written)
        num_drafts = None if drafts is None else [len(d) for d in drafts]
        model, samples = build_step_arrays(self.batch, slots, starts, counts, prev, bucket, rows,
                                           self.block_size, self.slots.padding_slot, num_drafts, flying)
        # A row's draw is keyed by how many tokens its request generated before it; with async
        # scheduling the host may not have the last of them yet, so count from the positions
        # (which end with the row's drafts, if any).
        generated = [max(0, c + n - s.num_prompt_tokens - (num_drafts[i] if num_drafts else 0))
                     for i, (s, c, n) in enumerate(zip(states, starts, counts))]
        want_logprobs = any(s.sampling_params.logprobs is not None for s, ok in zip(states, samples) if ok)
        sampling = SamplingMetadata.from_arrays(self.sampling_table.gather(model.row_slots, generated))
        # each token's adapter slot, the new adapters written first
        lora_slots = self.lora.token_slots(req_ids, counts, bucket) if self.lora is not None else None
        # use_bitmask stays off until launch knows whether a bitmask comes with the step.
        spec = (None if drafts is None else
                build_spec_inputs(model.query_start_loc, drafts, rows, self.num_spec, bucket))
        mrope = self._mrope_inputs(req_ids, starts, counts, bucket) if self.mrope else None
        inputs = StepArrays(model, sampling, need_logprobs=flag(want_logprobs), use_bitmask=flag(False),
                            lora_slot_ids=lora_slots, spec=spec, mrope_positions=mrope)
        plan = StepPlan(req_ids, total, bucket, samples, want_logprobs)
        return inputs, plan, states

    def _collect(self, out: SamplerOutput, plan: StepPlan, states: list[CachedRequestState],
                 so: SchedulerOutput, step: RunnerStep | None = None) -> ModelRunnerOutput:
        want_logprobs = plan.want_logprobs
        start = time.perf_counter()
        if want_logprobs:
            sampled, logprobs, logprob_ids, ranks = jax.device_get(
                (out.sampled_token_ids, out.logprobs, out.logprob_token_ids, out.sampled_token_rank))
        else:
            sampled = np.asarray(out.sampled_token_ids)
        self.stats.device_wait_seconds += time.perf_counter() - start
        sampled_lists: list[list[int]] = []
        logprob_rows: list[Any] = []
        prompt_logprobs: dict[str, list] = {}
        live_slots, live_tokens = [], []
        spec = self.num_spec > 0  # then each row is [K+1] ids, placeholders (-1) past the emitted ones
        tokens = sampled[: len(states)].tolist()
        for i, (state, ok, token) in enumerate(zip(states, plan.samples, tokens)):
            # num_computed_tokens is not advanced here: the scheduler's count arrives with the next
            # step, and with async scheduling that step was prepared before this one finished.
            if not ok:
                sampled_lists.append([])
                logprob_rows.append(None)
                continue
            emitted = [t for t in token if t >= 0] if spec else [token]
            state.output_token_ids.extend(emitted)
            if self.requests.get(state.req_id) is state:  # else finished or preempted meanwhile: its
                live_slots.append(state.slot)  # slot may already hold another request
                live_tokens.append(emitted)
            sampled_lists.append(emitted)
            rows = PromptLogprobsWorker.deliver(state)
            if rows is not None:
                prompt_logprobs[state.req_id] = rows
            k = state.sampling_params.logprobs
            if k is None:
                logprob_rows.append(None)
            elif spec:  # one row per emitted token (EngineCoreOutput.new_logprobs takes a list)
                logprob_rows.append([(logprob_ids[i, j, : k + 1].tolist(), logprobs[i, j, : k + 1].tolist(),
                                      int(ranks[i, j])) for j in range(len(emitted))])
            else:
                logprob_rows.append((logprob_ids[i, : k + 1].tolist(), logprobs[i, : k + 1].tolist(), int(ranks[i])))
        for j in range(max(map(len, live_tokens), default=0)):  # column by column: one scatter each
            col = [(s, t[j]) for s, t in zip(live_slots, live_tokens) if len(t) > j]
            self.batch.append_tokens([s for s, _ in col], [t for _, t in col])
        return ModelRunnerOutput(
            req_ids=plan.req_ids, req_id_to_index={r: i for i, r in enumerate(plan.req_ids)},
            sampled_token_ids=sampled_lists, logprobs=logprob_rows if want_logprobs else None,
            prompt_logprobs_dict=prompt_logprobs,
            spec_token_ids=self._spec_token_ids(states, sampled_lists, step, so.propose_drafts))

    def _spec_token_ids(self, states: list[CachedRequestState], sampled: list[list[int]],
                        step: RunnerStep | None, propose: bool) -> list[list[int]] | None:
        """The next step's drafts, or None without speculation. The EAGLE head runs every step
        (it catches up on this step's hidden states, which no later step has); its drafts are
        dropped when the scheduler asked for none (the auto-off rule's plain steps)."""
        if not self.num_spec:
            return None
        if self.eagle is not None:
            drafts = self._collect_head(states, step) if self.overlap else self._propose(states, sampled, step)
            return drafts if propose else [[] for _ in states]
        return self._propose(states, sampled, step) if propose else None

    def _head_contexts(self, states: list[CachedRequestState]) -> tuple[list[bool], list[np.ndarray]]:
        """Whether each row's request is still the runner's, and its known tokens now. A request
        gone while its step ran (async scheduling) has its tokens in its own state only: its
        slot's row may already hold another request's."""
        live = [self.requests.get(s.req_id) is s for s in states]
        known = [self.batch.token_ids[s.slot, : self.batch.num_tokens[s.slot]] if ok
                 else np.asarray(s.prompt_token_ids + s.output_token_ids, np.int32) for s, ok in zip(states, live)]
        return live, known

    def _collect_head(self, states: list[CachedRequestState], step: RunnerStep | None) -> list[list[int]]:
        """Overlapped speculation: the drafts the head proposed on the device after ``step``, read
        back now, and its bookkeeping, each row's true start read from the corrected positions."""
        assert self.eagle is not None and step is not None and step.head_drafts is not None
        assert step.corrected is not None and step.inputs is not None
        n = len(states)
        drafts, proposing, positions = jax.device_get((*step.head_drafts, step.corrected.positions))
        qsl = step.inputs.model.query_start_loc
        live, known = self._head_contexts(states)
        return self.eagle.collect_on_device([s.req_id for s in states], known, positions[qsl[:n]].tolist(),
                                            np.diff(qsl[: n + 1]).tolist(), live, drafts, proposing)

    def _draft_room(self, state: CachedRequestState) -> bool:
        """True if a draft could still yield a kept token: with K drafts up to K+1 tokens come
        back, so a row one token from ``max_tokens`` or ``max_model_len`` gets none."""
        max_tokens = state.sampling_params.max_tokens
        room = self.max_model_len - state.num_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - len(state.output_token_ids))
        return room > 1

    def _propose(self, states: list[CachedRequestState], sampled: list[list[int]],
                 step: RunnerStep | None = None) -> list[list[int]]:
        """The drafts for the next step (n-gram, the draft model or the EAGLE head), from each
        live row's known tokens (prompt and outputs), for the rows with room for a draft (the
        scheduler would cut them all at ``max_tokens``/``max_model_len``). Penalised and
        constrained rows too: the step counts each position's earlier drafts, and the scheduler
        cuts a constrained row's drafts at the first one its grammar refuses (the bitmask then has
        a row per verified position)."""
        if self.eagle is not None:  # every row, sampling or not: the head keeps up with the target
            assert step is not None and step.inputs is not None and step.draft_hidden is not None
            live, known = self._head_contexts(states)
            return self.eagle.propose([s.req_id for s in states], known, [bool(t) for t in sampled],
                                      step.inputs.model, step.draft_hidden, live)
        out: list[list[int]] = [[] for _ in states]
        rows = [i for i, (state, toks) in enumerate(zip(states, sampled))
                if toks and self.requests.get(state.req_id) is state and self._draft_room(state)]
        if rows:
            slots = [states[i].slot for i in rows]
            contexts = [self.batch.token_ids[s, : self.batch.num_tokens[s]] for s in slots]
            if self.drafter is not None:
                proposed = self.drafter.propose([states[i].req_id for i in rows], contexts)
            else:
                assert self.proposer is not None
                proposed = self.proposer.propose(contexts)
            for i, drafts in zip(rows, proposed):
                out[i] = drafts
        return out
