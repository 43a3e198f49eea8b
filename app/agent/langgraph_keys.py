"""How the key of a LangGraph task's action is derived from its thread's checkpoints, so that a
killed and resumed run sends the key it sent before (replayed by the gateway, not performed
again), and new work gets a key of its own. The rules are stated here and applied below, in
this order: the running task (`running_task`), its key's parts level by level (`derive`),
whether a task continues its parent's (`had_task`, `left_to_run`, `same_send`, `still_to_run`),
which task runs a subgraph (`subgraph_task`), a checkpoint's lineage (`Lineage`), and what is
read of a checkpoint (`Record`). Decides only: `derive` yields each read it needs (`Request`)
and is sent the answer; `oncegate.agent.langgraph` answers with the saver's sync or async API,
and is what users call. LangGraph 1.1 and 1.2 (`langgraph/pregel/_algo.py` and `_loop.py`).

The key (`compose`, written by `keys.task_key`): `thread:node:<digest>:action`, a part a level
inside subgraphs (`outer:<digest>|inner:<digest>`), the tool call's id before the action when
there is one.

Rules:
- The thread id is the caller's; it keeps two threads' keys apart. The action's name, and the
  tool call's id when there is one, end the key.
- A part for each graph level the task runs in (the top level; a subgraph's; a subgraph's
  subgraph), each the node that runs there and a digest of where the task comes from: the
  *lineage* of the checkpoint that level's step started from, and the path, in that step, of
  the task that runs at that level (`('__pregel_pull', 'node')`; `('__pregel_push', 2)` for the
  third `Send`; a functional API task's path names its entrypoint's and the call's number).
  LangGraph's task ids are not in the key: a fork gives every task new ids.
- A checkpoint's lineage (`Lineage`) is its own id when it starts new work (source `input`: new
  input; `update`: `update_state`), that of the checkpoint it copies when it is a copy (source
  `fork`: what LangGraph saves when a run is addressed by `checkpoint_id`, a copy of its parent;
  or `update_state(config, None, as_node="__copy__")`, a copy saved beside the checkpoint it
  copies, found as the one sibling with its versions: `copy_of`), and a digest of its parent's
  lineage when the loop made it (`loop`: one generation further). A subgraph's first checkpoint,
  which LangGraph makes anew whenever it starts the subgraph again (a fork above gives the task
  that runs it a new id, hence a new namespace), takes the level above's digest as its lineage.
  So the tasks a resume runs again get the keys they had, whether the resume names the thread
  only or a checkpoint id, and a replay from an earlier checkpoint id runs the same tasks with
  the same keys: answered from the gateway's store, never performed again (or refused with 422,
  if a node's request came out different).
- An `update_state` does not make the tasks it leaves to run new work when its parent
  checkpoint still had them to run (one killed after it acted, then an update, then a resume;
  LangGraph's time travel, an update of an earlier checkpoint): such a task's key comes from
  the parent (`had_task`, LangGraph's own rule read from the parent: a trigger newer than what
  the node saw, or the same `Send`; for the task above a subgraph's, whose triggers are not in
  the config, its node still to run by the channels it has seen, `still_to_run`, or the
  subgraph started from the parent, or, the parent an update that ran no task of that node,
  either of these of the parent's parent: `still_to_run_above`). A task
  the update itself starts (a node it triggers anew) is new work, with a key of its own. The
  same holds for an input that `update_state(config, values, as_node="__input__")` saves:
  unlike `invoke(input)`, which discards its parent's tasks, it leaves them to run
  (`left_to_run`). An update whose step ran only tasks its parent still had to run (read from
  the checkpoint that step saved: `tasks_ran`) continues the parent's lineage, so the steps
  after it are the ones the parent's run went on to, with their keys (a note on an earlier
  checkpoint replays the emails after it too); one whose step ran a task the update started is
  new work, and so are the steps after it. So the way to new work for a task killed after it
  acted is to record it as done (`update_state(..., as_node=node)`), then give it new input as
  the node before it.
- A functional API task (a call of its entrypoint) is taken as its parent's, never as new
  work, after an update; after an input, which starts its entrypoint again, it is new work.
- A `Send` that carries a tool call (the prebuilt agent's v2 sends one a call, langchain's
  `create_agent` a list of one call) continues the parent's `Send` with the same call, wherever
  an update (an edit of the model's message) moved it in the step (`same_send`); one with a
  call its parent did not have is new work. So does what the tool runs: a subgraph (the level
  above it is that `Send`), a functional API task (its path holds the `Send`'s).
- A node's error handler (LangGraph 1.2's `add_node(..., error_handler=...)`) runs in the step
  and namespace of the task that failed, for it (`handled`): whether an update continues it is
  asked of the failed task, still to run by the channels its node has seen.
- Which `Send` a subgraph runs for is read back from its task id, which LangGraph makes from
  the checkpoint, the step, the node and the `Send`'s index (`push_task_id`); a subgraph run by a
  functional API task's call, whose path is not in its config, is refused.
- Where no key can be derived that a resume would derive again, nothing is sent
  (`TaskKeyUnavailable`, its sentence says why): a graph without a checkpointer or a thread id;
  a subgraph called more than once in one node's code, or compiled with `checkpointer=True`; a
  step that runs a subgraph's node both as a node and by `Send`; a checkpoint saved by a source
  not named above, or missing; a copy whose copied checkpoint cannot be found.

One condition: the checkpoint a task's step started from must be saved before the task acts,
or a kill could lose it and the resumed run make another. With `durability="sync"` LangGraph
saves it before the step starts; with `"async"` (LangGraph's default) it saves it while the
step runs, and the key waits for that save (reading it back: a `Read` that is `own`) before
anything is sent. With `"exit"` nothing is saved before the run ends: refused; and the one
checkpoint such a run saves when it ends, parented to the last one saved before it, the steps
between in none, starts new work for the runs after it when that run began with new input,
and is refused to them otherwise (`consecutive`): one generation for it would give the tasks
after it other steps' keys.

What a saved checkpoint says never changes: a process remembers the records it read
(`RECORDS`) and the lineages it derived (`LINEAGE`), and reads a walk up a run's steps
`WALK_BATCH` checkpoints a query.

Where this reads LangGraph beyond its public API (the durability, the checkpointer and the
checkpoint map in a node's config; the channel of a step's `Send`s and the kinds of task path;
the function that makes a `Send`'s task id): the names are in `INTERNALS`, and
tests/agent/test_langgraph.py checks them against LangGraph's own and fails when a `Send`'s
task id is made otherwise; pyproject.toml bounds the version.
"""

