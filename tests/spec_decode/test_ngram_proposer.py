"""The n-gram proposer against a plain per-request loop, and the speculative config's checks."""

import random

import pytest

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.exceptions import ConfigError
from jaxserve.spec_decode import NgramProposer


def reference(ctx, k, lo, hi):
    """Longest n first, then the rightmost earlier occurrence; the up to k tokens after it."""
    for n in range(hi, lo - 1, -1):
        if len(ctx) <= n:
            continue
        suffix = ctx[-n:]
        for j in range(len(ctx) - n - 1, -1, -1):
            if ctx[j:j + n] == suffix:
                return ctx[j + n:j + n + k]
    return []


def test_examples():
    p = NgramProposer(3, 1, 3)
    assert p.propose([[1, 2, 3, 4, 1, 2, 3]]) == [[4, 1, 2]]           # n=3 match
    assert p.propose([[5, 1, 9, 9, 7, 1, 8, 1]]) == [[8, 1]]           # rightmost n=1: after the 2nd 1
    assert p.propose([[1, 2, 3]]) == [[]]                               # no match
    assert p.propose([[7, 7]]) == [[7]]                                 # only one token follows
    assert p.propose([]) == []
    assert NgramProposer(2, 2, 2).propose([[3, 4, 5, 4, 5]]) == [[4, 5]]  # the overlap is allowed


@pytest.mark.parametrize("seed", range(5))
def test_batch_matches_the_loop(seed):
    rng = random.Random(seed)
    k, lo = rng.randint(1, 5), rng.randint(1, 3)
    hi = lo + rng.randint(0, 3)
    ctxs = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(32)]
    assert NgramProposer(k, lo, hi).propose(ctxs) == [reference(c, k, lo, hi) for c in ctxs]


def test_speculative_config():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                  '"prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert cfg == SpeculativeConfig("ngram", 4, 3, 2)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_max": 4}) == \
        SpeculativeConfig("ngram", 2, 4, 4)
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    bad = [("{", "not valid JSON"), ('{"method": "eagle", "num_speculative_tokens": 2}', "eagle"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
           ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2}, "prompt_lookup_min=4"),
           ("[1]", "JSON object")]
    for value, words in bad:
        with pytest.raises(ConfigError, match=words):
            SpeculativeConfig.parse(value)
