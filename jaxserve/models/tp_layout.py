"""How a model's weights are split over ``size`` tensor-parallel shards (Megatron-style).

Which axis of which parameter is split (:data:`SPLIT_AXES`), and the column order of the fused
projections that makes a contiguous column block a whole shard:

- ``qkv_proj.kernel [hidden, size * (q + 2 kv)]``: shard ``s`` holds ``[q_s | k_s | v_s]``, its
  query heads and its key/value heads side by side. With one shard that is plain ``[q | k | v]``.
  Reshaping the output to ``[T, size, -1]`` and splitting the last axis gives every head back in
  its original order, so the model's code is the same for every ``size``.
- ``gate_up_proj.kernel [hidden, size * 2 * inter / size]``: shard ``s`` holds ``[gate_s | up_s]``.
- ``o_proj`` and ``down_proj`` are split on their input rows (one all-reduce each per layer);
  the embedding and the LM head on the vocabulary, padded to a multiple of ``size``; norms and
  the remaining biases are replicated.

When there are fewer key/value heads than shards, each is stored ``size / num_kv_heads`` times
(vLLM does the same), so every shard holds one: ``stored_kv_heads = max(num_kv_heads, size)``.
"""

from __future__ import annotations

import dataclasses

from jaxserve.exceptions import ConfigError
from jaxserve.models.config import ModelConfig

# A parameter's path below its decoder layer (or at the top level) -> the axis split over the
# shards; absent: replicated. Axes count from the parameter's own first axis (a scanned stack's
# layer axis comes before them).
SPLIT_AXES: dict[tuple[str, ...], int] = {
    ("embed_tokens", "embedding"): 0,
    ("lm_head", "kernel"): 1,
    ("self_attn", "qkv_proj", "kernel"): 1,
    ("self_attn", "qkv_proj", "bias"): 0,
    ("self_attn", "qkv_proj", "kernel_scale"): 0,  # a quantized kernel's scales follow its columns
    ("self_attn", "o_proj", "kernel"): 0,
    ("mlp", "gate_up_proj", "kernel"): 1,
    ("mlp", "gate_up_proj", "bias"): 0,
    ("mlp", "gate_up_proj", "kernel_scale"): 0,
    ("mlp", "down_proj", "kernel"): 0,
    # GGUF blocks kept (``--quantization gguf``) are stored ``[out, in...]``: the column-split
    # projections split their rows, the row-split ones their input in whole 32-wide blocks, the
    # tied embedding (also the LM head) its vocabulary rows.
    **{(*module, part): 0 for module in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj"),
                                         ("embed_tokens", "head")) for part in ("qs", "d", "m")},
    **{(*module, part): 1 for module in (("self_attn", "o_proj"), ("mlp", "down_proj")) for part in ("qs", "d", "m")},
    # A mixture-of-experts layer's experts are split whole (expert parallelism): shard s holds
    # experts [s * E / size, (s + 1) * E / size); the router stays replicated.
    ("mlp", "experts", "gate_up_proj"): 0,
    ("mlp", "experts", "down_proj"): 0,
    ("mlp", "experts", "gate_up_proj_bias"): 0,  # gpt-oss: the experts' biases go with them
    ("mlp", "experts", "down_proj_bias"): 0,
    ("self_attn", "sinks"): 0,  # gpt-oss: each shard's query heads' sinks
}


# The EAGLE head's one layer (:mod:`.eagle`'s flat names below ``layers.0.``, projections stored
# ``[in, out]``), split as a target layer is: q, k, v and gate, up by output columns (whole heads
# per shard), o and down by input rows. Everything else (fc, norms, its own embedding, LM head and
# d2t) is replicated.
EAGLE_SPLIT_AXES: dict[str, int] = {
    **{f"self_attn.{p}_proj.weight": 1 for p in "qkv"},
    **{f"self_attn.{p}_proj.bias": 0 for p in "qkv"},
    "self_attn.o_proj.weight": 0,
    "mlp.gate_proj.weight": 1,
    "mlp.up_proj.weight": 1,
    "mlp.down_proj.weight": 0,
}