from __future__ import annotations

import binascii
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver, CheckpointTuple
from langgraph.config import get_config
from langgraph.constants import START
from langgraph.pregel import _algo
from langgraph.runtime import get_runtime

from . import keys

# Where LangGraph keeps, in the config each node sees: the run's durability (set by `invoke` and
# `stream` from their `durability` argument; unset means LangGraph's default, "async"), the
# checkpointer, and the id of the checkpoint each level's step started from.
DURABILITY_KEY = "__pregel_durability"
CHECKPOINTER_KEY = "__pregel_checkpointer"
CHECKPOINT_MAP_KEY = "checkpoint_map"
# What a saved checkpoint and a task's path say: the channel that holds a step's `Send`s, and
# the first element of a task's path, a node's task (pull) or a `Send`'s or a call's (push).
TASKS_CHANNEL = "__pregel_tasks"
PULL = "__pregel_pull"
PUSH = "__pregel_push"
# What LangGraph 1.2 puts in the path of a node's error handler, after the failed task's path.
ERROR_HANDLER = "node_error_handler"
# Not a node: where a checkpoint's `versions_seen` keeps the versions a resumed run had seen
# when it started (LangGraph's `_first` sets it on every resume; a fork saves it as it is).
INTERRUPT = "__interrupt__"
INTERNALS = (
    DURABILITY_KEY,
    CHECKPOINTER_KEY,
    CHECKPOINT_MAP_KEY,
    TASKS_CHANNEL,
    PULL,
    PUSH,
    INTERRUPT,
)
# Checkpoints whose lineage a process remembers (one entry a step): enough for thousands of
# threads in flight, a few MB at most.
LINEAGE_CACHE = 20_000
# Checkpoints a process keeps as read (the steps' own, which every action of a step reads):
# each holds its channels' versions, a few kB at most.
RECORD_CACHE = 1_024
# Checkpoints a walk up a run's steps reads in one query (`Earlier`), the parents of the one it
# stands at: a new process walks back to the thread's last new input (hundreds of steps on a
# long thread), in one query per this many steps instead of one per step.
WALK_BATCH = 64


class TaskKeyUnavailable(RuntimeError):
    """No key can be derived here that a resume would derive again: nothing was sent."""


