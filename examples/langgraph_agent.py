"""A LangGraph agent that survives `kill -9` without sending its email twice.

Run the gateway and the demo upstream first (`make run` does both), then, in the checkout:

    .venv/bin/python examples/langgraph_agent.py case-81

It drafts an email, sends it through the gateway, and pauses (`PAUSE`, 5 s) before LangGraph
saves that step: kill it then (`kill -9`, Ctrl-C) and run the same command again. LangGraph
resumes thread case-81 from its last checkpoint and runs the killed node again; the node sends the
email again with the same key, and the gateway answers from its store ("replayed"): one email.

What oncegate asks of a LangGraph user is the two lines marked 1 and 2 below: a `Gateway`, and its
`post` in the node (the key comes from the task LangGraph runs). The run is invoked with
`durability="sync"`, which saves each step before it starts; LangGraph's default, `"async"`, works
too (the key then waits for the step's save before sending). docs/agents.md is the reference.

Needs the extra `oncegate[langgraph]` (`make` installs it). The checkpoints are LangGraph's own
`PostgresSaver` in the gateway's database: `ONCEGATE_DATABASE_URL` when it is set, otherwise the
embedded PostgreSQL that `oncegate serve` uses by default (`ONCEGATE_DATA_DIR`), joined while the
gateway runs. `GATEWAY_URL` says where the gateway is (default http://127.0.0.1:8080).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, TypedDict

import psycopg
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph

from oncegate import settings
from oncegate.agent.langgraph import Gateway
from oncegate.store import embedded

GATEWAY = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8080")
PAUSE = float(os.environ.get("PAUSE", "5"))

gateway = Gateway(GATEWAY)  # 1. the gateway, once


class Case(TypedDict, total=False):
    customer: str
    email: dict[str, Any]
    receipt: dict[str, Any]
    closed: bool


def draft(case: Case) -> Case:
    # Computed from the state only (no clock, no random number): a resumed run drafts the same
    # email, so its resend is the same request and the gateway replays the first answer.
    return {"email": {"to": case["customer"], "subject": "Your refund", "body": "On its way."}}


def send_email(case: Case) -> Case:
    response = gateway.post("/emails", case["email"], action="email")  # 2. the task's key
    replayed = response.headers.get("Idempotent-Replayed") == "true"
    print(f"email: {response.status_code}{' replayed' if replayed else ''}", flush=True)
    if PAUSE:
        print(f"pausing {PAUSE:g} s before LangGraph saves this step: kill me now", flush=True)
        time.sleep(PAUSE)
    return {"receipt": response.json()}


def close(case: Case) -> Case:
    return {"closed": True}


@contextlib.contextmanager
def gateway_database() -> Iterator[str]:
    """The URL of the gateway's database (see above)."""
    where = settings.load_part(settings.DatabaseSettings)
    if where.database_url:
        yield where.database_url
        return
    server = embedded.start(where.data_dir)
    try:
        yield server.url
    finally:
        server.stop()


def main(thread_id: str) -> None:
    builder = StateGraph(Case)
    builder.add_node("draft", draft)
    builder.add_node("send_email", send_email)
    builder.add_node("close", close)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send_email")
    builder.add_edge("send_email", "close")
    builder.add_edge("close", END)
    config: Any = {"configurable": {"thread_id": thread_id}}
    with (
        gateway_database() as url,
        psycopg.Connection.connect(url, autocommit=True, prepare_threshold=0) as connection,
    ):
        checkpointer = PostgresSaver(connection)
        checkpointer.setup()
        graph = builder.compile(checkpointer=checkpointer)
        # A thread with a checkpoint is resumed where it stopped; a new one starts.
        start = None if checkpointer.get_tuple(config) else {"customer": "ana@example.com"}
        final = graph.invoke(start, config, durability="sync")
    gateway.close()
    print(f"closed: {final['closed']}; receipt: {final['receipt']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "case-81")
