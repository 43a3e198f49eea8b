"""Keys for the actions of LangGraph nodes and tools, and the clients that send them through the
gateway.

Inside a node, `task_key("email")` is the key of the email that node is about to send;
`Gateway(url).post("/emails", body, action="email")` (or `AsyncGateway` in an async node) sends
it with that key and `Prefer: wait`, and raises the agent library's errors (`client`):
`ActionOutcomeUnknown`, `ActionKeyReused`, `ActionRejected`, `GaveUp`. Inside a tool, pass the
tool call's id (`tool_call_id=runtime.tool_call_id`): each tool call of one model message is its
own action. `docs/agents.md` is the user's reference; this docstring says why the key is what it
is. Needs the extra `oncegate[langgraph]`; nothing else in oncegate imports LangGraph.

What the key is made of (LangGraph 1.1 and 1.2, `langgraph/pregel/_algo.py` and `_loop.py`):
- The thread id: the caller's; it keeps two threads' keys apart.
- For a task of the graph's top level, the *lineage* of the checkpoint its step started from,
  and the task's path in that step (`('__pregel_pull', 'node')`, `('__pregel_push', 2, ...)` for
  the third `Send`). A checkpoint's lineage (`Lineage`) is its own id when it starts new work
  (source `input`: new input; `update`: `update_state`), its parent's when it is a copy of it
  (source `fork`: what LangGraph saves when a run is addressed by `checkpoint_id`), and a digest
  of its parent's lineage when the loop made it (`loop`: one generation further). So the tasks a
  resume runs again get the keys they had, whether the resume names the thread only or a
  checkpoint id (LangGraph then forks, and its own task ids change), and a replay from an earlier
  checkpoint id runs the same tasks with the same keys: answered from the gateway's store, never
  performed again (or refused with 422, if a node's request came out different).
- For a task inside a subgraph or a functional API task, LangGraph's namespace of it
  (`outer:<task id>|inner:<task id>`): the task ids are made from the checkpoints the steps
  started from, the same on every resume that does not fork. A fork gives them new ids, and
  the parent's new id gives the subgraph a namespace, and checkpoints, of its own, so no key of
  the run it continues can be found again: such a task is refused (`TaskKeyUnavailable`) when
  any of its levels' lineage holds a fork.
- The action's name, and the tool call's id when there is one.

One condition: the checkpoint a task's step started from must be saved before the task acts,
or a kill could lose it and the resumed run make another. With `durability="sync"` LangGraph
saves it before the step starts; with `"async"` (LangGraph's default) it saves it while the
step runs, and the key waits for that save (reading it back) before anything is sent. With
`"exit"` nothing is saved before the run ends: refused. Without a checkpointer there is no
thread to resume: refused.

Where this reads LangGraph's config beyond its public API (the durability, the checkpointer, the
checkpoint map): the names are in `INTERNALS`; were one to move, every key is refused, never made
unstable, and tests/agent/test_langgraph.py fails; pyproject.toml bounds the version.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Generator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import httpx
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple
from langgraph.config import get_config
from langgraph.runtime import get_runtime
from langgraph.types import RetryPolicy as NodeRetryPolicy

from . import keys
from .checkpoints import JSON
from .client import (
    ActionClient,
    ActionError,
    ActionRejected,
    GaveUp,
    RetryPolicy,
    SyncActionClient,
    is_final,
)

# Where LangGraph keeps, in the config each node sees: the run's durability (set by `invoke` and
# `stream` from their `durability` argument; unset means LangGraph's default, "async"), the
# checkpointer, and the id of the checkpoint each level's step started from.
DURABILITY_KEY = "__pregel_durability"
CHECKPOINTER_KEY = "__pregel_checkpointer"
CHECKPOINT_MAP_KEY = "checkpoint_map"
INTERNALS = (DURABILITY_KEY, CHECKPOINTER_KEY, CHECKPOINT_MAP_KEY)
DEFAULT_TIMEOUT = 30.0
# How long a key waits for the save of its step's checkpoint under durability="async". The save
# runs beside the step and takes milliseconds; a save that has not landed in this long is stuck
# (a database down), and sending without it could send twice.
SAVE_WAIT = 30.0
# Checkpoints whose lineage a process remembers (one entry a step): enough for thousands of
# threads in flight, a few MB at most.
LINEAGE_CACHE = 20_000
# Keys a client remembers having sent, with the attempt of the task that sent them.
SENT_MEMORY = 4_096


class TaskKeyUnavailable(RuntimeError):
    """No key can be derived here that a resume would derive again: nothing was sent."""


class ActionNameReused(ActionError):
    """One attempt of one task sent two actions under the same action name (and tool call):
    the second would have been answered with the first's stored answer, never performed.
    Nothing was sent for it."""


@dataclass(frozen=True, slots=True)
class Level:
    """One graph level a task runs in: its namespace, and the checkpoint its step started from."""

    namespace: str
    checkpoint_id: str


@dataclass(frozen=True, slots=True)
class Task:
    """What a node's config says of the task running now."""

    thread_id: str
    checkpoint_ns: str
    path: str
    durability: str
    checkpointer: BaseCheckpointSaver[Any]
    levels: tuple[Level, ...]  # the top level first

    @property
    def top_level(self) -> bool:
        return "|" not in self.checkpoint_ns


