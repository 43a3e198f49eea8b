"""A tool-calling agent that tests run in a process of their own, kill with SIGKILL and resume.

    python -m tests.agent.langgraph_tools --database-url URL --gateway URL --thread T
        [--agent toolnode|react-v1|react-v2|sends|batch] [--api sync|async] [--freeze]
        [--resume-by thread|checkpoint-id] [--update] [--drop-first-call | --add-call]
        [--delegate subgraph|task]

A scripted model (`ScriptedModel`) answers the thread's first message with one message holding
`CALLS` tool calls (an email to each of two customers); once the tools answered, it ends the
turn. The tools send their email through the gateway with the tool call's id
(`tool_call_id=...`, from LangChain's `InjectedToolCallId`), on LangGraph's `PostgresSaver`.

- `toolnode`: a `StateGraph` of a model node, a `ToolNode` and `tools_condition`: both tool calls
  run in one task (in two threads, or gathered under `ainvoke`).
- `react-v1`, `react-v2`: LangGraph's prebuilt `create_react_agent`; v1 runs the tool calls in
  one task, v2 sends each to a task of its own.
- `sends`: a model node whose edge sends each pending tool call to a `ToolNode` as
  `Send("tools", [call])`, a task a call: how `create_agent` (langchain 1.5, which LangGraph's
  deprecation of `create_react_agent` points to) runs its tools. `batch`: the same, all the
  pending calls in one `Send("tools", calls)`.

Each tool prints one JSON line when its email is answered (`sent`: the tool call's id, the key,
whether the gateway replayed it). With `--freeze`, the tool answered last prints
`{"event": "frozen"}` and waits for the SIGKILL: every email of the message was answered, and
LangGraph has saved nothing of the tool step (v2 may have saved the first task's writes).
With `--update`, the resume is preceded by an operator's `update_state` that adds no message:
the tool calls are still to run after it. With `--drop-first-call`, the resume is preceded by
an operator's edit of the model's message, as LangGraph's human-in-the-loop guides show: the
same message (its id) without its first tool call, written as the model's node. v2 then sends
the second call at the first `Send`'s place. With `--add-call`, the edit adds a call (`call_0`, an
email to a third customer) before the others: v2 sends each of them one place further on.
With `--delegate subgraph`, the tool does not send the email itself: it runs a subgraph
(`mailer`, compiled without a checkpointer, whose one node `mail` sends it), as an agent that
hands work to another agent does; the subgraph's node has no tool call id, its key descends from
the tool's task. With `--delegate task`, it calls a functional API task (`mail_task`) that sends
it, with the tool call's id it is given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from typing import Annotated, Any, NotRequired, TypedDict

import psycopg
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.tools import BaseTool, InjectedToolCallId, tool
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver
from langgraph.func import task
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, create_react_agent, tools_condition
from langgraph.types import Send

from oncegate.agent.langgraph import AsyncGateway, Gateway

CUSTOMERS = ("ana@example.com", "bo@example.com")
CALLS = len(CUSTOMERS)
# What `--add-call` puts before the message's calls.
ADDED = {
    "name": "send_email",
    "args": {"to": "cy@example.com"},
    "id": "call_0",
    "type": "tool_call",
}


REPORTING = threading.Lock()


def report(**fields: Any) -> None:
    """One JSON line on stdout, whole: a `ToolNode`'s tools report from threads of their own."""
    with REPORTING:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()


class ScriptedModel(BaseChatModel):
    """A chat model whose answers are written here: the tool calls first, then the end."""

    def _generate(
        self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None, **_: Any
    ) -> ChatResult:
        if any(isinstance(message, ToolMessage) for message in messages):
            reply = AIMessage(content="Both customers have their refund email.")
        else:
            calls = [
                {"name": "send_email", "args": {"to": to}, "id": f"call_{number}",
                 "type": "tool_call"}
                for number, to in enumerate(CUSTOMERS, start=1)
            ]  # fmt: skip
            reply = AIMessage(content="", tool_calls=calls)
        return ChatResult(generations=[ChatGeneration(message=reply)])

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:
        return self

    @property
    def _llm_type(self) -> str:
        return "scripted"


