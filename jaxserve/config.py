"""Engine configuration: one dataclass, validated once, surfaced one-to-one as CLI flags.

Field names follow vLLM's engine arguments so that ``--max-num-seqs`` and friends mean the same
thing here. ``add_cli_args``/``from_cli_args`` derive the flags from the fields, so a new field is
a new flag with no second list to keep in sync.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Literal, get_args, get_origin, get_type_hints

from jaxserve import envs
from jaxserve.exceptions import ConfigError
from jaxserve.models.config import QUANTIZATION_METHODS

ATTENTION_BACKENDS = ("auto", "xla", "pallas", "triton", "cpu", "mosaic")  # built in; more may be registered
# The reasoning parsers' names (``jaxserve.structured.reasoner`` and the server's parsers know each).
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# --kv-cache-dtype values, in vLLM's spellings (--quantization's are QUANTIZATION_METHODS).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's defaults for a multi-node engine's rank 0.
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29501

# vLLM's short spellings of some flags, besides the long one every field gets.
CLI_SHORT_FLAGS: dict[str, str] = {"tensor_parallel_size": "-tp", "data_parallel_size": "-dp"}


@dataclasses.dataclass
class EngineConfig:
    model: str | None = None
    """HF checkpoint folder or hub id (Qwen/Qwen3-0.6B); None = the built-in demo model."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; defaults to the model's."""
    revision: str | None = None
    """Hub revision of the model (branch, tag or commit); default: main."""
    download_dir: str | None = None
    """Hub cache folder to download into and read from; default: HF_HUB_CACHE (~/.cache/huggingface/hub)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (the checkpoint's), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; defaults to the model's max_position_embeddings."""
    block_size: int = 16
    """Tokens per KV cache block."""
    max_num_seqs: int = 256
    """Most requests in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, shared by prefill chunks and decodes."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (hash chain over full blocks)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps to fit the token budget."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0 = no cap)."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of admission and of preemption victims."""
    enforce_eager: bool = False
    """Run the step without jax.jit (for comparison with the compiled path)."""
    async_scheduling: bool = True
    """Schedule and prepare step N+1 while the device runs step N (outputs arrive one step later;
    the same tokens)."""
    attention_backend: str = "auto"
    """auto, xla, pallas, triton, cpu, mosaic, or a name registered with
    pallas_kernels.register_attention_backend in this process. auto = mosaic on an sm_90 GPU when
    it passes its start-up self-check, else pallas on GPU; on a CPU, cpu (the C++ kernel) when it
    builds here, else xla (mosaic on a CPU runs interpreted: tests only)."""
    data_parallel_size: int = 1
    """Engine replicas, each with its own scheduler, KV cache and devices (tensor_parallel_size
    of them), behind one API; requests go to the least loaded replica or to the one holding their
    prefix."""
    seed: int = 0
    """Seed of the engine's RNG (draws seeds for unseeded requests)."""
    kv_cache_memory: int | None = None
    """KV cache size in bytes (overrides gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's total memory this engine may use (vLLM's meaning): the KV cache gets
    what the weights, the largest step's temporaries and a fixed reserve leave of it."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV cache blocks."""
    max_logprobs: int = 20
    """Largest logprobs/prompt_logprobs a request may ask for."""
    max_prompt_chars: int = 1_000_000
    """Longest text prompt, in characters, checked before it is tokenized (tokenizing costs about a
    second per megabyte)."""
    max_n: int = 128
    """Most samples (n) one request may ask for; each is a sequence in the engine."""
    max_stop_strings: int = 64
    """Most stop strings one request may give."""
    max_stop_str_chars: int = 1024
    """Longest stop string, in characters."""
    compilation_cache_dir: str | None = None
    """JAX persistent compilation cache folder; default is under the user cache; 'off' disables it."""
    interpret_kernels: bool | None = None
    """Run Pallas kernels in interpret mode (default: on when not on a GPU)."""
    scan_layers: bool | None = None
    """Decoder layers under lax.scan over stacked weights (compile time flat in depth), or unrolled
    over per-layer weights (no weight slicing per step; longer compiles for deep models).
    Default: unrolled up to 8 layers, scanned above."""
    structured_outputs_max_grammar_bytes: int = 131072
    """Largest JSON schema, regex, grammar or choice list a structured-output request may send, in bytes."""
    structured_outputs_compile_timeout_s: float = 10.0
    """A structured-output request whose grammar has not compiled after this many seconds is aborted."""
    structured_outputs_any_whitespace: bool = False
    """JSON constraints allow any JSON whitespace between tokens (vLLM's default). Off: compact JSON
    (vLLM's disable_any_whitespace), since a model that favours whitespace could otherwise emit it
    without end; a request's whitespace_pattern still applies."""
    reasoning_parser: str | None = None
    """How the model marks its reasoning (vLLM's reasoning parsers): 'qwen3' (content unless the
    output opens <think>) or 'deepseek_r1' (reasoning until </think>). Structured outputs then
    constrain only what follows </think>, generated or already in the prompt, and the server
    splits <think>...</think> into message.reasoning_content. Default: none."""
    max_step_records: int = 4096
    """Per-step records kept in a ring (who ran and with how many tokens, who waited and why,
    preemptions, KV blocks, bucket, timings); 0 turns step recording off."""
    max_request_timelines: int = 1024
    """Finished requests whose timelines stay readable by id (live ones always are)."""
    record_token_ids: bool = False
    """Show each request's prompt and output token ids in its timeline."""
    tensor_parallel_size: int = 1
    """Devices each model is split over (Megatron-style: attention heads, MLP columns and the
    vocabulary); must divide the attention heads and be at most the devices present."""
    nnodes: int = 1
    """Hosts the engine spans, one process each; above 1, JAX's distributed runtime joins them
    and one mesh covers every host's devices."""
    node_rank: int = 0
    """This host's rank, 0 to nnodes - 1: rank 0 runs the scheduler and the API server, the others
    run the steps rank 0 sends them."""
    master_addr: str | None = None
    """Rank 0's address, where JAX's coordination service listens; default: the host of
    JAX_COORDINATOR_ADDRESS when set, else 127.0.0.1."""
    master_port: int | None = None
    """The coordination service's port on master_addr; default: the port of
    JAX_COORDINATOR_ADDRESS when set, else 29501."""
    node_heartbeat_timeout_s: int = 10
    """A host whose heartbeats to the coordination service stop for this many seconds counts as
    lost: rank 0 then fails its requests and /health answers 503."""
    otlp_traces_endpoint: str | None = None
    """OTLP/HTTP collector to send a span tree per request to (e.g. http://127.0.0.1:4318/v1/traces);
    needs the otel extra."""
    # ---- quantization (issue 31): weight and KV cache formats; to move into a sub-config at merge.
    quantization: str | None = None
    """Quantize the decoder layers' weights as they load (vLLM's flag): int8 (per output channel;
    on a CPU the activations are quantized per token for XLA's int8 dot) or fp8 (e4m3, per output
    channel). The embedding and the LM head stay in dtype. Default: none."""
    kv_cache_dtype: str = "auto"
    """KV cache storage (vLLM's flag): auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3,
    scale 1.0 as vLLM uses without calibrated scales): half of bfloat16's bytes per token."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def bad(field: str, why: str) -> ConfigError:
            return ConfigError(f"{field}: {why}, got {getattr(self, field)!r}")

        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise bad("block_size", "must be a positive power of two")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.data_parallel_size < 1:
            raise bad("data_parallel_size", "must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise bad("max_num_batched_tokens", "must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every scheduled request advances by at least one token, so this caps concurrency.
            self.max_num_seqs = self.max_num_batched_tokens
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2")
        if self.long_prefill_token_threshold < 0:
            raise bad("long_prefill_token_threshold", "must be >= 0")
        if not _is_backend_name(self.attention_backend):
            # Registered names are known only to the kernels' registry: the runner checks them.
            raise bad("attention_backend", f"must be one of {', '.join(ATTENTION_BACKENDS)} or a registered name")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise bad("scheduling_policy", "must be 'fcfs' or 'priority'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise bad("kv_cache_memory", "must be a positive number of bytes")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise bad("num_gpu_blocks_override", "must be >= 2 (block 0 is reserved)")
        if self.structured_outputs_max_grammar_bytes < 1:
            raise bad("structured_outputs_max_grammar_bytes", "must be >= 1")
        if not self.structured_outputs_compile_timeout_s > 0:
            raise bad("structured_outputs_compile_timeout_s", "must be > 0")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise bad("reasoning_parser", f"must be one of {', '.join(REASONING_PARSERS)}")
        for field in ("max_step_records", "max_request_timelines"):
            if getattr(self, field) < 0:
                raise bad(field, "must be >= 0")
        if self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be >= 1")
        if self.max_logprobs < 0:
            raise bad("max_logprobs", "must be >= 0")
        for name in ("max_prompt_chars", "max_n", "max_stop_strings", "max_stop_str_chars"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        self._validate_nodes(bad)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise bad("quantization", f"must be one of {', '.join(QUANTIZATION_METHODS)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.dtype != "auto":
            from jaxserve.models.config import normalize_dtype_name

            self.dtype = normalize_dtype_name(self.dtype)

    def _validate_nodes(self, bad) -> None:
        if self.nnodes < 1:
            raise bad("nnodes", "must be >= 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"must be in [0, nnodes - 1] with nnodes={self.nnodes}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise bad("master_port", "must be a TCP port, 1 to 65535")
        addr = self.master_addr
        if addr is not None and (not addr.strip() or (":" in addr and not addr.startswith("["))):
            raise bad("master_addr", "must be a host name or an address (an IPv6 one in brackets), no port")
        if self.tensor_parallel_size % self.nnodes:
            raise bad("tensor_parallel_size", f"must be a multiple of nnodes ({self.nnodes}): every node holds "
                      "an equal share of the mesh")
        if self.node_heartbeat_timeout_s < 1:
            raise bad("node_heartbeat_timeout_s", "must be >= 1")

    @property
    def is_multi_node(self) -> bool:
        return self.nnodes > 1

    def coordinator_address(self) -> str:
        """``host:port`` of JAX's coordination service (rank 0): ``master_addr``/``master_port``,
        each defaulting to its part of ``JAX_COORDINATOR_ADDRESS``, then 127.0.0.1:29501."""
        env_host, env_port = envs.jax_coordinator_address()
        host = self.master_addr or env_host or DEFAULT_MASTER_ADDR
        port = self.master_port or env_port or DEFAULT_MASTER_PORT
        return f"{host}:{port}"

    def resolved_compilation_cache_dir(self) -> str | None:
        if self.compilation_cache_dir == "off":
            return None
        if self.compilation_cache_dir:
            return self.compilation_cache_dir
        return str(envs.cache_dir() / "xla")

    # ---- CLI -------------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ("model",)) -> None:
        hints = get_type_hints(cls)
        docs = _field_docs(cls)
        for field in dataclasses.fields(cls):
            if field.name in skip:
                continue
            flags = ["--" + field.name.replace("_", "-")]
            if field.name in CLI_SHORT_FLAGS:
                flags.append(CLI_SHORT_FLAGS[field.name])
            kind = hints[field.name]
            doc = docs.get(field.name, "")
            # A docstring that explains its default says more than the bare value (often None).
            help_text = doc if "default" in doc.lower() else f"{doc} (default: {field.default})"
            if kind is bool or kind == (bool | None):
                parser.add_argument(*flags, dest=field.name, action=argparse.BooleanOptionalAction,
                                    default=field.default, help=help_text)
            elif get_origin(kind) is Literal:
                parser.add_argument(*flags, dest=field.name, choices=get_args(kind), default=field.default,
                                    help=help_text)
            else:
                base = next((t for t in (int, float, str) if t is kind or t in get_args(kind)), str)
                parser.add_argument(*flags, dest=field.name, type=base, default=field.default, help=help_text)

    def cli_flags(self, skip: tuple[str, ...] = ()) -> list[str]:
        """The flags that give this configuration from the defaults (those of changed fields)."""
        flags = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in skip or value == field.default:
                continue
            flag = "--" + field.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                flags += [flag, str(value)]
        return flags

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        values.update(overrides)
        return cls(**values)


def _is_backend_name(name: Any) -> bool:
    """A built-in backend, or a name a registered one could have (letters, digits, ``_-.``)."""
    return isinstance(name, str) and (name in ATTENTION_BACKENDS or (
        bool(name) and all(c.isalnum() or c in "_-." for c in name)))


def _field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal under each field) for --help."""
    import ast
    import inspect

    class_def = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(class_def, ast.ClassDef)
    body = class_def.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = str(nxt.value.value)
    return docs

