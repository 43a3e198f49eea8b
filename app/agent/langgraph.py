"""Keys for the actions of LangGraph nodes and tools, and the clients that send them through the
gateway.

Inside a node, `task_key("email")` is the key of the email that node is about to send;
`Gateway(url).post("/emails", body, action="email")` (or `AsyncGateway` in an async node) sends
it with that key and `Prefer: wait`, and raises the agent library's errors (`client`):
`ActionOutcomeUnknown`, `ActionKeyReused`, `ActionRejected`, `GaveUp`. Inside a tool, pass the
tool call's id (`tool_call_id=runtime.tool_call_id`): each tool call of one model message is its
own action. `docs/agents.md` is the user's reference. Needs the extra `oncegate[langgraph]`: of
the agent library, only this module and `langgraph_keys` import LangGraph.

What the key is made of, and why, is `langgraph_keys`: its docstring states the rules, its
`derive` applies them and reads nothing itself. This module is what a node calls, around it:
- `task_key` and `atask_key` run the derivation and answer each read it asks for with the
  saver's sync API (`answer`) or its async one (`aanswer`; a saver that has none is read in a
  thread). Under durability "async" a read of the step's own checkpoint waits for its save, up
  to `SAVE_WAIT`, before anything is sent: `langgraph_keys`' one condition.
- `Gateway` and `AsyncGateway` send an action with that key; `Sent` refuses a second action
  under one name in one attempt of a task (`ActionNameReused`); `reused` says what to do on
  LangGraph when the gateway refuses a key with another request (422).
- `retry_on`: which errors LangGraph's `RetryPolicy` may retry on a node that acts through the
  gateway.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import Any, Self

import httpx
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple
from langgraph.config import get_config
from langgraph.runtime import get_runtime
from langgraph.types import RetryPolicy as NodeRetryPolicy

from . import langgraph_keys
from .checkpoints import JSON
from .client import (
    ActionClient,
    ActionError,
    ActionKeyReused,
    ActionRejected,
    GaveUp,
    RetryPolicy,
    SyncActionClient,
    is_final,
)
from .langgraph_keys import INTERNALS as INTERNALS  # named by tests/agent
from .langgraph_keys import WALK_BATCH as WALK_BATCH  # named by docs/agents.md and tests/agent
from .langgraph_keys import TaskKeyUnavailable

DEFAULT_TIMEOUT = 30.0
# How long a key waits for the save of its step's checkpoint under durability="async". The save
# runs beside the step and takes milliseconds; a save that has not landed in this long is stuck
# (a database down), and sending without it could send twice.
SAVE_WAIT = 30.0
# Keys a client remembers having sent, with the attempt of the task that sent them.
SENT_MEMORY = 4_096


class ActionNameReused(ActionError):
    """One attempt of one task sent two actions under the same action name (and tool call):
    the second would have been answered with the first's stored answer, never performed.
    Nothing was sent for it."""


# --- the key of the running task ------------------------------------------------------------------


def _wait_message(task: langgraph_keys.Task, request: langgraph_keys.Read, save_wait: float) -> str:
    return (
        f"the checkpoint this task's step started from ({request.checkpoint_id}) was not saved "
        f"within {save_wait:g} s ({task.durability!r} durability): sent before that save, the "
        "action would get another key on resume, so nothing was sent"
    ) + (
        ""
        if request.namespace == ""
        else f". The step is one of subgraph {request.namespace!r}: a subgraph compiled with "
        "checkpointer=False never saves it; compile it without a checkpointer (the default, "
        "checkpointer=None: its checkpoints are saved with the parent's run)"
    )


def answer(
    task: langgraph_keys.Task, request: langgraph_keys.Request, save_wait: float
) -> langgraph_keys.Answer:
    """A request of `derive`, answered with the saver's sync API."""
    if isinstance(request, langgraph_keys.Search):
        if isinstance(request, langgraph_keys.Earlier) and not lists(task.checkpointer, sync=True):
            return ()  # a saver that cannot list: the walk reads one checkpoint at a time
        config, options = request.search(task.thread_id)
        return request.decide(task.checkpointer.list(config, **options))
    config = langgraph_keys.reading(task.thread_id, request.namespace, request.checkpoint_id)
    found = langgraph_keys.record(task.checkpointer.get_tuple(config))
    if found is None and request.own and task.durability == "async":
        for pause in pauses(task, request, save_wait):
            time.sleep(pause)
            found = langgraph_keys.record(task.checkpointer.get_tuple(config))
            if found is not None:
                break
    return found


