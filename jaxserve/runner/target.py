"""The device a runner's compiled step is built for: the local one, or an abstract one for an
ahead-of-time compile (``scripts/gpu_aot_check.py`` compiles for an H200 on a CPU machine).

The platform decides the control flow of the step, in this one place. XLA:GPU reads the
predicate of a ``conditional`` and the condition of a data-dependent ``while`` back to the host,
stalling the stream once per branch each step, so the GPU step holds neither: the host picks a
greedy or a random sampler program and every optional pass runs as a select. XLA:CPU runs them
inline, where skipping work a batch does not need is a real saving, so the CPU keeps its conds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxserve.sample.policy import SamplerPolicy


def normalize_platform(platform: str) -> str:
    """``cuda``/``rocm``/``gpu`` -> ``gpu``; everything else unchanged (``cpu``, ``tpu``)."""
    return "gpu" if platform.lower() in ("cuda", "rocm", "gpu") else platform.lower()


@dataclasses.dataclass(frozen=True)
class StepTarget:
    """``platform``: where the step runs (``gpu``/``cpu``). ``sharding``: set for an abstract
    target, whose arrays are never allocated; the runner's mesh is then its mesh, every input of
    the step carries a sharding on it, and the runner can only lower and compile
    (``runner.steps.lowered``), not run.
    """

    platform: str
    sharding: Any = None
    compute_capability: int | None = None  # an abstract GPU's, e.g. 90; kernels compiled outside XLA need it

    @classmethod
    def local(cls) -> StepTarget:
        return cls(normalize_platform(jax.default_backend()))

    @classmethod
    def abstract(cls, sharding: Any) -> StepTarget:
        device = next(iter(sharding.device_set))
        capability = getattr(device, "compute_capability", None)
        return cls(normalize_platform(device.platform), sharding,
                   None if capability is None else round(float(capability) * 10))

    @property
    def is_abstract(self) -> bool:
        return self.sharding is not None

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """An abstract target's mesh (its sharding's): the devices a runner on it compiles for."""
        return self.sharding.mesh

    @property
    def cond_free(self) -> bool:
        """True when the step must hold no conditional and no data-dependent loop (GPU)."""
        return self.platform == "gpu"

    def lora_table_rank(self, max_lora_rank: int) -> int:
        """The rank the LoRA slot tables hold for ``--max-lora-rank``: on a GPU a multiple of 16
        (XLA:GPU's tiler finds no tiles for ``x @ A`` of a rank-8 q|k|v table with 3 slots or
        more, ``Couldn't find output tile sizes``), an adapter's smaller rank being zeros as
        always; elsewhere the flag's own."""
        return -(-max_lora_rank // 16) * 16 if self.platform == "gpu" else max_lora_rank

    def sampler_policy(self, all_greedy: bool | None = None) -> SamplerPolicy:
        """The sampler's control flow on this target. ``all_greedy``: the host's word on the
        step's rows, which a cond-free step needs (None there: the logprob passes only, which
        never draw); with conds the device decides and it is ignored."""
        if not self.cond_free:
            return SamplerPolicy()
        return SamplerPolicy(cond_free=True, all_greedy=True if all_greedy is None else all_greedy)


def shapes_on(tree: Any, sharding: Any) -> Any:
    """``tree``'s arrays (or shapes) as shapes carrying ``sharding`` (one for all, or a tree of
    them whose structure is a prefix of ``tree``'s, one per weight): what a compile-only runner or
    proposer holds in place of its weights and pools (nothing is allocated)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    return jax.tree.map(lambda s, sub: shapes_on(sub, s), sharding, tree)
