"""Expected time of the ``mosaic`` attention kernel per step, from its tile schedule.

The kernel's own schedule (:mod:`pallas_kernels.mosaic_attention`): CTAs of ``(query tile, KV
head, split)``, each walking its share of the context in steps of ``block_kv`` positions; a step
loads one stage (K and V, ``2 * block_kv * D`` elements) by TMA and issues ``D / 16`` wgmma
instructions for ``Q Kᵀ`` (m64 n``block_kv`` k16) and ``block_kv / 16`` for ``p V`` (m64 n``D``
k16). The model counts, per layer:

* ``hbm_bytes``: each KV page once per KV head (the query tiles of one request re-read its
  pages, from L2 when they were read recently), the Q tiles, the real rows of the f32 partials, and
  the jnp pack of Q and gather of the rows;
* ``loaded_bytes``: every stage every CTA loads by TMA, re-reads included;
* ``flops``: the wgmmas' (64 rows per tile, however few are real: a decode tile of a GQA group of
  G uses G of them);
* four lower bounds on the time: ``hbm_bytes / HBM bandwidth``; ``loaded_bytes / L2 bandwidth``
  (``L2_OVER_HBM`` times HBM's, an assumption); ``flops / bf16 peak``; and the critical path, the
  longest CTA's steps, each at least one stage at one SM's share of the L2 bandwidth and its
  wgmmas at one SM's share of the peak, times the waves the CTAs need (CTAs per SM from the shared
  memory one holds). Empty CTAs (the static grid's bound past the batch's tiles) exit at once;
* a fixed launch overhead per kernel call (``LAUNCH_S``, an assumption: a few microseconds).

The expected time is the largest bound plus the launch. The roofline's ideal attention (KV read
once, exact FLOPs) sits next to it (``roofline.mosaic_columns``); their ratio is the kernel's
modelled efficiency. A model, not a measurement: ``scripts/gpu_check.sh`` measures the kernel the
day a GPU is lent.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from jaxserve.bench.gpu_targets import GpuSpec

if TYPE_CHECKING:
    from jaxserve.models.config import ModelConfig

LAUNCH_S = 4e-6  # one kernel launch inside a compiled step (assumed)
L2_OVER_HBM = 2.5  # L2 read bandwidth over HBM's on Hopper (assumed, not measured here)
WGMMA_K = 16  # bf16 wgmma: k16 per instruction


@dataclasses.dataclass(frozen=True)
class KernelEstimate:
    """One layer's attention call on the kernel's schedule."""

    ctas: int
    waves: int
    max_steps: int  # the longest CTA's KV steps
    stage_bytes: int  # K and V of one step
    smem_bytes: int
    wgmma_per_step: int
    hbm_bytes: int
    loaded_bytes: int
    flops: int
    memory_s: float
    l2_s: float
    compute_s: float
    critical_s: float

    def _bounds(self):
        return ((self.memory_s, "memory"), (self.l2_s, "L2"), (self.compute_s, "compute"),
                (self.critical_s, "critical path"))

    @property
    def seconds(self) -> float:
        return max(b for b, _ in self._bounds()) + LAUNCH_S

    @property
    def bound(self) -> str:
        return max(self._bounds())[1]


def estimate_layer(mc: ModelConfig, spec: GpuSpec, requests: list[tuple[int, int]], *, num_tokens: int,
                   num_seqs: int, block_size: int, max_model_len: int, itemsize: int = 2,
                   kv_itemsize: int | None = None) -> KernelEstimate:
    """The kernel's schedule for one layer of a step (bucket ``num_tokens`` x ``num_seqs``).

    ``kv_itemsize`` 1: an fp8 pool (half the K/V bytes per step, a cast into the staging tiles);
    the model's ``sliding_window`` starts each tile's walk at its window's first step."""
    kv_itemsize = itemsize if kv_itemsize is None else kv_itemsize
    window = mc.sliding_window or 0
    from pallas_kernels import mosaic_attention as ma

    hq, hkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    cfg = ma.default_mosaic_config(num_tokens, num_seqs, hq, hkv, d, block_size, max_model_len, kv_itemsize)
    bq = ma.block_q_for(hq, hkv)
    splits, bkv = cfg.num_splits, cfg.block_kv
    stage = 2 * bkv * d * kv_itemsize
    q_tile, g_pad = ma.TILE_ROWS * d * itemsize, ma.TILE_ROWS // bq
    total_steps = max_steps = runs = unique_steps = partials = 0
    for q_len, kv_len in requests:
        oldest = max(kv_len - q_len - window + 1, 0) // bkv if window else 0  # the request's first step read
        unique_steps += math.ceil(kv_len / bkv) - oldest
        for first in range(0, q_len, bq):
            tokens = min(bq, q_len - first)
            start = max(kv_len - q_len + first - window + 1, 0) // bkv if window else 0  # as split_run
            steps = math.ceil((kv_len - q_len + first + tokens) / bkv) - start  # causal: up to its last token
            per = max(math.ceil(steps / splits), cfg.min_split_steps)  # as the kernel's split_run
            total_steps += steps
            max_steps = max(max_steps, min(per, steps))
            runs += math.ceil(steps / per)
            # each run stores its real rows of the f32 accumulator, and the 64-row max and sum
            partials += math.ceil(steps / per) * (tokens * g_pad * d + 2 * ma.TILE_ROWS) * 4
    ctas = runs * hkv  # the CTAs that work: empty tiles and splits exit at once
    smem = ma.smem_bytes(d, cfg, itemsize, kv_itemsize)
    per_sm = max(1, ma.SMEM_BYTES_H200 // smem)
    waves = math.ceil(ctas / (spec.sm_count * per_sm))
    wgmma = d // WGMMA_K + bkv // WGMMA_K
    step_flops = 2 * 2 * ma.TILE_ROWS * bkv * d
    tokens_io = sum(q for q, _ in requests) * hq * d * (2 * itemsize + 4 * splits + itemsize)  # pack, rows, out
    hbm = hkv * (unique_steps * stage + partials) + ctas * q_tile + tokens_io
    loaded = hkv * total_steps * stage + ctas * q_tile
    flops = hkv * total_steps * step_flops
    l2_bw = L2_OVER_HBM * spec.hbm_bytes_per_s
    sm_l2, sm_flops = l2_bw / spec.sm_count, spec.bf16_flops / spec.sm_count
    critical = waves * max_steps * max(stage * per_sm / sm_l2, step_flops * per_sm / sm_flops)
    return KernelEstimate(ctas=ctas, waves=waves, max_steps=max_steps, stage_bytes=stage, smem_bytes=smem,
                          wgmma_per_step=wgmma, hbm_bytes=hbm, loaded_bytes=loaded, flops=flops,
                          memory_s=hbm / spec.hbm_bytes_per_s, l2_s=loaded / l2_bw,
                          compute_s=flops / spec.bf16_flops, critical_s=critical)
