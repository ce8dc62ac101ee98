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


def test_small_decode_buckets_below_16_up_to_max_num_seqs_and_deferred():
    table = BucketTable.build(max_num_batched_tokens=256, max_num_seqs=64, min_decode_tokens=1)
    assert table.small_decode == (1, 2, 4, 8) and table.midpoints == (24, 48)
    assert table.token_buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256)
    assert table.deferred == (1, 2, 4, 8, 24, 48)
    assert [table.pick(n) for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    # while they compile, steps pad to 16 as before
    assert [table.pick(n, pending=table.deferred) for n in (1, 3, 9)] == [16, 16, 16]
    assert table.num_rows(1) == 1 and table.num_rows(4) == 4
    # never above max_num_seqs (no decode step has more rows), never from 16 up
    assert BucketTable.build(256, max_num_seqs=3, min_decode_tokens=1).small_decode == (1, 2)
    assert BucketTable.build(256, max_num_seqs=64, min_decode_tokens=4).small_decode == (4, 8)
    assert BucketTable.build(256, max_num_seqs=64, min_decode_tokens=16).small_decode == ()
    assert BucketTable.build(256, max_num_seqs=64).token_buckets[0] == 16



def test_small_decode_buckets_hold_k_plus_one_tokens_a_request_when_speculating():
    # K=4 drafts: one stream's decode step has up to 5 tokens, so it gets its own 5 bucket (not 8
    # or 16); a step where the budget or the room cut the drafts takes the powers of two.
    one = BucketTable.build(256, max_num_seqs=1, min_decode_tokens=1, decode_tokens_per_seq=5)
    assert one.small_decode == (1, 2, 4, 5, 8) and one.pick(5) == 5 and one.pick(3) == 4
    assert one.deferred[:len(one.small_decode)] == one.small_decode
    assert BucketTable.build(256, max_num_seqs=1, min_decode_tokens=1).small_decode == (1,)
    assert BucketTable.build(256, max_num_seqs=2, min_decode_tokens=1, decode_tokens_per_seq=3).small_decode == \
        (1, 2, 3, 4, 6, 8)
    assert BucketTable.build(256, max_num_seqs=64, min_decode_tokens=1, decode_tokens_per_seq=5).small_decode == \
        (1, 2, 4, 5, 8, 10)
    # K+1 a power of two adds nothing; nothing reaches min_tokens
    assert BucketTable.build(256, max_num_seqs=64, min_decode_tokens=1, decode_tokens_per_seq=4).small_decode == \
        (1, 2, 4, 8)
    assert BucketTable.build(256, max_num_seqs=64, min_decode_tokens=16, decode_tokens_per_seq=5).small_decode == ()
