"""The crash-recovery lab (contract section 8): run the support task N times per strategy, kill
each run with a real SIGKILL at a random point, resume it, and count what really happened.

How a run goes:
- Its crash point is drawn from the seed: a step, uniformly among the 12, and for the three
  action steps, whether the crash falls in the gap between the action and the checkpoint (15%)
  or before the action was sent (85%). The same crash points are used for every strategy, so the
  strategies are compared on the same crashes.
- The lab forks a worker from itself (already warm: every module imported) for each process of
  the run. The worker runs `oncegate.agent.runner.run_agent`, which reports each point of each
  step on a pipe; when it reaches its crash point it says so and waits, and the lab kills it with
  SIGKILL. Then it forks a fresh worker that resumes the run (strategy A: from step 1).
- Duplicates and lost actions are counted from the demo upstream's `GET /actions`, by the run id
  every action body carries: what was performed, not what the agent believes. Redone steps are
  counted from the workers' reports of the work they did (a step finished twice).
- Wasted tokens and seconds are priced from the task's invented costs (`task.COSTS`): every
  finished step redone in full, plus the part of the step the crash interrupted (`Crash.progress`
  of it, drawn with the crash; none for a crash in the gap, whose step had finished). Checkpoint
  seconds are the saves the workers reported, at `task.CHECKPOINT_SAVE_SECONDS` each.

Strategies: A restart from step 1 (no checkpoint); B checkpoint after each step; C checkpoint and
a stable key per action, through the gateway; D checkpoint first, then act (no key).

What plays a run in the worker is the lab's `Runtime`: the agent library's runner by default
(`RUNNER`), or the same task as a LangGraph graph (`langgraph_runtime.RUNTIME`, strategies A, B, C
only); the lab around it (crashes, kills, resumes, counting) is the same.

`--late-resume` adds two: E and F are C resumed after the gateway has forgotten the run's keys
(through the gateway's `/late` route, whose keys live `stack.LATE_TTL`; each crashed run waits
`LATE_WAIT` before it is resumed). E resends its pending action anyway, and the gateway performs
it as new; F's client knows the route's key lifetime, so its runner stops with `StaleAction`
instead, and the lab reconciles as an operator would: it looks the key up in the upstream's
records and marks the step done with the upstream's receipt, or allows the resend if nothing
was performed; then it resumes the run.

`--kill-gateway`: a share of the C runs also have the gateway SIGKILLed a few milliseconds after
the agent is about to send one of its actions, and restarted at once. A run whose key went
`unknown` (the gateway died holding the claim) stops with `ActionOutcomeUnknown`; the lab then does
what an operator would: it looks the key up in the upstream's records and resolves it on the
admin API (completed with the upstream's receipt, or released if nothing was performed), and
resumes the run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import math
import os
import random
import secrets
import selectors
import signal
import ssl
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TextIO

import httpx

from ..agent.checkpoints import JSON, Checkpoint
from ..agent.client import ActionClient, ActionOutcomeUnknown, KeyLifetime, RetryPolicy
from ..agent.runner import Order, StaleAction, allow_resend, mark_done, run_agent
from ..store.checkpoints import PostgresCheckpoints
from .stack import LATE_TTL, Stack
from .task import ACTION_STEPS, CHECKPOINT_SAVE_SECONDS, COSTS, STEPS, support_task

# Contract section 8: 15% of the crashes that fall on a side-effect step fall between the action
# and the checkpoint.
GAP_SHARE = 0.15
# How long after the agent says "about to send" the gateway is killed: a few milliseconds, so the
# kill lands before, during or after the gateway's claim, forward and store.
GATEWAY_KILL_WINDOW = 0.015
EXIT_UNKNOWN = 3  # a worker's exit status when its action's outcome is unknown
EXIT_STALE = 4  # a worker's exit status when its run stopped for reconciliation (StaleAction)
# How long after its crash a late run (E, F) is resumed: past the `/late` route's key TTL by a
# second, so its keys have expired whatever the gateway's and the lab's clocks say.
LATE_WAIT = LATE_TTL + 1.0
# F's client: the `/late` route's TTL, less a second of margin (the route's whole upstream
# timeout, and more than the clocks of one machine can disagree).
LATE_KEY_LIFETIME = KeyLifetime(ttl=timedelta(seconds=LATE_TTL), margin=timedelta(seconds=1))
MAX_PROCESSES_PER_RUN = 8  # a run needing more is a bug: it is reported as failed


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    title: str
    checkpoints: bool
    through_gateway: bool  # with a stable key per action
    order: Order = "act-then-save"
    late: bool = False  # resumed after the gateway forgot its keys (the `/late` route)
    age_check: bool = True  # the client knows the key lifetime, and stops a too-late resend


STRATEGIES = {
    "A": Strategy("A", "restart from step 1", checkpoints=False, through_gateway=False),
    "B": Strategy("B", "checkpoint after each step", checkpoints=True, through_gateway=False),
    "C": Strategy("C", "checkpoint + stable keys via oncegate", True, through_gateway=True),
    "D": Strategy("D", "save first, then act", True, False, order="save-then-act"),
    "E": Strategy("E", "C resumed after its keys expired", True, True, late=True, age_check=False),
    "F": Strategy("F", "E with the key-age check", True, True, late=True),
}
LATE_STRATEGIES = "EF"


@dataclass(frozen=True, slots=True)
class Crash:
    step: int
    gap: bool  # between the action and its checkpoint (D: between the checkpoint and the action)
    # How far into its step's work the crash came (0 to 1): the share of the step's cost lost.
    # The real steps take microseconds, so this is drawn, not measured.
    progress: float = 0.0

    def point(self, strategy: Strategy) -> tuple[str, int]:
        """Where the worker is killed, as a runner event (`oncegate.agent.runner.EventHook`)."""
        if self.gap:
            return ("done" if strategy.order == "act-then-save" else "saved", self.step)
        if self.step in ACTION_STEPS:
            return ("prepared", self.step)  # parameters computed, nothing sent
        return ("started", self.step)


def draw_crashes(runs: int, seed: int) -> list[Crash]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible experiment, not a secret
    # A stream of its own, so a seed draws the same steps and gaps as before progress existed.
    progress = random.Random(f"progress-{seed}")  # noqa: S311 - reproducible, not a secret
    crashes = []
    for _ in range(runs):
        step = rng.randint(1, STEPS)
        gap = step in ACTION_STEPS and rng.random() < GAP_SHARE
        crashes.append(Crash(step, gap, progress.random()))
    return crashes


def expectation(strategy: Strategy) -> tuple[float, float]:
    """The model's expected wasted tokens and seconds per run, from `task.COSTS`.

    A crash falls on each of the 12 steps alike and interrupts it half-way on average; on an
    action step, GAP_SHARE of the crashes fall after the action instead, its step finished.
    Restarting (A) redoes every step before the crashed one; a checkpoint redoes none. A
    finished step caught in the gap is redone in full when the action comes before its
    checkpoint (A, B, C, E), and not at all when the checkpoint comes first (D) or when the
    run stops for reconciliation and the step is marked done from the upstream's records (F)."""
    redoes_gap = strategy.order == "act-then-save" and not (strategy.late and strategy.age_check)
    tokens = seconds = 0.0
    for step in range(1, STEPS + 1):
        gap = GAP_SHARE if step in ACTION_STEPS else 0.0
        share = (1 - gap) / 2 + (gap if redoes_gap else 0.0)
        before = [] if strategy.checkpoints else [COSTS[earlier] for earlier in range(1, step)]
        tokens += share * COSTS[step].tokens + sum(cost.tokens for cost in before)
        seconds += share * COSTS[step].seconds + sum(cost.seconds for cost in before)
    return tokens / STEPS, seconds / STEPS