# --- the running task -----------------------------------------------------------------------------


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
    route: tuple[Any, ...]  # the task's path in its step: ('__pregel_pull', 'node'), ...
    triggers: tuple[str, ...]  # the channels whose new values start the task's node
    durability: str
    checkpointer: BaseCheckpointSaver[Any]
    levels: tuple[Level, ...]  # the top level first


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
    segments = execution.checkpoint_ns.split("|") if execution.checkpoint_ns else []
    for namespace, checkpoint_id in configurable.get(CHECKPOINT_MAP_KEY, {}).items():
        # Only the levels the task runs in: a run addressed by a subgraph's own checkpoint
        # (`get_state(config, subgraphs=True)`) carries that checkpoint's namespace too.
        if namespace and namespace.split("|") != segments[: namespace.count("|") + 1]:
            continue
        # A functional API task runs in its entrypoint's checkpoint: a level seen already.
        if all(level.checkpoint_id != checkpoint_id for level in levels):
            levels.append(Level(namespace, checkpoint_id))
    if not levels or levels[0].namespace != "":
        raise TaskKeyUnavailable(
            f"LangGraph's config has no checkpoint map ({CHECKPOINT_MAP_KEY!r}) with the top "
            "level's checkpoint: this LangGraph version is not one oncegate supports"
        )
    for level in levels[1:]:
        # LangGraph names a level `node:<task id>`, and numbers the second and later calls of a
        # subgraph inside one task (`node:<task id>|1`); a subgraph compiled with
        # checkpointer=True keeps one thread of checkpoints under its node's name alone.
        if any(segment.isdecimal() for segment in level.namespace.split("|")[1:]):
            raise TaskKeyUnavailable(
                f"this task runs in a subgraph called more than once in one node's code "
                f"(namespace {level.namespace!r}: LangGraph numbers the second and later calls "
                "of one task), whose place oncegate cannot find again from the checkpoints, so "
                "it sends nothing. Call each subgraph once a node: give each call a node of its "
                "own (or add the compiled subgraph as a node)"
            )
        if any(":" not in segment for segment in level.namespace.split("|")):
            raise TaskKeyUnavailable(
                f"this task runs in a subgraph compiled with checkpointer=True (namespace "
                f"{level.namespace!r}), whose checkpoints LangGraph keeps across every run of "
                "its node: oncegate cannot tell a resume of one run from the next, so it sends "
                "nothing. Compile the subgraph without a checkpointer (the default, "
                "checkpointer=None: its checkpoints are saved with the parent's run)"
            )
    metadata = config.get("metadata", {})
    path, triggers = metadata.get("langgraph_path"), metadata.get("langgraph_triggers")
    if not isinstance(path, tuple | list) or not path:
        raise TaskKeyUnavailable(
            "LangGraph's config says no path of the running task ('langgraph_path'): this "
            "LangGraph version is not one oncegate supports"
        )
    return Task(
        thread_id=execution.thread_id,
        checkpoint_ns=execution.checkpoint_ns,
        route=tuple(path),
        triggers=tuple(triggers or ()),
        durability=durability,
        checkpointer=checkpointer,
        levels=tuple(levels),
    )


# --- the key's parts, level by level --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Part:
    """One level of a key: the node that runs at that level, and where it comes from."""

    node: str
    digest: str


