"""How a draft model's catch-up is cut into passes (``draft_runner.pass_tokens``): a pass runs
whole when its bucket pads it little or is small, else it takes the largest bucket it fills."""

from __future__ import annotations

import pytest

from jaxserve.runner.draft_runner import SPLIT_FROM_TOKENS, _pow2_buckets, pass_tokens

BUCKETS = _pow2_buckets(512)


def passes(want: int) -> list[int]:
    out = []
    while want:
        out.append(pass_tokens(want, BUCKETS))
        want -= out[-1]
    return out


@pytest.mark.parametrize("want, expected", [
    (131, [128, 3]),  # not one 256-token pass, nearly half padding
    (2, [2]), (3, [3]), (SPLIT_FROM_TOKENS - 1, [SPLIT_FROM_TOKENS - 1]),  # small: one pass
    (110, [110]), (512, [512]),  # bucket 128 pads 110 by at most a quarter
    (96, [64, 32]), (100, [64, 32, 4]),  # a 128-token bucket would pad them by more
    (90, [64, 26]),  # 26 in a 32-token bucket is within a quarter
    (300, [256, 32, 12]),
])
def test_passes(want, expected):
    assert passes(want) == expected


def test_every_pass_pads_at_most_a_quarter_or_fits_a_small_bucket():
    for want in range(1, 513):
        for size in passes(want):
            fit = next(b for b in BUCKETS if b >= size)
            assert fit <= SPLIT_FROM_TOKENS or 4 * (fit - size) <= size, (want, size)
