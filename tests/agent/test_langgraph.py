"""Keys for LangGraph tasks, on real graphs: LangGraph's `PostgresSaver` on the test PostgreSQL,
the real gateway in front of the demo upstream, and real SIGKILLs of the process running the
graph (tests/agent/langgraph_graph.py).

What LangGraph keeps stable across a resume of the same task (oncegate.agent.langgraph's
docstring says why): the thread id and the task's namespace, whose task id is made from the
checkpoint the step started from. These tests kill a graph between an action and LangGraph's
write of its step and resume it in a new process: same task id, same key, performed once. They
also kill one whose previous step's checkpoint was still being saved (`durability="async"`): the
resumed task has another id, which is why `task_key` insists on `durability="sync"`.
"""

from __future__ import annotations

import json
import operator
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TypedDict

import httpx
import psycopg
import pytest
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, interrupt

from oncegate.agent import keys
from oncegate.agent.client import ActionKeyReused, ActionOutcomeUnknown
from oncegate.agent.langgraph import DURABILITY_KEY, Gateway, TaskKeyUnavailable, task_key
from tests.e2e.conftest import DemoUpstream, GatewayProcess

ROOT = Path(__file__).parents[2]
LOOPS = 3  # tests/agent/langgraph_graph.py


class GraphProcess:
    """`python -m tests.agent.langgraph_graph`, read line by line."""

    def __init__(self, database_url: str, gateway: GatewayProcess, thread: str, *args: str):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "tests.agent.langgraph_graph", "--database-url",
             database_url, "--gateway", gateway.url, "--thread", thread, *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def events(self) -> Iterator[dict[str, Any]]:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            yield json.loads(line)

    def until(self, event: str) -> list[dict[str, Any]]:
        """Every event up to and with `event`; then the process is frozen, waiting for a kill."""
        seen = []
        for item in self.events():
            seen.append(item)
            if item["event"] == event:
                return seen
        raise AssertionError(f"ended before {event!r}: {seen}, {self.stderr()}")

    def kill(self) -> None:
        os.kill(self.popen.pid, signal.SIGKILL)
        assert self.popen.wait(10) == -signal.SIGKILL

    def finish(self) -> list[dict[str, Any]]:
        seen = list(self.events())
        assert self.popen.wait(60) == 0, self.stderr()
        assert seen[-1] == {"event": "finished", "receipts": LOOPS}
        return seen

    def stderr(self) -> str:
        assert self.popen.stderr is not None
        return self.popen.stderr.read()

    def close(self) -> None:
        if self.popen.poll() is None:
            self.kill()
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def processes() -> Iterator[list[GraphProcess]]:
    started: list[GraphProcess] = []
    try:
        yield started
    finally:
        for process in started:
            process.close()


def sent(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in events if item["event"] == "sent"]


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_task_killed_after_its_action_resumes_with_the_same_key_and_is_performed_once(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    api: str,
) -> None:
    thread = f"case-{uuid.uuid4()}"
    first = GraphProcess(database_url, gateway, thread, "--api", api, "--freeze-at", "2")
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()  # between the second email's answer and LangGraph's write of that step
    second = GraphProcess(database_url, gateway, thread, "--api", api)
    processes.append(second)
    after = sent(second.finish())

    assert [item["iteration"] for item in before] == [1, 2]
    # The resumed process ran the killed task again: same task id, same key, and the gateway
    # answered with the first attempt's answer.
    assert [item["iteration"] for item in after] == [2, 3]
    killed, resumed = before[1], after[0]
    assert resumed["task_id"] == killed["task_id"]
    assert resumed["key"] == killed["key"]
    assert resumed["key"] == f"{thread}:send:{killed['task_id']}:email"
    assert resumed["replayed"] and not killed["replayed"]
    # Every iteration its own key (a loop), each email performed exactly once.
    all_keys = [item["key"] for item in before] + [after[1]["key"]]
    assert len(set(all_keys)) == LOOPS
    for key in all_keys:
        assert len(upstream.actions(key)) == 1, key


def test_another_thread_gets_other_keys_for_the_same_work(
    database_url: str, gateway: GatewayProcess, processes: list[GraphProcess]
) -> None:
    runs = []
    for thread in (f"case-{uuid.uuid4()}", f"case-{uuid.uuid4()}"):
        process = GraphProcess(database_url, gateway, thread)
        processes.append(process)
        runs.append([item["key"] for item in sent(process.finish())])
    assert len(runs[0]) == len(runs[1]) == LOOPS
    assert not set(runs[0]) & set(runs[1])