def derive(task: Task) -> Generator[Request, Any, list[Part]]:
    """The key's parts, the top level first (see the module's docstring). Yields each read it
    needs and is sent its answer; decides only."""

    def read(
        namespace: str, checkpoint_id: str, own: bool, below: str | None = None
    ) -> Generator[Request, Any, Record]:
        entry = (task.thread_id, namespace, checkpoint_id)
        known = RECORDS.get(entry)
        if known is None and below is not None:
            # A walk up a run's steps: this one and the next parents, in one query.
            for earlier in (yield Earlier(namespace, below, WALK_BATCH)):
                RECORDS.put((task.thread_id, namespace, earlier.checkpoint_id), earlier)
            known = RECORDS.get(entry)
        if known is None:
            known = yield Read(namespace, checkpoint_id, own)
            if known is None:
                raise TaskKeyUnavailable(
                    f"checkpoint {checkpoint_id} of thread {task.thread_id!r} (namespace "
                    f"{namespace!r}) is not in the checkpointer: the key of this task is made "
                    "from the checkpoints its step descends from, and one is missing"
                )
            RECORDS.put(entry, known)
        return known

    def through(asking: Generator[Request, Any, str]) -> Generator[Request, Any, str]:
        """Runs `asking`, its reads through `read`, its other requests to the caller."""
        try:
            request = next(asking)
            while True:
                if isinstance(request, Read):
                    reply = yield from read(
                        request.namespace, request.checkpoint_id, request.own, request.below
                    )
                else:
                    reply = yield request
                request = asking.send(reply)
        except StopIteration as done:
            return str(done.value)

    def still_to_run_above(
        namespace: str, parent: Record, node: str, path: tuple[Any, ...]
    ) -> Generator[Request, Any, bool]:
        """Whether `parent` still had to run the task at `path` (of `node`), for a level above
        the running task: by the channels its node has seen (`still_to_run`), or a subgraph of
        it started from `parent`; or, `parent` an update or an input that left the node as its
        own parent had it (the same seen versions: it ran no task), whether that one did. The
        node's seen channels are not all its triggers: a node an edge started before may now
        be started by a join whose channel it has never seen."""
        while True:
            if still_to_run(parent, node, path):
                return True
            parents = {**parent.parents, namespace: parent.checkpoint_id}
            if (yield Started(namespace, parent.checkpoint_id, parents, node)):
                return True
            if path[:1] != (PULL,) or parent.source not in ("update", "input"):
                return False
            if parent.parent_id is None:
                return False
            before = yield from read(namespace, parent.parent_id, False)
            if parent.seen.get(node) != before.seen.get(node):
                return False
            parent = before

    segments = task.checkpoint_ns.split("|")
    handling = handled(task)
    parts: list[Part] = []
    anchor: str | None = None
    for index, level in enumerate(task.levels):
        innermost = index == len(task.levels) - 1
        own = yield from read(level.namespace, level.checkpoint_id, True)
        if innermost:
            node, path = segments[-1].rpartition(":")[0], task.route
        else:
            above = level.namespace.split("|") if level.namespace else []
            below = task.levels[index + 1].namespace.split("|")
            if below[:-1] != above:
                raise TaskKeyUnavailable(
                    f"subgraph {task.levels[index + 1].namespace!r} is run by a task below the "
                    "steps of its parent graph (a functional API task's call): oncegate cannot "
                    "tell which of them it is, so it sends nothing"
                )
            node, _, task_id = below[-1].rpartition(":")
            path = subgraph_task(own, level.namespace, node, task_id)
        # The checkpoint the task's key comes from: through forks (copies) and through updates
        # whose parent still had this task to run, which it continues, up to the first that
        # starts it.
        start, current = level.checkpoint_id, own
        while current.source in ("fork", "update", "input") and (parent_id := current.parent_id):
            if current.source == "fork":
                start = yield from through(copy_of(level.namespace, current))
                current = yield from read(level.namespace, start, False)
                continue
            parent = yield from read(level.namespace, parent_id, False)
            # A node's error handler runs in the step of the task that failed, for it.
            subject = handling if innermost and handling else (node, path)
            if not left_to_run(current, parent, *subject):
                break
            if innermost and handling:
                # Still to run where the failed task is (its triggers are not in the config).
                continues = still_to_run(parent, *handling)
            elif innermost:
                # A tool call's `Send` continues the parent's with that call, at its place.
                moved = same_send(current, parent, node, path)
                continues = moved is not None and had_task(parent, node, moved, task.triggers)
                path = moved if moved is not None and continues else path
            else:
                # A subgraph's task above the running one: a tool call's `Send` continues the
                # parent's with that call (an agent's tool that runs a subgraph); its triggers
                # are not in the config, and it may not have started from `parent` (an update
                # of an update).
                moved = same_send(current, parent, node, path)
                continues = moved is not None and (
                    yield from still_to_run_above(level.namespace, parent, node, moved)
                )
                path = moved if moved is not None and continues else path
            if not continues:
                break
            start, current = parent.checkpoint_id, parent
        lineage = yield from through(LINEAGE.walk(task.thread_id, level.namespace, start, anchor))
        anchor = _digest(lineage, repr(path))
        parts.append(Part(node, anchor))
    return parts


def handled(task: Task) -> tuple[str, tuple[Any, ...]] | None:
    """The node and path of the failed task that the running task handles, when it is a node's
    error handler (LangGraph 1.2's `add_node(..., error_handler=...)`), which LangGraph runs in
    the failed task's step and namespace, its path the failed task's then `(ERROR_HANDLER,
    False)`. None for any other task."""
    if task.route[-2:] != (ERROR_HANDLER, False):
        return None
    return task.checkpoint_ns.split("|")[-1].rpartition(":")[0], task.route[:-2]


def compose(task: Task, parts: list[Part], action: str, tool_call_id: str | None) -> str:
    """The key, from the task and its parts: `thread:node:<digest>:action`, a level each."""
    namespace = "|".join(f"{part.node}:{part.digest}" for part in parts)
    return keys.task_key(task.thread_id, namespace, action, tool_call_id=tool_call_id)


# --- whether a task continues its parent's --------------------------------------------------------


def had_task(parent: Record, node: str, path: tuple[Any, ...], triggers: tuple[str, ...]) -> bool:
    """Whether checkpoint `parent` still had to run the task at `path` (of `node`): a node
    whose trigger holds a value newer than what the node last saw (LangGraph's own rule, read
    from the checkpoint), or the `Send` at that index. A functional API task (a call of its
    entrypoint) is taken as its parent's: never as new work."""
    index = send_index(path)
    if index is not None:
        return index < len(parent.sends) and parent.sends[index] == node
    if path[:1] != (PULL,):
        return True
    seen = parent.seen.get(node)
    null = type(next(iter(parent.versions.values()), ""))()
    for channel in triggers:
        if channel not in parent.available:
            continue
        if seen is None or parent.versions.get(channel, null) > seen.get(channel, null):
            return True
    return False


