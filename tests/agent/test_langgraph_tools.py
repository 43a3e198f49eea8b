"""Tool calls on LangGraph: a scripted model's message with two tool calls, run by a `ToolNode`
and by the prebuilt `create_react_agent` (v1: one task for both calls; v2: a task each), killed
with SIGKILL once both emails were answered and resumed in a new process
(tests/agent/langgraph_tools.py). Each tool call is its own action, keyed by its id: performed
once, replayed on resume. And what happens when a tool forgets its call's id."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Annotated, Any

import psycopg
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, create_react_agent, tools_condition

from oncegate.agent.client import ActionError, ActionKeyReused, ActionOutcomeUnknown, GaveUp
from oncegate.agent.langgraph import ActionNameReused, Gateway, TaskKeyUnavailable
from tests.agent.conftest import GraphProcess
from tests.agent.langgraph_tools import ScriptedModel
from tests.e2e.conftest import DemoUpstream, GatewayProcess

CALLS = 2  # tests/agent/langgraph_tools.py


def sent(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The `sent` events by tool call id."""
    return {item["tool_call_id"]: item for item in events if item["event"] == "sent"}


@pytest.mark.parametrize(
    ("agent", "api", "resume_by", "update"),
    [
        ("toolnode", "sync", "thread", False),
        ("toolnode", "async", "checkpoint-id", False),
        ("react-v1", "sync", "checkpoint-id", False),
        ("react-v2", "async", "thread", False),
        # An operator's update_state between the kill and the resume, which leaves the tool
        # calls to run: they are the ones killed, with the keys they had.
        ("toolnode", "sync", "thread", True),
        ("react-v2", "async", "checkpoint-id", True),
    ],
)
def test_each_tool_call_of_a_message_is_its_own_action_performed_once_across_a_kill(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    agent: str,
    api: str,
    resume_by: str,
    update: bool,
) -> None:
    thread = f"case-{uuid.uuid4()}"
    options = ("--agent", agent, "--api", api, "--resume-by", resume_by)
    module = "tests.agent.langgraph_tools"
    first = GraphProcess(database_url, gateway, thread, *options, "--freeze", module=module)
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()  # both emails answered, the tool step not saved
    then = ("--update",) if update else ()
    second = GraphProcess(database_url, gateway, thread, *options, *then, module=module)
    processes.append(second)
    events = second.finish()
    after = sent(events)

    assert sorted(before) == ["call_1", "call_2"]
    assert not any(item["replayed"] for item in before.values())
    # Two tool calls, two keys, each with its call's id.
    keys = {call: item["key"] for call, item in before.items()}
    assert len(set(keys.values())) == CALLS
    for call, key in keys.items():
        assert key.startswith(f"{thread}:") and key.endswith(f":{call}:email")
    # The resumed process ran again what LangGraph had not saved (both calls in one task; in
    # v2 maybe only the frozen one): with the same keys, answered from the gateway's store.
    assert after, events
    for call, item in after.items():
        assert item["key"] == keys[call] and item["replayed"]
    assert events[-1]["messages"][-1] == "AIMessage"
    for key in keys.values():
        assert len(upstream.actions(key)) == 1, key
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread)]
    assert len(emails) == CALLS


@pytest.mark.parametrize(
    ("agent", "api"),
    [
        ("react-v2", "sync"),
        ("react-v2", "async"),
        ("react-v1", "sync"),
        ("sends", "sync"),
        ("batch", "sync"),
    ],
)
def test_an_edit_that_drops_a_performed_tool_call_keeps_the_other_calls_keys(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    agent: str,
    api: str,
) -> None:
    """Killed once both emails were answered; then an operator edits the model's message (the
    same message id) to drop its first tool call, and resumes. v2 sends the second call to the
    first `Send`'s place in the update's step: it is still the second call, with its key
    (answered from the gateway's store), not new work performed again. The same where each
    call is sent as `Send("tools", [call])` (`sends`: langchain's `create_agent`), and where
    all are sent in one `Send` (`batch`), which the edit leaves with one call: still by its
    place."""
    thread = f"case-{uuid.uuid4()}"
    options = ("--agent", agent, "--api", api)
    module = "tests.agent.langgraph_tools"
    first = GraphProcess(database_url, gateway, thread, *options, "--freeze", module=module)
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()
    edit = "--drop-first-call"
    second = GraphProcess(database_url, gateway, thread, *options, edit, module=module)
    processes.append(second)
    after = sent(second.finish())

    assert sorted(before) == ["call_1", "call_2"]
    assert sorted(after) == ["call_2"]
    assert after["call_2"]["key"] == before["call_2"]["key"] and after["call_2"]["replayed"]
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread)]
    assert len(emails) == CALLS


