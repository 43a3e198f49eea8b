"""`oncegate lab --runtime langgraph`: the lab's 12-step task as a LangGraph graph, killed and
resumed by the same lab (crashlab.py, worker.py), under three strategies:

- A: compiled without a checkpointer: every process runs the graph from its first node.
- B: LangGraph's `PostgresSaver` on the gateway's database; a process that finds the thread's
  checkpoint resumes it (`invoke(None, ...)`), and the actions go straight to the upstream.
- C: B, and every action sent through the gateway with its task's key
  (`oncegate.agent.langgraph.Gateway`).

The graph: one node per step of `task.support_task`, named as the step, in a chain. A node
computes its step's output from the earlier outputs (the state's `outputs`, which LangGraph
appends to); an action node computes its request's body that way and POSTs it. B and C run with
`durability="sync"`: LangGraph saves each step's checkpoint before the step starts, so the
figures do not include a key's wait for an `"async"` save.

Each node reports on the lab's pipe as the runner does: `started`, `prepared` (an action's body
is computed, nothing sent), `done` (its output computed, or its action answered), and the saver
reports `checkpoint` for each write it makes. The lab kills the worker where the crash point
says. The crash in the gap is the `done` of an action node: the node has its action's answer
and waits for the SIGKILL before it returns, and LangGraph writes what a node did only once it
returned (the task's writes, then the step's checkpoint). So the kill lands between the action
and LangGraph's write of its step, and on resume LangGraph runs the node again: B sends the
action a second time, C sends it with the same key and the gateway answers from its store.

`--runtime langgraph-tools` plays the same task as an agent's tool calls: each action step is a
node standing for a model (it computes the request and answers with a message holding one tool
call of a fresh id, as a model would) followed by a `ToolNode` whose tool performs the action. C
sends it with a key from the tool call's id; the model's message, saved before the tool runs,
gives a resumed run the same id. The tool reports `prepared` and `done`, so the gap is in the
tool, between the action's answer and LangGraph's write of the tool step.
"""

from __future__ import annotations

import json
import operator
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypedDict

import httpx
import psycopg
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, InjectedToolCallId, StructuredTool
from langgraph.checkpoint.base import ChannelVersions, Checkpoint, CheckpointMetadata
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

from ..agent.checkpoints import JSON
from ..agent.client import RetryPolicy, SyncActionClient
from ..agent.langgraph import Gateway
from ..agent.runner import Step
from ..settings import database_url
from .model import Reconciliation, Run
from .task import support_task
from .worker import Environment, Runtime, reporter

TITLES = {
    "A": "no checkpointer: start over",
    "B": "PostgresSaver",
    "C": "PostgresSaver + task keys via oncegate",
}
TOOL_TITLES = {**TITLES, "C": "PostgresSaver + tool call keys via oncegate"}


class State(TypedDict):
    outputs: Annotated[list[JSON], operator.add]
    # The tool-calling variant's conversation: each model message and its tool's answer.
    messages: Annotated[list[AnyMessage], add_messages]


def connect(environment: Environment) -> psycopg.Connection[Any]:
    """A connection to the gateway's database as `PostgresSaver` wants it (autocommit, no
    prepared statements). On the lab's own database a save is not flushed to disk at once: the
    lab kills agents, never PostgreSQL (see `worker.Environment.flush_each_save`)."""
    options = "" if environment.flush_each_save else "-c synchronous_commit=off"
    return psycopg.Connection.connect(
        database_url.for_libpq(environment.database_url),  # a host list as libpq writes it
        autocommit=True,
        prepare_threshold=0,
        options=options,
    )


class CountedSaver(PostgresSaver):
    """`PostgresSaver` that tells the lab of each write it made (the checkpoint seconds)."""

    def __init__(self, connection: psycopg.Connection[Any], pipe: int) -> None:
        super().__init__(connection)
        self._pipe = pipe

    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        saved = super().put(config, checkpoint, metadata, new_versions)
        os.write(self._pipe, f"checkpoint {metadata.get('step', 0)}\n".encode())
        return saved

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        super().put_writes(config, writes, task_id, task_path)
        os.write(self._pipe, b"checkpoint writes\n")


@dataclass(frozen=True, slots=True)
class Work:
    """What the nodes do in one worker: this run's steps (`task.support_task`), how they report
    to the lab, how an action is performed (its answer returned)."""

    steps: Sequence[Step]
    report: Callable[[str, int], None]
    # Performs a step's action with its body; the tool-calling variant gives the tool call's id.
    act: Callable[[Step, JSON, str | None], JSON]