def left_to_run(made: Record, parent: Record, node: str, path: tuple[Any, ...]) -> bool:
    """Whether checkpoint `made`, an update or an input saved on `parent`, left the task at
    `path` (of `node`) as `parent` had it. An update does: `update_state` runs no task of its
    parent's. An input made by `invoke(input)` does not: LangGraph's `_first` discards every task
    its parent still had to run (it marks their triggers as seen). One made by
    `update_state(config, values, as_node="__input__")` leaves them: the node's seen versions,
    or the step's `Send`s, are its parent's. A functional API call in an input's step, whose
    entrypoint the input starts again, is new work."""
    if made.source != "input":
        return True
    if path[:1] == (PULL,) and len(path) == 2:
        return made.seen.get(node) == parent.seen.get(node)
    if send_index(path) is not None:
        return made.sends == parent.sends
    return False


def send_index(path: tuple[Any, ...]) -> int | None:
    """The index of the `Send` a task's path names, or None for any other task. LangGraph's path
    of a node's `Send` is `(PUSH, index, False)` (`tasks_ran` and `subgraph_task` write `(PUSH,
    index)`); a functional API call's is `(PUSH, <its entrypoint's path>, number)`."""
    if path[:1] == (PUSH,) and len(path) > 1 and type(path[1]) is int:
        return path[1]
    return None


