"""Keys for LangGraph tasks, on real graphs: LangGraph's `PostgresSaver` on the test PostgreSQL,
the real gateway in front of the demo upstream, and real SIGKILLs of the process running the
graph (tests/agent/langgraph_graph.py).

What LangGraph keeps stable across a resume of the same task (oncegate.agent.langgraph_keys'
docstring says why): the thread id and the task's namespace, whose task id is made from the
checkpoint the step started from. These tests kill a graph between an action and LangGraph's
write of its step and resume it in a new process: same task id, same key, performed once. They
also kill one whose previous step's checkpoint was still being saved (`durability="async"`): the
resumed task has another id, which is why `task_key` insists on `durability="sync"`.
"""

from __future__ import annotations

import inspect
import json
import operator
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NotRequired, TypedDict

import httpx
import psycopg
import pytest
from langgraph._internal import _constants as constants
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.func import entrypoint, task
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, Send, StateSnapshot, interrupt
from langgraph.types import RetryPolicy as NodeRetryPolicy

from oncegate.agent import keys
from oncegate.agent.client import ActionKeyReused, ActionOutcomeUnknown, ActionRejected
from oncegate.agent.langgraph import (
    INTERNALS,
    WALK_BATCH,
    ActionNameReused,
    Gateway,
    TaskKeyUnavailable,
    retry_on,
    task_key,
)
from tests.agent.conftest import GraphProcess
from tests.e2e.conftest import DemoUpstream, GatewayProcess

LOOPS = 3  # tests/agent/langgraph_graph.py


def sent(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in events if item["event"] == "sent"]


@pytest.mark.parametrize(
    ("api", "durability", "resume_by"),
    [
        ("sync", "sync", "thread"),
        ("async", "sync", "thread"),
        ("sync", "sync", "checkpoint-id"),
        ("async", "sync", "checkpoint-id"),
        ("sync", "async", "thread"),
        ("async", "async", "checkpoint-id"),
    ],
)
def test_a_task_killed_after_its_action_resumes_with_the_same_key_and_is_performed_once(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    api: str,
    durability: str,
    resume_by: str,
) -> None:
    """Killed between the second email's answer and LangGraph's write of that step, then resumed
    in a new process by thread id, or by the latest checkpoint's id (`invoke(None,
    graph.get_state(config).config)`), which LangGraph runs as a fork with new task ids."""
    thread = f"case-{uuid.uuid4()}"
    options = ("--api", api, "--durability", durability)
    first = GraphProcess(database_url, gateway, thread, *options, "--freeze-at", "2")
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()
    second = GraphProcess(database_url, gateway, thread, *options, "--resume-by", resume_by)
    processes.append(second)
    after = sent(second.finish(LOOPS))

    assert [item["iteration"] for item in before] == [1, 2]
    # The resumed process ran the killed task again, with the same key, and the gateway
    # answered with the first attempt's answer.
    assert [item["iteration"] for item in after] == [2, 3]
    killed, resumed = before[1], after[0]
    assert resumed["key"] == killed["key"]
    assert resumed["key"].startswith(f"{thread}:send:") and resumed["key"].endswith(":email")
    assert resumed["replayed"] and not killed["replayed"]
    # By thread id LangGraph runs the same task again; by checkpoint id, a fork's new task:
    # the key does not follow LangGraph's task id.
    same_task = resumed["task_id"] == killed["task_id"]
    assert same_task == (resume_by == "thread")
    # Every iteration its own key (a loop), each email performed exactly once.
    all_keys = [item["key"] for item in before] + [after[1]["key"]]
    assert len(set(all_keys)) == LOOPS
    for key in all_keys:
        assert len(upstream.actions(key)) == 1, key
    assert len(thread_emails(upstream, thread)) == LOOPS


@pytest.mark.parametrize(("api", "resume_by"), [("sync", "thread"), ("async", "checkpoint-id")])
def test_two_processes_resuming_one_thread_at_once_perform_each_email_once(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    tmp_path: Path,
    api: str,
    resume_by: str,
) -> None:
    """Killed after the second email's answer; then two processes resume the thread at the same
    time (two workers picking up one job), the upstream answering each email 0.5 s after
    performing it. Both make the same keys; the gateway performs each once and has the other
    wait for its answer (`Prefer: wait`) or replays it."""
    thread = f"case-{uuid.uuid4()}"
    options = ("--api", api, "--durability", "sync", "--upstream-delay", "0.5")
    first = GraphProcess(database_url, gateway, thread, *options, "--freeze-at", "2")
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()
    go = tmp_path / "go"
    together = ("--resume-by", resume_by, "--wait-for", str(go))
    resumers = [GraphProcess(database_url, gateway, thread, *options, *together) for _ in "ab"]
    processes.extend(resumers)
    for resumer in resumers:
        resumer.until("ready")  # each has read the thread's latest checkpoint
    go.touch()
    afters = [sent(resumer.finish(LOOPS)) for resumer in resumers]

    # By thread id, a process that reads the thread after the other saved the second email's
    # step goes on from there; the third email is on its way for 0.5 s, and both send it.
    for after in afters:
        assert [item["iteration"] for item in after] in ([2, 3], [3])
        if len(after) == 2:
            assert after[0]["key"] == before[1]["key"] and after[0]["replayed"]
    assert afters[0][-1]["key"] == afters[1][-1]["key"]
    # The third email: one process performed it, the other was answered from the store.
    assert sorted(after[-1]["replayed"] for after in afters) == [False, True]
    assert len(thread_emails(upstream, thread)) == LOOPS


def thread_emails(upstream: DemoUpstream, thread: str) -> list[dict[str, Any]]:
    return [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(f"{thread}:")]


def test_another_thread_gets_other_keys_for_the_same_work(
    database_url: str, gateway: GatewayProcess, processes: list[GraphProcess]
) -> None:
    runs = []
    for thread in (f"case-{uuid.uuid4()}", f"case-{uuid.uuid4()}"):
        process = GraphProcess(database_url, gateway, thread)
        processes.append(process)
        runs.append([item["key"] for item in sent(process.finish(LOOPS))])
    assert len(runs[0]) == len(runs[1]) == LOOPS
    assert not set(runs[0]) & set(runs[1])


@pytest.mark.parametrize("api", ["sync", "async"])
def test_under_async_durability_nothing_is_sent_before_the_steps_checkpoint_is_saved(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    api: str,
) -> None:
    """With LangGraph's default, `"async"`, a step's checkpoint is saved while the step runs: a
    task that acted before that save could be given another id (and key) by a resume that had
    to rebuild it. The key waits for the save; here it never lands, and nothing is sent."""
    thread = f"case-{uuid.uuid4()}"
    options = ("--api", api, "--durability", "async")
    held = ("--hold-checkpoint-of-step", "1", "--save-wait", "1")
    first = GraphProcess(database_url, gateway, thread, *options, *held)
    processes.append(first)
    [refused] = [item for item in first.until("frozen") if item["event"] == "refused"]
    first.kill()
    assert refused["iteration"] == 1
    assert "was not saved within 1 s ('async' durability)" in refused["error"]
    assert thread_emails(upstream, thread) == []
    second = GraphProcess(database_url, gateway, thread, *options)
    processes.append(second)
    assert len(sent(second.finish(LOOPS))) == LOOPS
    emails = thread_emails(upstream, thread)
    assert len(emails) == len({email["idempotency_key"] for email in emails}) == LOOPS