class LangGraphTask:
    """The task's graph, compiled once in the lab before the first worker is forked (compiling
    costs a worker more than running its 12 steps); each worker gives it its `Work` in its own
    copy of the memory, then runs it."""

    def __init__(self, tool_calls: bool = False) -> None:
        self.graph: CompiledStateGraph[State, None, State, State] | None = None
        self.work: Work | None = None
        self.tool_calls = tool_calls

    def prepare(self, environment: Environment) -> None:
        """Compile the graph and create (or bring up to date) LangGraph's tables."""
        builder: StateGraph[State] = StateGraph(State)
        previous = START
        for number, step in enumerate(support_task("any"), start=1):  # names only
            if self.tool_calls and step.action is not None:
                # The model's node, then the tool's: `send-email`, `send-email-tool`.
                builder.add_node(step.name, ModelNode(self, number))
                builder.add_node(f"{step.name}-tool", ToolNode([action_tool(self, number)]))
                builder.add_edge(previous, step.name)
                builder.add_edge(step.name, f"{step.name}-tool")
                previous = f"{step.name}-tool"
                continue
            builder.add_node(step.name, StepNode(self, number))
            builder.add_edge(previous, step.name)
            previous = step.name
        builder.add_edge(previous, END)
        self.graph = builder.compile()
        with connect(environment) as connection:
            PostgresSaver(connection).setup()

    def play(
        self,
        run: Run,
        environment: Environment,
        crash_point: tuple[str, int] | None,
        reconciliation: Reconciliation | None,
        pipe: int,
    ) -> int:
        """Run (or resume) `run` as a LangGraph graph in this worker (worker.Play)."""
        if self.graph is None:
            raise RuntimeError("the lab prepares the LangGraph runtime before its workers")
        if reconciliation is not None:
            raise ValueError("the LangGraph runtime has no reconciliation (strategies E and F)")

        strategy = run.strategy
        with httpx.Client(verify=environment.ssl_context, trust_env=False, timeout=10.0) as http:
            policy = RetryPolicy(deadline=60.0)
            upstream = SyncActionClient(http, environment.upstream_url, policy=policy)
            gateway = Gateway(environment.gateway_url, http=http, policy=policy)

            def act(step: Step, body: JSON, tool_call_id: str | None) -> JSON:
                assert step.action is not None
                if strategy.through_gateway:
                    response = gateway.post(
                        step.action.path, body, action=step.action.name, tool_call_id=tool_call_id
                    )
                else:
                    response = upstream.send(step.action.path, body, None)
                answer: JSON = response.json()
                return answer

            self.work = Work(support_task(run.run_id), reporter(pipe, crash_point), act)
            if not strategy.checkpoints:
                self.graph.invoke({"outputs": [], "messages": []})
                return 0
            config: RunnableConfig = {"configurable": {"thread_id": run.run_id}}
            with connect(environment) as connection:
                saver = CountedSaver(connection, pipe)
                started = saver.get_tuple(config) is not None
                graph = self.graph.copy(update={"checkpointer": saver})
                start: State | None = None if started else {"outputs": [], "messages": []}
                graph.invoke(start, config, durability="sync")
        return 0


class StepNode:
    """The node of step `number`: its output from the earlier ones, or its action's answer."""

    def __init__(self, task: LangGraphTask, number: int) -> None:
        self.task = task
        self.number = number

    def __call__(self, state: State) -> dict[str, list[JSON]]:
        work, number = self.task.work, self.number
        assert work is not None, "a node runs in a worker, after play()"
        step = work.steps[number - 1]
        work.report("started", number)
        output = step.compute(tuple(state["outputs"]))
        if step.action is not None:
            work.report("prepared", number)
            output = work.act(step, output, None)
        work.report("done", number)
        return {"outputs": [output]}


class ModelNode:
    """The tool-calling variant's model for the action step `number`: it computes the action's
    request from the earlier outputs and answers with one tool call of it, under a fresh id (a
    model's ids are new on every call; the saved message keeps this one)."""

    def __init__(self, task: LangGraphTask, number: int) -> None:
        self.task = task
        self.number = number

    def __call__(self, state: State) -> dict[str, list[Any]]:
        work, number = self.task.work, self.number
        assert work is not None, "a node runs in a worker, after play()"
        step = work.steps[number - 1]
        assert step.action is not None
        work.report("started", number)
        body = step.compute(tuple(state["outputs"]))
        call = {"name": step.action.name, "args": {"body": body},
                "id": f"call_{uuid.uuid4().hex[:24]}", "type": "tool_call"}  # fmt: skip
        return {"messages": [AIMessage(content="", tool_calls=[call])]}


def action_tool(task: LangGraphTask, number: int) -> BaseTool:
    """The tool that performs the action of step `number` with the body the model asked for."""
    name = support_task("any")[number - 1].action
    assert name is not None

    def perform(
        body: dict[str, Any], tool_call_id: Annotated[str, InjectedToolCallId]
    ) -> Command[Any]:
        work = task.work
        assert work is not None, "a tool runs in a worker, after play()"
        step = work.steps[number - 1]
        work.report("prepared", number)
        answer = work.act(step, body, tool_call_id)
        work.report("done", number)
        message = ToolMessage(json.dumps(answer), tool_call_id=tool_call_id)
        return Command(update={"outputs": [answer], "messages": [message]})

    return StructuredTool.from_function(
        perform, name=name.name, description=f"perform the {name.name} action ({name.path})"
    )


TASK = LangGraphTask()
RUNTIME = Runtime("LangGraph", TASK.play, TITLES, prepare=TASK.prepare)
TOOLS_TASK = LangGraphTask(tool_calls=True)
TOOLS_RUNTIME = Runtime(
    "LangGraph with tool calls", TOOLS_TASK.play, TOOL_TITLES, prepare=TOOLS_TASK.prepare
)