def pauses(
    task: langgraph_keys.Task, request: langgraph_keys.Read, save_wait: float
) -> Iterator[float]:
    """The pauses between reads of a step's checkpoint that durability "async" has not saved
    yet: from 2 ms, doubling up to 50 ms; `TaskKeyUnavailable` once `save_wait` has passed."""
    deadline = time.monotonic() + save_wait
    pause = 0.002
    while time.monotonic() < deadline:
        yield pause
        pause = min(pause * 2, 0.05)
    raise TaskKeyUnavailable(_wait_message(task, request, save_wait))


def task_key(action: str, *, tool_call_id: str | None = None, save_wait: float = SAVE_WAIT) -> str:
    """The key of `action` for the LangGraph task running now: the same on every resume of this
    task, by thread id or by checkpoint id, another for the next run of the node and for another
    thread. `tool_call_id`: the tool call this action is for, inside a tool. Call it inside a
    node, a tool or a functional API task of a graph with a checkpointer; under durability
    "async" it waits (up to `SAVE_WAIT`) for the step's checkpoint to be saved."""
    task = langgraph_keys.running_task()
    derivation = langgraph_keys.derive(task)
    try:
        request = next(derivation)
        while True:
            request = derivation.send(answer(task, request, save_wait))
    except StopIteration as done:
        return langgraph_keys.compose(task, done.value, action, tool_call_id)


def lists(checkpointer: BaseCheckpointSaver[Any], *, sync: bool) -> bool:
    """Whether the saver can list its checkpoints, through the sync API or, `sync` False, either:
    a saver may keep only `get_tuple` and `put`, and then LangGraph's base `list` and `alist`
    refuse to list. Asked of the saver's class, as `aread` asks, not by catching what the base
    raises: a saver's own error reaches the caller as it is."""
    saver = type(checkpointer)
    if saver.list is not BaseCheckpointSaver.list:
        return True
    return not sync and saver.alist is not BaseCheckpointSaver.alist


async def aread(
    checkpointer: BaseCheckpointSaver[Any], config: RunnableConfig
) -> CheckpointTuple | None:
    """A saved checkpoint, through the saver's async API; a saver that has none (the sync
    `PostgresSaver`: it keeps LangGraph's base `aget_tuple`) is read in a thread, off the event
    loop. Asked of the saver's class, not by catching what the base raises: an async saver's own
    error reaches the caller as it is."""
    if type(checkpointer).aget_tuple is BaseCheckpointSaver.aget_tuple:
        return await asyncio.to_thread(checkpointer.get_tuple, config)
    return await checkpointer.aget_tuple(config)


async def aanswer(
    task: langgraph_keys.Task, request: langgraph_keys.Request, save_wait: float
) -> langgraph_keys.Answer:
    """`answer`, with the saver's async API (in a thread for a saver that has none)."""
    if isinstance(request, langgraph_keys.Search):
        checkpointer = task.checkpointer
        if isinstance(request, langgraph_keys.Earlier) and not lists(checkpointer, sync=False):
            return ()  # a saver that cannot list: the walk reads one checkpoint at a time
        config, options = request.search(task.thread_id)
        if type(checkpointer).alist is BaseCheckpointSaver.alist:
            listed = await asyncio.to_thread(lambda: list(checkpointer.list(config, **options)))
        else:
            listed = [saved async for saved in checkpointer.alist(config, **options)]
        return request.decide(listed)
    config = langgraph_keys.reading(task.thread_id, request.namespace, request.checkpoint_id)
    found = langgraph_keys.record(await aread(task.checkpointer, config))
    if found is None and request.own and task.durability == "async":
        for pause in pauses(task, request, save_wait):
            await asyncio.sleep(pause)
            found = langgraph_keys.record(await aread(task.checkpointer, config))
            if found is not None:
                break
    return found


async def atask_key(
    action: str, *, tool_call_id: str | None = None, save_wait: float = SAVE_WAIT
) -> str:
    """`task_key` for async nodes and tools: reads the checkpoints with the saver's async API."""
    task = langgraph_keys.running_task()
    derivation = langgraph_keys.derive(task)
    try:
        request = next(derivation)
        while True:
            request = derivation.send(await aanswer(task, request, save_wait))
    except StopIteration as done:
        return langgraph_keys.compose(task, done.value, action, tool_call_id)


# --- what a client sent ---------------------------------------------------------------------------