def test_a_body_drafted_in_the_sending_node_is_refused_on_resume_and_marked_sent_goes_on(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
) -> None:
    """Killed after its email, a node that drafts with the clock sends another body on resume:
    the gateway refuses it (422), nothing sent twice, the thread stuck. The way out: the
    upstream's answer recorded as the node's output (`update_state(..., as_node="send")`)."""
    thread = f"case-{uuid.uuid4()}"
    first = GraphProcess(database_url, gateway, thread, "--clock", "--freeze-at", "2")
    processes.append(first)
    killed = sent(first.until("frozen"))[-1]
    first.kill()
    stuck = GraphProcess(database_url, gateway, thread, "--clock")
    processes.append(stuck)
    [reused] = [item for item in stuck.events() if item["event"] == "reused"]
    assert stuck.popen.wait(60) != 0 and "ActionKeyReused" in stuck.stderr()
    assert reused["key"] == killed["key"]
    [performed] = upstream.actions(killed["key"])  # the upstream's records: performed once
    receipt = json.dumps({key: value for key, value in performed.items() if key != "request"})
    way_out = GraphProcess(database_url, gateway, thread, "--clock", "--mark-sent", receipt)
    processes.append(way_out)
    after = sent(way_out.finish(LOOPS))
    assert [item["iteration"] for item in after] == [3]
    emails = thread_emails(upstream, thread)
    assert len(emails) == len({email["idempotency_key"] for email in emails}) == LOOPS


@pytest.mark.parametrize(
    ("api", "resume_by", "subgraph", "note_as"),
    [
        ("sync", "thread", False, None),
        ("async", "checkpoint-id", False, None),
        ("sync", "thread", True, None),
        ("async", "thread", True, None),
        ("sync", "thread", False, "__input__"),
        ("async", "checkpoint-id", False, "__input__"),
        ("sync", "checkpoint-id", True, "__input__"),
        ("async", "thread", True, "__input__"),
    ],
)
def test_an_update_between_the_kill_and_the_resume_keeps_the_interrupted_tasks_key(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    api: str,
    resume_by: str,
    subgraph: bool,
    note_as: str | None,
) -> None:
    """Killed after the second email, then an operator's `update_state` that leaves `send` to
    run (a note the email does not read) before the resume: the task it still had to run is
    the one killed, so it sends the key the killed one sent, answered from the gateway's store.
    With `send` a subgraph, the update restarts the subgraph under new task ids: the same. So
    does a note written as new input (`as_node="__input__"`, saved as an input checkpoint):
    unlike `invoke(input)`, it leaves `send` to run, beside the graph's start."""
    thread = f"case-{uuid.uuid4()}"
    shape = ("--api", api, *(("--subgraph",) if subgraph else ()))
    first = GraphProcess(database_url, gateway, thread, *shape, "--freeze-at", "2")
    processes.append(first)
    killed = sent(first.until("frozen"))[-1]
    first.kill()
    noted = ("--note", "called the customer", *(("--note-as", note_as) if note_as else ()))
    second = GraphProcess(database_url, gateway, thread, *shape, *noted, "--resume-by", resume_by)
    processes.append(second)
    after = sent(second.finish(LOOPS))
    assert [item["iteration"] for item in after] == [2, 3]
    assert after[0]["key"] == killed["key"] and after[0]["replayed"]
    emails = thread_emails(upstream, thread)
    assert len(emails) == len({email["idempotency_key"] for email in emails}) == LOOPS


@pytest.mark.parametrize(("api", "resume_by"), [("sync", "thread"), ("async", "checkpoint-id")])
def test_two_updates_after_a_kill_in_a_subgraph_a_join_started_keep_its_key(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    api: str,
    resume_by: str,
) -> None:
    """`send`, a subgraph, ran first after `draft` (an edge), then after the join of `x` and `y`
    (a trigger it had never seen), and was killed there after its email. Two operator's notes
    (the second on the first, written as `x`) leave it to run: the email keeps its key, answered
    from the gateway's store, whether the node's seen channels say it was still to run or not."""
    thread = f"case-{uuid.uuid4()}"
    shape = ("--api", api, "--subgraph", "--join")
    first = GraphProcess(database_url, gateway, thread, *shape, "--freeze-at", "2")
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()
    notes = ("--note", "called the customer", "--note", "and again", "--note-as", "x")
    second = GraphProcess(database_url, gateway, thread, *shape, *notes, "--resume-by", resume_by)
    processes.append(second)
    after = sent(second.finish(LOOPS))

    assert [item["iteration"] for item in before] == [1, 2]
    assert [item["iteration"] for item in after] == [2, 3]
    assert after[0]["key"] == before[1]["key"] and after[0]["replayed"]
    emails = thread_emails(upstream, thread)
    assert sorted(email["request"]["n"] for email in emails) == [1, 2, 3]


