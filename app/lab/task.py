"""The lab's agent task: a 12-step support case, three of whose steps act on the world.

Steps 4, 7 and 10 send an email, open a ticket and charge a card; the others are pure
computations on the earlier outputs (they stand for an LLM call or a look-up: work that can be
redone without harm, but costs time). Each action's body carries the run id and the step, so
the lab can count, from the demo upstream's own records, what was really performed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

from ..agent.checkpoints import JSON
from ..agent.runner import Action, Step

STEPS = 12
ACTION_STEPS = {4: "email", 7: "ticket", 10: "charge"}


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
