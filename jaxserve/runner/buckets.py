"""The one table of padded step shapes, shared by warm-up and runtime (our CUDA graphs).

A step's token count ``T`` is padded up to a bucket: powers of two from ``min_tokens`` up to
``max_num_batched_tokens`` (which is always a bucket itself). The request dimension is derived,
not a second axis: every scheduled request advances at least one token, so a step of ``T`` tokens
holds at most ``min(T, max_num_seqs)`` requests. One axis keeps the number of compiled variants
to about ``log2(max_num_batched_tokens)``.

Decode steps (``T <= max_num_seqs``: one token per running request) also get the midpoints
``1.5 * 2^k``. As requests finish, the running count drifts through every value; with powers of
two alone a batch of 33 pays for 64 rows. The midpoints bound that padding at 33% instead of 50%,
for two or three more variants (``docs/benchmarks.md`` has the figures).
"""

from __future__ import annotations

import bisect
import dataclasses


@dataclasses.dataclass(frozen=True)
class BucketTable:
    token_buckets: tuple[int, ...]
    max_num_seqs: int

    @classmethod
    def build(cls, max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16) -> "BucketTable":
        buckets, t = [], min_tokens
        while t < max_num_batched_tokens:
            buckets.append(t)
            if t * 3 // 2 <= min(max_num_seqs, max_num_batched_tokens - 1):
                buckets.append(t * 3 // 2)
            t *= 2
        buckets.append(max_num_batched_tokens)
        return cls(tuple(sorted(set(buckets))), max_num_seqs)

    def num_rows(self, num_tokens_bucket: int) -> int:
        return min(num_tokens_bucket, self.max_num_seqs)

    def pick(self, num_tokens: int) -> int:
        """The smallest bucket holding ``num_tokens``."""
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        if i == len(self.token_buckets):
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket {self.token_buckets[-1]}")
        return self.token_buckets[i]