def same_send(
    made: Record, parent: Record, node: str, path: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    """The path, in `parent`'s step, of the `Send` at `path` in the step of `made` (an update
    saved on `parent`). A `Send` carrying a tool call is the parent's `Send` to the same node
    with the same call, wherever an edit of the model's message moved it (dropped or reordered
    the calls before it), and None (new work) when the parent had no such call; a functional API
    call's path holds its caller's, which may be such a `Send` (a task called from a tool); any
    other path is returned as it is (a `Send` is its parent's at the same index)."""
    if path[:1] == (PUSH,) and len(path) > 2 and isinstance(path[1], tuple):
        caller = same_send(made, parent, node, path[1])
        return None if caller is None else (path[0], caller, *path[2:])
    index = send_index(path)
    if index is None or index >= len(made.calls) or made.calls[index] is None:
        return path
    sender = made.sends[index]
    for other, (name, call) in enumerate(zip(parent.sends, parent.calls, strict=False)):
        if name == sender and call == made.calls[index]:
            return (path[0], other, *path[2:])
    if index < len(parent.sends) and parent.sends[index] == sender and parent.calls[index] is None:
        # There the parent sent no one call oncegate reads (several calls in one `Send`, which
        # the edit left with one): by its place, as any other `Send`.
        return path
    return None


def still_to_run(parent: Record, node: str, path: tuple[Any, ...]) -> bool:
    """`had_task` for a task whose triggers are unknown (a level above the running task): the
    channels its node has seen stand for them, and a node that never ran is taken as still to
    run (the old key: a replay or a 422, never a second send)."""
    if path[:1] == (PULL,) and node not in parent.seen:
        return True
    return had_task(parent, node, path, tuple(parent.seen.get(node, {})))


# --- which task runs a subgraph -------------------------------------------------------------------


def push_task_id(level: Record, namespace: str, node: str, index: int) -> str:
    """The id LangGraph gives the task of the `index`-th `Send` (to `node`) of the step that
    starts from `level` (`langgraph/pregel/_algo.py`, `prepare_push_task_send`)."""
    identify = _algo._xxhash_str if level.format > 1 else _algo._uuid5_str
    return identify(
        binascii.unhexlify(level.checkpoint_id.replace("-", "")),
        f"{namespace}|{node}" if namespace else node,
        str(level.step + 1),
        node,
        PUSH,
        str(index),
    )


def subgraph_task(level: Record, namespace: str, node: str, task_id: str) -> tuple[Any, ...]:
    """The path of the task (`node`, LangGraph's id `task_id`) that runs a subgraph from the
    step starting at `level`: its node's (one a step), or, when the step sends to that node,
    the index of its `Send`."""
    sent = [index for index, name in enumerate(level.sends) if name == node]
    for index in sent:
        if push_task_id(level, namespace, node, index) == task_id:
            return (PUSH, index)
    if sent:
        raise TaskKeyUnavailable(
            f"the step that runs subgraph {node!r} also sends to it, and task {task_id} is none "
            f"of its {len(sent)} Sends, so it sends nothing: either the step also runs {node!r} "
            "as a node (pulled and sent to in one step: give the Sends a node of their own "
            "that runs the same subgraph), or LangGraph's task ids are not made as this "
            "oncegate version reads them (see docs/agents.md, 'Versions')"
        )
    return (PULL, node)


# --- a checkpoint's lineage -----------------------------------------------------------------------


class Lineage:
    """The lineage of checkpoints, walked up their parents and remembered per process."""

    def __init__(self, size: int = LINEAGE_CACHE) -> None:
        self._known: Remembered[str] = Remembered(size)

    def walk(
        self, thread_id: str, namespace: str, checkpoint_id: str, anchor: str | None
    ) -> Generator[Request, Any, str]:
        """Yields each checkpoint it must read, is sent what was read, and returns the lineage
        of `checkpoint_id`. `anchor`: for a subgraph's level, what its first checkpoint descends
        from (the task of the level above that runs it). Decides only; the caller reads."""
        chain: list[tuple[str, Record]] = []
        current = checkpoint_id
        child: Record | None = None  # the loop checkpoint just below `current`, if any
        ran: list[Ran] | None = None  # the tasks the step from `current` (or its copy) ran
        climbed = 0  # the steps walked up so far
        while True:
            known = self._known.get((thread_id, namespace, current))
            if known is not None:
                # The parent of the loop checkpoint `child`, read as the walk read it before.
                if child is not None and not consecutive(
                    child, (yield Read(namespace, current, own=False))
                ):
                    chain.pop()  # `child`, which starts new work: its lineage is its own
                    lineage = child.checkpoint_id
                    self._known.put((thread_id, namespace, lineage), lineage)
                    break
                lineage = known
                break
            # A process that has run the steps before knows the lineage of the one before the
            # step's parent (one read a step); further up, the walk goes on: a batch a query.
            below = None if child is None or climbed < 2 else child.checkpoint_id
            found = yield Read(namespace, current, own=current == checkpoint_id, below=below)
            if child is not None:
                if not consecutive(child, found):
                    chain.pop()  # `child`, which starts new work: its lineage is its own
                    lineage = child.checkpoint_id
                    self._known.put((thread_id, namespace, lineage), lineage)
                    break
                ran = tasks_ran(found, child)
            child = found if found.source == "loop" else None
            if found.parent_id is None and anchor is not None:
                # A subgraph's first checkpoint: a new one each time LangGraph starts the
                # subgraph again (a fork gives it new task ids), the same task above it.
                lineage = anchor
                self._known.put((thread_id, namespace, current), lineage)
                break
            if found.source == "update" and ran is not None and found.parent_id is not None:
                # An update whose step ran only tasks its parent still had to run continues
                # the parent (an operator's note; LangGraph's time travel): the steps after it
                # are the ones the parent's run went on to, with their keys.
                parent = yield Read(namespace, found.parent_id, own=False)
                if parent is not None and all(
                    (moved := same_send(found, parent, node, path)) is not None
                    and had_task(parent, node, moved, triggers)
                    for node, path, triggers in ran
                ):
                    chain.append((current, found))
                    current = found.parent_id
                    continue
            if found.source in ("input", "update"):
                lineage = current
                self._known.put((thread_id, namespace, current), lineage)
                break
            if found.source not in ("loop", "fork"):
                raise TaskKeyUnavailable(
                    f"checkpoint {current} was saved by {found.source!r}, which oncegate does "
                    "not know: it cannot tell whether its tasks are new work or a copy of work "
                    "done before, so it sends nothing"
                )
            chain.append((current, found))
            if found.source == "fork":
                current = yield from copy_of(namespace, found)
            elif found.parent_id is None:
                raise TaskKeyUnavailable(
                    f"checkpoint {current} ({found.source}, step {found.step}) has no parent: "
                    "the steps before it were not saved (a first run under durability='exit', "
                    "or a saver that keeps only the latest checkpoint), so oncegate cannot tell "
                    "which keys they sent, and sends nothing. Give the thread new input, under "
                    "durability='sync' or 'async'"
                )
            else:
                current = found.parent_id
                climbed += 1
        for checkpoint, saved in reversed(chain):
            if saved.source == "loop":
                # Not the step's number: a fork takes a number of its own (its parent's + 1), so
                # the steps after it are numbered one further than the ones they replay.
                lineage = hashlib.sha256(f"{lineage}\0next".encode()).hexdigest()[:32]
            self._known.put((thread_id, namespace, checkpoint), lineage)
        return lineage


def consecutive(made: Record, parent: Record) -> bool:
    """Whether the loop checkpoint `made` was saved one step after its parent (LangGraph saves
    each step's under durability "sync" and "async"); False when the steps between, never saved
    (a run under "exit" saves only its last checkpoint, on the last one saved before it), began
    with new input (the input channel moved, the parent holding no input still to read:
    `invoke(input)` discards every task its parent still had to run), so that `made` starts new
    work; refused otherwise: the lineage cannot count steps it never saw (one generation would
    give the tasks after it other steps' keys, and a fork LangGraph did not save counts a step
    and no generation)."""
    if made.step == parent.step + 1 or made.step < 0:  # < 0: a saver that keeps no step
        return True
    if START not in parent.available and made.versions.get(START) != parent.versions.get(START):
        return False
    raise TaskKeyUnavailable(
        f"checkpoint {made.checkpoint_id} (step {made.step}) was saved {made.step - parent.step} "
        f"steps after its parent {parent.checkpoint_id} (step {parent.step}), the steps between "
        "in no checkpoint, as a run under durability='exit' saves them: oncegate cannot tell "
        "which keys they sent, so it sends nothing. Run again from that parent, by its "
        "checkpoint_id, under durability='sync' or 'async' (graph.invoke(None, {'configurable': "
        f"{{'thread_id': ..., 'checkpoint_id': {parent.checkpoint_id!r}}}}})): its steps get the "
        "keys they had, answered from the gateway's store; or give the thread new input"
    )


# A task a step ran: its node, its path in the step, the channels that started it.
Ran = tuple[str, tuple[Any, ...], tuple[str, ...]]


def tasks_ran(start: Record, made: Record) -> list[Ran]:
    """The tasks the step from checkpoint `start` ran, read from the checkpoint `made` that the
    step saved: each node whose seen versions of its triggers it moved (LangGraph's
    `apply_writes` marks the triggers of every task it ran as seen), and each `Send` of `start`.
    `INTERRUPT`'s entry, which every resumed run moves, is no task; nor is the empty entry
    `apply_writes` gives a node the first time it runs as a `Send` only (a `Send`'s trigger is
    no channel), such as the tools node of the prebuilt agent's v2."""
    pulled: list[Ran] = []
    for node, seen in made.seen.items():
        before = start.seen.get(node, {})
        triggers = tuple(
            channel for channel, version in seen.items() if before.get(channel) != version
        )
        if triggers and node != INTERRUPT:
            pulled.append((node, (PULL, node), triggers))
    return pulled + [(node, (PUSH, index), ()) for index, node in enumerate(start.sends)]


def copy_of(namespace: str, fork: Record) -> Generator[Request, Any, str]:
    """The checkpoint `fork` is a copy of: its parent, when LangGraph forked a run addressed by
    checkpoint id (one step on from it), or the sibling a `"__copy__"` copied (two steps on; a
    copy of a thread's first checkpoint, which has no parent, has none either: a functional API
    run killed in its first step)."""
    if fork.parent_id is not None:
        parent = yield Read(namespace, fork.parent_id, own=False)
        if parent is None or fork.step == parent.step + 1:
            return fork.parent_id
    copied = yield Copied(namespace, fork)
    if copied is None:
        raise TaskKeyUnavailable(
            f"checkpoint {fork.checkpoint_id} is a copy (source 'fork') of a checkpoint that is "
            "not its parent, and oncegate cannot find which (no single checkpoint beside it has "
            "its versions): it cannot tell which keys the copied run sent, so it sends nothing. "
            "Resume from the checkpoint that was copied, by its checkpoint_id"
        )
    return str(copied)


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


# --- what is read of the checkpoints --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """What a key needs of one saved checkpoint."""

    checkpoint_id: str
    source: str
    parent_id: str | None
    step: int
    format: int  # the checkpoint's `v`, which says how LangGraph made its task ids
    versions: Mapping[str, Any]  # channel_versions
    seen: Mapping[str, Mapping[str, Any]]  # versions_seen, per node
    available: frozenset[str]  # the channels that hold a value
    sends: tuple[str, ...]  # the node of each `Send` the checkpoint's step runs, in order
    calls: tuple[str | None, ...]  # the tool call's id each of those `Send`s carries, if any
    parents: Mapping[str, str]  # the checkpoint of each level above, by namespace


def record(saved: CheckpointTuple | None) -> Record | None:
    if saved is None:
        return None
    parent = saved.parent_config
    parent_id = None if parent is None else parent.get("configurable", {}).get("checkpoint_id")
    checkpoint = saved.checkpoint
    values = checkpoint.get("channel_values", {})
    step = saved.metadata.get("step")
    return Record(
        checkpoint_id=checkpoint["id"],
        source=str(saved.metadata.get("source")),
        parent_id=parent_id,
        step=step if isinstance(step, int) else -1,
        format=int(checkpoint.get("v", 1)),
        versions=checkpoint.get("channel_versions", {}),
        seen=checkpoint.get("versions_seen", {}),
        available=frozenset(values),
        sends=tuple(str(getattr(packet, "node", "")) for packet in values.get(TASKS_CHANNEL, ())),
        calls=tuple(tool_call_of(packet) for packet in values.get(TASKS_CHANNEL, ())),
        parents=dict(saved.metadata.get("parents") or {}),
    )


def tool_call_of(packet: Any) -> str | None:
    """The id of the tool call a `Send` carries: the prebuilt agent's v2 sends each call of the
    model's message to its tools node as a `ToolCallWithContext` (`{"tool_call": {...}, ...}`),
    or as the tool call itself; langchain's `create_agent` (1.5) as a list of that one call
    (`Send("tools", [call])`). None for any other `Send`."""
    arg = getattr(packet, "arg", None)
    if isinstance(arg, list | tuple) and len(arg) == 1:
        arg = arg[0]
    call = arg.get("tool_call", arg) if isinstance(arg, Mapping) else None
    if isinstance(call, Mapping) and "name" in call and "args" in call:
        identity = call.get("id")
        return identity if isinstance(identity, str) and identity else None
    return None


@dataclass(frozen=True, slots=True)
class Read:
    """Read this checkpoint of the task's thread; `own`: the step's own checkpoint, which an
    "async" run may still be saving; `below`: the loop checkpoint whose parent it is, when a
    walk comes up from there (its parents are read in batches, `Earlier`)."""

    namespace: str
    checkpoint_id: str
    own: bool
    below: str | None = None


@dataclass(frozen=True, slots=True)
class Started:
    """Whether a subgraph of `node` was started from checkpoint `checkpoint_id` of the level
    `namespace` (whose levels above are `parents`): its checkpoints say so."""

    namespace: str
    checkpoint_id: str
    parents: Mapping[str, str]
    node: str

    def search(self, thread_id: str) -> tuple[RunnableConfig, dict[str, Any]]:
        """The thread's checkpoints (every namespace) whose levels above are `parents`."""
        config: RunnableConfig = {"configurable": {"thread_id": thread_id}}
        return config, {"filter": {"parents": dict(self.parents)}}

    def decide(self, listed: Iterable[CheckpointTuple]) -> bool:
        for saved in listed:
            namespace = str(saved.config.get("configurable", {}).get("checkpoint_ns", ""))
            above, _, task = namespace.rpartition("|")
            if above == self.namespace and task.rpartition(":")[0] == self.node:
                return True
        return False


@dataclass(frozen=True, slots=True)
class Copied:
    """Which checkpoint of `namespace` the fork `fork` is a copy of, when it is not its parent:
    LangGraph's `update_state(config, None, as_node="__copy__")` saves the copy beside the
    checkpoint it copies, under that checkpoint's parent (its sibling, of the same versions)."""

    namespace: str
    fork: Record

    def search(self, thread_id: str) -> tuple[RunnableConfig, dict[str, Any]]:
        """The namespace's checkpoints one step before the fork."""
        config: RunnableConfig = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": self.namespace}
        }
        return config, {"filter": {"step": self.fork.step - 1}}

    def decide(self, listed: Iterable[CheckpointTuple]) -> str | None:
        """The one sibling of the fork with its versions, or None. Several siblings that are
        all forks (a run addressed twice by one checkpoint id, two `"__copy__"`s of one
        checkpoint: same parent, step and versions) are copies of one checkpoint: any of them."""
        found = {
            sibling.checkpoint_id: sibling.source
            for saved in listed
            if (sibling := record(saved)) is not None
            and sibling.parent_id == self.fork.parent_id
            and sibling.checkpoint_id != self.fork.checkpoint_id
            and sibling.versions == self.fork.versions
        }
        if len(found) == 1 or (found and set(found.values()) == {"fork"}):
            return min(found)
        return None


