"""Running a function per shard of a mesh (``jax.shard_map``), as the layers use it.

The replication check is off: the attention kernels are custom calls and Pallas programs that
carry no replication rules, and every function here states its own output specs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh


def shard_map(fn: Callable, mesh: Mesh, *, in_specs: Any, out_specs: Any) -> Callable:
    """``fn`` run on each device of ``mesh`` with its blocks of the arguments (``in_specs``),
    its outputs assembled by ``out_specs``."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