def running_task() -> Task:
    """The task running now, or `TaskKeyUnavailable` saying why no key can be made for it."""
    try:
        config = get_config()
    except RuntimeError as exc:
        raise TaskKeyUnavailable(
            "task_key() is called inside a LangGraph node or tool, where the running task is known"
        ) from exc
    runtime = get_runtime()
    execution = runtime.execution_info
    configurable = config.get("configurable", {})
    checkpointer = configurable.get(CHECKPOINTER_KEY)
    if execution is None or not execution.thread_id or checkpointer is None:
        raise TaskKeyUnavailable(
            "this graph runs without a checkpointer (or without a thread_id), so nothing of "
            "this task survives the process: compile it with a checkpointer and invoke it with "
            "config={'configurable': {'thread_id': ...}}"
        )
    durability = configurable.get(DURABILITY_KEY, "async")
    if durability not in ("sync", "async"):
        raise TaskKeyUnavailable(
            f"this run's durability is {durability!r}: LangGraph saves nothing of it before it "
            "ends, so a resumed run could not find this task's key again. Run it with "
            "durability='sync' or 'async' (LangGraph's default)"
        )
    levels: list[Level] = []
    for namespace, checkpoint_id in configurable.get(CHECKPOINT_MAP_KEY, {}).items():
        # A functional API task runs in its entrypoint's checkpoint: a level seen already.
        if all(level.checkpoint_id != checkpoint_id for level in levels):
            levels.append(Level(namespace, checkpoint_id))
    if not levels or levels[0].namespace != "":
        raise TaskKeyUnavailable(
            f"LangGraph's config has no checkpoint map ({CHECKPOINT_MAP_KEY!r}) with the top "
            "level's checkpoint: this LangGraph version is not one oncegate supports"
        )
    path = config.get("metadata", {}).get("langgraph_path")
    return Task(
        thread_id=execution.thread_id,
        checkpoint_ns=execution.checkpoint_ns,
        path=repr(path),
        durability=durability,
        checkpointer=checkpointer,
        levels=tuple(levels),
    )


# --- lineage ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """What the lineage needs of one saved checkpoint."""

    source: str
    parent_id: str | None


@dataclass(frozen=True, slots=True)
class Origin:
    """A checkpoint's lineage (see the module's docstring) and whether a fork is in it."""

    lineage: str
    forked: bool


def record(saved: CheckpointTuple | None) -> Record | None:
    if saved is None:
        return None
    parent = saved.parent_config
    parent_id = None if parent is None else parent.get("configurable", {}).get("checkpoint_id")
    return Record(
        source=str(saved.metadata.get("source")),
        parent_id=parent_id,
    )