def split_axis(path: tuple) -> int | None:
    """The split axis of the parameter at ``path`` (a module path as ``nnx`` spells it), counted
    from the parameter's own first axis; None when it is replicated."""
    names = tuple(p for p in path if isinstance(p, str) and p not in ("layers", "stacked"))
    return SPLIT_AXES.get(names)


def check_tensor_parallel_size(cfg: ModelConfig, size: int, expert_parallel: bool | None = None) -> None:
    """A ValueError naming the head count (or the width) that ``size`` does not divide.

    A mixture-of-experts model splits its experts whole over the devices (vLLM's expert
    parallelism), so ``size`` must divide the expert count; ``expert_parallel`` is the engine's
    ``enable_expert_parallel``, which such a split needs (None: not checked, the model is built)."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if (size % kv_heads) if size > kv_heads else (kv_heads % size):
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv_heads} key/value heads: one must "
                         "divide the other")
    if cfg.is_moe and size > 1:
        if expert_parallel is False:
            raise ConfigError(f"tensor_parallel_size {size} with a mixture-of-experts model ({cfg.architecture}): "
                              "its experts are split whole over the devices; pass enable_expert_parallel "
                              "(--enable-expert-parallel)")
        if cfg.num_experts % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {cfg.num_experts} experts "
                             "(expert parallelism splits them whole)")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate_size "
                         f"{cfg.intermediate_size}")


def splits_evenly(cfg: ModelConfig, size: int, expert_parallel: bool) -> bool:
    """True when :func:`check_tensor_parallel_size` accepts ``size`` for ``cfg`` (a draft model is
    split like the target then; otherwise it is replicated)."""
    try:
        check_tensor_parallel_size(cfg, size, expert_parallel)
    except (ValueError, ConfigError):
        return False
    return True


def eagle_head_splits(cfg: ModelConfig, size: int) -> bool:
    """True when an EAGLE head with layer shape ``cfg`` splits ``size`` ways with no copies: its
    query heads, key/value heads and MLP width all divide. Its KV pool is then split on the
    key/value heads as the target's is; otherwise head and pool are replicated (the one-layer
    head's weights are not reordered to store key/value heads twice)."""
    return size > 1 and not (cfg.num_attention_heads % size or cfg.num_key_value_heads % size
                             or cfg.intermediate_size % size)


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """The shapes of one model split ``size`` ways. Invariants: ``size`` divides ``num_heads``,
    ``stored_kv_heads``, ``intermediate_size`` and ``padded_vocab``."""

    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def of(cls, cfg: ModelConfig, size: int) -> TPLayout:
        check_tensor_parallel_size(cfg, size)
        return cls(size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                   cfg.vocab_size)

    @property
    def kv_replicas(self) -> int:
        """Copies stored of each key/value head (1 unless there are fewer of them than shards)."""
        return max(1, self.size // self.num_kv_heads)

    @property
    def stored_kv_heads(self) -> int:
        return self.num_kv_heads * self.kv_replicas

    @property
    def q_heads_per_shard(self) -> int:
        return self.num_heads // self.size

    @property
    def kv_heads_per_shard(self) -> int:
        return self.stored_kv_heads // self.size

    @property
    def qkv_width(self) -> int:
        """Output columns of the fused q|k|v projection, all shards together."""
        return (self.num_heads + 2 * self.stored_kv_heads) * self.head_dim

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding (columns of the LM head): the vocabulary rounded up to a multiple
        of ``size``; the padding rows are zero and their logits are dropped."""
        return -(-self.vocab_size // self.size) * self.size

    def kv_heads_of_shard(self, shard: int) -> list[int]:
        """The checkpoint's key/value heads that shard ``shard`` stores, in order."""
        first = shard * self.kv_heads_per_shard
        return [h // self.kv_replicas for h in range(first, first + self.kv_heads_per_shard)]