class Answered:
    """Counts the tools' answers; with `freeze`, the last one waits for the SIGKILL."""

    def __init__(self, freeze: bool) -> None:
        self.freeze = freeze
        self.count = 0
        self.lock = threading.Lock()

    def last(self) -> bool:
        with self.lock:
            self.count += 1
            return self.freeze and self.count == CALLS


def sent(response: Any, tool_call_id: str) -> None:
    report(
        event="sent",
        tool_call_id=tool_call_id,
        key=response.request.headers["Idempotency-Key"],
        replayed=response.headers.get("Idempotent-Replayed") == "true",
    )


class Mail(TypedDict):
    """`--delegate subgraph`'s state: the customer, and the tool call (only to report it)."""

    to: str
    call: str
    receipt: NotRequired[str]


def sync_tools(gateway: Gateway, answered: Answered, delegate: str | None) -> list[BaseTool]:
    def mail(state: Mail) -> dict[str, Any]:
        body = {"to": state["to"], "subject": "Your refund"}
        response = gateway.post("/emails", body, action="email")
        sent(response, state["call"])
        return {"receipt": str(response.json()["id"])}

    @task
    def mail_task(to: str, call: str) -> str:
        body = {"to": to, "subject": "Your refund"}
        response = gateway.post("/emails", body, action="email", tool_call_id=call)
        sent(response, call)
        return str(response.json()["id"])

    mailer = StateGraph(Mail)
    mailer.add_node("mail", mail)
    mailer.add_edge(START, "mail")
    mailer.add_edge("mail", END)
    delegated = mailer.compile()

    @tool
    def send_email(to: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Email a customer that the refund is on its way."""
        if delegate == "subgraph":
            receipt = delegated.invoke({"to": to, "call": tool_call_id})["receipt"]
        elif delegate == "task":
            receipt = mail_task(to, tool_call_id).result()
        else:
            body = {"to": to, "subject": "Your refund"}
            response = gateway.post("/emails", body, action="email", tool_call_id=tool_call_id)
            sent(response, tool_call_id)
            receipt = str(response.json()["id"])
        if answered.last():
            report(event="frozen")
            while True:  # until the SIGKILL
                time.sleep(60)
        return receipt

    return [send_email]


def async_tools(gateway: AsyncGateway, answered: Answered, delegate: str | None) -> list[BaseTool]:
    async def mail(state: Mail) -> dict[str, Any]:
        body = {"to": state["to"], "subject": "Your refund"}
        response = await gateway.post("/emails", body, action="email")
        sent(response, state["call"])
        return {"receipt": str(response.json()["id"])}

    @task
    async def mail_task(to: str, call: str) -> str:
        body = {"to": to, "subject": "Your refund"}
        response = await gateway.post("/emails", body, action="email", tool_call_id=call)
        sent(response, call)
        return str(response.json()["id"])

    mailer = StateGraph(Mail)
    mailer.add_node("mail", mail)
    mailer.add_edge(START, "mail")
    mailer.add_edge("mail", END)
    delegated = mailer.compile()

    @tool
    async def send_email(to: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> str:
        """Email a customer that the refund is on its way."""
        if delegate == "subgraph":
            receipt = (await delegated.ainvoke({"to": to, "call": tool_call_id}))["receipt"]
        elif delegate == "task":
            receipt = await mail_task(to, tool_call_id)
        else:
            body = {"to": to, "subject": "Your refund"}
            response = await gateway.post(
                "/emails", body, action="email", tool_call_id=tool_call_id
            )
            sent(response, tool_call_id)
            receipt = str(response.json()["id"])
        if answered.last():
            report(event="frozen")
            await asyncio.Event().wait()  # never set: until the SIGKILL
        return receipt

    return [send_email]


def build(agent: str, tools: list[BaseTool], checkpointer: Any) -> Any:
    model = ScriptedModel()
    if agent.startswith("react-"):
        return create_react_agent(
            model, tools, checkpointer=checkpointer, version="v1" if agent == "react-v1" else "v2"
        )

    def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    def send_calls(state: MessagesState) -> list[Send] | str:
        """Each call of the model's message still to answer, to the tools node on its own."""
        answered = {m.tool_call_id for m in state["messages"] if isinstance(m, ToolMessage)}
        last = state["messages"][-1]
        calls = last.tool_calls if isinstance(last, AIMessage) else []
        pending = [call for call in calls if call["id"] not in answered]
        if agent == "batch":
            return [Send("tools", pending)] if pending else END
        return [Send("tools", [call]) for call in pending] or END

    builder = StateGraph(MessagesState)
    builder.add_node("model", call_model)
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "model")
    if agent in ("sends", "batch"):
        builder.add_conditional_edges("model", send_calls, ["tools", END])
    else:
        builder.add_conditional_edges("model", tools_condition)
    builder.add_edge("tools", "model")
    return builder.compile(checkpointer=checkpointer)


