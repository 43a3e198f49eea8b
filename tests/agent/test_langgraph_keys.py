"""The keys of runs that never forked, pinned as literals: a change to how a LangGraph task's key
is derived (oncegate.agent.langgraph_keys) fails here.

A user who upgrades oncegate while a thread is between a kill and its resume relies on the
resumed tasks getting the keys the killed ones sent, so that the gateway answers them from its
store instead of performing them again. So the keys of ordinary runs (killed after an action and
resumed by thread id or by checkpoint id, an operator's note or `__copy__` before the resume,
interrupts, `Send`s, a subgraph, the functional API, a node's error handler, the prebuilt
agent's tool calls, langchain's `create_agent`'s, a subgraph or functional API task a tool call
runs, a replay from an earlier checkpoint, new input) must not change from one
version to the next. A change that has to change them is a breaking change for threads in
flight: say so in docs/agents.md ("Keys of threads in flight across an upgrade"), and only then
write the new literals here.

To make keys that are the same on every run, each graph runs on LangGraph's in-memory saver with
its checkpoint ids made by a counter instead of the clock (`counted_checkpoint_ids`), a thread id
of its own, and the process's memory of checkpoints read cleared (as in a new process). Each
scenario runs under durability "sync" and "async"; both make the same keys. In-process: a few
seconds for all of them.
"""

from __future__ import annotations

import inspect
import operator
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Annotated, Any, NotRequired, TypedDict

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import InjectedToolCallId, tool
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.func import entrypoint
from langgraph.func import task as functional_task
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import create_react_agent
from langgraph.pregel import _checkpoint
from langgraph.types import Command, Send, interrupt

from oncegate.agent import langgraph_keys
from oncegate.agent.langgraph import atask_key, task_key
from tests.agent.langgraph_tools import ScriptedModel, build

DURABILITIES = ("sync", "async")
# LangGraph 1.2 runs a node's error handler (`add_node(..., error_handler=...)`); 1.1 has none.
ERROR_HANDLERS = "error_handler" in inspect.signature(StateGraph.add_node).parameters


class Killed(Exception):
    """The process running the graph dies here (after its action, before LangGraph's write)."""


class State(TypedDict):
    count: int
    keys: Annotated[list[str], operator.add]
    note: NotRequired[str]


class Run:
    """The keys one run's tasks made (`made`: each once, sorted: the tasks of one step run in
    threads, in any order); `kill_at`: the labels of the actions after which the run is killed,
    once each."""

    def __init__(self, *kill_at: str) -> None:
        self.keys: list[str] = []
        self.kill_at = set(kill_at)

    @property
    def made(self) -> list[str]:
        return sorted(set(self.keys))

    def key(self, label: str, action: str, tool_call_id: str | None = None) -> str:
        key = task_key(action, tool_call_id=tool_call_id)
        self.keys.append(key)
        self.killed_after(label)
        return key

    async def akey(self, label: str, action: str) -> str:
        key = await atask_key(action)
        self.keys.append(key)
        self.killed_after(label)
        return key

    def killed_after(self, label: str) -> None:
        if label in self.kill_at:
            self.kill_at.discard(label)
            raise Killed(label)