def test_a_task_whose_steps_checkpoint_was_lost_in_an_async_run_gets_another_id(
    database_url: str, gateway: GatewayProcess, processes: list[GraphProcess]
) -> None:
    """Why `task_key` wants `durability="sync"`: with LangGraph's default, `"async"`, a step's
    checkpoint is still being saved while the next step acts. Killed then, the resumed run
    rebuilds that checkpoint under a new id, and the task that acted gets a new id: a new key."""
    thread = f"case-{uuid.uuid4()}"
    options = ("--durability", "async", "--observe")
    first = GraphProcess(database_url, gateway, thread, *options, "--hold-checkpoint-of-step", "1")
    processes.append(first)
    [held] = [item for item in first.until("frozen") if item["event"] == "observed"]
    first.kill()
    second = GraphProcess(database_url, gateway, thread, *options)
    processes.append(second)
    [resumed] = [item for item in second.until("frozen") if item["event"] == "observed"]
    assert held["iteration"] == resumed["iteration"] == 1
    assert resumed["task_id"] != held["task_id"]
    assert resumed["key"] != held["key"]


# --- in this process: what task_key refuses, fan-out, the client's errors -----------------------


class Loop(TypedDict):
    iteration: int
    keys: Annotated[list[str], operator.add]


def saver(database_url: str) -> Iterator[PostgresSaver]:
    with psycopg.Connection.connect(database_url, autocommit=True, prepare_threshold=0) as db:
        checkpointer = PostgresSaver(db)
        checkpointer.setup()
        yield checkpointer


@pytest.fixture
def checkpointer(database_url: str) -> Iterator[PostgresSaver]:
    yield from saver(database_url)


def one_node(node: Any, checkpointer: PostgresSaver | None) -> Any:
    builder = StateGraph(Loop)
    builder.add_node("act", node)
    builder.add_edge(START, "act")
    builder.add_edge("act", END)
    return builder.compile(checkpointer=checkpointer)


def thread() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"case-{uuid.uuid4()}"}}


def test_task_key_refuses_a_run_whose_keys_a_resume_would_not_find_again(
    checkpointer: PostgresSaver,
) -> None:
    def act(state: Loop) -> dict[str, Any]:
        return {"keys": [task_key("email")]}

    start = {"iteration": 0, "keys": []}
    with pytest.raises(TaskKeyUnavailable, match="durability is 'async'"):
        one_node(act, checkpointer).invoke(start, thread())  # LangGraph's default
    with pytest.raises(TaskKeyUnavailable, match="durability is 'exit'"):
        one_node(act, checkpointer).invoke(start, thread(), durability="exit")
    with pytest.raises(TaskKeyUnavailable, match="without a checkpointer"):
        one_node(act, None).invoke(start)
    with pytest.raises(TaskKeyUnavailable, match="inside a LangGraph node"):
        task_key("email")
    # Where LangGraph keeps the durability (not public): this fails loudly when it moves.
    seen = one_node(act, checkpointer).invoke(start, thread(), durability="sync")
    assert len(seen["keys"]) == 1
    assert DURABILITY_KEY == "__pregel_durability"


def test_tasks_sent_to_one_node_in_one_step_each_get_their_own_key(
    checkpointer: PostgresSaver,
) -> None:
    def fan_out(state: Loop) -> list[Send]:
        return [Send("act", {"iteration": number, "keys": []}) for number in range(4)]

    def act(state: Loop) -> dict[str, Any]:
        return {"keys": [task_key("email")]}

    builder = StateGraph(Loop)
    builder.add_node("act", act)
    builder.add_conditional_edges(START, fan_out, ["act"])
    builder.add_edge("act", END)
    graph = builder.compile(checkpointer=checkpointer)
    config = thread()
    final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
    assert len(final["keys"]) == len(set(final["keys"])) == 4
    for key in final["keys"]:
        assert key.startswith(config["configurable"]["thread_id"] + ":act:")