def start_or_resume(saved: bool) -> Any:
    """The thread's first message, or None: resume it."""
    if saved:
        return None
    return {"messages": [HumanMessage("Tell both customers their refund is on its way.")]}


def edited(messages: list[AnyMessage], add: bool) -> dict[str, Any]:
    """The update that drops the first tool call of the model's last message (the same id), or,
    `add`, adds one before its calls."""
    last = [message for message in messages if isinstance(message, AIMessage)][-1]
    calls = [ADDED, *last.tool_calls] if add else last.tool_calls[1:]
    return {"messages": [AIMessage(content=last.content, id=last.id, tool_calls=calls)]}


def run_sync(arguments: argparse.Namespace) -> None:
    config: Any = {"configurable": {"thread_id": arguments.thread}}
    with (
        psycopg.Connection.connect(
            arguments.database_url, autocommit=True, prepare_threshold=0
        ) as connection,
        Gateway(arguments.gateway) as gateway,
    ):
        saver = PostgresSaver(connection)
        saver.setup()
        tools = sync_tools(gateway, Answered(arguments.freeze), arguments.delegate)
        graph = build(arguments.agent, tools, saver)
        saved = saver.get_tuple(config) is not None
        if saved and arguments.update:
            graph.update_state(config, {"messages": []})
        if saved and (arguments.drop_first_call or arguments.add_call):
            messages = graph.get_state(config).values["messages"]
            graph.update_state(config, edited(messages, arguments.add_call))
        if saved and arguments.resume_by == "checkpoint-id":
            config = graph.get_state(config).config
        final = graph.invoke(start_or_resume(saved), config)
    report(event="finished", messages=[type(message).__name__ for message in final["messages"]])


async def run_async(arguments: argparse.Namespace) -> None:
    config: Any = {"configurable": {"thread_id": arguments.thread}}
    async with (
        await psycopg.AsyncConnection.connect(
            arguments.database_url, autocommit=True, prepare_threshold=0
        ) as connection,
        AsyncGateway(arguments.gateway) as gateway,
    ):
        saver = AsyncPostgresSaver(connection)
        await saver.setup()
        tools = async_tools(gateway, Answered(arguments.freeze), arguments.delegate)
        graph = build(arguments.agent, tools, saver)
        saved = await saver.aget_tuple(config) is not None
        if saved and arguments.update:
            await graph.aupdate_state(config, {"messages": []})
        if saved and (arguments.drop_first_call or arguments.add_call):
            messages = (await graph.aget_state(config)).values["messages"]
            await graph.aupdate_state(config, edited(messages, arguments.add_call))
        if saved and arguments.resume_by == "checkpoint-id":
            config = (await graph.aget_state(config)).config
        final = await graph.ainvoke(start_or_resume(saved), config)
    report(event="finished", messages=[type(message).__name__ for message in final["messages"]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--thread", required=True)
    agents = ["toolnode", "react-v1", "react-v2", "sends", "batch"]
    parser.add_argument("--agent", choices=agents, default="toolnode")
    parser.add_argument("--api", choices=["sync", "async"], default="sync")
    parser.add_argument("--resume-by", choices=["thread", "checkpoint-id"], default="thread")
    parser.add_argument("--freeze", action="store_true")
    parser.add_argument("--update", action="store_true")
    edit = parser.add_mutually_exclusive_group()
    edit.add_argument("--drop-first-call", action="store_true")
    edit.add_argument("--add-call", action="store_true")
    parser.add_argument("--delegate", choices=["subgraph", "task"])
    arguments = parser.parse_args()
    if arguments.api == "sync":
        run_sync(arguments)
    else:
        asyncio.run(run_async(arguments))


if __name__ == "__main__":
    sys.exit(main())
