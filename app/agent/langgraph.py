"""Keys for the actions of LangGraph nodes, and the clients that send them through the gateway.

Inside a node, `task_key("email")` is the key of the email that node is about to send;
`Gateway(url).post("/emails", body, action="email")` (or `AsyncGateway` in an async node) sends
it with that key and `Prefer: wait`, and raises the agent library's errors (`client`):
`ActionOutcomeUnknown`, `ActionKeyReused`, `ActionRejected`, `GaveUp`. Needs the extra
`oncegate[langgraph]`; nothing else in oncegate imports LangGraph.

Why the key is what it is (LangGraph 1.2, `langgraph/pregel/_algo.py`, `prepare_single_task`):
- A task's id is a hash of the id of the checkpoint its step started from, its namespace, the
  step's number, the node's name and its triggers. A resume reloads the thread's last saved
  checkpoint and runs again every task of the step that had not saved its writes: the same
  checkpoint, so the same task ids. The next run of the same node (a loop) starts from a later
  checkpoint, and another thread from another one: other ids.
- The task's checkpoint namespace (`node:<task id>`, `outer:<id>|inner:<id>` in a subgraph)
  carries that id, and for a subgraph the ids of the tasks above it.
- The thread id is the caller's; it keeps two threads' keys apart whatever their ids.
- The task's path (`('__pregel_pull', 'node')`) is the same in every iteration of a loop: not
  enough on its own. The step number is, but a fork of the thread (`update_state` on an earlier
  checkpoint) runs the same step numbers again for other work.
So the key is the thread id, the task's namespace and the action's name (`keys.task_key`).

One condition: the checkpoint the task's step started from must be saved before the task acts.
With `durability="sync"` LangGraph saves each step's checkpoint before the next step starts.
With `"async"` (LangGraph's default) it saves it while the next step runs: a kill then can lose
it, the resumed run rebuilds it under a new id, and the task that had acted gets a new id, so
its action a new key (tests/agent/test_langgraph.py kills one there). With `"exit"` nothing is
saved before the end. `task_key` therefore refuses to make a key unless the run is `"sync"`, and
unless it has a checkpointer (without one there is no thread to resume).
"""

from __future__ import annotations

import random
from types import TracebackType
from typing import Any, Self

import httpx
from langgraph.config import get_config
from langgraph.runtime import get_runtime

from . import keys
from .checkpoints import JSON
from .client import ActionClient, RetryPolicy, SyncActionClient

# Where LangGraph keeps a run's durability in the config each node sees (set by `invoke` and
# `stream` from their `durability` argument). Not public: were it to move, every run would look
# like LangGraph's default ("async") and `task_key` would refuse them all, loudly, never make an
# unstable key; tests/agent/test_langgraph.py fails then, and pyproject.toml bounds the version.
DURABILITY_KEY = "__pregel_durability"
DEFAULT_TIMEOUT = 30.0


class TaskKeyUnavailable(RuntimeError):
    """No key can be derived here that a resume would derive again."""


def task_key(action: str) -> str:
    """The key of `action` for the LangGraph task running now: the same on every resume of this
    task, another for the next run of the node and for another thread. Call it inside a node
    (or a functional API task) of a graph with a checkpointer, run with `durability="sync"`."""
    try:
        config = get_config()
    except RuntimeError as exc:
        raise TaskKeyUnavailable(
            "task_key() is called inside a LangGraph node, where the running task is known"
        ) from exc
    execution = get_runtime().execution_info
    if execution is None or not execution.thread_id:
        raise TaskKeyUnavailable(
            "this graph runs without a checkpointer (or without a thread_id), so nothing of "
            "this task survives the process: compile it with a checkpointer and invoke it with "
            "config={'configurable': {'thread_id': ...}}"
        )
    # Unset when `invoke` was given no durability: LangGraph's default, "async", applies.
    durability: Any = config.get("configurable", {}).get(DURABILITY_KEY, "async")
    if durability != "sync":
        raise TaskKeyUnavailable(
            f"this run's durability is {durability!r}: a task's key is stable across a crash "
            "only if the checkpoint its step started from was saved before it acted, which "
            "LangGraph guarantees with durability='sync': invoke(..., durability='sync')"
        )
    return keys.task_key(execution.thread_id, execution.checkpoint_ns, action)


class Gateway:
    """Sends a node's actions through the gateway at `base_url`, each with its task's key.

    `http`: a caller's `httpx.Client` (its timeouts, proxies, certificates); by default one of
    its own, closed by `close()` or at the end of a `with` block."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.Client | None = None,
        policy: RetryPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._own = http is None
        self._http = http or httpx.Client(timeout=DEFAULT_TIMEOUT)
        self._client = SyncActionClient(self._http, base_url, policy=policy, rng=rng)

    def post(
        self, path: str, body: JSON, *, action: str, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST `body` as JSON to `path` with the key of `action` for the running task; the
        final 2xx answer (a replay is as good), or raise."""
        return self._client.send(path, body, task_key(action), headers=headers)

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
    """`Gateway` for async nodes (`ainvoke`, `astream`), on an `httpx.AsyncClient`."""

    def __init__(
        self,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        policy: RetryPolicy | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._own = http is None
        self._http = http or httpx.AsyncClient(timeout=DEFAULT_TIMEOUT)
        # No key lifetime: a LangGraph run has no saved pending action whose age it could check.
        self._client = ActionClient(self._http, base_url, policy=policy, rng=rng, key_lifetime=None)

    async def post(
        self, path: str, body: JSON, *, action: str, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """POST `body` as JSON to `path` with the key of `action` for the running task; the
        final 2xx answer (a replay is as good), or raise."""
        return await self._client.send(path, body, task_key(action), headers=headers)

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
