"""The worker: a process forked from the lab (already warm: every module imported) that plays
one run, or resumes it, and may be killed at its crash point.

It reports each point of each step on a pipe (`started`, `prepared`, `done`, `saved`, each with
the step's number), `checkpoint` for each save, and when it reaches its crash point it says
`kill-me` and waits for the lab's SIGKILL. A run whose key went unknown, or that stopped for
reconciliation, says so on the pipe and ends with its own exit status (`EXIT_UNKNOWN`,
`EXIT_STALE`).

What plays a run in the worker is the lab's `Runtime`: the agent library's runner by default
(`RUNNER`), or the same task as a LangGraph graph (`langgraph_runtime.RUNTIME`, strategies A, B, C
only); the lab around it (crashes, kills, resumes, counting) is the same.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import httpx

from ..agent.checkpoints import Checkpoint
from ..agent.client import ActionClient, ActionOutcomeUnknown, KeyLifetime, RetryPolicy
from ..agent.runner import StaleAction, allow_resend, mark_done, run_agent
from ..store.checkpoints import PostgresCheckpoints
from .model import STRATEGIES, Reconciliation, Run
from .stack import LATE_TTL
from .task import support_task

EXIT_UNKNOWN = 3  # a worker's exit status when its action's outcome is unknown
EXIT_STALE = 4  # a worker's exit status when its run stopped for reconciliation (StaleAction)
# F's client: the `/late` route's TTL, less a second of margin (the route's whole upstream
# timeout, and more than the clocks of one machine can disagree).
LATE_KEY_LIFETIME = KeyLifetime(ttl=timedelta(seconds=LATE_TTL), margin=timedelta(seconds=1))


class Forgetful:
    """Strategy A's checkpoint store: remembers nothing, so every process starts at step 1."""

    async def load(self, run_id: str) -> Checkpoint | None:
        return None

    async def save(self, checkpoint: Checkpoint) -> None:
        return None

    async def close(self) -> None:
        return None


class Counted:
    """A worker's checkpoint store that tells the lab of each save it made (the checkpoint
    seconds)."""

    def __init__(self, store: PostgresCheckpoints, pipe: int) -> None:
        self._store = store
        self._pipe = pipe

    async def load(self, run_id: str) -> Checkpoint | None:
        return await self._store.load(run_id)

    async def save(self, checkpoint: Checkpoint) -> None:
        await self._store.save(checkpoint)
        os.write(self._pipe, f"checkpoint {checkpoint.next_step}\n".encode())


@dataclass(frozen=True, slots=True)
class Environment:
    """Where a worker finds PostgreSQL, the upstream and the gateway."""

    database_url: str
    upstream_url: str
    gateway_url: str
    # Built once in the lab, inherited by every fork: loading CA certificates per process would
    # cost more than the whole agent run (the lab only speaks plain HTTP on loopback).
    ssl_context: ssl.SSLContext
    # False on the lab's own embedded PostgreSQL (see `PostgresCheckpoints.connect`): the lab
    # kills agents and gateways, never PostgreSQL, so a save that is committed but not yet
    # flushed is exactly as visible to the resumed run; it saves ~2 ms of fsync per step.
    flush_each_save: bool = True
    # The gateway's `/late` route, whose keys live `stack.LATE_TTL` (strategies E and F).
    late_gateway_url: str | None = None


# What a worker runs: (run, environment, crash point, reconciliation, pipe) -> its exit status.
# It reports each point of each step on the pipe (`started`, `prepared`, `done`, `saved`, each
# with the step's number), `checkpoint` for each save, and stops at the crash point (`kill-me`).
Play = Callable[[Run, Environment, tuple[str, int] | None, Reconciliation | None, int], int]


@dataclass(frozen=True, slots=True)
class Runtime:
    """What plays the task in a worker, with the strategies it has and their titles."""

    name: str
    play: Play
    titles: dict[str, str]  # strategy name -> its line in the table
    # Called once in the lab before the first worker (whatever the workers share, made once).
    prepare: Callable[[Environment], None] | None = None