@pytest.mark.parametrize(("api", "subgraph"), [("sync", False), ("async", False), ("sync", True)])
def test_a_new_process_reads_a_long_threads_steps_in_batches(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    api: str,
    subgraph: bool,
) -> None:
    """A key descends from every checkpoint back to the thread's last new input. A process
    that ran the steps before reads the step's own checkpoint and the one before it (`draft`'s,
    whose lineage no key asked for); a new one, resuming after a kill at step 300, walks back
    through all of them: from the third on, `WALK_BATCH` a query (`list`), not a `get_tuple`
    each (REVIEW7 R3: 301 reads here before). Counted on the real saver."""
    loops = 150
    thread = f"case-{uuid.uuid4()}"
    shape = ("--api", api, "--loops", str(loops), *(("--subgraph",) if subgraph else ()))
    first = GraphProcess(database_url, gateway, thread, *shape, "--freeze-at", str(loops))
    processes.append(first)
    warm = sent(first.until("frozen"))
    first.kill()
    second = GraphProcess(database_url, gateway, thread, *shape)
    processes.append(second)
    [resumed] = sent(second.finish(loops))
    assert resumed["key"] == warm[-1]["key"] and resumed["replayed"]
    # Inside the subgraph, two more: its step's own checkpoint and its first one.
    inner = 2 if subgraph else 0
    assert max(item["reads"] for item in warm[1:]) == 2 + inner
    steps = 2 * loops + 1  # the checkpoints before the step's own, the input's included
    assert resumed["reads"] <= 2 + -(-steps // WALK_BATCH) + inner


def test_a_saver_that_cannot_list_is_walked_one_checkpoint_at_a_time(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
) -> None:
    """A saver with LangGraph's base `list` (it raises NotImplementedError: only `get_tuple`
    and `put` kept): a new process resuming after a kill walks back one `get_tuple` a step
    instead of in batches, and the email keeps its key, performed once."""
    loops = 20
    thread = f"case-{uuid.uuid4()}"
    shape = ("--unlisted", "--loops", str(loops))
    first = GraphProcess(database_url, gateway, thread, *shape, "--freeze-at", str(loops))
    processes.append(first)
    warm = sent(first.until("frozen"))
    first.kill()
    second = GraphProcess(database_url, gateway, thread, *shape)
    processes.append(second)
    [resumed] = sent(second.finish(loops))
    assert resumed["key"] == warm[-1]["key"] and resumed["replayed"]
    assert resumed["reads"] > 2 * loops  # each checkpoint back to the input, one at a time
    emails = thread_emails(upstream, thread)
    assert len(emails) == len({email["idempotency_key"] for email in emails}) == loops


def test_a_subgraph_resumed_by_checkpoint_id_keeps_its_key_and_the_thread_goes_on(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
) -> None:
    """`send` is a subgraph. Killed after its second email, resumed by the latest checkpoint's
    id (LangGraph forks: the subgraph runs again under new task ids and checkpoints) and killed
    again after the resend, then resumed by thread id from the fork LangGraph saved: the email
    keeps one key throughout, performed once, and the thread finishes."""
    thread = f"case-{uuid.uuid4()}"
    first = GraphProcess(database_url, gateway, thread, "--subgraph", "--freeze-at", "2")
    processes.append(first)
    killed = sent(first.until("frozen"))[-1]
    first.kill()
    forked = GraphProcess(database_url, gateway, thread, "--subgraph", "--freeze-at", "2",
                          "--resume-by", "checkpoint-id")  # fmt: skip
    processes.append(forked)
    again = sent(forked.until("frozen"))[-1]
    forked.kill()
    last = GraphProcess(database_url, gateway, thread, "--subgraph")
    processes.append(last)
    after = sent(last.finish(LOOPS))
    assert again["checkpoint_ns"] != killed["checkpoint_ns"]  # LangGraph's task ids changed
    assert again["key"] == killed["key"] == after[0]["key"]
    assert again["replayed"] and after[0]["replayed"]
    assert "|email:" in killed["key"]
    emails = thread_emails(upstream, thread)
    assert len(emails) == len({email["idempotency_key"] for email in emails}) == LOOPS


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
    with pytest.raises(TaskKeyUnavailable, match="durability is 'exit'"):
        one_node(act, checkpointer).invoke(start, thread(), durability="exit")
    with pytest.raises(TaskKeyUnavailable, match="without a checkpointer"):
        one_node(act, None).invoke(start)
    with pytest.raises(TaskKeyUnavailable, match="inside a LangGraph node"):
        task_key("email")
    keeping = StateGraph(Loop)  # a subgraph with checkpoints of its own across its node's runs
    keeping.add_node("inner", act)
    keeping.add_edge(START, "inner")
    keeping.add_edge("inner", END)
    with pytest.raises(TaskKeyUnavailable, match="checkpointer=True"):
        one_node(keeping.compile(checkpointer=True), checkpointer).invoke(start, thread())

    def waiting(state: Loop) -> dict[str, Any]:
        return {"keys": [task_key("email", save_wait=0.2)]}

    unsaved = StateGraph(Loop)  # a subgraph that saves no checkpoint (sync: LangGraph fails)
    unsaved.add_node("inner", waiting)
    unsaved.add_edge(START, "inner")
    unsaved.add_edge("inner", END)
    with pytest.raises(TaskKeyUnavailable, match="compiled with checkpointer=False never saves"):
        one_node(unsaved.compile(checkpointer=False), checkpointer).invoke(
            start, thread(), durability="async"
        )
    # Both durabilities that save before the end make keys; where LangGraph keeps what the key
    # reads (not public): this fails loudly when it moves.
    for durability in ("sync", "async"):
        seen = one_node(act, checkpointer).invoke(start, thread(), durability=durability)
        assert len(seen["keys"]) == 1
    seen = one_node(act, checkpointer).invoke(start, thread())  # LangGraph's default: "async"
    assert len(seen["keys"]) == 1
    assert INTERNALS == (
        constants.CONFIG_KEY_DURABILITY,
        constants.CONFIG_KEY_CHECKPOINTER,
        constants.CONFIG_KEY_CHECKPOINT_MAP,
        constants.TASKS,
        constants.PULL,
        constants.PUSH,
        constants.INTERRUPT,
    )


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


def test_an_answered_action_resent_by_a_retry_inside_the_task_is_refused_saying_what_to_do(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A node that emails, then calls a CRM that fails once after the email was answered, and
    retries both itself (a loop in the node, or langchain's `ToolRetryMiddleware` around a
    tool): the resend is in the same attempt of the task, which `ActionNameReused` refuses, as
    it would a second action under the email's name. Its sentence says so and what to do:
    leave the retry to LangGraph's `RetryPolicy`, whose next attempt resends the email with
    its key, answered from the gateway's store; one email either way."""
    crm_down = [True]

    def crm() -> None:
        if crm_down and crm_down.pop():
            raise ConnectionError("the CRM did not answer")

    def retrying(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            for attempt in range(2):
                try:
                    response = client.post("/emails", {"n": 1}, action="email")
                    crm()
                    return {"keys": [response.request.headers["Idempotency-Key"]]}
                except ConnectionError:
                    if attempt:
                        raise
        return {}

    with pytest.raises(ActionNameReused, match="a retry inside the task") as reuse:
        one_node(retrying, checkpointer).invoke({"iteration": 0, "keys": []}, thread(),
                                                durability="sync")  # fmt: skip
    assert "RetryPolicy" in str(reuse.value)
    assert len(upstream.actions(reuse.value.key)) == 1

    crm_down.append(True)

    def once(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            response = client.post("/emails", {"n": 2}, action="email")
        crm()
        return {"keys": [response.request.headers["Idempotency-Key"]]}

    builder = StateGraph(Loop)
    builder.add_node("act", once, retry_policy=NodeRetryPolicy(retry_on=retry_on))
    builder.add_edge(START, "act")
    builder.add_edge("act", END)
    graph = builder.compile(checkpointer=checkpointer)
    final = graph.invoke({"iteration": 0, "keys": []}, thread(), durability="sync")
    [key] = final["keys"]
    assert [action["request"] for action in upstream.actions(key)] == [{"n": 2}]


def test_the_sync_client_raises_the_agent_librarys_errors(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    answers: list[httpx.Response] = []

    def twice(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            answers.append(client.post("/emails", {"n": 1}, action="email"))
        with Gateway(gateway.url) as another:  # the clients of a process know each other's keys
            another.post("/emails", {"n": 1}, action="email")  # same task, same action
        return {}

    # Sent, the second email would have been answered with the first's stored answer.
    with pytest.raises(ActionNameReused, match="already sent action 'email'") as reuse:
        one_node(twice, checkpointer).invoke({"iteration": 0, "keys": []}, thread(),
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
    # Each key is made from its step's lineage and the task's path in that step (a task's path
    # names its entrypoint's and the call's number), so a replay by checkpoint id, which
    # LangGraph runs under new task ids, finds them again.
    thread_id = config["configurable"]["thread_id"]
    assert outer.startswith(f"{thread_id}:flow:") and outer.endswith(":flow")
    for key in (first, second):
        assert key.startswith(f"{thread_id}:send:") and key.endswith(":email")
    start = list(flow.get_state_history(config))[-1]
    assert flow.invoke(None, start.config, durability="sync") == found


# --- resumes and replays by checkpoint id, retries, a body that changed (in this process) -------


class Emails(TypedDict):
    iteration: int
    keys: Annotated[list[str], operator.add]
    note: NotRequired[str]


def emails_graph(checkpointer: PostgresSaver, client: Gateway) -> Any:
    """`LOOPS` times: `draft` counts, `send` emails through the gateway."""

    def draft(state: Emails) -> dict[str, Any]:
        return {"iteration": state["iteration"] + 1}

    def send(state: Emails) -> dict[str, Any]:
        response = client.post("/emails", {"n": state["iteration"]}, action="email")
        return {"keys": [response.request.headers["Idempotency-Key"]]}

    builder = StateGraph(Emails)
    builder.add_node("draft", draft)
    builder.add_node("send", send)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send")
    builder.add_conditional_edges(
        "send", lambda state: "draft" if state["iteration"] < LOOPS else END
    )
    return builder.compile(checkpointer=checkpointer)


def test_a_replay_from_an_earlier_checkpoint_id_sends_the_same_keys_and_performs_nothing_again(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """LangGraph runs `invoke(None, <an earlier checkpoint's config>)` as a fork: new checkpoints,
    new task ids. The keys follow the lineage instead: the replayed sends are answered from the
    gateway's store."""
    config = thread()
    with Gateway(gateway.url) as client:
        graph = emails_graph(checkpointer, client)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        history = list(graph.get_state_history(config))
        assert len(final["keys"]) == len(set(final["keys"])) == LOOPS
        # From before the second send, and from the very first checkpoint (the input).
        [before_second] = [
            state for state in history
            if state.next == ("send",) and state.values["iteration"] == 2
        ]  # fmt: skip
        replayed = graph.invoke(None, before_second.config, durability="sync")
        assert replayed["keys"] == final["keys"]
        replayed = graph.invoke(None, history[-1].config, durability="async")
        assert replayed["keys"] == final["keys"]
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key


def test_the_checkpoint_a_run_under_exit_durability_saved_gives_no_key_that_could_be_another(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A run under `durability="exit"` saves only its last checkpoint, whose parent is the last
    one saved before it: the steps between are in no checkpoint. Here the thread ran its three
    emails (sync), then a replay from its first checkpoint under "exit" stopped at the first
    email (refused: "exit"), saving a checkpoint three steps after that first one. A resume
    under "sync" from there must not take it for the next step (its emails would get the keys
    of other steps: all three performed again): refused, saying how to go on, which is a
    replay from the checkpoint before it: the emails answered from the gateway's store. A run
    under "exit" that began with new input is new work, whatever it saved."""
    config = thread()
    with Gateway(gateway.url) as client:
        graph = emails_graph(checkpointer, client)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        first = list(graph.get_state_history(config))[-1].config
        with pytest.raises(TaskKeyUnavailable, match="durability is 'exit'"):
            graph.invoke(None, first, durability="exit")
        saved = graph.get_state(config)
        first_id = first["configurable"]["checkpoint_id"]
        assert saved.next == ("send",) and saved.parent_config is not None
        assert saved.parent_config["configurable"]["checkpoint_id"] == first_id
        with pytest.raises(TaskKeyUnavailable, match="durability='exit'") as refused:
            graph.invoke(None, config, durability="sync")
        assert first_id in str(refused.value)
        replayed = graph.invoke(None, first, durability="sync")
        # New input under "exit", stopped before its first email (nothing sent) and resumed
        # under "sync": the checkpoint it saved starts new work, each new email performed once.
        start = {"iteration": 0, "keys": []}
        graph.invoke(start, config, durability="exit", interrupt_before=["send"])
        assert graph.get_state(config).next == ("send",)
        again = graph.invoke(None, config, durability="sync")
    assert replayed["keys"] == final["keys"]
    new_keys = again["keys"][len(final["keys"]) :]
    assert len(set(new_keys)) == LOOPS and not set(new_keys) & set(final["keys"])
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 2 * LOOPS
    for key in final["keys"] + new_keys:
        assert len(upstream.actions(key)) == 1, key


def test_an_edit_of_an_earlier_checkpoint_keeps_the_key_of_the_task_it_had_to_run(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """LangGraph's time travel: `update_state` on an earlier checkpoint, then a run from the
    edit. The task that checkpoint still had to run (the third `send`) is the one the first run
    performed: an edit that leaves its email as it was gets its answer back; one that changes
    the email is refused before anything is sent, with what to do; done as it says, the new
    email is new work with a key of its own, performed once."""
    config = thread()
    with Gateway(gateway.url) as client:
        graph = emails_graph(checkpointer, client)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        [before_third] = [
            state for state in graph.get_state_history(config)
            if state.next == ("send",) and state.values["iteration"] == 3
        ]  # fmt: skip
        noted = graph.update_state(before_third.config, {"note": "checked by Ana"})
        assert graph.get_state(noted).next == ("send",)
        branch = graph.invoke(None, noted, durability="sync")
        assert branch["keys"] == final["keys"]
        changed = graph.update_state(before_third.config, {"iteration": 30})
        with pytest.raises(ActionKeyReused) as reused:
            graph.invoke(None, changed, durability="sync")
        third = final["keys"][-1]
        assert reused.value.key == third
        message = str(reused.value)
        assert "as_node='send'" in message and "update_state" in message
        # What it says: the email sent is recorded as the node's output, then the new one is
        # given to `send` as new input from the node before it.
        done = graph.update_state(changed, {"keys": [third]}, as_node="send")
        again = graph.update_state(done, {"iteration": 30}, as_node="draft")
        new = graph.invoke(None, again, durability="sync")
    new_key = new["keys"][-1]
    assert new_key not in final["keys"]
    assert [action["request"] for action in upstream.actions(new_key)] == [{"n": 30}]
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key


def test_new_sends_an_edit_starts_are_new_work_once_the_advice_is_followed(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """Time travel on a fan-out: an update of the checkpoint of two `Send`s, written as `draft`
    (whose edge makes the `Send`s), makes two other emails. Each is refused at the key of the
    first run's `Send` at its index (422, nothing sent); done as `ActionKeyReused` says (the
    `Send`s recorded as done, then the new input as `draft`), the new `Send`s are new work, with
    keys of their own, each performed once. LangGraph's path of a `Send` is
    `('__pregel_push', index, False)`: read as such, not as a functional API call's."""
    config = thread()
    with Gateway(gateway.url) as client:

        def draft(state: Emails) -> dict[str, Any]:
            return {"iteration": state["iteration"] + 1}

        def fan_out(state: Emails) -> list[Send]:
            return [Send("send", {"iteration": state["iteration"] * 10 + n}) for n in range(2)]

        def send(state: Emails) -> dict[str, Any]:
            response = client.post("/emails", {"n": state["iteration"]}, action="email")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        builder = StateGraph(Emails)
        builder.add_node("draft", draft)
        builder.add_node("send", send)
        builder.add_edge(START, "draft")
        builder.add_conditional_edges("draft", fan_out, ["send"])
        builder.add_edge("send", END)
        graph = builder.compile(checkpointer=checkpointer)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        [fanned] = [
            state for state in graph.get_state_history(config) if state.next == ("send", "send")
        ]
        changed = graph.update_state(fanned.config, {"iteration": 7}, as_node="draft")
        with pytest.raises(ActionKeyReused) as reused:
            graph.invoke(None, changed, durability="sync")
        assert reused.value.key in final["keys"]
        assert "as_node='send'" in str(reused.value)
        done = graph.update_state(changed, {"keys": final["keys"]}, as_node="send")
        again = graph.update_state(done, {"iteration": 7}, as_node="draft")
        new = graph.invoke(None, again, durability="sync")
    new_keys = [key for key in new["keys"] if key not in final["keys"]]
    assert len(new_keys) == 2
    performed = sorted(
        action["request"]["n"] for key in new_keys for action in upstream.actions(key)
    )
    assert performed == [70, 71]
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key


def test_the_steps_after_an_edit_of_an_earlier_checkpoint_keep_their_keys(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """Time travel from before the first `send`: an edit that leaves every email as it was
    (a note, or the same iteration written as `draft`) runs the three sends again with the
    first run's keys, each answered from the gateway's store; an edit that changes the emails
    is refused at the first send (422), before anything is sent."""
    config = thread()
    with Gateway(gateway.url) as client:
        graph = emails_graph(checkpointer, client)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        [before_first] = [
            state for state in graph.get_state_history(config)
            if state.next == ("send",) and state.values["iteration"] == 1
        ]  # fmt: skip
        noted = graph.update_state(before_first.config, {"note": "checked by Ana"})
        assert graph.invoke(None, noted, durability="sync")["keys"] == final["keys"]
        same = graph.update_state(before_first.config, {"iteration": 1}, as_node="draft")
        assert graph.invoke(None, same, durability="sync")["keys"] == final["keys"]
        changed = graph.update_state(before_first.config, {"iteration": 20}, as_node="draft")
        with pytest.raises(ActionKeyReused):
            graph.invoke(None, changed, durability="sync")
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == LOOPS
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key


def test_the_steps_after_an_edit_of_a_fan_outs_checkpoint_keep_their_keys(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """Time travel to the checkpoint whose step runs a fan-out's `Send`s (to a node only `Send`s
    reach), then a report after them: a note there runs the `Send`s and the report again with
    the first run's keys, each answered from the gateway's store."""
    config = thread()
    with Gateway(gateway.url) as client:

        def fan(state: Loop) -> list[Send]:
            return [Send("send", {"iteration": n, "keys": []}) for n in range(2)]

        def send(state: Loop) -> dict[str, Any]:
            body = {"iteration": state["iteration"]}
            response = client.post("/emails", body, action="email")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        def report(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"sent": len(state["keys"])}, action="report")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        builder = StateGraph(Loop)
        builder.add_node("draft", lambda state: {})
        builder.add_node("send", send)
        builder.add_node("report", report)
        builder.add_edge(START, "draft")
        builder.add_conditional_edges("draft", fan, ["send"])
        builder.add_edge("send", "report")
        builder.add_edge("report", END)
        graph = builder.compile(checkpointer=checkpointer)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        [fanned] = [s for s in graph.get_state_history(config) if s.next == ("send", "send")]
        noted = graph.update_state(fanned.config, {"iteration": 0}, as_node="draft")
        again = graph.invoke(None, noted, durability="sync")
    assert sorted(again["keys"]) == sorted(final["keys"])
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 3


def test_a_note_on_the_fork_a_replay_by_checkpoint_id_was_killed_in_keeps_the_later_keys(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A replay by checkpoint id saves LangGraph's fork, then is killed after its first email;
    an operator's note on the thread (an update of that fork) and a resume: the later emails are
    the ones the first run sent, answered from the gateway's store, not performed again (the
    fork's `versions_seen['__interrupt__']`, which every resume sets, is not a task; REVIEW7 R4)."""
    config = thread()
    crash: list[bool] = []
    with Gateway(gateway.url) as client:

        def draft(state: Emails) -> dict[str, Any]:
            return {"iteration": state["iteration"] + 1}

        def send(state: Emails) -> dict[str, Any]:
            response = client.post("/emails", {"n": state["iteration"]}, action="email")
            if crash.pop() if crash else False:
                raise Killed("killed after the email, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        builder = StateGraph(Emails)
        builder.add_node("draft", draft)
        builder.add_node("send", send)
        builder.add_edge(START, "draft")
        builder.add_edge("draft", "send")
        builder.add_conditional_edges(
            "send", lambda state: "draft" if state["iteration"] < LOOPS else END
        )
        graph = builder.compile(checkpointer=checkpointer)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        [before_first] = [
            state for state in graph.get_state_history(config)
            if state.next == ("send",) and state.values["iteration"] == 1
        ]  # fmt: skip
        crash.append(True)
        with pytest.raises(Killed):
            graph.invoke(None, before_first.config, durability="sync")
        assert (graph.get_state(config).metadata or {}).get("source") == "fork"
        graph.update_state(config, {"note": "checked by Ana"})
        resumed = graph.invoke(None, config, durability="sync")
    assert resumed["keys"] == final["keys"]
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == LOOPS


@pytest.mark.skipif(
    "error_handler" not in inspect.signature(StateGraph.add_node).parameters,
    reason="node error handlers came with LangGraph 1.2",
)
def test_a_nodes_error_handler_killed_after_its_action_keeps_its_key_across_an_update(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """LangGraph 1.2's `add_node(..., error_handler=...)`: `send` fails, its handler alerts
    through the gateway and is killed after the alert. An operator's note (an `update_state`
    that leaves `send` to run), then a resume: the handler runs again for the same failed task,
    and sends the alert's key again, answered from the gateway's store (before: another key,
    the alert performed twice)."""
    config = thread()
    crash = [True]
    with Gateway(gateway.url) as client:

        def draft(state: Emails) -> dict[str, Any]:
            return {"iteration": state["iteration"] + 1}

        def send(state: Emails) -> dict[str, Any]:
            raise RuntimeError("the mail server refused the email")

        def alert(state: Emails) -> dict[str, Any]:
            response = client.post("/emails", {"failed": state["iteration"]}, action="alert")
            if crash.pop() if crash else False:
                raise Killed("killed after the alert, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        builder = StateGraph(Emails)
        builder.add_node("draft", draft)
        builder.add_node("send", send, error_handler=alert)
        builder.add_edge(START, "draft")
        builder.add_edge("draft", "send")
        builder.add_edge("send", END)
        graph = builder.compile(checkpointer=checkpointer)
        with pytest.raises(Killed):
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        graph.update_state(config, {"note": "checked by Ana"})
        assert graph.get_state(config).next == ("send",)
        final = graph.invoke(None, config, durability="sync")
    [key] = final["keys"]
    assert len(upstream.actions(key)) == 1
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 1


def test_a_copy_of_the_checkpoint_a_task_was_killed_in_keeps_its_key(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """LangGraph's other fork, `update_state(config, None, as_node="__copy__")`, saves the copy
    beside the checkpoint it copies (under that checkpoint's parent): the task the copy runs
    again is the one killed, and keeps its key."""
    crash = [True]
    config = thread()
    with Gateway(gateway.url) as client:

        def send(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"n": 1}, action="email")
            if crash.pop() if crash else False:
                raise Killed("killed after the email, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        graph = one_node(send, checkpointer)
        with pytest.raises(Killed):
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        copied = graph.update_state(config, None, as_node="__copy__")
        assert graph.get_state(copied).next == ("act",)
        final = graph.invoke(None, config, durability="sync")
    [key] = final["keys"]
    assert len(upstream.actions(key)) == 1
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 1


def test_a_copy_of_a_run_replayed_twice_by_checkpoint_id_keeps_the_keys(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A replay by checkpoint id, twice from one checkpoint, saves two forks of it beside each
    other (same parent, step and versions); a `"__copy__"` of one of them is then beside two
    checkpoints with its versions. Both are copies of the same checkpoint, with the same keys:
    the thread goes on by its id with them, not refused on every resume (REVIEW7 R1)."""
    config = thread()
    with Gateway(gateway.url) as client:
        graph = emails_graph(checkpointer, client)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        [before_third] = [
            state for state in graph.get_state_history(config)
            if state.next == ("send",) and state.values["iteration"] == 3
        ]  # fmt: skip
        for _ in range(2):
            assert graph.invoke(None, before_third.config, durability="sync") == final
        forks = [
            state for state in graph.get_state_history(config)
            if (state.metadata or {}).get("source") == "fork"
        ]  # fmt: skip
        assert len(forks) == 2
        graph.update_state(forks[0].config, None, as_node="__copy__")
        assert graph.invoke(None, config, durability="sync")["keys"] == final["keys"]
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == LOOPS


def test_a_copy_of_a_functional_api_run_killed_in_its_first_step_keeps_its_keys(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """An entrypoint's first step starts from the thread's first checkpoint, which has no
    parent, and a `"__copy__"` of it has none either: the copy is still found as the sibling of
    the same versions, so the thread goes on by its id, each email performed once."""
    crash = [True]
    config = thread()
    with Gateway(gateway.url) as client:

        @task
        def send(number: int) -> str:
            response = client.post("/emails", {"n": number}, action="email")
            if number == 1 and crash and crash.pop():
                raise Killed("killed after the second email, before LangGraph saved it")
            return str(response.request.headers["Idempotency-Key"])

        @entrypoint(checkpointer=checkpointer)
        def flow(count: int) -> list[str]:
            return [send(number).result() for number in range(count)]

        with pytest.raises(Killed):
            flow.invoke(3, config, durability="sync")
        flow.update_state(config, None, as_node="__copy__")
        found = flow.invoke(None, config, durability="sync")
    assert len(set(found)) == 3
    for key in found:
        assert len(upstream.actions(key)) == 1, key
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 3


def subgraph_of(node: Any) -> Any:
    """A graph whose one node, `outer`, is a subgraph whose one node, `inner`, is `node`."""
    sub = StateGraph(Loop)
    sub.add_node("inner", node)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)
    outer = StateGraph(Loop)
    outer.add_node("outer", sub.compile())
    outer.add_edge(START, "outer")
    outer.add_edge("outer", END)
    return outer


def test_a_subgraph_called_twice_in_one_nodes_code_is_refused_saying_so(
    checkpointer: PostgresSaver,
) -> None:
    """LangGraph numbers the second and later calls of a subgraph inside one task
    (`outer:<task id>|1`): the second call's task is refused saying that, and what to do, not
    that its subgraph was compiled with checkpointer=True (it was not; REVIEW7 R2)."""
    keys_seen: list[str] = []

    def inner(state: Loop) -> dict[str, Any]:
        keys_seen.append(task_key("email"))
        return {}

    sub = StateGraph(Loop)
    sub.add_node("inner", inner)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)
    compiled = sub.compile()

    def twice(state: Loop) -> dict[str, Any]:
        compiled.invoke({"iteration": 1, "keys": []})
        compiled.invoke({"iteration": 2, "keys": []})
        return {}

    with pytest.raises(TaskKeyUnavailable) as refused:
        one_node(twice, checkpointer).invoke({"iteration": 0, "keys": []}, thread(),
                                             durability="sync")  # fmt: skip
    message = str(refused.value)
    assert "checkpointer=True" not in message
    assert "called more than once" in message and "node of its own" in message
    assert len(keys_seen) == 1  # the first call's task has its key


def test_a_subgraphs_task_resumed_or_replayed_by_checkpoint_id_sends_the_same_key(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """LangGraph runs a subgraph of a forked run under new task ids and checkpoints of its own;
    the key follows the outer step's lineage and the subgraph's node instead."""
    config = thread()
    crash = [True]
    with Gateway(gateway.url) as client:

        def inner(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"thread": config["configurable"]}, action="email")
            if crash.pop() if crash else False:
                raise Killed("killed after the email, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        graph = subgraph_of(inner).compile(checkpointer=checkpointer)
        with pytest.raises(Killed):
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        resumed = graph.invoke(None, graph.get_state(config).config, durability="sync")
        [key] = resumed["keys"]
        assert key.startswith(config["configurable"]["thread_id"] + ":outer:")
        assert "|inner:" in key
        # The thread goes on by its id from the fork LangGraph saved, and a replay from before
        # the subgraph sends the same key again.
        assert graph.get_state(config).next == ()
        [before] = [
            state for state in graph.get_state_history(config)
            if state.next == ("outer",) and (state.metadata or {}).get("source") == "loop"
        ]  # fmt: skip
        replayed = graph.invoke(None, before.config, durability="sync")
        assert replayed["keys"] == [key]
    assert len(upstream.actions(key)) == 1
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 1


@pytest.mark.parametrize("edit", [False, True])
def test_a_run_addressed_by_a_subgraphs_own_checkpoint_keeps_the_keys(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream, edit: bool
) -> None:
    """LangGraph's way into a subgraph: `get_state(config, subgraphs=True)` gives the
    subgraph's own config (its checkpoint in `checkpoint_map`), which `invoke` resumes, and
    `update_state` edits, returning a config of the same kind. The subgraph sends three emails
    in a loop and is killed after its second: resumed that way, with or without an edit that
    leaves the emails as they were, each email is performed once (the map's entry for the
    addressed subgraph, which the running task's namespace is not under, is no level of it)."""
    config = thread()
    crash = [True]
    with Gateway(gateway.url) as client:

        def draft(state: Loop) -> dict[str, Any]:
            return {"iteration": state["iteration"] + 1}

        def send(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"n": state["iteration"]}, action="email")
            if state["iteration"] == 2 and crash and crash.pop():
                raise Killed("killed after the email, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        sub = StateGraph(Loop)
        sub.add_node("draft", draft)
        sub.add_node("send", send)
        sub.add_edge(START, "draft")
        sub.add_edge("draft", "send")
        sub.add_conditional_edges(
            "send", lambda state: "draft" if state["iteration"] < LOOPS else END
        )
        outer = StateGraph(Loop)
        outer.add_node("outer", sub.compile())
        outer.add_edge(START, "outer")
        outer.add_edge("outer", END)
        graph = outer.compile(checkpointer=checkpointer)
        with pytest.raises(Killed):
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        inside = graph.get_state(config, subgraphs=True).tasks[0].state
        assert isinstance(inside, StateSnapshot) and inside.next == ("send",)
        addressed = inside.config
        if edit:
            addressed = graph.update_state(addressed, {"iteration": 2}, as_node="draft")
        final = graph.invoke(None, addressed, durability="sync")
    assert len(final["keys"]) == len(set(final["keys"])) == LOOPS
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key
    emails = thread_emails(upstream, config["configurable"]["thread_id"])
    assert sorted(email["request"]["n"] for email in emails) == [1, 2, 3]


@pytest.mark.parametrize("updates", [1, 2])
def test_an_update_on_the_outer_level_after_a_subgraphs_send_keeps_its_key(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream, updates: int
) -> None:
    """The subgraph's node sent and was killed; an `update_state` of the outer graph (or two,
    the second on the first) that leaves the subgraph to run again restarts it under new task
    ids: the email keeps its key."""
    config = thread()
    crash = [True]
    with Gateway(gateway.url) as client:

        def inner(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"n": 1}, action="email")
            if crash.pop() if crash else False:
                raise Killed("killed after the email, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        graph = subgraph_of(inner).compile(checkpointer=checkpointer)
        with pytest.raises(Killed):
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        for _ in range(updates):
            graph.update_state(config, {"iteration": 0})
        assert graph.get_state(config).next == ("outer",)
        final = graph.invoke(None, config, durability="sync")
    [key] = final["keys"]
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 1
    assert len(upstream.actions(key)) == 1


def test_a_changed_request_inside_a_subgraph_is_refused_with_advice_that_applies(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """The email a subgraph's node sent before the kill comes out different after an update:
    refused (422), and the `as_node` the error names is a node of the graph the caller invokes,
    so doing what it says records the email and the thread goes on, nothing sent again."""
    config = thread()
    crash = [True]
    with Gateway(gateway.url) as client:

        def inner(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"n": state["iteration"]}, action="email")
            if crash.pop() if crash else False:
                raise Killed("killed after the email, before LangGraph saved the step")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        graph = subgraph_of(inner).compile(checkpointer=checkpointer)
        with pytest.raises(Killed):
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        graph.update_state(config, {"iteration": 5})
        with pytest.raises(ActionKeyReused) as reused:
            graph.invoke(None, config, durability="sync")
        assert "as_node='outer'" in str(reused.value)
        graph.update_state(config, {"keys": [reused.value.key]}, as_node="outer")
        final = graph.invoke(None, config, durability="sync")
    assert final["keys"] == [reused.value.key]
    assert len(thread_emails(upstream, config["configurable"]["thread_id"])) == 1


class Keys(TypedDict):
    keys: Annotated[list[str], operator.add]


def test_subgraphs_sent_to_in_one_step_keep_their_own_keys_in_a_replay(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """Three `Send`s to one subgraph node: three actions, three keys, and a replay from before
    them (by checkpoint id) sends each its own key again. Which `Send` a subgraph runs for is
    read from LangGraph's task ids (not public): this fails loudly if those move."""
    config = thread()
    with Gateway(gateway.url) as client:

        def inner(state: Loop) -> dict[str, Any]:
            response = client.post("/emails", {"n": state["iteration"]}, action="email")
            return {"keys": [response.request.headers["Idempotency-Key"]]}

        sub = StateGraph(Loop, output_schema=Keys)  # three at once: only their keys go out
        sub.add_node("inner", inner)
        sub.add_edge(START, "inner")
        sub.add_edge("inner", END)
        outer = StateGraph(Loop)
        outer.add_node("outer", sub.compile())
        outer.add_conditional_edges(
            START, lambda state: [Send("outer", {"iteration": n, "keys": []}) for n in range(3)]
        )
        outer.add_edge("outer", END)
        graph = outer.compile(checkpointer=checkpointer)
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        assert len(final["keys"]) == len(set(final["keys"])) == 3
        first = list(graph.get_state_history(config))[-1]
        replayed = graph.invoke(None, first.config, durability="sync")
    assert sorted(replayed["keys"]) == sorted(final["keys"])
    for key in final["keys"]:
        assert len(upstream.actions(key)) == 1, key


def test_a_subgraph_pulled_and_sent_to_in_one_step_is_refused_saying_what_to_do(
    checkpointer: PostgresSaver,
) -> None:
    def inner(state: Loop) -> dict[str, Any]:
        return {"keys": [task_key("email")]}

    sub = StateGraph(Loop, output_schema=Keys)
    sub.add_node("inner", inner)
    sub.add_edge(START, "inner")
    sub.add_edge("inner", END)
    outer = StateGraph(Loop)
    outer.add_node("fan", lambda state: {})
    outer.add_node("outer", sub.compile())
    outer.add_edge(START, "fan")
    outer.add_edge("fan", "outer")
    outer.add_conditional_edges("fan", lambda state: [Send("outer", {"iteration": 1})])
    outer.add_edge("outer", END)
    with pytest.raises(TaskKeyUnavailable, match="pulled and sent to in one step: give the"):
        outer.compile(checkpointer=checkpointer).invoke({"iteration": 0, "keys": []}, thread())


def retried(node: Any, checkpointer: PostgresSaver) -> Any:
    """A graph of `node` alone, retried by LangGraph with oncegate's `retry_on`."""
    builder = StateGraph(Loop)
    policy = NodeRetryPolicy(max_attempts=3, initial_interval=0.01, retry_on=retry_on)
    builder.add_node("act", node, retry_policy=policy)
    builder.add_edge(START, "act")
    builder.add_edge("act", END)
    return builder.compile(checkpointer=checkpointer)


def test_langgraphs_retry_of_a_node_resends_with_the_same_key(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A retry is a new attempt of the same task: its resend is the same action again, not a
    second one under the same name (which `ActionNameReused` would refuse)."""
    sent_keys: list[str] = []

    def flaky(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            response = client.post("/emails", {"n": 1}, action="email")
        sent_keys.append(response.request.headers["Idempotency-Key"])
        if len(sent_keys) == 1:
            raise ConnectionError("the network went away after the email was sent")
        return {"keys": sent_keys[-1:]}

    graph = retried(flaky, checkpointer)
    final = graph.invoke({"iteration": 0, "keys": []}, thread(), durability="sync")
    first, second = sent_keys
    assert first == second == final["keys"][0]
    assert len(upstream.actions(first)) == 1


@pytest.mark.parametrize(("path", "released"), [("/emails", False), ("/released/emails", True)])
def test_a_retried_500_is_performed_again_only_where_the_route_releases_it(
    checkpointer: PostgresSaver,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    path: str,
    released: bool,
) -> None:
    """The upstream fails the first attempt with a 500. Stored (the default `release_statuses`,
    [429, 503]), LangGraph's retry gets the stored 500 as a replay, and `retry_on` stops there;
    released, the retry reaches the upstream, which performs it."""
    answers: list[int] = []

    def send(state: Loop) -> dict[str, Any]:
        failing = {"X-Demo-Status": "500"} if not answers else {}
        with Gateway(gateway.url) as client:
            try:
                response = client.post(path, {"n": 1}, action="email", headers=failing)
            except ActionRejected as error:
                assert error.response is not None
                answers.append(error.response.status_code)
                raise
        answers.append(response.status_code)
        return {"keys": [response.request.headers["Idempotency-Key"]]}

    graph = retried(send, checkpointer)
    config = thread()
    if released:
        final = graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        assert answers == [500, 201]
        [key] = final["keys"]
        assert len(upstream.actions(key)) == 1
    else:
        with pytest.raises(ActionRejected, match="answered 500") as stored:
            graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
        assert answers == [500, 500]  # the second a replay: not retried again
        assert stored.value.response is not None
        assert stored.value.response.headers["idempotent-replayed"] == "true"


def test_retry_on_retries_only_what_a_retry_can_change() -> None:
    def rejected(status: int, replayed: bool = False) -> ActionRejected:
        headers = {"Idempotent-Replayed": "true"} if replayed else {}
        return ActionRejected("no", response=httpx.Response(status, headers=headers))

    assert retry_on(rejected(500)) and retry_on(rejected(502))
    assert not retry_on(rejected(500, replayed=True))  # stored: every retry gets it again
    assert not retry_on(rejected(400)) and not retry_on(rejected(404))
    assert not retry_on(ActionKeyReused("k")) and not retry_on(ActionOutcomeUnknown("u"))
    assert not retry_on(ActionNameReused("twice")) and not retry_on(TaskKeyUnavailable("x"))
    assert retry_on(ConnectionError("down")) and not retry_on(ValueError("bug"))


class Killed(Exception):
    """A crash in the gap, in this process: the node acted, LangGraph saved nothing of it."""


def test_a_body_that_changed_on_resume_is_refused_and_the_node_can_be_marked_done(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A node that drafts its email with a clock sends another body on resume: the gateway
    refuses it (422, `ActionKeyReused`), on every resume. The way out: find the answer the
    first attempt got, record it as the node's output (`update_state(..., as_node=...)`), and
    resume past it."""
    clock = iter(range(1, 100))
    crash = [True]

    def send(state: Loop) -> dict[str, Any]:
        with Gateway(gateway.url) as client:
            response = client.post("/emails", {"sent_at": next(clock)}, action="email")
        if crash.pop() if crash else False:
            raise Killed("killed after the email, before LangGraph saved the step")
        return {"keys": [response.request.headers["Idempotency-Key"]]}

    graph = one_node(send, checkpointer)
    config = thread()
    with pytest.raises(Killed):
        graph.invoke({"iteration": 0, "keys": []}, config, durability="sync")
    for _ in range(2):  # every resume alike
        with pytest.raises(ActionKeyReused) as reused:
            graph.invoke(None, config, durability="sync")
    key = reused.value.key
    assert key is not None
    [performed] = upstream.actions(key)
    assert performed["request"] == {"sent_at": 1}
    # The way out: the upstream's (or the gateway's, `oncegate keys show`) answer recorded as
    # what the node returned; the graph then goes on from there.
    graph.update_state(config, {"keys": [key]}, as_node="act")
    final = graph.invoke(None, config, durability="sync")
    assert final["keys"] == [key]
    assert graph.get_state(config).next == ()
    assert len(upstream.actions(key)) == 1


class LatestOnly(InMemorySaver):
    """Keeps only each thread's latest checkpoint, as a shallow saver (or a pruned one) does."""

    def get_tuple(self, config: Any) -> Any:
        wanted = config["configurable"].get("checkpoint_id")
        latest = super().get_tuple({"configurable": {**config["configurable"],
                                                     "checkpoint_id": None}})  # fmt: skip
        if latest is None or (wanted and latest.config["configurable"]["checkpoint_id"] != wanted):
            return None
        return latest


def test_a_checkpointer_without_the_threads_history_gets_no_key() -> None:
    def act(state: Loop) -> dict[str, Any]:
        return {"keys": [task_key("email")]}

    with pytest.raises(TaskKeyUnavailable, match="is not in the checkpointer"):
        one_node(act, LatestOnly()).invoke({"iteration": 0, "keys": []}, thread(),
                                           durability="sync")  # fmt: skip
    # The same graph on a saver that keeps the history makes its key.
    final = one_node(act, InMemorySaver()).invoke({"iteration": 0, "keys": []}, thread(),
                                                  durability="sync")  # fmt: skip
    assert len(final["keys"]) == 1
