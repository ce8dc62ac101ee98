"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral, as a Flax NNX module.

A router picks ``top_k`` experts per token (softmax over all experts in float32, the top ``k``
kept and, when the checkpoint says so, renormalized to sum to one: Qwen3-MoE's
``norm_topk_prob``; Mixtral always renormalizes). The experts are one stacked weight each
(``gate_up_proj [E, hidden, 2 * inter]``, ``down_proj [E, inter, hidden]``) and run as a grouped
matmul: the ``T * k`` (token, expert) pairs are sorted by expert and ``jax.lax.ragged_dot``
multiplies each expert's contiguous rows by its own weight, so the work is that of the active
experts only. :func:`dense_moe` runs every expert on every token, weighted by a one-hot mix: on
XLA:CPU it is the faster of the two (``ragged_dot`` lowers to a slow loop there; figures in
docs/benchmarks.md), so :func:`default_grouped` picks it on a CPU and ``ragged_dot`` elsewhere.

Expert parallelism (a mesh of N devices): each device holds E / N whole experts. Tokens are
already on every device (the attention's all-reduce leaves them replicated), so there is no
dispatch collective: every device routes all tokens, runs the pairs of its own experts (the
others weighted 0) and one ``psum`` per layer adds the devices' partial outputs: an all-reduce in
the step's HLO, as the dense MLP's down projection has.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jaxserve.layers.linear import Linear
from jaxserve.layers.shard import shard_map


def default_grouped(platform: str | None = None) -> bool:
    """``ragged_dot`` except on a CPU, where the dense one-hot form measured faster."""
    return (platform or jax.default_backend()) != "cpu"


def route(router_logits: jax.Array, top_k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """``[T, E]`` logits -> the top-k experts' weights ``[T, k]`` (float32) and ids ``[T, k]``."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids


def route_topk_softmax(router_logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """gpt-oss's routing: the ``top_k`` largest logits, then a softmax over those only."""
    logits, ids = jax.lax.top_k(router_logits.astype(jnp.float32), top_k)
    return jax.nn.softmax(logits, axis=-1), ids


def expert_load(ids: jax.Array, valid: jax.Array, num_experts: int) -> jax.Array:
    """Routed (token, expert) pairs per expert, ``[E]`` int32: a bincount of the top-k ``ids
    [T, k]`` over the tokens where ``valid [T]`` is set (a step's padding tokens route too)."""
    weights = jnp.broadcast_to(valid[:, None], ids.shape).reshape(-1).astype(jnp.int32)
    return jnp.zeros((num_experts,), jnp.int32).at[ids.reshape(-1)].add(weights)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """Qwen3-MoE's and Mixtral's expert activation."""
    return jax.nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: gate clamped from above and up on both sides at ``limit``,
    then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)


Glu = Callable[[jax.Array, jax.Array], jax.Array]


def grouped_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array, down: jax.Array,
                gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None, *,
                glu: Glu = swiglu) -> jax.Array:
    """Gated experts over the routed pairs with ``ragged_dot``: ``x [T, H]`` -> ``[T, H]``; the
    biases (``[E, 2 * inter]``, ``[E, H]``; gpt-oss) are each pair's expert's row."""
    num_tokens, top_k = ids.shape
    num_experts = gate_up.shape[0]
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)  # pairs grouped by expert
    token_of = order // top_k
    expert_of = flat_ids[order]
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[token_of], gate_up, group_sizes)
    if gate_up_bias is not None:
        h = h + gate_up_bias[expert_of].astype(h.dtype)
    gate, up = jnp.split(h, 2, axis=-1)
    out = jax.lax.ragged_dot(glu(gate, up), down, group_sizes)
    if down_bias is not None:
        out = out + down_bias[expert_of].astype(out.dtype)
    out = out * weights.reshape(-1)[order, None].astype(out.dtype)
    return jnp.zeros((num_tokens, x.shape[1]), out.dtype).at[token_of].add(out)


def dense_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array, down: jax.Array,
              gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None, *,
              glu: Glu = swiglu) -> jax.Array:
    """The same sum computed densely: every expert on every token, weighted by a one-hot mix."""
    mix = (jax.nn.one_hot(ids, gate_up.shape[0], dtype=jnp.float32) * weights[..., None]).sum(axis=1)  # [T, E]
    h = jnp.einsum("th,ehi->eti", x, gate_up)
    if gate_up_bias is not None:
        h = h + gate_up_bias[:, None, :].astype(h.dtype)
    gate, up = jnp.split(h, 2, axis=-1)
    out = jnp.einsum("eti,eih->eth", glu(gate, up), down)
    if down_bias is not None:
        out = out + down_bias[:, None, :].astype(out.dtype)
    return jnp.einsum("eth,te->th", out, mix.astype(out.dtype))