@pytest.mark.parametrize(
    ("delegate", "edit", "api"),
    [
        ("subgraph", "--drop-first-call", "sync"),
        ("subgraph", "--add-call", "sync"),
        ("subgraph", "--add-call", "async"),
        ("task", "--drop-first-call", "sync"),
        ("task", "--add-call", "async"),
    ],
)
def test_what_a_v2_tool_call_runs_keeps_its_key_when_an_edit_moves_the_call(
    database_url: str,
    gateway: GatewayProcess,
    upstream: DemoUpstream,
    processes: list[GraphProcess],
    delegate: str,
    edit: str,
    api: str,
) -> None:
    """The v2 agent's tool hands the email to a subgraph whose node sends it (an agent that
    hands each call to another agent), keyed from the tool's task (the `Send` of the call), as
    it has no call id of its own; or to a functional API task, given the call's id, whose path
    holds the tool's. Killed once both emails were answered; then the operator edits the
    model's message (dropping its first call, or adding one before its calls) and resumes. The
    edit moves the calls to other places in the step: each is still its call, with its key
    (answered from the gateway's store), whatever place it moved to, and a call the edit adds
    is new work, performed once."""
    thread = f"case-{uuid.uuid4()}"
    options = ("--agent", "react-v2", "--api", api, "--delegate", delegate)
    module = "tests.agent.langgraph_tools"
    first = GraphProcess(database_url, gateway, thread, *options, "--freeze", module=module)
    processes.append(first)
    before = sent(first.until("frozen"))
    first.kill()
    second = GraphProcess(database_url, gateway, thread, *options, edit, module=module)
    processes.append(second)
    after = sent(second.finish())

    assert sorted(before) == ["call_1", "call_2"]
    kept = ["call_2"] if edit == "--drop-first-call" else ["call_1", "call_2"]
    assert sorted(after) == sorted([*kept, *(["call_0"] if edit == "--add-call" else [])])
    for call in kept:
        assert after[call]["key"] == before[call]["key"] and after[call]["replayed"], call
    if edit == "--add-call":
        assert not after["call_0"]["replayed"]
        assert after["call_0"]["key"] not in [item["key"] for item in before.values()]
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread)]
    assert sorted(email["request"]["to"] for email in emails) == sorted(
        ["ana@example.com", "bo@example.com"] + (["cy@example.com"] if edit == "--add-call" else [])
    )


@pytest.fixture
def checkpointer(database_url: str) -> Iterator[PostgresSaver]:
    with psycopg.Connection.connect(database_url, autocommit=True, prepare_threshold=0) as db:
        saver = PostgresSaver(db)
        saver.setup()
        yield saver


def test_a_tool_that_does_not_pass_its_call_id_sends_its_second_call_not_at_all(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """Without the tool call's id, both calls of one message would share the task's key: the
    second would be "replayed" the first's answer, never performed. The client refuses it
    before sending (also while the first is still on its way, in the `ToolNode`'s other
    thread), and the `ToolNode`, which turns only invalid arguments into messages, raises it."""
    thread_id = f"case-{uuid.uuid4()}"
    with Gateway(gateway.url) as client:

        @tool
        def send_email(to: str) -> str:
            """Email a customer."""
            return str(client.post("/emails", {"to": to}, action="email").json()["id"])

        def model(state: MessagesState) -> dict[str, Any]:
            calls = [
                {"name": "send_email", "args": {"to": to}, "id": f"call_{to}", "type": "tool_call"}
                for to in ("ana@example.com", "bo@example.com")
            ]
            return {"messages": [AIMessage(content="", tool_calls=calls)]}

        builder = StateGraph(MessagesState)
        builder.add_node("model", model)
        builder.add_node("tools", ToolNode([send_email]))
        builder.add_edge(START, "model")
        builder.add_edge("model", "tools")
        graph = builder.compile(checkpointer=checkpointer)
        with pytest.raises(ActionNameReused, match="already sent action 'email'"):
            graph.invoke(
                {"messages": [("user", "email both")]},
                {"configurable": {"thread_id": thread_id}},
            )
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread_id)]
    assert len(emails) == 1