@dataclass(frozen=True, slots=True)
class Earlier:
    """The checkpoints of `namespace` saved before `checkpoint_id`, the newest first, at most
    `limit`: on a run's own branch, the parents a walk up its steps reads next."""

    namespace: str
    checkpoint_id: str
    limit: int

    def search(self, thread_id: str) -> tuple[RunnableConfig, dict[str, Any]]:
        config: RunnableConfig = {
            "configurable": {"thread_id": thread_id, "checkpoint_ns": self.namespace}
        }
        before = reading(thread_id, self.namespace, self.checkpoint_id)
        return config, {"before": before, "limit": self.limit}

    def decide(self, listed: Iterable[CheckpointTuple]) -> tuple[Record, ...]:
        return tuple(found for saved in listed if (found := record(saved)) is not None)


Search = Started | Copied | Earlier
Request = Read | Search


def reading(thread_id: str, namespace: str, checkpoint_id: str) -> RunnableConfig:
    return {
        "configurable": {
            "thread_id": thread_id,
            "checkpoint_ns": namespace,
            "checkpoint_id": checkpoint_id,
        }
    }


Answer = Record | bool | str | tuple[Record, ...] | None


# --- what a process remembers ---------------------------------------------------------------------


Value = TypeVar("Value")


class Remembered(Generic[Value]):
    """The last `size` values found, by (thread, namespace, checkpoint id): what a saved
    checkpoint says never changes. Thread-safe: a `ToolNode` runs its tools in threads."""

    def __init__(self, size: int) -> None:
        self._known: OrderedDict[tuple[str, str, str], Value] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, entry: tuple[str, str, str]) -> Value | None:
        with self._lock:
            value = self._known.get(entry)
            if value is not None:
                self._known.move_to_end(entry)
            return value

    def put(self, entry: tuple[str, str, str], value: Value) -> None:
        with self._lock:
            self._known[entry] = value
            while len(self._known) > self._size:
                self._known.popitem(last=False)


# One per process: every client and `task_key` share what was read.
RECORDS: Remembered[Record] = Remembered(RECORD_CACHE)

LINEAGE = Lineage()