@pytest.fixture(autouse=True)
def counted_checkpoint_ids(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """LangGraph's checkpoint ids made by a counter, in the order the clock would make them (a
    thread's checkpoints are ordered by id); and the process's memory of checkpoints read and
    lineages derived emptied, as in a new process, since the ids repeat from test to test."""
    made: list[str] = []

    def counted(node: int | None = None, clock_seq: int | None = None) -> uuid.UUID:
        made.append(f"00000000-0000-6000-8000-{len(made) + 1:012x}")
        return uuid.UUID(made[-1])

    # Where LangGraph makes a checkpoint's id (`create_checkpoint`, `empty_checkpoint`);
    # `checkpoint_ids_are_counted` fails loudly when it makes them elsewhere.
    monkeypatch.setattr(_checkpoint, "uuid6", counted)
    monkeypatch.setattr(
        langgraph_keys, "RECORDS", langgraph_keys.Remembered(langgraph_keys.RECORD_CACHE)
    )
    monkeypatch.setattr(langgraph_keys, "LINEAGE", langgraph_keys.Lineage())
    yield made


def checkpoint_ids_are_counted(saver: BaseCheckpointSaver[Any], made: list[str]) -> None:
    saved = [item.config["configurable"]["checkpoint_id"] for item in saver.list(None)]
    assert saved, "the run saved no checkpoint"
    assert set(saved) <= set(made), "LangGraph made checkpoint ids elsewhere than counted"


def steps_graph(run: Run) -> StateGraph[State]:
    """draft -> send (an email), three times; a fan-out of three `Send`s; a node that emails,
    then asks (`interrupt`) and notifies; a subgraph."""

    def draft(state: State) -> dict[str, Any]:
        return {"count": state["count"] + 1}

    def send(state: State) -> dict[str, Any]:
        return {"keys": [run.key(f"send-{state['count']}", "email")]}

    def fan_out(state: State) -> list[Send]:
        return [Send("notify", {"count": number, "keys": []}) for number in range(3)]

    def notify(state: State) -> dict[str, Any]:
        return {"keys": [run.key("notify", "email")]}

    def ask(state: State) -> dict[str, Any]:
        run.key("ask", "email")
        interrupt("send the notice?")
        return {"keys": [run.key("ask", "notice")]}

    def inner(state: State) -> dict[str, Any]:
        return {"keys": [run.key("inner", "inner")]}

    subgraph = StateGraph(State)
    subgraph.add_node("inner", inner)
    subgraph.add_edge(START, "inner")
    subgraph.add_edge("inner", END)
    builder = StateGraph(State)
    builder.add_node("draft", draft)
    builder.add_node("send", send)
    builder.add_node("fanned", lambda state: {})
    builder.add_node("notify", notify)
    builder.add_node("ask", ask)
    builder.add_node("outer", subgraph.compile())
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send")
    builder.add_conditional_edges("send", lambda state: "draft" if state["count"] < 3 else "fanned")
    builder.add_conditional_edges("fanned", fan_out, ["notify"])
    builder.add_edge("notify", "ask")
    builder.add_edge("ask", "outer")
    builder.add_edge("outer", END)
    return builder


def steps(resume: str, durability: str, made: list[str]) -> list[str]:
    """Killed after the second email, resumed as `resume` says; the interrupt answered; then a
    replay from the thread's first checkpoint by its id, answered; new input, answered."""
    run = Run("send-2")
    saver = InMemorySaver()
    graph = steps_graph(run).compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": f"steps-{resume}"}}
    start = {"count": 0, "keys": []}
    with pytest.raises(Killed):
        graph.invoke(start, config, durability=durability)
    if resume == "checkpoint-id":
        config_of_resume = graph.get_state(config).config
    elif resume == "note":
        graph.update_state(config, {"note": "checked"}, as_node="draft")
        config_of_resume = config
    elif resume == "copy":
        graph.update_state(config, None, as_node="__copy__")
        config_of_resume = config
    else:
        config_of_resume = config
    graph.invoke(None, config_of_resume, durability=durability)
    graph.invoke(Command(resume="yes"), config, durability=durability)
    first = list(graph.get_state_history(config))[-1].config
    graph.invoke(None, first, durability=durability)
    graph.invoke(Command(resume="yes"), config, durability=durability)
    graph.invoke(start, config, durability=durability)
    graph.invoke(Command(resume="yes"), config, durability=durability)
    checkpoint_ids_are_counted(saver, made)
    return run.made


def functional(durability: str, made: list[str]) -> list[str]:
    """An entrypoint that emails from a task per call: three calls, then two on the same thread,
    then a replay of the first run from its first checkpoint by id."""
    run = Run()

    @functional_task
    def email(number: int) -> str:
        return run.key("call", "email")

    saver = InMemorySaver()

    @entrypoint(checkpointer=saver)
    def flow(count: int) -> list[str]:
        return [email(number).result() for number in range(count)]

    config: Any = {"configurable": {"thread_id": "functional"}}
    flow.invoke(3, config, durability=durability)
    flow.invoke(2, config, durability=durability)
    flow.invoke(None, list(flow.get_state_history(config))[-1].config, durability=durability)
    checkpoint_ids_are_counted(saver, made)
    return run.made


def error_handler(resume: str, durability: str, made: list[str]) -> list[str]:
    """A node that fails, whose error handler alerts and is killed after it; resumed."""
    run = Run("alert")

    def draft(state: State) -> dict[str, Any]:
        return {"count": state["count"] + 1}

    def failing(state: State) -> dict[str, Any]:
        raise RuntimeError("refused")

    def handler(state: State) -> dict[str, Any]:
        return {"keys": [run.key("alert", "alert")]}

    builder = StateGraph(State)
    builder.add_node("draft", draft)
    builder.add_node("send", failing, error_handler=handler)  # type: ignore[call-arg, unused-ignore]
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send")
    builder.add_edge("send", END)
    saver = InMemorySaver()
    graph = builder.compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": f"handler-{resume}"}}
    with pytest.raises(Killed):
        graph.invoke({"count": 0, "keys": []}, config, durability=durability)
    again = graph.get_state(config).config if resume == "checkpoint-id" else config
    graph.invoke(None, again, durability=durability)
    checkpoint_ids_are_counted(saver, made)
    return run.made


class Mail(TypedDict):
    to: str
    call: str


def tool_calls(resume: str, durability: str, made: list[str], shape: str = "v2") -> list[str]:
    """The prebuilt agent (v2: a `Send` a tool call) emails two customers, a tool call each;
    killed after the second email, resumed as `resume` says, then replayed from the first
    checkpoint by id. `shape`: `sends`, a graph that sends each call as `Send("tools", [call])`
    (langchain's `create_agent`); `subgraph`, v2 whose tool runs a subgraph that emails (no call
    id); `task`, v2 whose tool calls a functional API task that emails with the call's id."""
    run = Run("bo@example.com")

    def mail(state: Mail) -> dict[str, Any]:
        run.key(state["to"], "email")
        return {}

    mailer = StateGraph(Mail)
    mailer.add_node("mail", mail)
    mailer.add_edge(START, "mail")
    mailer.add_edge("mail", END)
    delegated = mailer.compile()

    @functional_task
    def mail_task(to: str, call: str) -> str:
        return run.key(to, "email", call)

    @tool
    def send_email(to: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Email a customer."""
        if shape == "subgraph":
            delegated.invoke({"to": to, "call": tool_call_id})
        elif shape == "task":
            mail_task(to, tool_call_id).result()
        else:
            run.key(to, "email", tool_call_id)
        return "sent"

    saver = InMemorySaver()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "create_react_agent has been moved")
        if shape == "sends":
            graph = build("sends", [send_email], saver)
        else:
            graph = create_react_agent(
                ScriptedModel(), [send_email], checkpointer=saver, version="v2"
            )
    suffix = "" if shape == "v2" else f"-{shape}"
    config: Any = {"configurable": {"thread_id": f"tools{suffix}-{resume}"}}
    with pytest.raises(Killed):
        graph.invoke({"messages": [HumanMessage("refund both")]}, config, durability=durability)
    if resume == "checkpoint-id":
        config = graph.get_state(config).config
    elif resume == "note":
        graph.update_state(config, {"messages": []})
    elif resume == "same-message":  # the model's message written again as it was
        message = [m for m in graph.get_state(config).values["messages"] if m.type == "ai"][-1]
        again = AIMessage(content="", id=message.id, tool_calls=message.tool_calls)
        graph.update_state(config, {"messages": [again]})
    elif resume == "input-note":
        graph.update_state(config, {"messages": [HumanMessage("?")]}, as_node="__input__")
    graph.invoke(None, config, durability=durability)
    graph.invoke(None, list(graph.get_state_history(config))[-1].config, durability=durability)
    checkpoint_ids_are_counted(saver, made)
    return run.made


async def async_nodes(made: list[str]) -> list[str]:
    """`atask_key` in async nodes under `ainvoke`: draft -> send twice, killed after the first
    email, resumed by thread id."""
    run = Run("send-1")

    async def draft(state: State) -> dict[str, Any]:
        return {"count": state["count"] + 1}

    async def send(state: State) -> dict[str, Any]:
        return {"keys": [await run.akey(f"send-{state['count']}", "email")]}

    builder = StateGraph(State)
    builder.add_node("draft", draft)
    builder.add_node("send", send)
    builder.add_edge(START, "draft")
    builder.add_edge("draft", "send")
    builder.add_conditional_edges("send", lambda state: "draft" if state["count"] < 2 else END)
    saver = InMemorySaver()
    graph = builder.compile(checkpointer=saver)
    config: Any = {"configurable": {"thread_id": "async nodes/ü"}}  # escaped in the key
    with pytest.raises(Killed):
        await graph.ainvoke({"count": 0, "keys": []}, config, durability="async")
    await graph.ainvoke(None, config, durability="async")
    checkpoint_ids_are_counted(saver, made)
    return run.made


SCENARIOS: dict[str, Callable[[str, list[str]], list[str]]] = {
    **{
        f"steps, resumed by {resume}": (
            lambda durability, made, resume=resume: steps(resume, durability, made)
        )
        for resume in ("thread", "checkpoint-id", "note", "copy")
    },
    "functional API": functional,
    **{
        f"tool calls, resumed by {resume}": (
            lambda durability, made, resume=resume: tool_calls(resume, durability, made)
        )
        for resume in ("thread", "checkpoint-id", "note", "same-message", "input-note")
    },
    **{
        f"tool calls ({shape}), resumed by {resume}": (
            lambda durability, made, resume=resume, shape=shape: tool_calls(
                resume, durability, made, shape
            )
        )
        for shape in ("sends", "subgraph", "task")
        for resume in ("thread", "checkpoint-id", "note", "same-message")
    },
    **{
        f"error handler, resumed by {resume}": (
            lambda durability, made, resume=resume: error_handler(resume, durability, made)
        )
        for resume in (("thread", "checkpoint-id") if ERROR_HANDLERS else ())
    },
}


@pytest.mark.parametrize("durability", DURABILITIES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_keys_of_runs_that_never_forked_are_the_pinned_ones(
    scenario: str, durability: str, counted_checkpoint_ids: list[str]
) -> None:
    thread, keys = EXPECTED[scenario]
    made = SCENARIOS[scenario](durability, counted_checkpoint_ids)
    assert made == [f"{thread}:{key}" for key in keys]


async def test_the_keys_of_async_nodes_are_the_pinned_ones(
    counted_checkpoint_ids: list[str],
) -> None:
    thread, keys = EXPECTED_ASYNC_NODES
    made = await async_nodes(counted_checkpoint_ids)
    assert made == [f"{thread}:{key}" for key in keys]


# The keys, each written after its thread id: `node:<digest>:action`, a level each inside a
# subgraph, the tool call's id before the action.
# The steps' keys when the resume made a checkpoint of its own (a fork, a note, a copy): the first
# run's keys (replayed by the resume and by the replay), and those after the new input.
STEPS_AFTER_ONE_MORE_CHECKPOINT = [
    "ask:34c431a97077ceb6578f955c89b8306a:email",
    "ask:34c431a97077ceb6578f955c89b8306a:notice",
    "ask:f33f689d0cd9a888e1cc20c005cfb7a1:email",
    "ask:f33f689d0cd9a888e1cc20c005cfb7a1:notice",
    "notify:23c15c61230985cfbf45b6748994990f:email",
    "notify:2d8fef4ed8a2859f9b3385624f89cc5b:email",
    "notify:2f6baeafd55ba979f0e9c89719d8475e:email",
    "notify:4812afc6eadb0b76ae58d9d5f5380df2:email",
    "notify:c4cfe0f704da261af09ef6c1f2beab2b:email",
    "notify:d37ea0fb05019cdb0a095595a20455b0:email",
    "outer:a7b9ff0d09bde51376c1f0747684a485|inner:db6f6e689aa88f1ed7bf549ea0b4af48:inner",
    "outer:e6911260697d8a07dccad44a3d06e3cb|inner:90de0088bf956a0d882fa6df81bc59b5:inner",
    "send:4a54ff8b00ef0a4b4e035a47db015316:email",
    "send:6abd5cfaa983e3162eb8643cbcdb7b2b:email",
    "send:97400616e0af577f37cbcbe735739bcb:email",
    "send:ab87c4821274103889cbbdf1f9a47a87:email",
    "send:e165470702c62842b761b29179f1a951:email",
    "send:eab58f2aee7218493121993594202551:email",
]
# Each tool call keeps its key however the run is resumed.
TOOL_CALLS = [
    "tools:11e47061eb70d49e714a4302308a7083:call_1:email",
    "tools:65e1a933c1dcca86a30166ad356c2d98:call_2:email",
]
# A subgraph a v2 tool call runs: the tool's part, then the subgraph's node's (no call id).
TOOL_CALLS_SUBGRAPH = [
    "tools:2d48c506b69a94aadd30c023c051380e|mail:52b456608e8b7c9ac271da535c389eb2:email",
    "tools:bf25335c15c33dcbd183cdce0d0d3fe3|mail:7e078968a25ef2d0cd0e637c1d972a7b:email",
]
# A functional API task a v2 tool call calls, with the call's id.
TOOL_CALLS_TASK = [
    "mail_task:0a887192060ae08c0d672df8c04f9363:call_2:email",
    "mail_task:b6a23c659d56f05d52aa158c3b5cb7d0:call_1:email",
]
EXPECTED: dict[str, tuple[str, list[str]]] = {
    "steps, resumed by thread": (
        "steps-thread",
        [
            "ask:6f5bcc94321786a0121225b763a13967:email",
            "ask:6f5bcc94321786a0121225b763a13967:notice",
            "ask:f33f689d0cd9a888e1cc20c005cfb7a1:email",
            "ask:f33f689d0cd9a888e1cc20c005cfb7a1:notice",
            "notify:2d8fef4ed8a2859f9b3385624f89cc5b:email",
            "notify:a526bc1a7949bdce4176e7001dcb757b:email",
            "notify:c41a80b38bd97d07fdcb460c27689a97:email",
            "notify:c4cfe0f704da261af09ef6c1f2beab2b:email",
            "notify:c68571cf1eeea7a201eb5693dd177ead:email",
            "notify:d37ea0fb05019cdb0a095595a20455b0:email",
            "outer:2d4f4508df37d738e9f3a8d4d5da2d7a|inner:9820c5d923245d7cc0a7735a37de2d9c:inner",
            "outer:a7b9ff0d09bde51376c1f0747684a485|inner:db6f6e689aa88f1ed7bf549ea0b4af48:inner",
            "send:3779c10841aa0adda70d1c4daacae6b1:email",
            "send:699e4681e24d98d048f526f7e543a887:email",
            "send:6abd5cfaa983e3162eb8643cbcdb7b2b:email",
            "send:7443609c6997ef1e7ee632c6b775bd19:email",
            "send:ab87c4821274103889cbbdf1f9a47a87:email",
            "send:eab58f2aee7218493121993594202551:email",
        ],
    ),
    "steps, resumed by checkpoint-id": ("steps-checkpoint-id", STEPS_AFTER_ONE_MORE_CHECKPOINT),
    "steps, resumed by note": ("steps-note", STEPS_AFTER_ONE_MORE_CHECKPOINT),
    "steps, resumed by copy": ("steps-copy", STEPS_AFTER_ONE_MORE_CHECKPOINT),
    "functional API": (
        "functional",
        [
            "email:3ac6d72bcbcb6d4386823c1d8d442936:email",
            "email:7db102bdf8e1418831d33a6aefacd55d:email",
            "email:87d6aa46f037812903998d3d5fbd3c02:email",
            "email:9342d90293f2ce32c08457955dd00e28:email",
            "email:b983fb0297522c1131293bec223397e6:email",
        ],
    ),
    "tool calls, resumed by thread": ("tools-thread", TOOL_CALLS),
    "tool calls, resumed by checkpoint-id": ("tools-checkpoint-id", TOOL_CALLS),
    "tool calls, resumed by note": ("tools-note", TOOL_CALLS),
    "tool calls, resumed by same-message": ("tools-same-message", TOOL_CALLS),
    "tool calls, resumed by input-note": ("tools-input-note", TOOL_CALLS),
    **{
        f"tool calls ({shape}), resumed by {resume}": (f"tools-{shape}-{resume}", keys)
        for shape, keys in (
            ("sends", TOOL_CALLS),
            ("subgraph", TOOL_CALLS_SUBGRAPH),
            ("task", TOOL_CALLS_TASK),
        )
        for resume in ("thread", "checkpoint-id", "note", "same-message")
    },
    "error handler, resumed by thread": (
        "handler-thread",
        ["send:021729b16de8c1a63eafa8bc31deb0bc:alert"],
    ),
    "error handler, resumed by checkpoint-id": (
        "handler-checkpoint-id",
        ["send:021729b16de8c1a63eafa8bc31deb0bc:alert"],
    ),
}
# The thread id is escaped in the key (a space, a non-ASCII letter).
EXPECTED_ASYNC_NODES = (
    "async%20nodes/%C3%BC",
    [
        "send:6abd5cfaa983e3162eb8643cbcdb7b2b:email",
        "send:eab58f2aee7218493121993594202551:email",
    ],
)