@dataclass(frozen=True, slots=True)
class Reconciliation:
    """What the lab, as an operator, decided for a run stopped by `StaleAction`."""

    step: int
    receipt: JSON  # the upstream's record of the action: the step is marked done with it
    performed: bool  # False: nothing was performed, the resend is allowed (receipt unused)


@dataclass(frozen=True, slots=True)
class GatewayKill:
    step: int  # killed when the agent is about to send this step's action
    delay: float


@dataclass
class Run:
    strategy: Strategy
    number: int
    run_id: str
    crash: Crash
    gateway_kill: GatewayKill | None = None
    processes: int = 0
    done: collections.Counter[int] = field(default_factory=collections.Counter)
    gateway_killed: bool = False
    unknown_keys: list[str] = field(default_factory=list)
    resolutions: list[str] = field(default_factory=list)
    stale_keys: list[str] = field(default_factory=list)  # each stop for reconciliation
    reconciliations: list[Reconciliation] = field(default_factory=list)
    saves: int = 0  # checkpoint saves, in every process of the run
    failure: str | None = None
    finished: bool = False

    @property
    def redone(self) -> int:
        return sum(count - 1 for count in self.done.values() if count > 1)

    def wasted(self) -> tuple[float, float]:
        """Tokens and seconds spent again: each finished step redone, in full, and the part of
        the step the crash interrupted (none after a crash in the gap: its step had finished)."""
        tokens = seconds = 0.0
        for step, count in self.done.items():
            tokens += (count - 1) * COSTS[step].tokens
            seconds += (count - 1) * COSTS[step].seconds
        if not self.crash.gap:
            tokens += self.crash.progress * COSTS[self.crash.step].tokens
            seconds += self.crash.progress * COSTS[self.crash.step].seconds
        return tokens, seconds