class TwoRounds(ScriptedModel):
    """Two rounds of tool calls: an email to each customer, then (once both answered) one to
    the team; then the end."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **_: Any
    ) -> ChatResult:
        answered = sum(isinstance(message, ToolMessage) for message in messages)
        rounds = {0: [("ana@example.com", "call_1"), ("bo@example.com", "call_2")],
                  CALLS: [("team@example.com", "call_9")]}  # fmt: skip
        calls = [
            {"name": "send_email", "args": {"to": to}, "id": call, "type": "tool_call"}
            for to, call in rounds.get(answered, [])
        ]
        return ChatResult(generations=[ChatGeneration(message=AIMessage("", tool_calls=calls))])


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
@pytest.mark.parametrize("version", ["v1", "v2"])
def test_an_edit_of_an_earlier_model_message_that_changes_no_call_replays_the_later_rounds(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream, version: str
) -> None:
    """LangGraph's time travel on a tool agent: the model's first message is rewritten as it
    was (the same id, the same calls) at its checkpoint, and the thread run from there. The
    update's step runs only the tool calls that checkpoint still had to run, so the steps after
    it keep their keys: every email, the second round's too, is answered from the gateway's
    store, none performed again."""
    thread_id = f"case-{uuid.uuid4()}"
    config: Any = {"configurable": {"thread_id": thread_id}}
    with Gateway(gateway.url) as client:

        @tool
        def send_email(to: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            """Email someone."""
            body = {"to": to, "subject": "Your refund"}
            return str(client.post("/emails", body, action="email", tool_call_id=tool_call_id))

        graph = create_react_agent(
            TwoRounds(), [send_email], checkpointer=checkpointer, version=version
        )
        graph.invoke({"messages": [HumanMessage("Refund both and tell the team.")]}, config)
        first_round = next(
            state for state in graph.get_state_history(config)
            if state.next and state.next[0] == "tools" and len(state.values["messages"]) == 2
        )  # fmt: skip
        message = first_round.values["messages"][-1]
        same = AIMessage("", id=message.id, tool_calls=message.tool_calls)
        edited = graph.update_state(first_round.config, {"messages": [same]})
        graph.invoke(None, edited)
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread_id)]
    assert sorted(email["request"]["to"] for email in emails) == [
        "ana@example.com", "bo@example.com", "team@example.com"
    ]  # fmt: skip


def tool_errors(error: Exception) -> str:
    """docs/agents.md's `handle_tool_errors` for a `ToolNode`: oncegate's errors stop the run,
    any other becomes a message to the model."""
    if isinstance(error, ActionError | GaveUp | TaskKeyUnavailable):
        raise error
    return f"Error: {error!r}"


class CallsAgainOnError(ScriptedModel):
    """Calls the tool; when the tool's answer is an error, calls it again (a new call id)."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **_: Any
    ) -> ChatResult:
        answers = [message for message in messages if isinstance(message, ToolMessage)]
        if len(answers) >= 2 or (answers and not str(answers[-1].content).startswith("Error")):
            return ChatResult(generations=[ChatGeneration(message=AIMessage("Done."))])
        call = {"name": "send_email", "args": {"to": "ana@example.com"},
                "id": f"call_{len(answers) + 1}", "type": "tool_call"}  # fmt: skip
        return ChatResult(generations=[ChatGeneration(message=AIMessage("", tool_calls=[call]))])


