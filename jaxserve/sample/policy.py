"""How the sampler branches: with device-side conds (XLA:CPU) or with none at all (XLA:GPU).

Every optional pass of the sampler goes through one of three doors, so the pipeline is written
once and the policy alone decides its control flow (``jaxserve/runner/target.py`` says why the
GPU step holds no conditional; ``StepTarget.sampler_policy`` builds the policy):

* ``skip_unless(active, on, off)``: a pass that is the identity on the rows that do not use it
  (penalties, restrictions). With conds it is skipped when no row is active; cond-free it always
  runs, which changes nothing for those rows.
* ``select(flag, on, off)``: a pass whose result differs when off (the bitmask, the logprobs).
  With conds only the taken branch runs; cond-free both run and an element-wise select picks.
* ``full_sort_only`` (and, for logprobs, top-K in rounds of the GPU's TopK kernel): where a
  partial sort plus a conditional full sort is the CPU's cheaper way.

``all_greedy`` is the host's word on whether every row is greedy, for a program with or without
the random draw; None (only with conds) lets the device decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import lax

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SamplerPolicy:
    cond_free: bool = False
    all_greedy: bool | None = None

    def __post_init__(self):
        if self.cond_free and self.all_greedy is None:
            raise ValueError("SamplerPolicy: a cond-free sampler needs the host's all_greedy (True or False)")

    def skip_unless(self, active: Callable[[], jax.Array], on: Callable[[], T], off: Callable[[], T]) -> T:
        """``on()`` where ``active()`` holds; ``on`` must equal ``off`` on the inactive rows."""
        return on() if self.cond_free else lax.cond(active(), on, off)

    def select(self, flag: jax.Array, on: Callable[[], T], off: Callable[[], T]) -> T:
        """``on()`` if the traced scalar ``flag`` is True, else ``off()``."""
        if not self.cond_free:
            return lax.cond(flag, on, off)
        return jax.tree.map(lambda a, b: jnp.where(flag, a, b), on(), off())

    @property
    def full_sort_only(self) -> bool:
        """Truncation sorts every row (XLA:GPU lowers a top-k wider than 16 to a sort anyway)."""
        return self.cond_free


# The default: conds on the device (the CPU step, tests, the sampler benchmark).
WITH_CONDS = SamplerPolicy()