# A walk's request: read this checkpoint (of the thread and namespace the walk is for); `True`
# when it is the step's own checkpoint, which an "async" run may still be saving.
Read = tuple[str, bool]


class Lineage:
    """The lineage of checkpoints, walked up their parents and remembered per process (a
    checkpoint never changes once saved). Thread-safe: a `ToolNode` runs its tools in threads."""

    def __init__(self, size: int = LINEAGE_CACHE) -> None:
        self._known: OrderedDict[tuple[str, str, str], Origin] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def walk(
        self, thread_id: str, namespace: str, checkpoint_id: str
    ) -> Generator[Read, Record | None, Origin]:
        """Yields each checkpoint it must read, is sent what was read (None: not saved), and
        returns the origin of `checkpoint_id`. Decides only; the caller does the reading."""
        chain: list[tuple[str, Record]] = []
        current, first = checkpoint_id, True
        while True:
            known = self._get((thread_id, namespace, current))
            if known is not None:
                origin = known
                break
            found = yield current, first
            first = False
            if found is None:
                raise TaskKeyUnavailable(
                    f"checkpoint {current} of thread {thread_id!r} (namespace {namespace!r}) is "
                    "not in the checkpointer: the key of this task is made from the checkpoints "
                    "its step descends from, and one is missing"
                )
            if found.source in ("input", "update"):
                origin = Origin(current, forked=False)
                self._put((thread_id, namespace, current), origin)
                break
            if found.source not in ("loop", "fork"):
                raise TaskKeyUnavailable(
                    f"checkpoint {current} was saved by {found.source!r}, which oncegate does "
                    "not know: it cannot tell whether its tasks are new work or a copy of work "
                    "done before, so it sends nothing"
                )
            if found.parent_id is None:
                raise TaskKeyUnavailable(f"checkpoint {current} ({found.source}) has no parent")
            chain.append((current, found))
            current = found.parent_id
        for checkpoint, saved in reversed(chain):
            if saved.source == "fork":
                origin = Origin(origin.lineage, forked=True)
            else:
                # Not the step's number: a fork takes a number of its own (its parent's + 1), so
                # the steps after it are numbered one further than the ones they replay.
                digest = hashlib.sha256(f"{origin.lineage}\0next".encode()).hexdigest()
                origin = Origin(digest[:32], origin.forked)
            self._put((thread_id, namespace, checkpoint), origin)
        return origin

    def _get(self, entry: tuple[str, str, str]) -> Origin | None:
        with self._lock:
            origin = self._known.get(entry)
            if origin is not None:
                self._known.move_to_end(entry)
            return origin

    def _put(self, entry: tuple[str, str, str], origin: Origin) -> None:
        with self._lock:
            self._known[entry] = origin
            while len(self._known) > self._size:
                self._known.popitem(last=False)


# One per process: every client and `task_key` share what was read.
LINEAGE = Lineage()


def reading(thread_id: str, namespace: str, checkpoint_id: str) -> RunnableConfig:
    return {
        "configurable": {
            "thread_id": thread_id,
            "checkpoint_ns": namespace,
            "checkpoint_id": checkpoint_id,
        }
    }


def origins(task: Task) -> Generator[tuple[Level, Read], Record | None, list[Origin]]:
    """Every level's origin, the top level first (one walk after the other)."""
    found = []
    for level in task.levels:
        walk = LINEAGE.walk(task.thread_id, level.namespace, level.checkpoint_id)
        try:
            request = next(walk)
            while True:
                request = walk.send((yield level, request))
        except StopIteration as done:
            found.append(done.value)
    return found