@pytest.mark.parametrize("handle", ["oncegate", "all"])
def test_a_tool_node_that_turns_an_unknown_outcome_into_a_message_lets_the_model_act_again(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream, handle: str
) -> None:
    """The upstream answers after the route's timeout: `ActionOutcomeUnknown`, the email may
    have been sent (it was). `handle_tool_errors=True` hands that to the model as a message, and
    a model that calls the tool again makes a new call, with a new key: performed twice. With
    docs/agents.md's `tool_errors`, the run stops on it, the thread resumable, sent once."""
    thread_id = f"case-{uuid.uuid4()}"
    with Gateway(gateway.url) as client:

        @tool
        def send_email(to: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            """Email a customer."""
            late = {"X-Demo-Delay": "1.5"}  # the route's timeout is 1 s
            response = client.post(
                "/emails", {"to": to}, action="email", tool_call_id=tool_call_id, headers=late
            )
            return str(response.json()["id"])

        model = CallsAgainOnError()

        def call_model(state: MessagesState) -> dict[str, Any]:
            return {"messages": [model.invoke(state["messages"])]}

        builder = StateGraph(MessagesState)
        builder.add_node("model", call_model)
        handler = tool_errors if handle == "oncegate" else True
        builder.add_node("tools", ToolNode([send_email], handle_tool_errors=handler))
        builder.add_edge(START, "model")
        builder.add_conditional_edges("model", tools_condition)
        builder.add_edge("tools", "model")
        graph = builder.compile(checkpointer=checkpointer)
        config: Any = {"configurable": {"thread_id": thread_id}}
        if handle == "oncegate":
            with pytest.raises(ActionOutcomeUnknown):
                graph.invoke({"messages": [HumanMessage("Email Ana.")]}, config)
        else:
            graph.invoke({"messages": [HumanMessage("Email Ana.")]}, config)

    def performed() -> int:
        actions = upstream.actions()
        return len([a for a in actions if (a["idempotency_key"] or "").startswith(thread_id)])

    deadline = time.monotonic() + 5  # the upstream performs each at once, answers 1.5 s later
    while performed() < (1 if handle == "oncegate" else 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert performed() == (1 if handle == "oncegate" else 2)


class Killed(Exception):
    """Stands for a kill after the email was answered, before LangGraph saved the step."""


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")
def test_a_refused_tool_call_says_to_record_every_call_of_its_message(
    checkpointer: PostgresSaver, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    """A tool that drafts its email with a clock, in v2, "killed" after call_2's email: every
    resume is refused (422). The advice recorded literally, call_2's ToolMessage alone as
    `tools`, would drop call_1 (done, its answer not yet in the state) and the prebuilt agent
    would refuse the history; the error says to record each call of the message, and that
    resumes the thread: 2 emails."""
    thread_id = f"case-{uuid.uuid4()}"
    config: Any = {"configurable": {"thread_id": thread_id}}
    clock = iter(range(1, 100))
    kill = ["bo@example.com"]
    with Gateway(gateway.url) as client:

        @tool
        def send_email(to: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
            """Email a customer."""
            body = {"to": to, "drafted_at": next(clock)}
            client.post("/emails", body, action="email", tool_call_id=tool_call_id)
            if to in kill:
                kill.remove(to)
                raise Killed(to)
            return "sent"

        graph = create_react_agent(
            ScriptedModel(), [send_email], checkpointer=checkpointer, version="v2"
        )
        with pytest.raises(Killed):
            graph.invoke({"messages": [HumanMessage("Refund both.")]}, config)
        with pytest.raises(ActionKeyReused) as refused:
            graph.invoke(None, config)
        assert "tool call 'call_2'" in str(refused.value)
        assert "a ToolMessage for each other call of the model's message" in str(refused.value)
        answers = [ToolMessage("sent", tool_call_id=call) for call in ("call_1", "call_2")]
        graph.update_state(config, {"messages": answers}, as_node="tools")
        final = graph.invoke(None, config)
    assert isinstance(final["messages"][-1], AIMessage)
    emails = [a for a in upstream.actions() if (a["idempotency_key"] or "").startswith(thread_id)]
    assert len(emails) == CALLS