class Sent:
    """The keys a client is sending or had answered, each with the attempt of the task that sent
    it: the same key sent again in the same attempt is a second action under one name (refused,
    also when the first is still on its way, from another thread of a `ToolNode`); in a later
    attempt (LangGraph's retry, a resume) it is the same action again (sent). A send that
    failed is forgotten: the node may resend it."""

    def __init__(self, size: int = SENT_MEMORY) -> None:
        # The attempt object is kept, not its id(): a freed object's id can be reused.
        self._sent: OrderedDict[str, object] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def claim(self, key: str, attempt: object, action: str, tool_call_id: str | None) -> None:
        """Note `key` as sent by `attempt`, or raise `ActionNameReused` if it already was."""
        with self._lock:
            if self._sent.get(key) is not attempt:
                self._sent[key] = attempt
                self._sent.move_to_end(key)
                while len(self._sent) > self._size:
                    self._sent.popitem(last=False)
                return
        what = f"action {action!r}" + (f" of tool call {tool_call_id!r}" if tool_call_id else "")
        raise ActionNameReused(
            f"this task already sent {what} (key {key}): a second action under the same name "
            "would be answered with the first one's stored answer, never performed. Give each "
            "action of a task its own name (action='email-customer', action='email-team'), and "
            "pass each tool call's id (tool_call_id=...). If this is the same action again, "
            "resent by a retry inside the task (a loop in the node or the tool, langchain's "
            "ToolRetryMiddleware) after something that followed it failed: nothing was sent "
            "for it; leave that retry to LangGraph's RetryPolicy on the node, whose next "
            "attempt resends the action with the same key, answered from the gateway's store, "
            "or retry only what comes before the action",
            key=key,
        )

    def forget(self, key: str, attempt: object) -> None:
        """The send of `key` by `attempt` failed: it may be sent again."""
        with self._lock:
            if self._sent.get(key) is attempt:
                del self._sent[key]


# One per process: two clients in one task (a client made per call) see each other's keys.
SENT = Sent()


def reused(error: ActionKeyReused, tool_call_id: str | None = None) -> ActionKeyReused:
    """The gateway's 422 for a task's key, with what to do about it on LangGraph."""
    node = get_config().get("metadata", {}).get("langgraph_node", "<node>")
    # `update_state` on the graph the caller invokes names a node of its top level: inside a
    # subgraph, the node that runs the subgraph (a node's name holds no ':' or '|').
    execution = get_runtime().execution_info
    namespace = execution.checkpoint_ns if execution is not None else ""
    top = namespace.split("|")[0].split(":")[0] or node
    inside = f" (the node whose subgraph runs {node!r})" if top != node else ""
    # A tool call's output is a ToolMessage; recorded alone, LangGraph drops the message's other
    # calls still to run, and a prebuilt agent refuses a history with unanswered calls.
    call = (
        f". For tool call {tool_call_id!r} the output is its ToolMessage, in one update with a "
        "ToolMessage for each other call of the model's message ({'messages': [ToolMessage(..., "
        f"tool_call_id={tool_call_id!r}), ...]}}): a call left out is dropped, and a prebuilt "
        "agent refuses the history."
        if tool_call_id
        else ""
    )
    return ActionKeyReused(
        f"{error}. On LangGraph this key is the one the task this run continues sent (a "
        "resume, a replay, or an update_state that left the task to run), and this run's "
        "request came out different, so nothing was sent. If the first request was performed "
        "and that is all, record what the node returned and resume: graph.update_state(config, "
        f"output, as_node={top!r}){inside}. If this request is new work, to perform as well: "
        "record the first that way, then give the node its new input as the node before it "
        "(graph.update_state(config, values, as_node=...)): a task started by that update gets "
        "a key of its own. A request that changes on every run (a clock, a model's draft) is "
        f"drafted in an earlier node (docs/agents.md, 'Drafting in an earlier node'){call}",
        key=error.key,
        response=error.response,
    )


