"""The draft model's catch-up after a verifying step, from the step's device outputs
(``jaxserve.runner.draft_catch_up``), against the host's: ``DraftModelProposer.propose`` on the
true tokens, its two compiled stages replaced by recorders of what they are fed."""

import jax
import numpy as np
import pytest

from jaxserve.runner.draft_catch_up import draft_catch_up
from jaxserve.runner.draft_runner import DraftModelProposer


class Recorded:
    """The host proposer's bookkeeping, its programs recorded: per request, the positions and
    tokens the catch-up fed and where the decode loop started; drafts drawn from ``rng``."""

    def __init__(self, k, rng):
        self.head = head = object.__new__(DraftModelProposer)
        head.k, head.block_size, head.seqs, head._free = k, 4, {}, list(range(4000, 0, -1))
        self.fed: dict[str, tuple[list[int], list[int]]] = {}
        self.decode_start: dict[str, int] = {}

        def catch_up(req_ids, contexts):
            for r, ctx in zip(req_ids, contexts):
                done = head.seqs[r].num_computed
                self.fed[r] = (list(range(done, len(ctx))), [int(t) for t in ctx[done:]])
            return [int(t) for t in rng.integers(1, 1000, len(req_ids))]

        def decode(req_ids, first, starts):
            self.decode_start.update(zip(req_ids, starts))
            return rng.integers(1, 1000, (len(req_ids), k - 1)).tolist()

        head._run_catch_up, head._run_decode = catch_up, decode

    def propose(self, req_ids, contexts):
        return self.head.propose(req_ids, [np.asarray(c, np.int32) for c in contexts])


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_device_catch_up_is_the_hosts(seed, k):
    rng = np.random.default_rng(seed)
    host = Recorded(k, rng)
    num = 2 * k + 4
    req_ids = [f"r{i}" for i in range(num)]
    contexts = [[int(t) for t in rng.integers(1, 1000, int(rng.integers(3, 20)))] for _ in req_ids]
    proposed = host.propose(req_ids, contexts)  # after each request's first token (a prefill)
    starts = np.asarray([len(c) - 1 for c in contexts], np.int32)
    emitted = np.full((num, k + 1), -1, np.int32)
    num_emitted = np.zeros(num, np.int32)
    for i, drafts in enumerate(proposed):
        verified = drafts[:k - i % 2] if k > 1 else drafts  # some rows verify fewer (trimmed)
        accepted = i % (len(verified) + 1)  # every count, all accepted included
        bonus = int(rng.integers(1, 1000))
        while accepted < len(verified) and bonus == verified[accepted]:
            bonus = int(rng.integers(1, 1000))
        out = verified[:accepted] + [bonus]
        emitted[i, :len(out)], num_emitted[i] = out, len(out)
        contexts[i] = contexts[i] + out
    host.propose(req_ids, contexts)
    ids, positions, real, decode_start = jax.jit(draft_catch_up, static_argnums=3)(starts, emitted, num_emitted, k)
    ids, positions, real = np.asarray(ids), np.asarray(positions), np.asarray(real)
    for i, r in enumerate(req_ids):
        want_positions, want_ids = host.fed[r]
        assert positions[i][real[i]].tolist() == want_positions, r
        assert ids[i][real[i]].tolist() == want_ids, r
        if k > 1:
            assert int(decode_start[i]) == host.decode_start[r]
    counts = real.sum(axis=1)
    assert counts.min() == 1 and counts.max() == 2  # one token a row, two after all K were accepted
