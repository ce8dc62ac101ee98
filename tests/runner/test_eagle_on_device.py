"""The EAGLE head proposing from a step's device outputs (``EagleProposer.propose_on_device``,
what the runner runs after each step when it overlaps speculating steps) against
``EagleProposer.propose`` run on the true tokens after the same step: the same drafts for the
same rows, the same head KV written, the same bookkeeping once the tokens are known
(``settle_on_device``), and no compile after its warm-up.

The head is a real engine's (a near pass-through EAGLE-1 head on the random tiny target); the
step is built by hand (tests/runner/test_head_catch_up.py's rows: verifying rows with random
acceptance, a prompt's last chunk, a chunk that does not sample, a row whose request left, a
blind row, a plain decode), its hidden states random, the head's pool filled with random KV so
that every row attends over something."""

import jax
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.runner.input_batch import PersistentBatch, build_step_arrays, write_drafts
from tests.eagle_checks import write_near_pass_through_head
from tests.head_step_rows import step_row
from tests.shapes import ENGINE_TESTS_SHAPE

K = 3
SLOTS = 8
BUCKET = 64


@pytest.fixture(scope="module")
def head(demo_model, tmp_path_factory):
    folder = write_near_pass_through_head(tmp_path_factory.mktemp("head") / "eagle", demo_model)
    llm = LLM(demo_model, show_progress=False, **ENGINE_TESTS_SHAPE,
              speculative_config={"method": "eagle", "model": folder, "num_speculative_tokens": K})
    head = llm.llm_engine.core.runner.eagle
    head.on_device = True
    head.warm_up(jax.numpy.dtype(llm.llm_engine.core.runner.mc.dtype))
    return head


def scenario(rng):
    def toks(n):
        return [int(t) for t in rng.integers(1, 1000, n)]

    return [  # kind: verify (d drafts, a accepted), final (last prompt chunk), chunk (does not sample)
        dict(id="v", slot=2, known=toks(40), prompt=30, kind="verify", d=K, a=int(rng.integers(0, K))),
        dict(id="f", slot=0, known=toks(21), prompt=21, kind="final", start=5),
        dict(id="c", slot=4, known=toks(30), prompt=30, kind="chunk", start=16, n=7),
        dict(id="dead", slot=5, known=toks(25), prompt=20, kind="verify", d=2, a=int(rng.integers(0, 3)),
             live=False),
        dict(id="blind", slot=1, known=toks(18), prompt=15, kind="verify", d=K, a=1, blind=True),
        dict(id="p", slot=3, known=toks(33), prompt=33, kind="verify", d=0, a=0),  # a plain decode
        dict(id="all", slot=6, known=toks(19), prompt=10, kind="verify", d=K, a=K),
    ]


def build_step(rng, head):
    """The step's host inputs, and per row what propose and propose_on_device are given."""
    reqs = scenario(rng)
    bs, rows = head.block_size, head.step_rows[BUCKET]
    batch = PersistentBatch(SLOTS, head.table_width * bs, head.table_width)
    free = [int(b) for b in rng.permutation(np.arange(1, head.num_blocks))]
    starts, counts, drafts, contexts, samples, next_known = [], [], [], [], [], []
    emitted = np.full((rows, K + 1), -1, np.int32)
    for i, q in enumerate(reqs):
        known = q["known"]
        start, n, d, ctx, out, nxt = step_row(q, rng)
        emitted[i, :len(out)] = out
        blocks = [free.pop() for _ in range(-(-(start + n + K) // bs))]  # with the drafts' lookahead
        batch.add_request(q["slot"], known[:q["prompt"]], known[q["prompt"]:], (blocks,))
        starts.append(start)
        counts.append(n)
        drafts.append(d)
        contexts.append(np.asarray(ctx, np.int32))
        samples.append(q["kind"] != "chunk")
        next_known.append(nxt)
    slots = [q["slot"] for q in reqs]
    write_drafts(batch, slots, drafts)
    step, _ = build_step_arrays(batch, slots, starts, counts, [-1] * len(reqs), BUCKET, rows, bs, SLOTS,
                                [len(d) for d in drafts])
    return dict(reqs=reqs, step=step, starts=starts, counts=counts, num_drafts=[len(d) for d in drafts],
                contexts=contexts, samples=samples, next_known=next_known, emitted=emitted,
                live=[q.get("live", True) for q in reqs], ids=[q["id"] for q in reqs],
                blind={q["id"] for q in reqs if q.get("blind")})


def random_pool(rng, kv):
    return jax.tree.map(lambda a: jax.device_put(rng.standard_normal(a.shape).astype(a.dtype), a.sharding), kv)


@pytest.mark.parametrize("seed", range(3))
def test_device_proposal_is_the_hosts(head, seed):
    rng = np.random.default_rng(seed)
    s = build_step(rng, head)
    hidden = jax.numpy.asarray(rng.standard_normal((BUCKET, head.cfg.target_hidden_width)),
                               head.tables.embedding.dtype)
    pool = jax.tree.map(np.asarray, random_pool(rng, head.kv))
    place = lambda: jax.tree.map(lambda a, like: jax.device_put(a, like.sharding), pool, head.kv)  # noqa: E731
    compiles = head.unexpected_compiles

    head.kv, head.num_computed, head.blind = place(), {}, set(s["blind"])
    want = head.propose(s["ids"], s["contexts"], s["samples"], s["step"], hidden, s["live"])
    want_kv, want_computed, want_blind = jax.tree.map(np.asarray, head.kv), head.num_computed, head.blind

    head.kv, head.num_computed, head.blind = place(), {}, set(s["blind"])
    drafts, proposing = head.propose_on_device(s["ids"], s["samples"], s["next_known"], s["step"], hidden,
                                               jax.device_put(s["emitted"]), s["num_drafts"], s["live"])
    drafts, proposing = np.asarray(drafts), np.asarray(proposing)
    head.settle_on_device(s["ids"], s["contexts"], s["starts"], s["counts"], s["live"])

    got = [drafts[i].tolist() if proposing[i] else [] for i in range(len(s["ids"]))]
    assert got == want
    assert [bool(d) for d in want] == [True, True, False, False, False, True, True]
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, head.kv)), jax.tree.leaves(want_kv)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert head.num_computed == want_computed and head.blind == want_blind
    assert head.unexpected_compiles == compiles
    head.num_computed, head.blind = {}, set()
