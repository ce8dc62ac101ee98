import os
import subprocess
import sys

from jaxserve.core import kv_cache_utils
from jaxserve.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens, hash_request_tokens
from tests.core.core_testing import make_request


def test_chain_depends_on_parent():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(hash_block_tokens(None, [9, 9]), [1, 2])
    assert a != b and len(a) == 32
    assert hash_block_tokens(None, [1, 2]) == a
    assert hash_block_tokens(None, [1, 2], ("x",)) != a
    # Encoding is unambiguous: token boundaries and extra keys cannot be confused.
    assert hash_block_tokens(None, [12]) != hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))


def test_seed_determinism_and_change():
    kv_cache_utils.set_seed(123)
    a = hash_block_tokens(None, [1, 2, 3])
    kv_cache_utils.set_seed(123)
    assert hash_block_tokens(None, [1, 2, 3]) == a
    kv_cache_utils.set_seed(124)
    assert hash_block_tokens(None, [1, 2, 3]) != a


def test_env_seed_is_deterministic_across_processes():
    code = ("from jaxserve.core.kv_cache_utils import hash_block_tokens;"
            "print(hash_block_tokens(None,[1,2]).hex())")
    env = dict(os.environ, JAXSERVE_HASH_SEED="42")
    outs = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout for _ in range(2)}
    assert len(outs) == 1
    env.pop("JAXSERVE_HASH_SEED")
    rnd = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout for _ in range(2)}
    assert len(rnd) == 2  # random root per process without a seed


def test_extra_keys():
    r = make_request(list(range(8)), lora_name="adapter", cache_salt="tenant")
    first = generate_block_hash_extra_keys(r, 0, 4)
    later = generate_block_hash_extra_keys(r, 4, 8)
    assert ("salt", "tenant") in first and ("lora", "adapter") in first
    assert later == (("lora", "adapter"),)
    assert generate_block_hash_extra_keys(make_request([1]), 0, 1) is None


def test_cache_salt_isolates_via_first_block_only():
    tokens = list(range(12))
    plain = hash_request_tokens(4, make_request(tokens))
    s1 = hash_request_tokens(4, make_request(tokens, cache_salt="a"))
    s2 = hash_request_tokens(4, make_request(tokens, cache_salt="b"))
    assert all(x != y for x, y in zip(plain, s1)) and all(x != y for x, y in zip(s1, s2))
    # The salt enters the first block only: later blocks differ purely through the chain.
    salted = make_request(tokens, cache_salt="a")
    assert hash_block_tokens(s1[0], tokens[4:8],
                             generate_block_hash_extra_keys(salted, 4, 8)) == s1[1]
    assert hash_block_tokens(s1[0], tokens[4:8], None) == s1[1]


def test_lora_affects_every_block():
    tokens = list(range(8))
    base = hash_request_tokens(4, make_request(tokens))
    lora = make_request(tokens, lora_name="x")
    h = hash_request_tokens(4, lora)
    assert all(a != b for a, b in zip(base, h))
    # Even with the same parent, block 2 differs by the LoRA key.
    assert hash_block_tokens(base[0], tokens[4:8], None) == base[1]
    assert hash_block_tokens(base[0], tokens[4:8],
                             generate_block_hash_extra_keys(lora, 4, 8)) != base[1]
