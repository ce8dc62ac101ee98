"""The one table of padded step shapes, shared by warm-up and runtime (our CUDA graphs).

A step's token count ``T`` is padded up to a bucket: powers of two from ``min_tokens`` up to
``max_num_batched_tokens`` (which is always a bucket itself). The request dimension is derived,
not a second axis: every scheduled request advances at least one token, so a step of ``T`` tokens
holds at most ``min(T, max_num_seqs)`` requests. One axis keeps the number of compiled variants
to about ``log2(max_num_batched_tokens)``.

Decode steps (``T <= max_num_seqs``: one token per running request) also get the midpoints
``1.5 * 2^k``. As requests finish, the running count drifts through every value; with powers of
two alone a batch of 33 pays for 64 rows. The midpoints bound that padding at 33% instead of 50%,
for two or three more variants (``docs/benchmarks.md`` has the figures). They only save padding, so
the engine becomes ready without them and compiles them in the background.

Below ``min_tokens``, decode steps of a few requests may get their own buckets, the powers of two
from ``min_decode_tokens`` (``small_decode``): on a CPU a padded row costs its whole matmul, so one
stream in a 16-row bucket does 16 rows of work for one token. With speculative decoding a decode
step holds up to K+1 tokens a request, and the small buckets reach that far. Like the midpoints they only save
padding and are compiled in the background (``deferred``). A speculating step also gets the
multiples ``(K+1) * 2^j`` below ``min_tokens``: one stream verifying K=4 drafts runs 5 rows, not 8.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Collection


@dataclasses.dataclass(frozen=True)
class BucketTable:
    token_buckets: tuple[int, ...]
    max_num_seqs: int
    midpoints: tuple[int, ...] = ()  # the decode midpoints among token_buckets
    small_decode: tuple[int, ...] = ()  # the decode buckets below min_tokens among token_buckets

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16,
              min_decode_tokens: int | None = None, decode_tokens_per_seq: int = 1) -> BucketTable:
        # A decode step holds one token per request, or with K speculative drafts up to K+1: then
        # the small buckets reach the power of two above max_num_seqs * (K+1).
        reach = max_num_seqs
        if decode_tokens_per_seq > 1:
            reach = 1 << (max_num_seqs * decode_tokens_per_seq - 1).bit_length()
        small, t = [], min_decode_tokens or min_tokens
        while t < min(min_tokens, max_num_batched_tokens) and t <= reach:
            small.append(t)
            t *= 2
        if decode_tokens_per_seq > 1 and small:
            # A speculating decode step of r requests holds r * (K+1) tokens when every draft is
            # scheduled: those sizes get their own buckets too (vLLM sizes its CUDA graphs so).
            t = decode_tokens_per_seq
            while t < min(min_tokens, max_num_batched_tokens) and t <= reach:
                small.append(t)
                t *= 2
            small = sorted(set(small))
        buckets, midpoints, t = list(small), [], min_tokens
        while t < max_num_batched_tokens:
            buckets.append(t)
            if t * 3 // 2 <= min(max_num_seqs, max_num_batched_tokens - 1):
                midpoints.append(t * 3 // 2)
            t *= 2
        buckets.append(max_num_batched_tokens)
        return cls(tuple(sorted(set(buckets + midpoints))), max_num_seqs, tuple(midpoints), tuple(small))

    @property
    def deferred(self) -> tuple[int, ...]:
        """The buckets that only save padding: compiled after the engine is ready."""
        return self.small_decode + self.midpoints

    def num_rows(self, num_tokens_bucket: int) -> int:
        return self.rows_of(num_tokens_bucket, self.max_num_seqs)

    @staticmethod
    def rows_of(num_tokens_bucket: int, max_num_seqs: int) -> int:
        """Every scheduled request advances at least one token: at most that many rows."""
        return min(num_tokens_bucket, max_num_seqs)

    def pick(self, num_tokens: int, pending: Collection[int] = ()) -> int:
        """The smallest bucket holding ``num_tokens``, skipping the ``pending`` ones (deferred
        buckets not compiled yet; never all of them, so a bucket is always found)."""
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.token_buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.token_buckets[-1]}")
        while self.token_buckets[i] in pending:
            i += 1
        return self.token_buckets[i]
