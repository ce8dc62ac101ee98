"""What the compiled step carries from one step to the next, and what it returns.

Both are registered dataclasses (pytrees): the step takes ``DeviceState`` donated and returns
its updated version inside ``StepOutput``, so XLA updates the KV cache and the penalty tables in
place.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.runner.step_inputs import ModelInputs
from jaxserve.sample.penalties import PenaltyTables
from jaxserve.sample.sampler import SamplerOutput

KVCache = tuple[jax.Array, jax.Array]  # (k, v), each [L, num_blocks, block_size, Hkv, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeviceState:
    kv_cache: KVCache
    penalties: PenaltyTables
    # The last step's sampled ids, padded to max_num_seqs (one shape for every bucket): with
    # async scheduling a decode row reads its input token here instead of from the host.
    prev_sampled: jax.Array
    # With speculating steps overlapped (``spec_in_flight.overlaps_speculation``), the rest of
    # what step N+1 corrects its inputs from, all per row of N, padded to max_num_seqs: the drafts
    # the EAGLE head proposed after N [S, K] (written by the head's program), and N's emitted and
    # verified draft counts [S]. None otherwise (nothing carried, nothing traced).
    prev_drafts: jax.Array | None = None
    prev_num_emitted: jax.Array | None = None
    prev_num_drafts: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    state: DeviceState
    sampler: SamplerOutput
    hidden: jax.Array  # [T, hidden] of every scheduled token (prompt logprobs need them)
    expert_load: jax.Array | None = None  # MoE: routed (token, expert) pairs per expert [E], layers summed
    # EAGLE: the hidden states its head reads, [T, h] (eagle: after the final norm) or [T, 3h]
    # (eagle3: entering its three layers); None without an EAGLE proposer
    draft_hidden: jax.Array | None = None
    # Overlapped speculation: the step's model inputs as it ran them, corrected on the device from
    # the step before (the EAGLE head catches up over them); None otherwise
    corrected: ModelInputs[jax.Array] | None = None
