"""The lab's invented costs put the model's expectation near the write-up's figures (A 14,300 /
B and C 1,188 wasted tokens, restarting 18.3 s), and the expectation is the arithmetic that
docs/lab.md shows."""

from __future__ import annotations

import pytest

from oncegate.lab.model import GAP_SHARE, STRATEGIES, expectation
from oncegate.lab.task import COSTS, STEPS


def test_the_models_expectation_lands_within_one_percent_of_the_write_up() -> None:
    a_tokens, a_seconds = expectation(STRATEGIES["A"])
    assert a_tokens == pytest.approx(14_300, rel=0.01)
    assert a_seconds == pytest.approx(18.3, rel=0.01)
    for name in "BCE":
        tokens, _ = expectation(STRATEGIES[name])
        assert tokens == pytest.approx(1_188, rel=0.01)


def test_the_expectation_is_the_arithmetic_of_the_docs() -> None:
    # docs/lab.md: a checkpointed run loses half its crashed step, or all of it when the crash
    # falls in the gap (15% of the crashes on the three action steps)...
    partial = sum(cost.tokens for cost in COSTS.values()) / 2
    gap = GAP_SHARE * sum(COSTS[step].tokens for step in (4, 7, 10)) / 2
    assert expectation(STRATEGIES["B"])[0] == pytest.approx((partial + gap) / STEPS)
    assert round(expectation(STRATEGIES["B"])[0]) == 1_194
    # ...and a restart also redoes every step before the crashed one: step i, 12 - i times.
    before = sum(COSTS[step].tokens * (STEPS - step) for step in COSTS)
    assert before == 157_900
    assert expectation(STRATEGIES["A"])[0] == pytest.approx((before + partial + gap) / STEPS)
    assert round(expectation(STRATEGIES["A"])[0]) == 14_352
    # D saves before acting: a crash in the gap finishes its step and redoes nothing; nor does
    # F, whose gap crashes stop for reconciliation and have their step marked done.
    assert expectation(STRATEGIES["D"])[0] == pytest.approx((partial - gap) / STEPS)
    assert expectation(STRATEGIES["F"]) == expectation(STRATEGIES["D"])