@dataclass(frozen=True, slots=True)
class Figures:
    redone_avg: float
    duplicate_runs_pct: float
    lost_runs_pct: float
    wasted_tokens_avg: float
    wasted_seconds_avg: float
    checkpoint_seconds_avg: float


@dataclass
class Outcome:
    runs: int
    seed: int
    strategies: dict[str, Figures]
    seconds: float
    failures: list[str]
    gateway: dict[str, int] | None  # with --kill-gateway
    late: dict[str, Any] | None = None  # with --late-resume
    runtime: Runtime | None = None  # what played the runs; None: the runner

    def document(self) -> dict[str, Any]:
        """Contract section 8's JSON (plus `gateway_kills` with --kill-gateway, `late_resume`
        with --late-resume)."""
        document: dict[str, Any] = {
            "runs": self.runs,
            "seed": self.seed,
            "strategies": {
                name: dataclasses.asdict(figures) for name, figures in self.strategies.items()
            },
        }
        if self.gateway is not None:
            document["gateway_kills"] = self.gateway
        if self.late is not None:
            document["late_resume"] = self.late
        return document


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


# --- the worker: a forked child that runs (or resumes) one run and may be killed --------------


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


# --- the lab: runs, kills, resumes, counts -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Resume:
    """What comes after a worker ended: another worker for its run, now or at `at`."""

    at: float  # time.monotonic()
    reconciliation: Reconciliation | None = None


