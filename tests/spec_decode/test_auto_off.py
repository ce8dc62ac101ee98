"""The auto-off rule against a simulated device whose step time is a + b * tokens."""

import random

import pytest

from jaxserve.spec_decode.auto_off import SpecAutoOff, expected_tokens


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def simulate(alpha, batch, k=4, steps=400, a=0.02, b=0.001, seed=0):
    """Tokens per second of the rule on a device of cost a + b*T with acceptance alpha, and the
    share of steps it speculated."""
    rng = random.Random(seed)
    rule = SpecAutoOff(k)
    tokens = seconds = 0.0
    spec_steps = 0
    for _ in range(steps):
        decision = rule.decide(batch)
        speculate, rows = decision.speculate, min(decision.rows or batch, batch)
        scheduled = batch + (rows * k if speculate else 0)
        t = a + b * scheduled
        rule.observe_step(scheduled, t)
        seconds += t
        if speculate:
            spec_steps += 1
            accepted = 0
            for _ in range(rows):
                n = 0
                while n < k and rng.random() < alpha:
                    n += 1
                accepted += n
            rule.observe_acceptance(rows * k, accepted)
            tokens += batch + accepted
        else:
            tokens += batch
    return tokens / seconds, spec_steps / steps


def plain(batch, a=0.02, b=0.001):
    return batch / (a + b * batch)


def test_on_at_batch_one_with_good_acceptance():
    rate, share = simulate(alpha=0.8, batch=1)
    assert share > 0.9 and rate > 2.0 * plain(1)


def test_off_at_high_concurrency_with_poor_acceptance_yet_probing():
    rate, share = simulate(alpha=0.3, batch=64)
    assert 0.0 < share < 0.05  # off, but still probing
    assert rate > 0.95 * plain(64)
    always_on = 64 * expected_tokens(0.3, 4) / (0.02 + 0.001 * 64 * 5)
    assert rate > always_on  # the rule beats speculating blindly


def test_switches_back_on_when_acceptance_recovers():
    rule = SpecAutoOff(4, probe_every=4)
    for _ in range(32):
        rule.observe_step(64, 0.02 + 0.001 * 64)
        rule.observe_step(320, 0.02 + 0.001 * 320)
        rule.observe_acceptance(256, 20)
    assert not rule.decide(64).speculate
    for _ in range(60):
        rule.observe_acceptance(256, 250)
    assert rule.decide(64).speculate


def test_decisions_name_their_reason():
    rule = SpecAutoOff(4, probe_every=3)
    rule.observe_step(8, 0.05)
    first = rule.decide(8)
    assert first.reason == "measure" and first.describe().startswith(("on (measure", "off (measure"))
    rule.observe_step(40, 0.09)
    reasons = [rule.decide(8).reason for _ in range(6)]
    assert reasons.count("probe") == 2 and reasons.count("gain") == 4


def test_measuring_and_probing_steps_speculate_on_a_few_rows():
    rule = SpecAutoOff(4, probe_every=5, probe_rows=3)
    first = rule.decide(64)  # nothing measured: the first step is plain, the next measures drafts
    assert (first.speculate, first.reason) == (False, "measure")
    rule.observe_step(64, 0.08)
    second = rule.decide(64)
    assert (second.speculate, second.reason, second.rows) == (True, "measure", 3)
    assert second.describe().endswith(", 3 rows)")
    rule.observe_step(76, 0.2)  # compute-bound: the model says off at 64 rows
    decisions = [rule.decide(64) for _ in range(10)]
    assert all(not d.speculate for d in decisions if d.reason == "gain")
    probes = [d for d in decisions if d.reason == "probe"]
    assert len(probes) == 2 and all(d.speculate and d.rows == 3 for d in probes)
    for _ in range(40):  # cheap steps and full acceptance: on, for every row
        rule.observe_step(64, 0.08)
        rule.observe_step(320, 0.081)
        rule.observe_acceptance(16, 16)
    on = rule.decide(64)
    assert on.reason == "gain" and on.speculate and on.rows == 0
