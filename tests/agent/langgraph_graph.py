"""A LangGraph graph that tests run in a process of their own, kill with SIGKILL and resume.

    python -m tests.agent.langgraph_graph --database-url URL --gateway URL --thread T
        [--api sync|async] [--freeze-at N] [--durability sync|async|exit]
        [--resume-by thread|checkpoint-id] [--hold-checkpoint-of-step N] [--save-wait S]
        [--subgraph] [--join] [--note TEXT [--note TEXT] [--note-as NODE]] [--loops N]
        [--upstream-delay S] [--wait-for PATH]

The graph loops `LOOPS` times (`--loops N`: N) through `draft` then `send`; `send` POSTs an
email through the gateway with its task's key (`oncegate.agent.langgraph`), checkpointed by
LangGraph's `PostgresSaver` on the given database. Each `send` prints one JSON line: its
iteration, the task id, the task's namespace, the key, whether the gateway replayed the answer,
and how many reads (`get_tuple`, `list`) the checkpointer served while the email was sent (its
key's). A run with no checkpoint yet starts the thread; otherwise it resumes it:
`invoke(None, {thread})`, or with `--resume-by checkpoint-id` as many users do,
`invoke(None, graph.get_state(config).config)` (the thread's latest checkpoint by its id, which
LangGraph runs as a fork).

- `--freeze-at N`: after the N-th iteration's email was answered, print `{"event": "frozen"}`
  and wait for the SIGKILL: the kill lands between the action and LangGraph's write of the step.
- `--hold-checkpoint-of-step N`: the saver never finishes saving the checkpoint of step N, as if
  the kill came while that save was still on its way.
- `--clock`: the email's body holds the time it was drafted (in `send`): a resume sends another
  body with the same key, which the gateway refuses (`{"event": "reused", "key": ...}`, exit 1).
- `--mark-sent RECEIPT_JSON`: before resuming, record that answer as what `send` returned
  (`update_state(..., as_node="send")`), the way out of a body that changed.
- `--note TEXT`: before resuming, an operator's `update_state(config, {"note": TEXT})`, which
  the email does not read: the interrupted `send` is still to run after it. `--note-as NODE`:
  written as that node (`__input__`: as new input, which LangGraph saves as an input checkpoint
  and which, unlike `invoke(input)`, leaves `send` to run). Given twice, two updates, the second
  on the first.
- `--subgraph`: `send` is a subgraph whose one node, `email`, sends (the key then descends
  from the outer step's and the subgraph's checkpoints).
- `--join`: only the first iteration goes `draft -> send`; after each `send`, `x` (which counts
  the iteration) and `y` run side by side and their join starts `send` again: a node with two
  kinds of trigger (an edge, then a join it had never seen).
- `--upstream-delay S`: the upstream answers each email S seconds after performing it (the
  demo upstream's `X-Demo-Delay`, outside the request's fingerprint).
- `--wait-for PATH`: once connected, with the config to run, print `{"event": "ready"}` and
  wait until PATH exists before invoking the graph (processes started together run together).
- A `send` whose client refuses to make a key prints `{"event": "refused", "error": ...}` and
  waits for the SIGKILL (`--save-wait S`: how long the key waits for its step's checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import operator
import os
import sys
import time
from typing import Annotated, Any, NotRequired, TypedDict

import psycopg
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.runtime import get_runtime

from oncegate.agent.client import ActionKeyReused
from oncegate.agent.langgraph import AsyncGateway, Gateway, TaskKeyUnavailable

LOOPS = 3
READS = [0]  # the checkpointer's reads so far (`CountingSaver`)


class State(TypedDict):
    iteration: int
    receipts: Annotated[list[dict[str, Any]], operator.add]
    note: NotRequired[str]


class Inner(TypedDict):
    """`--subgraph`'s state: its `receipts` are what its one node returns (no reducer), which
    the outer graph adds to its own."""

    iteration: int
    receipts: list[dict[str, Any]]


def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)  # noqa: T201 - the test reads these lines


def freeze() -> None:
    report(event="frozen")
    while True:  # until the SIGKILL
        time.sleep(60)


def build(arguments: argparse.Namespace, gateway: Gateway | AsyncGateway) -> StateGraph[Any]:
    def draft(state: State) -> dict[str, Any]:
        return {"iteration": state["iteration"] + 1}

    def body(state: State) -> dict[str, Any]:
        drafted = {"to": "ana@example.com", "thread": arguments.thread, "n": state["iteration"]}
        if arguments.clock:  # drafted in the node that sends: another body on every run
            drafted["drafted_at"] = time.time_ns()
        return drafted

    def sent(state: State, response: Any, reads: int) -> dict[str, Any]:
        execution = get_runtime().execution_info
        assert execution is not None
        report(
            event="sent",
            iteration=state["iteration"],
            task_id=execution.task_id,
            checkpoint_ns=execution.checkpoint_ns,
            key=response.request.headers["Idempotency-Key"],
            replayed=response.headers.get("Idempotent-Replayed") == "true",
            reads=reads,
        )
        if state["iteration"] == arguments.freeze_at:
            freeze()
        return {"receipts": [response.json()]}

    def refused(state: State, error: TaskKeyUnavailable) -> dict[str, Any]:
        report(event="refused", iteration=state["iteration"], error=str(error))
        freeze()
        return {}

    def send(state: State) -> dict[str, Any]:
        assert isinstance(gateway, Gateway)
        before = READS[0]
        try:
            response = gateway.post("/emails", body(state), action="email", headers=delayed)
        except TaskKeyUnavailable as error:
            return refused(state, error)
        except ActionKeyReused as error:
            report(event="reused", iteration=state["iteration"], key=error.key)
            raise
        return sent(state, response, READS[0] - before)

    async def send_async(state: State) -> dict[str, Any]:
        assert isinstance(gateway, AsyncGateway)
        before = READS[0]
        try:
            response = await gateway.post("/emails", body(state), action="email", headers=delayed)
        except TaskKeyUnavailable as error:
            return refused(state, error)
        return sent(state, response, READS[0] - before)

    delayed = {"X-Demo-Delay": str(arguments.upstream_delay)} if arguments.upstream_delay else None

    def again(state: State) -> str | list[str]:
        if state["iteration"] >= arguments.loops:
            return END
        return ["x", "y"] if arguments.join else "draft"

    builder = StateGraph(State)
    builder.add_node("draft", draft)
    node = send if arguments.api == "sync" else send_async
    if arguments.subgraph:
        inner = StateGraph(Inner)
        # Unannotated, so the node reads the subgraph's state (`Inner`), not `State`.
        if arguments.api == "sync":
            inner.add_node("email", lambda state: send(state))
        else:

            async def email(state):  # type: ignore[no-untyped-def]  # read as `Inner`, see above
                return await send_async(state)

            inner.add_node("email", email)
        inner.add_edge(START, "email")
        inner.add_edge("email", END)
        builder.add_node("send", inner.compile())
    else:
        builder.add_node("send", node)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send")
    if arguments.join:
        builder.add_node("x", draft)
        builder.add_node("y", lambda state: {})
        builder.add_conditional_edges("send", again, ["x", "y", END])
        builder.add_edge(["x", "y"], "send")
    else:
        builder.add_conditional_edges("send", again)
    return builder


class CountingSaver(PostgresSaver):
    """Counts the checkpoints read (`READS`): each `get_tuple`, each `list`."""

    def get_tuple(self, config: Any) -> Any:
        READS[0] += 1
        return super().get_tuple(config)

    def list(self, config: Any, **kwargs: Any) -> Any:
        READS[0] += 1
        return super().list(config, **kwargs)


class UnlistedSaver(CountingSaver):
    """A saver that cannot list its checkpoints (LangGraph's base `list`, which raises
    NotImplementedError): the key's walk up a thread reads one checkpoint at a time."""

    list = BaseCheckpointSaver.list  # type: ignore[assignment]


