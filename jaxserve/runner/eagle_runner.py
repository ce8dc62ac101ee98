"""The ``eagle``, ``eagle3`` and ``mtp`` proposers (vLLM's ``v1/spec_decode/eagle.py``): a one-layer
head (:mod:`jaxserve.models.eagle`; mtp's, the target's own layer: :mod:`jaxserve.models.mtp`) fed
the target's hidden states.

The head's KV pool is one layer laid out as the target's: the same block ids, block tables and
slots, so a request's head KV lives in its target blocks and a prefix-cache hit brings the head's
KV with the target's. (The head's entry at ``p`` reads the token at ``p + 1``, so at the hit's last
position it may belong to another continuation: with EAGLE the scheduler drops a hit's last block,
as vLLM does, and the target and the head recompute it.) The scheduler also allocates K lookahead
slots per request (``num_lookahead_tokens``) for the drafts' KV.

After each target step the head catches up over the step's tokens, in the step's own layout (one
compiled program per target token bucket, the step's hidden states passed as they came out of
it): the token at ``p`` of a row is the head's input at ``p - 1``. A row's valid positions are
those whose hidden state the target computed on tokens it kept: its prompt chunk, or its input
token and the drafts it accepted; rejected drafts' positions write no KV (slot -1). A row that
samples drafts K tokens greedily in the same program: the head's output at its last valid
position gives the first, then K-1 one-token steps each read the previous step's output hidden
state, their KV written into the lookahead slots and overwritten by the next catch-up. Every
program is compiled at warm-up; a shape met later is compiled then and counted in
``unexpected_compiles``. A compile-only proposer (``abstract``, for the deviceless GPU check)
holds shapes only, placed as a local one's arrays would be, and can lower its programs
(:meth:`lowered`), not run them.

Async scheduling: the runner overlaps speculating steps (``on_device``): right after each step
is launched, :meth:`propose_on_device` catches up over it and drafts from its device outputs
(the drafts stay on the device for the next step, already scheduled with placeholders for them),
and :meth:`collect_on_device` does the bookkeeping when the step is collected. Without
``on_device`` (a compile-only proposer; the direct tests) the catch-up runs when the step is
collected (:meth:`propose`). Either way the catch-ups run in launch order, each once, and a row
whose request left meanwhile (aborted, finished, preempted) is caught up all the same: its
blocks may stay in the prefix cache.

Tensor parallel: everything lives on the target's mesh, an MTP layer as an EAGLE head. When the
head's heads and MLP width divide it (:func:`jaxserve.models.tp_layout.eagle_head_splits`) its
layer is split as a target layer and its pool on the key/value heads, so each device holds the
head KV of its own key/value heads in the target's blocks, as it holds the target's; otherwise (or
with ``draft_tensor_parallel_size`` 1) head and pool are replicated.
The hidden states it reads are replicated (the target's all-reduce came before them).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.exceptions import ConfigError
from jaxserve.layers.attention import AttentionFn, AttentionMetadata
from jaxserve.models.config import ModelConfig
from jaxserve.models.eagle import (
    EagleConfig,
    TargetTables,
    Weights,
    combine_target_hidden,
    eagle_config,
    eagle_forward,
    greedy_tokens,
    load_eagle_weights,
)
from jaxserve.models.mtp import load_mtp_head, mtp_forward
from jaxserve.models.tp_layout import eagle_head_splits
from jaxserve.runner.head_catch_up import head_catch_up
from jaxserve.runner.kv_cache import ProposerKV, allocate_kv_cache, bytes_per_block
from jaxserve.runner.mesh import eagle_head_shardings, replicated
from jaxserve.runner.step_inputs import ModelInputs
from jaxserve.runner.target import shapes_on

logger = logging.getLogger("jaxserve")


def load_eagle_head(config: EngineConfig, target: ModelConfig) -> tuple[EagleConfig, Weights]:
    """The head named by ``speculative_config.model`` (mtp: the target's own first MTP layer) in
    the target's dtype, checked against it."""
    from jaxserve.models.hub import resolve_model

    spec = config.spec_decode_config.spec
    assert spec is not None
    if target.embed_scale is not None or target.final_logit_softcapping is not None or target.norm_offset:
        raise ConfigError(f"speculative_config.method={spec.method}: EAGLE heads are built for Llama-family "
                          f"targets; {target.architecture} (scaled embeddings or norms) is not supported")
    if spec.method == "mtp":
        folder = resolve_model(config.model, revision=config.revision, download_dir=config.download_dir).path
        return load_mtp_head(folder, target, jnp.dtype(target.dtype))
    assert spec.model is not None
    try:
        source = resolve_model(spec.model, download_dir=config.download_dir, state_dict_bin=True)
    except ConfigError as exc:
        raise ConfigError(f"speculative_config.model: {exc}") from None
    cfg = eagle_config(source.path, spec.method, target)
    return cfg, load_eagle_weights(source.path, cfg, jnp.dtype(target.dtype))


def target_tables(paths: Sequence[tuple], arrays: Sequence[jax.Array], method: str) -> TargetTables:
    """The target's embedding and untied LM head among its flattened weights."""
    by_path = {tuple(str(k) for k in p): a for p, a in zip(paths, arrays)}
    embedding = by_path.get(("embed_tokens", "embedding"))
    if embedding is None:
        raise ConfigError(f"speculative_config.method={method}: the head reads the target's embedding, which "
                          "this target keeps quantized (GGUF blocks); serve a float checkpoint")
    return TargetTables(embedding, by_path.get(("lm_head", "kernel")))


def head_pool_kv(config: EngineConfig, cfg: EagleConfig) -> ProposerKV:
    """The head's pool as the target's KV sizing counts it: one layer in each target block."""
    return ProposerKV(bytes_per_block(cfg.layer, config.block_size, 1, config.kv_cache_dtype, 1))


def _valid_positions(context: np.ndarray, start: int, count: int) -> int:
    """How many of a row's ``count`` positions from ``start`` the head catches up on: its input
    at p is the token at p + 1, known up to ``len(context)``."""
    return max(0, min(count, len(context) - 1 - start))


class EagleProposer:
    """``step_rows``: the target's rows per token bucket (every bucket gets its program);
    ``hidden_sharding``: where the step's hidden states live; ``mesh``: the target's;
    ``num_blocks`` and ``table_width``: the target's pool and block-table width;
    ``abstract``: a compile-only proposer, whose weights and pool are shapes carrying the
    shardings a local one's arrays would have."""

    def __init__(self, config: EngineConfig, cfg: EagleConfig, weights: Weights, tables: TargetTables, k: int,
                 attn_fn: AttentionFn, mesh: Mesh, num_blocks: int, table_width: int,
                 step_rows: dict[int, int], hidden_sharding: Any, abstract: bool = False):
        self.k = k
        self.table_width = table_width
        self.cfg = cfg
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.attn_fn = attn_fn
        spec = config.spec_decode_config.spec
        # An MTP layer is placed as an EAGLE head's (its decoder layer under the same names).
        self.split = (eagle_head_splits(cfg.layer, mesh.size)
                      and (spec is None or spec.draft_tensor_parallel_size != 1))
        self.mesh = mesh if mesh.size > 1 else None  # the target's tables are split over it
        self.attn_mesh = mesh if self.split else None
        self._forward = functools.partial(mtp_forward if cfg.method == "mtp" else eagle_forward,
                                          mesh=self.mesh, attn_mesh=self.attn_mesh)
        self.tables = tables

        def make_kv():  # one layer: [num_blocks, bs, Hkv, D]
            k_pool, v_pool = allocate_kv_cache(cfg.layer, num_blocks, self.block_size, 1, config.kv_cache_dtype)
            return k_pool[0], v_pool[0]

        weight_shardings, pool_sharding = eagle_head_shardings(mesh, weights, self.split)
        if abstract:
            self.weights = shapes_on(weights, weight_shardings)
            self.kv = shapes_on(jax.eval_shape(make_kv), pool_sharding)
        else:
            self.weights = jax.device_put(weights, weight_shardings)
            self.kv = jax.jit(make_kv, out_shardings=pool_sharding)()
        self.step_rows = dict(step_rows)
        self.hidden_sharding = hidden_sharding
        # Each request's positions with head KV (the rest of its blocks: stale or lookahead).
        self.num_computed: dict[str, int] = {}
        # Requests the head missed positions of (never expected: a safety net): no drafts until freed.
        self.blind: set[str] = set()
        # The donated pools come back as they went in; the drafts are replicated.
        self._jitted = jax.jit(self._propose_fn, donate_argnums=(2,), out_shardings=(pool_sharding, replicated(mesh)))
        self._compiled: dict[int, Any] = {}
        # The program run from a step's device outputs (propose_on_device), per token bucket;
        # compiled at warm-up only when ``on_device`` is set (the overlap of speculating steps).
        self.on_device = False
        # Its drafts also come out padded to max_num_seqs rows inside the program: the shape the
        # step's carried state holds them in (DeviceState.prev_drafts, donated to the next step,
        # so a buffer apart from the drafts read back), whatever the bucket.
        self.draft_rows = config.max_num_seqs
        self.carried_drafts: jax.Array | None = None
        self._jitted_on_device = jax.jit(self._propose_on_device_fn, donate_argnums=(2,),
                                         out_shardings=(pool_sharding, replicated(mesh), replicated(mesh),
                                                        replicated(mesh)))
        self._compiled_on_device: dict[int, Any] = {}
        self.unexpected_compiles = 0
        self.num_passes = 0

    def free(self, req_id: str) -> None:
        """Forget a finished, preempted or replaced request (its blocks are the target's)."""
        self.num_computed.pop(req_id, None)
        self.blind.discard(req_id)

    def _catches_up(self, req_id: str, start: int) -> bool:
        """Whether the head can catch up on ``req_id`` from ``start``: not blind, and holding every
        position before it (a new request resumes from the target's: its prefix hit holds the
        head's KV too); a request it missed positions of goes blind."""
        if req_id in self.blind:
            return False
        if self.num_computed.setdefault(req_id, start) < start:
            self._go_blind(req_id)
            return False
        return True

    def _go_blind(self, req_id: str) -> None:
        self.num_computed.pop(req_id, None)
        self.blind.add(req_id)

    # ---- the compiled program ------------------------------------------------------------------

    def _propose_fn(self, weights, tables, kv, target_hidden, input_ids, positions, slot_mapping, block_tables,
                    kv_lens, query_start_loc, num_seqs, logits_indices, proposing):
        """Catch up over the step's tokens, then K greedy drafts for the ``proposing`` rows."""
        cfg, bs = self.cfg, self.block_size
        md = AttentionMetadata(positions, slot_mapping, block_tables, kv_lens, query_start_loc, num_seqs)
        hidden = combine_target_hidden(cfg, weights, target_hidden)
        rows, hidden, kv = self._forward(cfg, weights, tables, input_ids, hidden, kv, md, self.attn_fn)
        tokens = greedy_tokens(cfg, weights, tables, rows[logits_indices], self.mesh)
        hidden = hidden[logits_indices]
        num_rows = logits_indices.shape[0]
        # Draft j+2 is read at position p + 1 + j, p the row's last valid position.
        starts = positions[logits_indices] + 1
        one_each = jnp.arange(num_rows + 1, dtype=jnp.int32)
        out = [tokens]
        width = block_tables.shape[1]
        for j in range(self.k - 1):
            pos = starts + j
            # Past max_model_len there is no page: nothing written (those drafts are cut anyway).
            page = jnp.take_along_axis(block_tables, jnp.minimum(pos // bs, width - 1)[:, None], axis=1)[:, 0]
            slot = jnp.where(proposing & (pos < width * bs), page * bs + pos % bs, -1)
            # Rows not drafting attend to one position of the null block and write nothing.
            md = AttentionMetadata(jnp.where(proposing, pos, 0), slot, jnp.where(proposing[:, None], block_tables, 0),
                                   jnp.where(proposing, pos + 1, 1), one_each, jnp.full((1,), num_rows, jnp.int32))
            rows, hidden, kv = self._forward(cfg, weights, tables, tokens, hidden, kv, md, self.attn_fn)
            tokens = greedy_tokens(cfg, weights, tables, rows, self.mesh)
            out.append(tokens)
        return kv, jnp.stack(out, axis=1)

    def _propose_on_device_fn(self, weights, tables, kv, target_hidden, input_ids, positions, slot_mapping,
                              block_tables, kv_lens, query_start_loc, num_seqs, emitted, num_drafts, samples,
                              next_known, live, skip):
        """:meth:`_propose_fn` with its ids, slots, logits indices and proposing flags built here
        from the step's device outputs (:func:`head_catch_up`): ``emitted`` i32[R, K+1] is the
        step's verified output as the sampler left it (-1 past a row's emitted tokens)."""
        num_emitted = jnp.sum(emitted >= 0, axis=1).astype(jnp.int32)
        ids, slots, logits_indices, proposing = head_catch_up(
            input_ids, slot_mapping, query_start_loc, emitted, num_emitted, num_drafts, samples, next_known,
            live, skip)
        kv, drafts = self._propose_fn(weights, tables, kv, target_hidden, ids, positions, slots, block_tables,
                                      kv_lens, query_start_loc, num_seqs, logits_indices, proposing)
        padded = jnp.zeros((max(self.draft_rows, drafts.shape[0]), self.k), jnp.int32)
        padded = padded.at[:drafts.shape[0]].set(drafts.astype(jnp.int32))
        # The drafts read back are another value (-1 where a row did not propose), so never the
        # carried buffer, which the next step takes donated.
        return kv, jnp.where(proposing[:, None], drafts, -1), padded, proposing

    def _padding_args(self, bucket: int) -> tuple:
        rows = self.step_rows[bucket]
        z = np.zeros
        return (z(bucket, np.int32), z(bucket, np.int32), np.full(bucket, -1, np.int32),
                z((rows, self.table_width), np.int32), z(rows, np.int32), z(rows + 1, np.int32),
                z(1, np.int32), z(rows, np.int32), z(rows, np.bool_))

    def _zero_hidden(self, bucket: int, dtype: Any) -> jax.Array:
        return jax.device_put(jnp.zeros((bucket, self.cfg.target_hidden_width), dtype), self.hidden_sharding)

    def lowered(self, bucket: int, hidden_dtype: Any) -> Any:
        """The program of the target's ``bucket``-token steps, lowered (compiles nothing); the
        step's hidden states in ``hidden_dtype``."""
        hidden = jax.ShapeDtypeStruct((bucket, self.cfg.target_hidden_width), hidden_dtype,
                                      sharding=self.hidden_sharding)
        return self._jitted.lower(self.weights, self.tables, self.kv, hidden, *self._padding_args(bucket))

    def _program(self, bucket: int, hidden: jax.Array, warm: bool = False):
        if bucket not in self._compiled:
            if not warm:
                self.unexpected_compiles += 1
                logger.warning("%s head: compiling the %d-token program after warm-up", self.cfg.method, bucket)
            self._compiled[bucket] = self.lowered(bucket, hidden.dtype).compile()
        return self._compiled[bucket]

    def _device_padding_args(self, bucket: int) -> tuple:
        """:meth:`propose_on_device`'s program arguments after the hidden states, on padding."""
        ids, positions, slots, block_tables, kv_lens, qsl, num_seqs, _, _ = self._padding_args(bucket)
        rows, z = self.step_rows[bucket], np.zeros
        return (ids, positions, slots, block_tables, kv_lens, qsl, num_seqs, np.full((rows, self.k + 1), -1, np.int32),
                z(rows, np.int32), z(rows, np.bool_), z(rows, np.int32), z(rows, np.bool_), z(rows, np.bool_))

    def lowered_on_device(self, bucket: int, hidden_dtype: Any) -> Any:
        """:meth:`propose_on_device`'s program of the target's ``bucket``-token steps, lowered."""
        hidden = jax.ShapeDtypeStruct((bucket, self.cfg.target_hidden_width), hidden_dtype,
                                      sharding=self.hidden_sharding)
        return self._jitted_on_device.lower(self.weights, self.tables, self.kv, hidden,
                                            *self._device_padding_args(bucket))

    def _program_on_device(self, bucket: int, hidden: jax.Array, warm: bool = False):
        if bucket not in self._compiled_on_device:
            if not warm:
                self.unexpected_compiles += 1
                logger.warning("%s head: compiling the %d-token device program after warm-up", self.cfg.method,
                               bucket)
            self._compiled_on_device[bucket] = self.lowered_on_device(bucket, hidden.dtype).compile()
        return self._compiled_on_device[bucket]

    def warm_up(self, hidden_dtype: Any) -> None:
        """Compile and run every program once on padding (no KV written: every slot is -1); with
        ``on_device``, :meth:`propose_on_device`'s too."""
        for bucket in sorted(self.step_rows):
            hidden = self._zero_hidden(bucket, hidden_dtype)
            self.kv, _ = self._program(bucket, hidden, warm=True)(self.weights, self.tables, self.kv, hidden,
                                                                  *self._padding_args(bucket))
            if self.on_device:
                self.kv, _, _, _ = self._program_on_device(bucket, hidden, warm=True)(
                    self.weights, self.tables, self.kv, hidden, *self._device_padding_args(bucket))
        jax.block_until_ready(self.kv)

    @property
    def num_programs(self) -> int:
        return len(self._compiled) + len(self._compiled_on_device)

    # ---- proposing -----------------------------------------------------------------------------

    def propose(self, req_ids: Sequence[str], contexts: Sequence[np.ndarray], samples: Sequence[bool],
                step: ModelInputs[np.ndarray], hidden: jax.Array, live: Sequence[bool]) -> list[list[int]]:
        """After a target step: ``req_ids`` its rows in order, ``contexts`` each row's known tokens
        now, ``samples`` whether the row sampled, ``step`` its host inputs, ``hidden`` its hidden
        states, ``live`` whether the row's request is still the runner's. K drafts for each live
        sampling row, [] for the others. A row whose request left while the step ran (async
        scheduling: finished, aborted or preempted) has its positions' KV written all the same, as
        its blocks may stay in the prefix cache, and leaves no bookkeeping (the runner freed it).
        Called once per target step, in the steps' launch order: a later catch-up attends over the
        KV an earlier one wrote."""
        bucket = len(step.positions)
        ids, _, slots, _, _, _, _, logits_idx, proposing = self._padding_args(bucket)
        qsl, positions = step.query_start_loc, step.positions
        for i, (r, ctx, sampled, alive) in enumerate(zip(req_ids, contexts, samples, live)):
            q0, count = int(qsl[i]), int(qsl[i + 1] - qsl[i])
            start = int(positions[q0])
            if alive and not self._catches_up(r, start):
                continue
            valid = _valid_positions(ctx, start, count)
            ids[q0:q0 + valid] = ctx[start + 1:start + 1 + valid]
            slots[q0:q0 + valid] = step.slot_mapping[q0:q0 + valid]
            if not alive:  # written all the same, no bookkeeping: the runner freed it
                continue
            self.num_computed[r] = start + valid
            if sampled and valid > 0:
                logits_idx[i] = q0 + valid - 1
                proposing[i] = True
        out: list[list[int]] = [[] for _ in req_ids]
        if not (slots >= 0).any():
            return out
        call_args = (ids, positions, slots, step.block_tables, step.kv_lens, qsl, step.num_seqs, logits_idx, proposing)
        self.kv, drafts = self._program(bucket, hidden)(self.weights, self.tables, self.kv, hidden, *call_args)
        self.num_passes += 1
        if proposing.any():
            values = np.asarray(drafts)
            for row in np.flatnonzero(proposing[:len(req_ids)]):
                out[row] = values[row].tolist()
        return out

    def propose_on_device(self, req_ids: Sequence[str], samples: Sequence[bool], next_known: Sequence[int],
                          step: ModelInputs[Any], hidden: jax.Array, emitted: jax.Array,
                          num_drafts: Sequence[int], live: Sequence[bool]) -> tuple[jax.Array, jax.Array]:
        """:meth:`propose` without the step's tokens on the host: launched right after the target
        step, from its device outputs, so the host never waits for them. ``step``: the step's
        inputs as it ran (host or device arrays); ``emitted`` i32[R, K+1]: its verified output,
        still on the device; ``num_drafts``: the drafts each row verified; ``next_known``: the
        token after a row's chunk when the row does not sample (the host has it). Returns the
        drafts i32[R, K] and which rows proposed bool[R], both on the device. Blind rows are
        skipped as :meth:`propose` skips them; the bookkeeping waits for the step's tokens
        (:meth:`settle_on_device`). Same call-order invariant as :meth:`propose`. The drafts
        padded to ``draft_rows`` (max_num_seqs) rows are left in ``carried_drafts``."""
        bucket = len(step.positions)
        rows = self.step_rows[bucket]

        def pad(values: Sequence[Any], dtype: Any) -> np.ndarray:
            out = np.zeros(rows, dtype)
            out[:len(values)] = values
            return out

        skip = pad([ok and r in self.blind for r, ok in zip(req_ids, live)], np.bool_)
        args = (step.input_ids, step.positions, step.slot_mapping, step.block_tables, step.kv_lens,
                step.query_start_loc, step.num_seqs, emitted, pad(num_drafts, np.int32), pad(samples, np.bool_),
                pad(next_known, np.int32), pad(live, np.bool_), skip)
        self.kv, drafts, self.carried_drafts, proposing = self._program_on_device(bucket, hidden)(
            self.weights, self.tables, self.kv, hidden, *args)
        self.num_passes += 1
        return drafts, proposing

    def settle_on_device(self, req_ids: Sequence[str], contexts: Sequence[np.ndarray], starts: Sequence[int],
                         counts: Sequence[int], live: Sequence[bool]) -> None:
        """The bookkeeping :meth:`propose` does for a step, done for one that
        :meth:`propose_on_device` caught up on, once the step's tokens are known (``contexts``:
        each row's known tokens after it; ``starts``/``counts``: its rows' first positions and
        token counts as it ran). A row the head had missed positions of goes blind (its drafts,
        already in flight, are only checked by the target)."""
        for r, ctx, start, count, alive in zip(req_ids, contexts, starts, counts, live):
            if alive and self._catches_up(r, start):
                self.num_computed[r] = start + _valid_positions(ctx, start, count)

    def collect_on_device(self, req_ids: Sequence[str], contexts: Sequence[np.ndarray], starts: Sequence[int],
                          counts: Sequence[int], live: Sequence[bool], drafts: np.ndarray,
                          proposing: np.ndarray) -> list[list[int]]:
        """:meth:`settle_on_device`, then each row's drafts as :meth:`propose` returns them (K for
        a live row that proposed and is not blind, [] for the others), from the device
        program's ``drafts``/``proposing`` read back."""
        self.settle_on_device(req_ids, contexts, starts, counts, live)
        return [drafts[i].tolist() if proposing[i] and ok and r not in self.blind else []
                for i, (r, ok) in enumerate(zip(req_ids, live))]