def compose(task: Task, found: list[Origin], action: str, tool_call_id: str | None) -> str:
    """The key, from the task and its levels' origins (see the module's docstring)."""
    if task.top_level:
        node = task.checkpoint_ns.rpartition(":")[0]
        digest = hashlib.sha256(f"{found[0].lineage}\0{task.path}".encode()).hexdigest()
        return keys.task_key(
            task.thread_id, f"{node}:{digest[:32]}", action, tool_call_id=tool_call_id
        )
    if any(origin.forked for origin in found):
        raise TaskKeyUnavailable(
            f"this task runs inside a subgraph (or an entrypoint) of a run that LangGraph forked "
            f"from a checkpoint (a run addressed by checkpoint_id, or a copy of the thread): its "
            f"task ids, {task.checkpoint_ns!r}, are new, and no key of the run it continues can "
            "be found again, so it sends nothing. Resume the thread without a checkpoint_id "
            "(config={'configurable': {'thread_id': ...}}) from a checkpoint that is not a fork, "
            "or give the branch new work first (graph.update_state), whose actions are new"
        )
    return keys.task_key(task.thread_id, task.checkpoint_ns, action, tool_call_id=tool_call_id)


def _wait_message(task: Task, level: Level, save_wait: float) -> str:
    return (
        f"the checkpoint this task's step started from ({level.checkpoint_id}) was not saved "
        f"within {save_wait:g} s ({task.durability!r} durability): sent before that save, the "
        "action would get another key on resume, so nothing was sent"
    )


def task_key(action: str, *, tool_call_id: str | None = None, save_wait: float = SAVE_WAIT) -> str:
    """The key of `action` for the LangGraph task running now: the same on every resume of this
    task, by thread id or by checkpoint id, another for the next run of the node and for another
    thread. `tool_call_id`: the tool call this action is for, inside a tool. Call it inside a
    node, a tool or a functional API task of a graph with a checkpointer; under durability
    "async" it waits (up to `SAVE_WAIT`) for the step's checkpoint to be saved."""
    task = running_task()
    walk = origins(task)
    try:
        level, (checkpoint_id, own) = next(walk)
        while True:
            found = record(task.checkpointer.get_tuple(reading(task.thread_id, level.namespace,
                                                               checkpoint_id)))  # fmt: skip
            if found is None and own and task.durability == "async":
                found = _wait_saved(task, level, checkpoint_id, save_wait)
            level, (checkpoint_id, own) = walk.send(found)
    except StopIteration as done:
        return compose(task, done.value, action, tool_call_id)


def _wait_saved(task: Task, level: Level, checkpoint_id: str, save_wait: float) -> Record:
    deadline = time.monotonic() + save_wait
    pause = 0.002
    while time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        saved = task.checkpointer.get_tuple(reading(task.thread_id, level.namespace, checkpoint_id))
        if (found := record(saved)) is not None:
            return found
    raise TaskKeyUnavailable(_wait_message(task, level, save_wait))


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


async def atask_key(
    action: str, *, tool_call_id: str | None = None, save_wait: float = SAVE_WAIT
) -> str:
    """`task_key` for async nodes and tools: reads the checkpoints with the saver's async API."""
    task = running_task()
    walk = origins(task)
    try:
        level, (checkpoint_id, own) = next(walk)
        while True:
            config = reading(task.thread_id, level.namespace, checkpoint_id)
            found = record(await aread(task.checkpointer, config))
            if found is None and own and task.durability == "async":
                deadline = time.monotonic() + save_wait
                pause = 0.002
                while found is None:
                    if time.monotonic() >= deadline:
                        raise TaskKeyUnavailable(_wait_message(task, level, save_wait))
                    await asyncio.sleep(pause)
                    pause = min(pause * 2, 0.05)
                    found = record(await aread(task.checkpointer, config))
            level, (checkpoint_id, own) = walk.send(found)
    except StopIteration as done:
        return compose(task, done.value, action, tool_call_id)


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
            "pass each tool call's id (tool_call_id=...)",
            key=key,
        )

    def forget(self, key: str, attempt: object) -> None:
        """The send of `key` by `attempt` failed: it may be sent again."""
        with self._lock:
            if self._sent.get(key) is attempt:
                del self._sent[key]


# One per process: two clients in one task (a client made per call) see each other's keys.
SENT = Sent()


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


# --- retries ------------------------------------------------------------------------------------


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