class Lab:
    def __init__(
        self,
        stack: Stack,
        *,
        runs: int,
        seed: int,
        strategies: Sequence[str] = ("A", "B", "C", "D"),
        jobs: int = 4,
        kill_gateway: float = 0.0,
        late_resume: bool = False,
        crashes: Sequence[Crash] | None = None,
        progress: Callable[[int, int], None] | None = None,
        runtime: Runtime = RUNNER,
    ) -> None:
        """`crashes` (one per run) replaces the ones drawn from `seed`; tests fix them."""
        names = [*strategies, *(LATE_STRATEGIES if late_resume else "")]
        if unknown := [name for name in names if name not in runtime.titles]:
            raise ValueError(f"the {runtime.name} runtime has no strategy {', '.join(unknown)}")
        if runtime is not RUNNER and (kill_gateway or late_resume):
            raise ValueError(f"the {runtime.name} runtime has no --kill-gateway, --late-resume")
        if kill_gateway and stack.gateway is None:
            raise ValueError("--kill-gateway needs the lab's own gateway (no --gateway)")
        if late_resume and stack.late_gateway_url is None:
            raise ValueError("--late-resume needs the lab's own gateway (no --gateway)")
        if crashes is not None and len(crashes) != runs:
            raise ValueError(f"{len(crashes)} crashes for {runs} runs")
        self.stack = stack
        self.runtime = runtime
        self.runs = runs
        self.seed = seed
        self.jobs = jobs
        self.progress = progress
        self.environment = Environment(
            stack.database_url,
            stack.upstream_url,
            stack.gateway_url,
            httpx.create_ssl_context(),
            flush_each_save=not stack.own_database,
            late_gateway_url=stack.late_gateway_url,
        )
        session = secrets.token_hex(3)  # several labs may share one upstream or database
        self.prefix = f"lab-{session}"
        kills = random.Random(seed + 1)  # noqa: S311 - reproducible, not a secret
        self.plan: list[Run] = []
        for number, crash in enumerate(crashes or draw_crashes(runs, seed), start=1):
            for name in names:
                strategy = STRATEGIES[name]
                self.plan.append(Run(strategy, number, f"{self.prefix}-{name}-run-{number}", crash))
        # The share of C's runs, and at least one, so a short demo (5% of 40) shows a kill. Only
        # C's: E and F wait out their keys' lifetime, which a gateway kill's `unknown` key and
        # its resolution would have to fit in.
        candidates = [run for run in self.plan if run.strategy.name == "C"]
        if kill_gateway and candidates:
            count = max(1, round(kill_gateway * len(candidates)))
            for run in kills.sample(candidates, count):
                step = kills.choice(sorted(ACTION_STEPS))
                run.gateway_kill = GatewayKill(step, kills.uniform(0, GATEWAY_KILL_WINDOW))
        self.kill_gateway = kill_gateway
        self.late_resume = late_resume
        self.gateway_kills = 0
        self._http = httpx.Client(trust_env=False, timeout=30.0)

    def run(self) -> Outcome:
        started = time.monotonic()
        if self.runtime.prepare is not None:
            self.runtime.prepare(self.environment)
        queue = collections.deque(self.plan)
        selector = selectors.DefaultSelector()
        timers: list[float] = []  # when the gateway is to be killed
        waiting: list[tuple[float, Run, Reconciliation | None]] = []  # late resumes
        active = 0  # runs with a worker alive
        finished = 0
        try:
            while queue or active or waiting:
                now = time.monotonic()
                # Resumes that are due come before new runs: a run in progress finishes first.
                for due in sorted(item for item in waiting if item[0] <= now)[: self.jobs - active]:
                    waiting.remove(due)
                    self._start(selector, due[1], None, due[2])
                    active += 1
                while queue and active < self.jobs:
                    run = queue.popleft()
                    self._start(selector, run, run.crash.point(run.strategy))
                    active += 1
                deadlines = timers + [item[0] for item in waiting]
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                for selected, _ in selector.select(timeout):
                    worker: Worker = selected.data
                    data = os.read(worker.fd, 65536)
                    if data:
                        self._read(worker, data, timers)
                        continue
                    selector.unregister(worker.fd)
                    os.close(worker.fd)
                    _, status = os.waitpid(worker.pid, 0)
                    after = self._ended(worker, status)
                    if after is None:
                        active -= 1
                        finished += 1
                        if self.progress is not None:
                            self.progress(finished, len(self.plan))
                    elif after.at <= time.monotonic():
                        self._start(selector, worker.run, None, after.reconciliation)
                    else:
                        active -= 1
                        waiting.append((after.at, worker.run, after.reconciliation))
                now = time.monotonic()
                for due_kill in [when for when in timers if when <= now]:
                    timers.remove(due_kill)
                    self._kill_gateway()
        finally:
            # Interrupted (Ctrl-C): no worker may outlive the lab, least of all one frozen at its
            # crash point waiting for a SIGKILL that would never come.
            for selected in list(selector.get_map().values()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(selected.data.pid, signal.SIGKILL)
                os.waitpid(selected.data.pid, 0)
                os.close(selected.fd)
            selector.close()
        seconds = time.monotonic() - started
        return self._count(seconds)

    def _start(
        self,
        selector: selectors.BaseSelector,
        run: Run,
        point: tuple[str, int] | None,
        reconciliation: Reconciliation | None = None,
    ) -> None:
        worker = fork_worker(run, self.environment, point, reconciliation, self.runtime.play)
        selector.register(worker.fd, selectors.EVENT_READ, worker)

    def _read(self, worker: Worker, data: bytes, timers: list[float]) -> None:
        worker.buffer += data
        *lines, worker.buffer = worker.buffer.split(b"\n")
        run = worker.run
        for line in lines:
            word, _, argument = line.decode().partition(" ")
            if word == "done":
                run.done[int(argument)] += 1
            elif word == "checkpoint":
                run.saves += 1
            elif word == "kill-me":
                os.kill(worker.pid, signal.SIGKILL)  # the crash: nothing of the worker runs on
                worker.killed = True
            elif word == "unknown":
                run.unknown_keys.append(argument)
            elif word == "stale":
                run.stale_keys.append(argument)  # "<step> <key>"
            elif (
                word == "prepared"
                and run.gateway_kill is not None
                and not run.gateway_killed
                and int(argument) == run.gateway_kill.step
            ):
                run.gateway_killed = True
                timers.append(time.monotonic() + run.gateway_kill.delay)

    def _ended(self, worker: Worker, status: int) -> Resume | None:
        """What follows a worker's end: another worker for its run, or None: the run is over
        (finished, or failed with `run.failure` set)."""
        run = worker.run
        code = os.waitstatus_to_exitcode(status)
        if worker.killed and code == -signal.SIGKILL:
            wait = LATE_WAIT if run.strategy.late else 0.0
            return self._again(run, Resume(time.monotonic() + wait))
        if code == 0 and worker.crash_point is None:
            run.finished = True
            return None
        if code == EXIT_UNKNOWN and run.unknown_keys:
            try:
                run.resolutions.append(self._resolve(run.unknown_keys[-1]))
            except (RuntimeError, httpx.HTTPError) as exc:
                run.failure = f"{run.run_id}: its key went unknown and was not resolved: {exc}"
                return None
            return self._again(run, Resume(time.monotonic()))
        if code == EXIT_STALE and run.stale_keys:
            try:
                reconciliation = self._reconcile(run.stale_keys[-1])
            except httpx.HTTPError as exc:
                run.failure = f"{run.run_id}: stopped for reconciliation, not reconciled: {exc}"
                return None
            run.reconciliations.append(reconciliation)
            return self._again(run, Resume(time.monotonic(), reconciliation))
        run.failure = f"{run.run_id}: worker {worker.pid} ended with status {code}"
        return None

    def _again(self, run: Run, resume: Resume) -> Resume | None:
        if run.processes >= MAX_PROCESSES_PER_RUN:
            run.failure = f"{run.run_id}: still not finished after {run.processes} processes"
            return None
        return resume

    def _kill_gateway(self) -> None:
        self.gateway_kills += 1
        self.stack.restart_gateway()

    def _resolve(self, key: str) -> str:
        """What an operator does with an `unknown` key: ask the upstream, then settle the key."""
        if self.stack.admin_url is None:
            raise RuntimeError("the gateway is not the lab's own: resolve it on its admin API")
        performed = self._get(self.stack.upstream_url + "/actions", {"key": key})["actions"]
        headers = {"Authorization": f"Bearer {self.stack.admin_token}"}
        records = self._get(self.stack.admin_url + "/admin/keys", {"key": key}, headers)
        unknown = [record for record in records["records"] if record["state"] == "unknown"]
        if len(unknown) != 1:
            raise RuntimeError(f"expected one unknown record of {key}, found {records}")
        if performed:
            resolution = {
                "action": "complete",
                "status": 201,
                "headers": [["content-type", "application/json"]],
                "body": json.dumps(performed[0]),
            }
        else:
            resolution = {"action": "release"}
        url = f"{self.stack.admin_url}/admin/keys/{unknown[0]['id']}/resolve"
        response = self._http.post(url, json=resolution, headers=headers)
        response.raise_for_status()
        return str(resolution["action"])

    def _reconcile(self, stale: str) -> Reconciliation:
        """What an operator does with a run stopped by `StaleAction` (`"<step> <key>"`): look
        the key up in the upstream's records, and mark the step done with the upstream's
        receipt if it performed the action, or allow the resend if it did not."""
        step, _, key = stale.partition(" ")
        performed = self._get(self.stack.upstream_url + "/actions", {"key": key})["actions"]
        if performed:
            return Reconciliation(int(step), performed[0], performed=True)
        return Reconciliation(int(step), None, performed=False)

    def _get(
        self, url: str, params: dict[str, str] | None = None, headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        response = self._http.get(url, params=params, headers=headers)
        response.raise_for_status()
        document: dict[str, Any] = response.json()
        return document

    def _count(self, seconds: float) -> Outcome:
        performed: collections.Counter[tuple[str, int]] = collections.Counter()
        for action in self._get(self.stack.upstream_url + "/actions")["actions"]:
            request = action.get("request")
            if isinstance(request, dict) and str(request.get("run", "")).startswith(self.prefix):
                performed[(request["run"], request["step"])] += 1
        figures: dict[str, Figures] = {}
        for name in dict.fromkeys(run.strategy.name for run in self.plan):
            runs = [run for run in self.plan if run.strategy.name == name]
            duplicated = sum(
                any(performed[(run.run_id, step)] > 1 for step in ACTION_STEPS) for run in runs
            )
            lost = sum(
                any(performed[(run.run_id, step)] == 0 for step in ACTION_STEPS) for run in runs
            )
            wasted = [run.wasted() for run in runs]
            figures[name] = Figures(
                redone_avg=round(sum(run.redone for run in runs) / len(runs), 3),
                duplicate_runs_pct=round(100 * duplicated / len(runs), 2),
                lost_runs_pct=round(100 * lost / len(runs), 2),
                wasted_tokens_avg=round(sum(tokens for tokens, _ in wasted) / len(runs), 1),
                wasted_seconds_avg=round(sum(seconds for _, seconds in wasted) / len(runs), 3),
                checkpoint_seconds_avg=round(
                    sum(run.saves for run in runs) * CHECKPOINT_SAVE_SECONDS / len(runs), 3
                ),
            )
        gateway = None
        if self.kill_gateway:
            gateway = {
                "kills": self.gateway_kills,
                "runs_with_unknown_key": sum(bool(run.unknown_keys) for run in self.plan),
                "resolved_completed": sum(run.resolutions.count("complete") for run in self.plan),
                "resolved_released": sum(run.resolutions.count("release") for run in self.plan),
            }
        late: dict[str, Any] | None = None
        if self.late_resume:
            late = {"key_ttl_seconds": LATE_TTL, "resumed_after_seconds": LATE_WAIT}
            for name in LATE_STRATEGIES:
                runs = [run for run in self.plan if run.strategy.name == name]
                decided = [item for run in runs for item in run.reconciliations]
                late[name] = {
                    # The runs whose crash left an action saved but not finished: the ones
                    # whose late resume would send it again.
                    "runs_left_pending": sum(run.crash.step in ACTION_STEPS for run in runs),
                    "runs_stopped": sum(bool(run.stale_keys) for run in runs),
                    "marked_done": sum(item.performed for item in decided),
                    "resent": sum(not item.performed for item in decided),
                }
        failures = [run.failure for run in self.plan if run.failure is not None]
        self._http.close()
        return Outcome(
            self.runs, self.seed, figures, seconds, failures, gateway, late, self.runtime
        )


# --- presentation --------------------------------------------------------------------------------


class ProgressBar:
    """`[#####.....] 1200/4000 runs  31 s` on stderr, redrawn at most ten times a second (on a
    terminal) or at every tenth of the way (in a log)."""

    def __init__(self, stream: TextIO = sys.stderr, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self.started = time.monotonic()
        self._drawn = 0.0
        self._tenth = -1
        self.tty = stream.isatty()

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        tenth = 10 * done // total
        if self.tty:
            if now - self._drawn < 0.1 and done < total:
                return
        elif tenth == self._tenth:
            return
        self._drawn, self._tenth = now, tenth
        filled = self.width * done // total
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{total} runs  {now - self.started:.0f} s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and done == total:
            self.stream.write("\n")
        self.stream.flush()


# B performs an action twice when the crash falls on an action step (3 of 12) and in its gap.
B_DUPLICATE_SHARE = GAP_SHARE * len(ACTION_STEPS) / STEPS


def runs_to_show_the_gap(miss: float = 0.01) -> int:
    """Runs after which B shows at least one duplicate but for `miss` of the seeds."""
    return math.ceil(math.log(miss) / math.log(1 - B_DUPLICATE_SHARE))


def runs_for_a_figure(within: float = 1 / 3) -> int:
    """Runs after which B's duplicate share is within `within` of itself (relative), 19 seeds
    out of 20 (a binomial share's normal interval)."""
    share = B_DUPLICATE_SHARE
    return math.ceil((1.96 / within) ** 2 * (1 - share) / share)


def too_few_runs(runs: int) -> str | None:
    """What a table of `runs` runs cannot show, or None when they are enough for a figure."""
    if runs >= runs_for_a_figure():
        return None
    share = B_DUPLICATE_SHARE
    return (
        f"too few runs to measure B's gap: B performs an action twice in about {share:.2%} of "
        f"runs, so {runs} runs expect {share * runs:.1f} such runs and show none "
        f"{(1 - share) ** runs:.0%} of the time (B then reads like C); --runs "
        f"{runs_to_show_the_gap()} shows the gap for 99 seeds in 100, --runs "
        f"{runs_for_a_figure()} puts B's figure within a third of itself (docs/lab.md)"
    )


def table(outcome: Outcome) -> str:
    runtime = outcome.runtime or RUNNER
    on = "" if runtime is RUNNER else f" on {runtime.name}"
    rows = [
        f"crash-recovery lab{on}: {outcome.runs} runs per strategy, seed {outcome.seed}, "
        f"{outcome.seconds:.0f} s",
        "",
        f"{'strategy':<42} {'steps redone':>13} {'action twice':>13} {'action lost':>12} "
        f"{'wasted tokens':>14} {'wasted s':>9} {'checkpoint s':>13}",
    ]
    for name, figures in outcome.strategies.items():
        title = f"{name}  {runtime.titles[name]}"
        rows.append(
            f"{title:<42} {figures.redone_avg:>13.2f} {figures.duplicate_runs_pct:>12.1f}% "
            f"{figures.lost_runs_pct:>11.1f}% {figures.wasted_tokens_avg:>14,.0f} "
            f"{figures.wasted_seconds_avg:>9.2f} {figures.checkpoint_seconds_avg:>13.2f}"
        )
    rows.append("")
    rows.append(
        "steps redone: finished steps done again, per run (avg); action twice / lost: runs "
        "(%) in which demo-upstream performed an action twice / never"
    )
    expected = ", ".join(
        f"{name} {tokens:,.0f} / {seconds:.2f} s"
        for name in outcome.strategies
        for tokens, seconds in [expectation(STRATEGIES[name])]
    )
    rows.append(
        "wasted tokens / s: finished steps redone plus the part of the step the crash "
        "interrupted, per run (avg), at invented per-step costs; the model expects "
        f"{expected}; checkpoint s: saves x {CHECKPOINT_SAVE_SECONDS * 1000:.0f} ms (invented)"
    )
    note = too_few_runs(outcome.runs) if "B" in outcome.strategies else None
    if note is not None:
        rows.append(note)
    if outcome.gateway is not None:
        gateway = outcome.gateway
        rows.append(
            f"gateway SIGKILLed {gateway['kills']} times; {gateway['runs_with_unknown_key']} "
            f"C runs had a key go unknown, resolved from the upstream's records: "
            f"{gateway['resolved_completed']} completed, {gateway['resolved_released']} released"
        )
    if outcome.late is not None:
        late = outcome.late
        rows.append(
            f"E, F: resumed {late['resumed_after_seconds']:g} s after the crash, past the "
            f"{late['key_ttl_seconds']:g} s its keys live at the gateway's /late route"
        )
        for name in LATE_STRATEGIES:
            counts = late[name]
            rows.append(
                f"{name}: {counts['runs_left_pending']} runs crashed with an action pending; "
                f"{counts['runs_stopped']} stopped for reconciliation ({counts['marked_done']} "
                f"marked done from the upstream's records, {counts['resent']} resent)"
            )
    return "\n".join(rows)
