"""A crash-safe agent in a page, without a framework: copy it, change the steps.

Run the gateway and the demo upstream first (`make run` does both), then, in the checkout:

    .venv/bin/python examples/agent.py run-81

Kill it at any moment (Ctrl-C, `kill -9`) and run the same command again: it resumes at the
first unfinished step with the earlier outputs in hand, and an action that was sent just before
the crash is answered by the gateway from its store instead of being performed twice.

The keys come from what the run saved before acting, in the two ways a plain Python agent has:
- a step's number (`run-81:step-2:email`, `action_key`) for the steps' own actions;
- a tool call's id (`run-81:call_team:email`, `tool_call_key`) for the actions a model asks for:
  the model's message, with its tool calls and their ids, is a step's output, saved before any
  call is acted on, so a resumed run reads the same ids (a real model would draw new ones).

The checkpoints live in the gateway's database: `ONCEGATE_DATABASE_URL` when it is set (migrated
with `oncegate migrate`), otherwise the same embedded PostgreSQL that `oncegate serve` uses by
default (`ONCEGATE_DATA_DIR`), joined while the gateway runs. `GATEWAY_URL` says where the gateway
is (default http://127.0.0.1:8080).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence

import httpx

from oncegate.agent.checkpoints import JSON
from oncegate.agent.client import ActionClient
from oncegate.agent.keys import tool_call_key
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

    def model(outputs: Sequence[JSON]) -> JSON:
        # Stands for a chat model's answer: a message asking for two tool calls.
        notes = [("call_team", "team@example.com"), ("call_manager", "manager@example.com")]
        return {
            "role": "assistant",
            "tool_calls": [
                {"id": call_id, "name": "send_email",
                 "args": {"to": to, "subject": f"Refund for {customer}"}}
                for call_id, to in notes
            ],
        }  # fmt: skip

    return [
        Step("look-up", lambda outputs: {"customer": customer, "refund_cents": 1250}),
        Step("email", draft, Action("email", "/emails")),
        Step("refund", refund, Action("charge", "/charges")),
        Step("model", model),
    ]


async def act_on_tool_calls(run_id: str, message: JSON, client: ActionClient) -> list[JSON]:
    """Each tool call of the saved message, sent with a key from its id: run again after a
    crash, the calls already sent are answered from the gateway's store."""
    assert isinstance(message, dict) and isinstance(message["tool_calls"], list)
    answers: list[JSON] = []
    for call in message["tool_calls"]:
        assert isinstance(call, dict) and isinstance(call["id"], str)
        key = tool_call_key(run_id, call["id"], "email")
        response = await client.send("/emails", call["args"], key)
        answers.append({"tool_call": call["id"], "receipt": response.json()["id"]})
    return answers


async def main(run_id: str) -> None:
    store = await PostgresCheckpoints.connect()  # the gateway's database (see above)
    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            # keys: f"{run_id}:step-2:email", ...; the gateway keeps them 24 h (its default
            # ttl): give `key_lifetime=KeyLifetime(ttl=...)` when its route says otherwise.
            client = ActionClient(http, GATEWAY)
            outputs = await run_agent(run_id, steps("ana@example.com"), store, client)
            answers = await act_on_tool_calls(run_id, outputs[-1], client)
    finally:
        await store.close()
    for number, output in enumerate(outputs, start=1):
        print(f"step {number}: {output}")
    for answer in answers:
        print(f"tool call: {answer}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "run-81"))
