"""The lab's agent task: a 12-step support case, three of whose steps act on the world.

Steps 4, 7 and 10 send an email, open a ticket and charge a card; the others are pure
computations on the earlier outputs (they stand for an LLM call or a look-up: work that can be
redone without harm, but costs time). Each action's body carries the run id and the step, so
the lab can count, from the demo upstream's own records, what was really performed.

What a step costs is invented, as the write-up's costs are: the steps here compute in
microseconds, so the lab counts what a real agent would have paid, in tokens of an LLM and in
seconds, from `COSTS` (docs/lab.md shows the arithmetic of the expectation they give).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..agent.checkpoints import JSON
from ..agent.runner import Action, Step

STEPS = 12
ACTION_STEPS = {4: "email", 7: "ticket", 10: "charge"}


@dataclass(frozen=True, slots=True)
class Cost:
    tokens: int
    seconds: float


# Invented per-step costs (by step number): reading and diagnosing cost the most tokens, an
# action's step only drafts a short request, and seconds follow tokens except for the action's
# round trip. Chosen so the model's expectation lands near the write-up's figures (A 14,300 / B
# and C 1,188 wasted tokens, A 18.3 s): A 14,352 / 1,194 tokens, 18.26 s (docs/lab.md).
COSTS = {
    1: Cost(2900, 3.8),  # read-case: the whole thread
    2: Cost(2200, 3.0),  # look-up-customer
    3: Cost(2400, 3.2),  # draft-reply
    4: Cost(1800, 1.8),  # send-email
    5: Cost(3400, 4.6),  # read-logs: the longest input
    6: Cost(2600, 3.4),  # diagnose
    7: Cost(1600, 1.6),  # open-ticket
    8: Cost(2200, 2.8),  # compute-refund
    9: Cost(1800, 2.4),  # approve-refund
    10: Cost(1600, 1.8),  # charge-card
    11: Cost(3200, 3.8),  # summarise: the whole case again
    12: Cost(2200, 2.4),  # close-case
}
# What one checkpoint save costs, the write-up's figure (a round trip to a remote database that
# flushes to disk; the lab's own, on loopback with no flush, takes a millisecond or two).
CHECKPOINT_SAVE_SECONDS = 0.040


def _digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]


def support_task(run_id: str) -> list[Step]:
    """The 12 steps of run `run_id` (same names for every run: one task)."""

    def think(name: str) -> Callable[[Sequence[JSON]], JSON]:
        def compute(outputs: Sequence[JSON]) -> JSON:
            return {"step": name, "digest": _digest(run_id, name, outputs[-1] if outputs else None)}

        return compute

    def email(outputs: Sequence[JSON]) -> JSON:
        return {"run": run_id, "step": 4, "to": "customer@example.com",
                "subject": f"About your case {_digest(run_id, outputs[0])}"}  # fmt: skip

    def ticket(outputs: Sequence[JSON]) -> JSON:
        return {"run": run_id, "step": 7, "queue": "billing", "summary": _digest(outputs[5])}

    def charge(outputs: Sequence[JSON]) -> JSON:
        amount = 500 + int(_digest(run_id, outputs[8]), 16) % 5000
        return {"run": run_id, "step": 10, "amount_cents": amount, "currency": "EUR"}

    return [
        Step("read-case", think("read-case")),
        Step("look-up-customer", think("look-up-customer")),
        Step("draft-reply", think("draft-reply")),
        Step("send-email", email, Action("email", "/emails")),
        Step("read-logs", think("read-logs")),
        Step("diagnose", think("diagnose")),
        Step("open-ticket", ticket, Action("ticket", "/tickets")),
        Step("compute-refund", think("compute-refund")),
        Step("approve-refund", think("approve-refund")),
        Step("charge-card", charge, Action("charge", "/charges")),
        Step("summarise", think("summarise")),
        Step("close-case", think("close-case")),
    ]