class AsyncCountingSaver(AsyncPostgresSaver):
    """`CountingSaver` for the async API."""

    async def aget_tuple(self, config: Any) -> Any:
        READS[0] += 1
        return await super().aget_tuple(config)

    def alist(self, config: Any, **kwargs: Any) -> Any:
        READS[0] += 1
        return super().alist(config, **kwargs)


class HeldSaver(CountingSaver):
    """Never finishes saving the checkpoint of one step (the others are saved as usual)."""

    step: int

    def put(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        if metadata.get("step") == self.step:
            while True:  # the save "on its way" when the SIGKILL comes
                time.sleep(60)
        return super().put(config, checkpoint, metadata, new_versions)


class AsyncHeldSaver(AsyncCountingSaver):
    """`HeldSaver` for the async API."""

    step: int

    async def aput(self, config: Any, checkpoint: Any, metadata: Any, new_versions: Any) -> Any:
        if metadata.get("step") == self.step:
            await asyncio.Event().wait()  # never set: the save "on its way" when the kill comes
        return await super().aput(config, checkpoint, metadata, new_versions)


def ready(arguments: argparse.Namespace) -> None:
    """With `--wait-for`, say so and wait for the file."""
    if arguments.wait_for is None:
        return
    report(event="ready")
    while not os.path.exists(arguments.wait_for):
        time.sleep(0.01)


def run_sync(arguments: argparse.Namespace) -> None:
    config: Any = {"configurable": {"thread_id": arguments.thread}}
    with (
        psycopg.Connection.connect(
            arguments.database_url, autocommit=True, prepare_threshold=0
        ) as connection,
        Gateway(arguments.gateway, save_wait=arguments.save_wait) as gateway,
    ):
        saver: PostgresSaver
        if arguments.hold_checkpoint_of_step is not None:
            held = HeldSaver(connection)
            held.step = arguments.hold_checkpoint_of_step
            saver = held
        elif arguments.unlisted:
            saver = UnlistedSaver(connection)
        else:
            saver = CountingSaver(connection)
        saver.setup()
        graph = build(arguments, gateway).compile(checkpointer=saver)
        if arguments.mark_sent is not None:
            # The way out of a body that changed: the answer the first attempt got, recorded
            # as what `send` returned; the resume goes on after it.
            graph.update_state(
                config, {"receipts": [json.loads(arguments.mark_sent)]}, as_node="send"
            )
        for note in arguments.note:
            graph.update_state(config, {"note": note}, as_node=arguments.note_as)
        if saver.get_tuple(config) is None:
            start: Any = {"iteration": 0, "receipts": []}
        else:
            start = None
            if arguments.resume_by == "checkpoint-id":
                config = graph.get_state(config).config
        ready(arguments)
        final = graph.invoke(start, config, durability=arguments.durability)
    report(event="finished", receipts=len(final["receipts"]))


async def run_async(arguments: argparse.Namespace) -> None:
    config: Any = {"configurable": {"thread_id": arguments.thread}}
    async with (
        await psycopg.AsyncConnection.connect(
            arguments.database_url, autocommit=True, prepare_threshold=0
        ) as connection,
        AsyncGateway(arguments.gateway, save_wait=arguments.save_wait) as gateway,
    ):
        saver: AsyncPostgresSaver
        if arguments.hold_checkpoint_of_step is not None:
            held = AsyncHeldSaver(connection)
            held.step = arguments.hold_checkpoint_of_step
            saver = held
        else:
            saver = AsyncCountingSaver(connection)
        await saver.setup()
        graph = build(arguments, gateway).compile(checkpointer=saver)
        for note in arguments.note:
            await graph.aupdate_state(config, {"note": note}, as_node=arguments.note_as)
        if await saver.aget_tuple(config) is None:
            start: Any = {"iteration": 0, "receipts": []}
        else:
            start = None
            if arguments.resume_by == "checkpoint-id":
                config = (await graph.aget_state(config)).config
        ready(arguments)
        final = await graph.ainvoke(start, config, durability=arguments.durability)
    report(event="finished", receipts=len(final["receipts"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--thread", required=True)
    parser.add_argument("--api", choices=["sync", "async"], default="sync")
    parser.add_argument("--durability", choices=["sync", "async", "exit"], default="sync")
    parser.add_argument("--resume-by", choices=["thread", "checkpoint-id"], default="thread")
    parser.add_argument("--freeze-at", type=int)
    parser.add_argument("--hold-checkpoint-of-step", type=int)
    parser.add_argument("--save-wait", type=float, default=30.0)
    parser.add_argument("--clock", action="store_true")
    parser.add_argument("--mark-sent", metavar="RECEIPT_JSON")
    parser.add_argument("--note", action="append", default=[])
    parser.add_argument("--note-as")
    parser.add_argument("--subgraph", action="store_true")
    parser.add_argument("--join", action="store_true")
    parser.add_argument("--loops", type=int, default=LOOPS)
    parser.add_argument("--unlisted", action="store_true", help="a saver that cannot list (sync)")
    parser.add_argument("--upstream-delay", type=float)
    parser.add_argument("--wait-for")
    arguments = parser.parse_args()
    if arguments.api == "sync":
        run_sync(arguments)
    else:
        asyncio.run(run_async(arguments))


if __name__ == "__main__":
    sys.exit(main())
