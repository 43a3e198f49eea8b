"""A crash-safe agent in a page: copy it, change the steps.

Run the gateway and the demo upstream first (`make run` does both), then:

    ONCEGATE_DATABASE_URL=postgresql://... python examples/agent.py run-81

Kill it at any moment (Ctrl-C, `kill -9`) and run the same command again: it resumes at the
first unfinished step with the earlier outputs in hand, and an action that was sent just before
the crash is answered by the gateway from its store instead of being performed twice.

The database needs the schema (`oncegate migrate`): the checkpoints live in it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

import httpx

from oncegate.agent.checkpoints import JSON
from oncegate.agent.client import ActionClient
from oncegate.agent.runner import Action, Step, run_agent
from oncegate.store.checkpoints import PostgresCheckpoints

GATEWAY = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080")


def steps(customer: str) -> list[Step]:
    # Pure parts only: what to send is computed from earlier outputs, never from the clock or
    # a random number, so a resumed run computes (or reuses) exactly the same request.
    def draft(outputs: Sequence[JSON]) -> JSON:
        return {"to": customer, "subject": "Your refund", "body": "It is on its way."}

    def refund(outputs: Sequence[JSON]) -> JSON:
        return {"customer": customer, "amount_cents": -1250, "currency": "EUR"}

    return [
        Step("look-up", lambda outputs: {"customer": customer, "refund_cents": 1250}),
        Step("email", draft, Action("email", "/emails")),
        Step("refund", refund, Action("charge", "/charges")),
        Step("close", lambda outputs: {"closed": True}),
    ]


async def main(run_id: str) -> None:
    store = await PostgresCheckpoints.connect(os.environ["ONCEGATE_DATABASE_URL"])
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            # keys: f"{run_id}:step-2:email", ...; the gateway keeps them 24 h (its default
            # ttl): give `key_lifetime=KeyLifetime(ttl=...)` when its route says otherwise.
            client = ActionClient(http, GATEWAY)
            outputs = await run_agent(run_id, steps("ana@example.com"), store, client)
    finally:
        await store.close()
    for number, output in enumerate(outputs, start=1):
        print(f"step {number}: {output}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "run-81"))