@dataclass
class Worker:
    run: Run
    pid: int
    fd: int
    crash_point: tuple[str, int] | None
    buffer: bytes = b""
    killed: bool = False


def fork_worker(
    run: Run,
    environment: Environment,
    crash_point: tuple[str, int] | None,
    reconciliation: Reconciliation | None = None,
    play: Play | None = None,
) -> Worker:
    """Fork a worker that runs `run` with `play` (the agent runner by default) until it ends or
    reaches `crash_point`, after applying `reconciliation` to its checkpoint."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        status = 1
        try:
            os.close(read_fd)
            status = (play or _worker)(run, environment, crash_point, reconciliation, write_fd)
        except BaseException:
            traceback.print_exc()
        finally:
            # Not sys.exit: the lab's atexit handlers (its embedded PostgreSQL) are not ours.
            os._exit(status)
    os.close(write_fd)
    run.processes += 1
    return Worker(run, pid, read_fd, crash_point)


def reporter(pipe: int, crash_point: tuple[str, int] | None) -> Callable[[str, int], None]:
    """A worker's report of each point of a step to the lab, which stops at `crash_point`."""

    def report(event: str, step: int) -> None:
        os.write(pipe, f"{event} {step}\n".encode())
        if (event, step) == crash_point:
            os.write(pipe, b"kill-me\n")
            while True:  # frozen at the crash point until the SIGKILL arrives
                time.sleep(60)

    return report


def _worker(
    run: Run,
    environment: Environment,
    crash_point: tuple[str, int] | None,
    reconciliation: Reconciliation | None,
    pipe: int,
) -> int:
    report = reporter(pipe, crash_point)

    async def main() -> int:
        strategy = run.strategy
        database: PostgresCheckpoints | None = None
        store: Counted | Forgetful = Forgetful()
        if strategy.checkpoints:
            database = await PostgresCheckpoints.connect(
                environment.database_url, flush_each_save=environment.flush_each_save
            )
            store = Counted(database, pipe)
        base_url = environment.upstream_url
        key_lifetime: KeyLifetime | None = KeyLifetime()  # the lab's main route: the 24 h default
        if strategy.late:
            if environment.late_gateway_url is None:
                raise RuntimeError("strategies E and F need the gateway's /late route")
            base_url = environment.late_gateway_url
            key_lifetime = LATE_KEY_LIFETIME if strategy.age_check else None
        elif strategy.through_gateway:
            base_url = environment.gateway_url
        try:
            if reconciliation is not None and database is not None:
                # The operator's step, on the store itself: not one of the agent's saves.
                if reconciliation.performed:
                    await mark_done(
                        database, run.run_id, reconciliation.step, reconciliation.receipt
                    )
                else:
                    await allow_resend(database, run.run_id, reconciliation.step)
            async with httpx.AsyncClient(
                verify=environment.ssl_context, trust_env=False, timeout=10.0
            ) as http:
                client = ActionClient(
                    http, base_url, policy=RetryPolicy(deadline=60.0), key_lifetime=key_lifetime
                )
                await run_agent(
                    run.run_id,
                    support_task(run.run_id),
                    store,
                    client,
                    use_keys=strategy.through_gateway,
                    order=strategy.order,
                    on_event=report,
                )
        except ActionOutcomeUnknown as exc:
            os.write(pipe, f"unknown {exc.key}\n".encode())
            return EXIT_UNKNOWN
        except StaleAction as exc:
            os.write(pipe, f"stale {exc.step} {exc.key}\n".encode())
            return EXIT_STALE
        finally:
            if database is not None:
                await database.close()
        return 0

    return asyncio.run(main())


# The lab's own runtime: the agent library's step runner (`oncegate.agent.runner`).
RUNNER = Runtime("runner", _worker, {name: strategy.title for name, strategy in STRATEGIES.items()})
