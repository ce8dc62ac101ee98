"""The ``draft_model`` proposer: a second, smaller model with the target's vocabulary, its own
paged KV pool and its own compiled programs (vLLM's ``v1/spec_decode/draft_model.py``).

After each target step the draft is fed what the target accepted and proposes K tokens greedily
for every decoding request:

- **catch-up** (one program per token bucket, rows ``min(bucket, max_num_seqs)``): each row's
  tokens the draft has no KV for yet (its whole prompt the first time, else the accepted drafts
  and the target's own token), written into the draft's pool; the argmax at each row's last token
  is the first draft. A catch-up longer than the largest bucket, or on a CPU one its bucket would
  pad by more than a quarter (:func:`pass_tokens`), runs in several passes.
- **decode loop** (one program per row bucket): the remaining K-1 drafts, K-1 one-token forwards
  unrolled inside one compiled program, the argmax fed back on the device.

Rollback is arithmetic: the drafts fed to the draft (positions n..n+K-2) are kept per request; the
next call keeps their KV as far as they equal the tokens the target accepted, and the rest is
overwritten by the next catch-up. Blocks are allocated per request from a free list and returned
when the request finishes, is preempted or is replaced; a request the pool cannot hold gets no
drafts that step. Every program is compiled at warm-up; a shape met later is compiled then and
counted in ``unexpected_compiles``. A draft kept in GGUF blocks multiplies few rows by int8
activations in every product, its Q8_0 head's too (a served model keeps float activations for
8-bit blocks; a draft's precision only moves its acceptance). A compile-only proposer
(``abstract``, for the deviceless GPU check) holds shapes only, placed as a local one's arrays
would be, and can lower its programs (:meth:`lowered`), not run them.

Tensor parallel (vLLM runs the draft at the target's size): on the target's mesh, a draft whose
heads and MLP width the mesh divides (:func:`jaxserve.models.tp_layout.splits_evenly`) is loaded
in the target's layout, each shard read onto its device, and runs split as the target does, its
pool split on the key/value heads; any other draft, or any with ``draft_tensor_parallel_size``
1, is replicated on every device (weights and pool whole), each device running the same program,
so the drafts are the same either way.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_utils import cdiv
from jaxserve.exceptions import ConfigError
from jaxserve.layers.attention import AttentionFn, AttentionMetadata
from jaxserve.layers.block_quant_linear import set_int8_activations
from jaxserve.models.config import ModelConfig
from jaxserve.models.tp_layout import splits_evenly
from jaxserve.runner.kv_cache import ProposerKV, allocate_kv_cache, bytes_per_block, kv_cache_groups, num_kv_slots
from jaxserve.runner.mesh import kv_cache_sharding, param_sharding, replicated, weight_shardings
from jaxserve.runner.target import shapes_on

logger = logging.getLogger("jaxserve")


def draft_layout_size(config: EngineConfig, mc: ModelConfig, mesh_size: int) -> int:
    """The shards a draft of shape ``mc`` is laid out for on the target's ``mesh_size`` devices:
    all of them when its shapes divide them and ``draft_tensor_parallel_size`` is not 1, else 1
    (replicated)."""
    spec = config.spec_decode_config.spec
    assert spec is not None
    split = spec.draft_tensor_parallel_size != 1 and splits_evenly(mc, mesh_size, config.enable_expert_parallel)
    return mesh_size if mesh_size > 1 and split else 1


def load_draft_model(config: EngineConfig, target: ModelConfig, mesh: Mesh) -> Any:
    """The draft named by ``speculative_config.model``, in the target's dtype (or its own
    ``quantization``), checked against the target: the same vocabulary, one KV cache group. On a
    mesh of several devices it is laid out and placed split over ``mesh`` when its shapes divide
    it, else replicated on every device (its ``tensor_parallel_size`` says which)."""
    from jaxserve.models import load_model
    from jaxserve.models.hub import resolve_model
    from jaxserve.models.loader import checkpoint_config

    spec = config.spec_decode_config.spec
    assert spec is not None and spec.model is not None
    try:
        source = resolve_model(spec.model, download_dir=config.download_dir)
    except ConfigError as exc:
        raise ConfigError(f"speculative_config.model: {exc}") from None
    mc = checkpoint_config(str(source.path))
    if mc.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config.model: the draft's vocabulary ({mc.vocab_size} tokens) is not "
                          f"the target's ({target.vocab_size}); a draft model needs the target's tokenizer")
    if len(kv_cache_groups(mc, config.block_size, 1 << 20)) != 1:
        raise ConfigError("speculative_config.model: a draft with sliding-window or hybrid attention layers "
                          "is not supported; use a full-attention draft")
    if mc.rope.mrope_section:
        raise ConfigError("speculative_config.model: an M-RoPE (vision-language) draft is not supported")
    # The target's scan_layers flag (None: by depth). Unrolled, SmolLM2's Q4_1 draft proposed 8x
    # slower on this CPU (docs/benchmarks.md, the draft-model section).
    size = draft_layout_size(config, mc, mesh.size)
    if mesh.size > 1 and size == 1 and spec.draft_tensor_parallel_size != 1:
        logger.info("draft model %s: its shapes do not divide tensor_parallel_size %d; replicated on every device",
                    spec.model, mesh.size)
    whole = replicated(mesh)
    return load_model(str(source.path), target.dtype, config.scan_layers, quantization=spec.quantization,
                      tensor_parallel_size=size,
                      place=lambda path, shape: param_sharding(mesh, path, len(shape)) if size > 1 else whole)


def draft_pool_kv(config: EngineConfig, mc: ModelConfig, max_model_len: int, k: int) -> ProposerKV:
    """The draft's pool as the target's KV sizing counts it: its bytes per block (as many blocks
    as the target's), and its null block and each request's lookahead besides (an upper bound:
    :class:`DraftModelProposer` also caps the pool at ``max_num_seqs`` full-length requests)."""
    bs = config.block_size
    slots = num_kv_slots(kv_cache_groups(mc, bs, max_model_len, config.kv_cache_dtype))
    per_block = bytes_per_block(mc, bs, 1, config.kv_cache_dtype, slots)
    return ProposerKV(per_block, (1 + config.max_num_seqs * cdiv(k, bs)) * per_block)


@dataclasses.dataclass
class _DraftSeq:
    """One request as the draft holds it: KV for positions < ``num_computed``, and the drafts
    fed after them (positions ``num_computed + j``), kept as far as the target accepts them."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    fed: list[int] = dataclasses.field(default_factory=list)


# A catch-up pass whose bucket holds more than this many tokens is split where padding it would
# waste more than a quarter of it (pass_tokens); below it a pass's fixed cost (every weight read
# once) outweighs the padded tokens.
SPLIT_FROM_TOKENS = 16


def pass_tokens(want: int, buckets: Sequence[int]) -> int:
    """How many of ``want`` tokens (1 <= want <= ``buckets[-1]``) one catch-up pass takes: all of
    them when their bucket is at most :data:`SPLIT_FROM_TOKENS` or pads them by at most a quarter,
    else the largest bucket they fill, the rest left to the next passes. A 131-token prompt runs as
    128 + 3 (bucket 4) instead of one 256-token pass, half of it padding."""
    fit = next(b for b in buckets if b >= want)
    if fit <= SPLIT_FROM_TOKENS or 4 * (fit - want) <= want:
        return want
    return max(b for b in buckets if b <= want)


def _pow2_buckets(top: int, start: int = 1) -> list[int]:
    out, b = [], start
    while b < top:
        out.append(b)
        b *= 2
    return [*out, top]


class DraftModelProposer:
    """``model``: the loaded draft (split over ``mesh`` when its ``tensor_parallel_size`` is the
    mesh's, else replicated on it); ``mesh``: the target's; ``attn_fn``: the target's attention
    backend function (the draft's pool has the same block size). ``abstract``: a compile-only
    proposer, whose weights and pool are shapes carrying the shardings a local one's arrays would
    have (``model`` may be abstract)."""

    def __init__(self, config: EngineConfig, model: Any, max_model_len: int, k: int, attn_fn: AttentionFn,
                 mesh: Mesh, target_num_blocks: int, abstract: bool = False):
        self.k = k
        self.mc: ModelConfig = model.config
        self.block_size = bs = config.block_size
        self.max_num_seqs = config.max_num_seqs
        # A row writes drafts up to K-1 positions past its context.
        self.max_blocks_per_seq = cdiv(max_model_len + k, bs)
        # As many tokens as the target's pool, plus each request's lookahead (block 0: the null block).
        self.num_blocks = 1 + min(target_num_blocks + config.max_num_seqs * cdiv(k, bs),
                                  config.max_num_seqs * self.max_blocks_per_seq)
        self._free = list(range(self.num_blocks - 1, 0, -1))
        self.seqs: dict[str, _DraftSeq] = {}
        self.attn_fn = attn_fn
        size = getattr(model, "tensor_parallel_size", 1)
        self.split = size > 1
        if self.split and size != mesh.size:
            raise ValueError(f"draft model laid out for {size} shards on a mesh of {mesh.size} devices")
        # The model's calls get the mesh only when split (replicated, each device runs it whole).
        self.mesh = mesh if self.split else None
        # The draft's Q8_0 products (a tied head) take int8 activations as its 4-bit ones do: what
        # they change is only which drafts the target then accepts.
        set_int8_activations(model)
        self.graphdef, flat = nnx.flatten(model, with_paths=True)
        slots = num_kv_slots(kv_cache_groups(self.mc, bs, max_model_len, config.kv_cache_dtype))
        make_kv = lambda: allocate_kv_cache(self.mc, self.num_blocks, bs, size, config.kv_cache_dtype, slots)  # noqa: E731
        whole = replicated(mesh)
        kv_sharding = kv_cache_sharding(mesh) if self.split else whole
        placed = weight_shardings(mesh, flat) if self.split else [whole] * len(flat)
        if abstract:
            self.weights = shapes_on([v for _, v in flat], placed)
            self.kv = shapes_on(jax.eval_shape(make_kv), kv_sharding)
        else:
            self.weights = jax.device_put([v for _, v in flat], placed)
            # Made in place: no device ever holds more of the pool than its shard.
            self.kv = jax.jit(make_kv, out_shardings=kv_sharding)()
        # The donated pool comes back as it went in; the drafts are replicated.
        outs = (kv_sharding, whole)
        top = min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)
        # From 1: after full acceptance a catch-up is 2 tokens a row (the last draft, the target's).
        self.token_buckets = _pow2_buckets(top)
        # On a CPU a padded token costs about what a real one does (past a few rows the products
        # are bound by arithmetic), so a catch-up is cut rather than padded (pass_tokens); on a
        # GPU padding is nearly free and every pass reads the weights again.
        self.cut_padded_passes = jax.default_backend() == "cpu"
        self.row_buckets = _pow2_buckets(config.max_num_seqs)
        self._catch_up = jax.jit(self._catch_up_fn, donate_argnums=(1,), out_shardings=outs)
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,), out_shardings=outs)
        self._compiled: dict[tuple[str, int], Any] = {}
        self.unexpected_compiles = 0
        self.num_passes = 0  # forward programs run (catch-up passes and decode loops)

    # ---- bookkeeping ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def free(self, req_id: str) -> None:
        """Forget a finished, preempted or replaced request; its blocks go back to the pool."""
        seq = self.seqs.pop(req_id, None)
        if seq is not None:
            self._free.extend(reversed(seq.blocks))

    def _reserve(self, seq: _DraftSeq, num_tokens: int) -> bool:
        need = cdiv(num_tokens, self.block_size) - len(seq.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            seq.blocks.append(self._free.pop())
        return True

    # ---- the compiled programs -----------------------------------------------------------------

    def _model(self, weights):
        return nnx.merge(self.graphdef, weights)

    def _forward(self, model, kv, input_ids, md: AttentionMetadata):
        hidden, kv, _ = model.forward(input_ids, kv, md, self.attn_fn, self.mesh)
        return hidden, kv

    def _catch_up_fn(self, weights, kv, input_ids, positions, slot_mapping, block_tables, kv_lens,
                     query_start_loc, num_seqs, logits_indices):
        model = self._model(weights)
        md = AttentionMetadata(positions, slot_mapping, block_tables, kv_lens, query_start_loc, num_seqs)
        hidden, kv = self._forward(model, kv, input_ids, md)
        logits = model.compute_logits(hidden[logits_indices], self.mesh)
        return kv, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def _decode_fn(self, weights, kv, tokens, starts, block_tables, num_real):
        """K-1 greedy one-token steps for rows ``< num_real`` (the others are padding)."""
        model = self._model(weights)
        rows = tokens.shape[0]
        real = jnp.arange(rows) < num_real[0]
        qsl = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(real.astype(jnp.int32))])
        out = []
        for j in range(self.k - 1):
            pos = starts + j
            page = jnp.take_along_axis(block_tables, (pos // self.block_size)[:, None], axis=1)[:, 0]
            slot = jnp.where(real, page * self.block_size + pos % self.block_size, -1)
            md = AttentionMetadata(jnp.where(real, pos, 0), slot, block_tables, jnp.where(real, pos + 1, 0),
                                   qsl, num_real)
            hidden, kv = self._forward(model, kv, tokens, md)
            tokens = jnp.argmax(model.compute_logits(hidden, self.mesh), axis=-1).astype(jnp.int32)
            out.append(tokens)
        return kv, jnp.stack(out, axis=1)

    def _catch_up_args(self, bucket: int) -> tuple:
        rows = min(bucket, self.max_num_seqs)
        z = np.zeros
        return (z(bucket, np.int32), z(bucket, np.int32), np.full(bucket, -1, np.int32),
                z((rows, self.max_blocks_per_seq), np.int32), z(rows, np.int32), z(rows + 1, np.int32),
                z(1, np.int32), z(rows, np.int32))

    def _decode_args(self, rows: int) -> tuple:
        return (np.zeros(rows, np.int32), np.zeros(rows, np.int32),
                np.zeros((rows, self.max_blocks_per_seq), np.int32), np.zeros(1, np.int32))

    def programs(self) -> list[tuple[str, int]]:
        """Every program warm-up compiles: (kind, size), a catch-up per token bucket and, with
        K > 1, a decode loop per row bucket."""
        return ([("catch_up", b) for b in self.token_buckets]
                + ([("decode", r) for r in self.row_buckets] if self.k > 1 else []))

    def lowered(self, kind: str, size: int) -> Any:
        """The program ``kind`` ("catch_up" or "decode") for ``size`` tokens or rows, lowered
        (compiles nothing)."""
        fn, args = ((self._catch_up, self._catch_up_args(size)) if kind == "catch_up"
                    else (self._decode, self._decode_args(size)))
        return fn.lower(self.weights, self.kv, *args)

    def _program(self, kind: str, size: int, warm: bool = False):
        key = (kind, size)
        if key not in self._compiled:
            if not warm:
                self.unexpected_compiles += 1
                logger.warning("draft model: compiling %s for %d after warm-up", kind, size)
            self._compiled[key] = self.lowered(kind, size).compile()
        return self._compiled[key]

    def warm_up(self) -> None:
        """Compile and run every program once on padding (no KV written: every slot is -1)."""
        for kind, size in self.programs():
            args = self._catch_up_args(size) if kind == "catch_up" else self._decode_args(size)
            self.kv, _ = self._program(kind, size, warm=True)(self.weights, self.kv, *args)
        jax.block_until_ready(self.kv)

    @property
    def num_programs(self) -> int:
        return len(self._compiled)

    # ---- proposing -----------------------------------------------------------------------------

    def propose(self, req_ids: Sequence[str], contexts: Sequence[np.ndarray]) -> list[list[int]]:
        """K greedy drafts for each request from its known tokens (prompt and outputs); [] for a
        request the draft's pool cannot hold now."""
        out: list[list[int]] = [[] for _ in req_ids]
        rows: list[int] = []
        for i, (r, ctx) in enumerate(zip(req_ids, contexts)):
            seq = self.seqs.setdefault(r, _DraftSeq())
            n = len(ctx)
            # Keep the KV of the fed drafts the target accepted (never the last token: its logits are needed).
            keep = 0
            for j, t in enumerate(seq.fed):
                p = seq.num_computed + j
                if p >= n - 1 or int(ctx[p]) != t:
                    break
                keep += 1
            seq.num_computed = min(seq.num_computed + keep, n - 1)
            seq.fed = []
            if self._reserve(seq, n + self.k - 1):
                rows.append(i)
        if not rows:
            return out
        first = self._run_catch_up([req_ids[i] for i in rows], [contexts[i] for i in rows])
        drafts = [[t] for t in first]
        if self.k > 1:
            rest = self._run_decode([req_ids[i] for i in rows], first, [len(contexts[i]) for i in rows])
            drafts = [[t, *more] for t, more in zip(first, rest)]
        for i, d in zip(rows, drafts):
            out[i] = d
            seq = self.seqs[req_ids[i]]
            seq.num_computed = len(contexts[i])
            seq.fed = d[:-1]
        return out

    def _tables(self, req_ids: Sequence[str], rows: int) -> np.ndarray:
        tables = np.zeros((rows, self.max_blocks_per_seq), np.int32)
        for i, r in enumerate(req_ids):
            b = self.seqs[r].blocks
            tables[i, :len(b)] = b
        return tables

    def _run_catch_up(self, req_ids: list[str], contexts: list[np.ndarray]) -> list[int]:
        """Feed each row's uncomputed tokens; the argmax at each row's last token."""
        done = [self.seqs[r].num_computed for r in req_ids]
        ends = [len(c) for c in contexts]
        first = [0] * len(req_ids)
        top = self.token_buckets[-1]
        while True:
            todo = [i for i in range(len(req_ids)) if done[i] < ends[i]]
            if not todo:
                return first
            # One pass: rows in order, each as much as the pass still holds.
            size = min(sum(ends[i] - done[i] for i in todo[:self.max_num_seqs]), top)
            if self.cut_padded_passes:
                size = pass_tokens(size, self.token_buckets)
            take: list[tuple[int, int]] = []
            left = size
            for i in todo:
                if left == 0 or len(take) == self.max_num_seqs:
                    break
                n = min(ends[i] - done[i], left)
                take.append((i, n))
                left -= n
            total = size - left
            bucket = next(b for b in self.token_buckets if b >= total and min(b, self.max_num_seqs) >= len(take))
            args = self._catch_up_args(bucket)
            ids, pos, slots, _, kv_lens, qsl, num_seqs, logits_idx = args
            tables = self._tables([req_ids[i] for i, _ in take], min(bucket, self.max_num_seqs))
            at = 0
            for row, (i, n) in enumerate(take):
                p = np.arange(done[i], done[i] + n)
                blocks = tables[row, p // self.block_size]
                ids[at:at + n] = contexts[i][p]
                pos[at:at + n] = p
                slots[at:at + n] = blocks * self.block_size + p % self.block_size
                at += n
                kv_lens[row] = done[i] + n
                qsl[row + 1:] = at
                logits_idx[row] = at - 1
            num_seqs[0] = len(take)
            self.kv, argmax = self._program("catch_up", bucket)(self.weights, self.kv, ids, pos, slots, tables,
                                                                kv_lens, qsl, num_seqs, logits_idx)
            self.num_passes += 1
            finished = [(row, i) for row, (i, n) in enumerate(take) if done[i] + n == ends[i]]
            if finished:
                values = np.asarray(argmax)
                for row, i in finished:
                    first[i] = int(values[row])
            for i, n in take:
                done[i] += n

    def _run_decode(self, req_ids: list[str], first: list[int], starts: list[int]) -> list[list[int]]:
        """Drafts 2..K of each row, one compiled loop per chunk of at most max_num_seqs rows."""
        out: list[list[int]] = []
        for lo in range(0, len(req_ids), self.max_num_seqs):
            chunk = req_ids[lo:lo + self.max_num_seqs]
            rows = next(b for b in self.row_buckets if b >= len(chunk))
            tokens, pos, _, num_real = self._decode_args(rows)
            tokens[:len(chunk)] = first[lo:lo + len(chunk)]
            pos[:len(chunk)] = starts[lo:lo + len(chunk)]
            num_real[0] = len(chunk)
            self.kv, drafts = self._program("decode", rows)(self.weights, self.kv, tokens, pos,
                                                            self._tables(chunk, rows), num_real)
            self.num_passes += 1
            out += np.asarray(drafts)[:len(chunk)].tolist()
        return out