class Gateway:
    """Sends a node's (or a tool's) actions through the gateway at `base_url`, each with its
    task's key.

    `http`: a caller's `httpx.Client` (its timeouts, proxies, certificates); by default one of
    its own, closed by `close()` or at the end of a `with` block. `save_wait`: how long a key
    waits for its step's checkpoint to be saved under durability "async" (`SAVE_WAIT`)."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.Client | None = None,
        policy: RetryPolicy | None = None,
        rng: random.Random | None = None,
        save_wait: float = SAVE_WAIT,
    ) -> None:
        self._save_wait = save_wait
        self._own = http is None
        self._http = http or httpx.Client(timeout=DEFAULT_TIMEOUT)
        self._client = SyncActionClient(self._http, base_url, policy=policy, rng=rng)

    def post(
        self,
        path: str,
        body: JSON,
        *,
        action: str,
        tool_call_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST `body` as JSON to `path` with the key of `action` for the running task (and
        tool call); the final 2xx answer (a replay is as good), or raise."""
        return self.request(
            "POST", path, action=action, json=body, tool_call_id=tool_call_id, headers=headers
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        action: str,
        json: JSON | None = None,
        form: Mapping[str, str] | None = None,
        tool_call_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """Send `method` to `path`, the body JSON (`json`) or a form (`form`), with the key of
        `action` for the running task (and tool call); the final 2xx answer, or raise."""
        key = task_key(action, tool_call_id=tool_call_id, save_wait=self._save_wait)
        attempt = running_task_attempt()
        SENT.claim(key, attempt, action, tool_call_id)
        try:
            return self._client.request(method, path, key, json=json, form=form, headers=headers)
        except ActionKeyReused as error:
            SENT.forget(key, attempt)
            raise reused(error, tool_call_id) from error
        except BaseException:
            SENT.forget(key, attempt)
            raise

    def close(self) -> None:
        if self._own:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class AsyncGateway:
    """`Gateway` for async nodes and tools (`ainvoke`, `astream`), on an `httpx.AsyncClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        policy: RetryPolicy | None = None,
        rng: random.Random | None = None,
        save_wait: float = SAVE_WAIT,
    ) -> None:
        self._save_wait = save_wait
        self._own = http is None
        self._http = http or httpx.AsyncClient(timeout=DEFAULT_TIMEOUT)
        # No key lifetime: a LangGraph run has no saved pending action whose age it could check.
        self._client = ActionClient(self._http, base_url, policy=policy, rng=rng, key_lifetime=None)

    async def post(
        self,
        path: str,
        body: JSON,
        *,
        action: str,
        tool_call_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """POST `body` as JSON to `path` with the key of `action` for the running task (and
        tool call); the final 2xx answer (a replay is as good), or raise."""
        return await self.request(
            "POST", path, action=action, json=body, tool_call_id=tool_call_id, headers=headers
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        action: str,
        json: JSON | None = None,
        form: Mapping[str, str] | None = None,
        tool_call_id: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> httpx.Response:
        """`Gateway.request`, awaited."""
        key = await atask_key(action, tool_call_id=tool_call_id, save_wait=self._save_wait)
        attempt = running_task_attempt()
        SENT.claim(key, attempt, action, tool_call_id)
        try:
            return await self._client.request(
                method, path, key, json=json, form=form, headers=headers
            )
        except ActionKeyReused as error:
            SENT.forget(key, attempt)
            raise reused(error, tool_call_id) from error
        except BaseException:
            SENT.forget(key, attempt)
            raise

    async def aclose(self) -> None:
        if self._own:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


def running_task_attempt() -> object:
    """The object that stands for this attempt of the running task: LangGraph makes a new
    runtime for each attempt (`RetryPolicy`), shared by a node's tools."""
    return get_runtime()


# --- retries --------------------------------------------------------------------------------------


def retry_on(error: Exception) -> bool:
    """A `retry_on` for LangGraph's `RetryPolicy` on nodes that act through the gateway:
    `RetryPolicy(retry_on=oncegate.agent.langgraph.retry_on)`.

    Retries an upstream's 5xx answered for the first time (`ActionRejected`, not a replay): the
    retry sends the same key, so the upstream sees it again only if the route releases that
    status (`release_statuses`); a stored 5xx comes back as a replay, which is final. Never
    retries oncegate's final errors: a reused key, an unknown outcome, an upstream's 4xx, a
    client that gave up after its own retries, two actions under one name, a task without a key.
    Anything else is LangGraph's default rule's to decide."""
    if isinstance(error, ActionRejected):
        response = error.response
        return response is not None and response.status_code >= 500 and not is_final(response)
    if isinstance(error, ActionError | GaveUp | TaskKeyUnavailable):
        return False
    # LangGraph's own rule, the default of its RetryPolicy (a function, though typed as either).
    default = NodeRetryPolicy().retry_on
    return bool(default(error)) if callable(default) else isinstance(error, tuple(default))


__all__ = [
    "ActionNameReused",
    "AsyncGateway",
    "Gateway",
    "TaskKeyUnavailable",
    "atask_key",
    "retry_on",
    "task_key",
]
