"""The bucket table: token buckets, decode midpoints and the pick among those compiled."""

import pytest

from jaxserve.runner.buckets import BucketTable


def test_bucket_table_powers_of_two_up_to_budget():
    table = BucketTable.build(max_num_batched_tokens=200, max_num_seqs=24)
    assert table.token_buckets == (16, 24, 32, 64, 128, 200)  # 24 = 1.5 * 16 is a decode midpoint
    assert [table.pick(n) for n in (1, 16, 17, 25, 129, 200)] == [16, 16, 24, 32, 200, 200]
    assert table.num_rows(16) == 16 and table.num_rows(128) == 24
    with pytest.raises(ValueError, match="201 tokens exceed the largest bucket 200"):
        table.pick(201)


def test_bucket_table_midpoints_only_below_max_num_seqs():
    table = BucketTable.build(max_num_batched_tokens=1024, max_num_seqs=64)
    assert table.token_buckets == (16, 24, 32, 48, 64, 128, 256, 512, 1024)
    assert [table.pick(n) for n in (17, 25, 33, 49)] == [24, 32, 48, 64]
    # a budget below a midpoint never produces a bucket past the budget
    assert BucketTable.build(max_num_batched_tokens=20, max_num_seqs=64).token_buckets == (16, 20)


def test_pick_skips_midpoints_still_compiling():
    table = BucketTable.build(max_num_batched_tokens=1024, max_num_seqs=64)
    assert table.midpoints == (24, 48)
    assert [table.pick(n, pending={24, 48}) for n in (17, 25, 33, 49)] == [32, 32, 64, 64]
    assert [table.pick(n, pending={48}) for n in (17, 33)] == [24, 64]