class MoEExperts(nnx.Module):
    """The stacked expert weights: ``gate_up_proj [E, hidden, 2 * inter]`` (``[gate | up]`` per
    expert) and ``down_proj [E, inter, hidden]``; with ``use_bias`` (gpt-oss) their biases
    ``gate_up_proj_bias [E, 2 * inter]`` (``[gate | up]`` too) and ``down_proj_bias [E, hidden]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, param_dtype, rngs: nnx.Rngs,
                 use_bias: bool = False):
        init = nnx.initializers.normal(stddev=0.02)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, 2 * inter), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, inter, hidden), param_dtype))
        self.gate_up_proj_bias = (nnx.Param(jnp.zeros((num_experts, 2 * inter), param_dtype)) if use_bias
                                  else nnx.data(None))
        self.down_proj_bias = nnx.Param(jnp.zeros((num_experts, hidden), param_dtype)) if use_bias else nnx.data(None)

    def arrays(self) -> tuple[jax.Array, ...]:
        """``gate_up_proj``, ``down_proj`` and, when there are biases, theirs."""
        stacks = (self.gate_up_proj[...], self.down_proj[...])
        if self.gate_up_proj_bias is None or self.down_proj_bias is None:
            return stacks
        return (*stacks, self.gate_up_proj_bias[...], self.down_proj_bias[...])


class SparseMoeBlock(nnx.Module):
    """Router (``gate``) and experts; ``grouped`` picks ``ragged_dot`` over the one-hot form
    (None: :func:`default_grouped`). ``clamped_swiglu`` (gpt-oss: its ``(alpha, limit)``) also
    gives the router and the experts biases and routes by :func:`route_topk_softmax`."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, normalize: bool, *,
                 param_dtype, rngs: nnx.Rngs, grouped: bool | None = None,
                 clamped_swiglu: tuple[float, float] | None = None):
        self.top_k = top_k
        self.normalize = normalize
        self.grouped = default_grouped() if grouped is None else grouped
        gpt_oss = clamped_swiglu is not None
        self.glu: Glu = swiglu if clamped_swiglu is None else ClampedSwiglu(*clamped_swiglu)
        self.topk_softmax = gpt_oss
        self.gate = Linear(hidden, num_experts, use_bias=gpt_oss, param_dtype=param_dtype, rngs=rngs)
        self.experts = MoEExperts(num_experts, hidden, inter, param_dtype=param_dtype, rngs=rngs, use_bias=gpt_oss)

    def __call__(self, x: jax.Array, mesh: Mesh | None = None) -> jax.Array:
        return self.forward(x, mesh)[0]

    def forward(self, x: jax.Array, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
        """The block's output ``[T, hidden]`` and the experts each token was routed to ``[T, k]``."""
        logits = self.gate(x)
        weights, ids = (route_topk_softmax(logits, self.top_k) if self.topk_softmax
                        else route(logits, self.top_k, self.normalize))
        fn = functools.partial(grouped_moe if self.grouped else dense_moe, glu=self.glu)
        stacks = self.experts.arrays()
        if mesh is not None and mesh.size > 1:
            return expert_parallel_moe(fn, mesh, x, weights, ids, *stacks).astype(x.dtype), ids
        return fn(x, weights, ids, *stacks).astype(x.dtype), ids


def expert_parallel_moe(fn, mesh: Mesh, x: jax.Array, weights: jax.Array, ids: jax.Array,
                        *stacks: jax.Array) -> jax.Array:
    """``fn`` (grouped or dense) with the experts split whole over ``mesh`` (module docstring);
    ``stacks``: the experts' weights (and biases), each with the experts first."""
    axes = mesh.axis_names

    def local(x, weights, ids, *stacks):
        num_local = stacks[0].shape[0]
        first = jax.lax.axis_index(axes) * num_local
        mine = (ids >= first) & (ids < first + num_local)
        out = fn(x, jnp.where(mine, weights, 0.0), jnp.where(mine, ids - first, 0), *stacks)
        return jax.lax.psum(out, axes)

    specs = tuple(PartitionSpec(axes, *(None,) * (a.ndim - 1)) for a in stacks)
    return shard_map(local, mesh, in_specs=(PartitionSpec(),) * 3 + specs,
                     out_specs=PartitionSpec())(x, weights, ids, *stacks)
