"""A stack of identical layers run under ``lax.scan``: one layer's graph, its parameters stacked."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

import jax
import jax.numpy as jnp
from flax import nnx

Carry = TypeVar("Carry")


class ScannedLayers(nnx.Module):
    """``num_layers`` layers of one structure, held as ``stacked``: a single layer module whose
    every parameter has a leading layer axis.

    :meth:`scan` traces the layer once, so compile time does not grow with depth. Indexing
    (``layers[i]``) returns layer ``i`` as a module of its own, holding a copy of its slice: edits
    to it do not reach the stack. Edit ``stacked`` (all layers at once; new parameters need the
    leading axis too), or load the model unrolled to edit one layer.
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *, rngs: nnx.Rngs):
        self.num_layers = num_layers
        self.stacked = nnx.vmap(make_layer, in_axes=0, out_axes=0)(rngs.split(num_layers))

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index: int) -> nnx.Module:
        if not -self.num_layers <= index < self.num_layers:
            raise IndexError(f"layer {index} of a {self.num_layers}-layer stack")
        graphdef, state = nnx.split(self.stacked)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[index], state))

    def __iter__(self) -> Iterator[nnx.Module]:
        return (self[i] for i in range(self.num_layers))

    def scan(self, body: Callable[[nnx.Module, jax.Array, Carry], Carry], carry: Carry) -> Carry:
        """``carry = body(layer_i, i, carry)`` for each layer in order, ``i`` an int32 scalar.

        The scan slices each parameter's stack per iteration and rebuilds the layer module from
        the slices inside the traced body; whatever must be updated in place belongs in ``carry``.
        A submodule whose class sets ``READS_STACK_IN_PLACE`` keeps its parameters whole, layer
        axis included, and is handed the index by its caller: on XLA:CPU a slice feeding a custom
        call is a copy, so reading the layer in place saves copying it every step.
        """
        in_place = {path for path, module in nnx.iter_modules(self.stacked)
                    if getattr(type(module), "READS_STACK_IN_PLACE", False)}

        def sliced(path: tuple, _value: object) -> bool:  # a variable's path: its owner's, then its name
            return tuple(path[:-1]) not in in_place

        graphdef, state, whole = nnx.split(self.stacked, sliced, ...)  # type: ignore[misc]

        def step(carry, xs):
            layer_state, index = xs
            return body(nnx.merge(graphdef, layer_state, whole), index, carry), None

        carry, _ = jax.lax.scan(step, carry, (state, jnp.arange(self.num_layers, dtype=jnp.int32)))
        return carry