def test_the_sync_client_raises_the_agent_librarys_errors(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    answers: list[httpx.Response] = []

    def reused(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            answers.append(client.post("/emails", {"n": 1}, action="email"))
            client.post("/emails", {"n": 2}, action="email")  # same task, same action
        return {}

    with pytest.raises(ActionKeyReused) as reuse:
        one_node(reused, checkpointer).invoke({"iteration": 0, "keys": []}, thread(),
                                              durability="sync")  # fmt: skip
    [first] = answers
    assert first.status_code == 201
    assert reuse.value.key == first.request.headers["Idempotency-Key"]
    assert first.request.headers["Prefer"] == "wait=10"
    assert len(upstream.actions(reuse.value.key)) == 1

    def slow(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:  # the route's timeout is 1 s
            client.post("/emails?delay=3", {"n": 1}, action="email")
        return {}

    with pytest.raises(ActionOutcomeUnknown) as unknown:
        one_node(slow, checkpointer).invoke({"iteration": 0, "keys": []}, thread(),
                                            durability="sync")  # fmt: skip
    assert unknown.value.response is not None and unknown.value.response.status_code == 504
    assert unknown.value.key is not None and unknown.value.key.endswith(":email")


# --- the key itself (pure) ----------------------------------------------------------------------


def test_the_key_names_the_thread_the_task_and_the_action() -> None:
    task = "1f0c3b2a-0d4e-6f70-8a9b-0c1d2e3f4a5b"
    assert keys.task_key("case-81", f"send:{task}", "email") == f"case-81:send:{task}:email"
    nested = f"review:{task}|send:{task}"
    assert keys.task_key("case-81", nested, "email") == f"case-81:{nested}:email"


def test_characters_a_header_or_the_layout_cannot_carry_are_percent_encoded() -> None:
    key = keys.task_key("ana's case: 1,2 %", "send mail:abc", "email")
    assert key == "ana's%20case%3A%201%2C2%20%25:send%20mail:abc:email"
    assert keys.task_key("ü", "n:t", "email") == "%C3%BC:n:t:email"
    # Two threads that differ only by what is encoded keep apart.
    assert keys.task_key("a:b", "n:t", "email") != keys.task_key("a", "b:n:t", "email")


def test_a_key_too_long_for_the_gateway_becomes_a_digest_of_the_same_parts() -> None:
    long_thread = "t" * 300
    key = keys.task_key(long_thread, "send:abc", "email")
    assert key.startswith("sha256-") and key.endswith(":email") and len(key) <= 255
    assert key == keys.task_key(long_thread, "send:abc", "email")
    assert key != keys.task_key(long_thread, "send:abd", "email")


@pytest.mark.parametrize(
    ("thread_id", "namespace", "action", "message"),
    [
        ("", "send:abc", "email", "thread id"),
        ("case", "", "email", "namespace"),
        ("case", "send", "email", "not a task's namespace"),
        ("case", "send:abc", "Send Email", "action"),
    ],
)
def test_what_is_not_a_task_is_refused(
    thread_id: str, namespace: str, action: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        keys.task_key(thread_id, namespace, action)


def test_a_node_resumed_after_an_interrupt_resends_its_action_with_the_same_key(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """Human in the loop: a node that sent an email, then asked for approval (`interrupt`), runs
    again from its start when resumed, as the same task: its email is replayed, not sent again."""
    answers: list[httpx.Response] = []

    def act(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            answers.append(client.post("/emails", {"n": 1}, action="email"))
        approved = interrupt("send the refund?")
        return {"keys": [answers[-1].request.headers["Idempotency-Key"], approved]}

    graph = one_node(act, checkpointer)
    config = thread()
    paused = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
    assert "__interrupt__" in paused
    final = graph.invoke(Command(resume="yes"), config, durability="sync")
    first, resumed = answers
    key = first.request.headers["Idempotency-Key"]
    assert resumed.request.headers["Idempotency-Key"] == key
    assert resumed.headers["Idempotent-Replayed"] == "true"
    assert final["keys"] == [key, "yes"]
    assert len(upstream.actions(key)) == 1


def test_functional_api_tasks_get_keys_of_their_own_under_their_entrypoint(
    checkpointer: PostgresSaver,
) -> None:
    @task
    def send(number: int) -> str:
        return task_key("email")

    @entrypoint(checkpointer=checkpointer)
    def flow(count: int) -> list[str]:
        return [send(number).result() for number in range(count)] + [task_key("flow")]

    config = thread()
    found = flow.invoke(2, config, durability="sync")
    first, second, outer = found
    assert len(set(found)) == 3
    prefix = outer.removesuffix(":flow")
    assert prefix.startswith(config["configurable"]["thread_id"] + ":flow:")
    assert first.startswith(prefix + "|send:") and second.startswith(prefix + "|send:")
