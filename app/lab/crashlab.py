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

Strategies: A restart from step 1 (no checkpoint); B checkpoint after each step; C checkpoint and
a stable key per action, through the gateway; D checkpoint first, then act (no key).

`--kill-gateway`: a share of the C runs also have the gateway SIGKILLed a few milliseconds after
the agent is about to send one of its actions, and restarted at once. A run whose key went
`unknown` (the gateway died holding the claim) stops with `OutcomeUnknown`; the lab then does
what an operator would: it looks the key up in the upstream's records and resolves it on the
admin API (completed with the upstream's receipt, or released if nothing was performed), and
resumes the run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
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
from typing import Any, TextIO

import httpx

from ..agent.checkpoints import Checkpoint
from ..agent.client import ActionClient, OutcomeUnknown, RetryPolicy
from ..agent.runner import Order, run_agent
from ..store.checkpoints import PostgresCheckpoints
from .stack import Stack
from .task import ACTION_STEPS, STEPS, support_task

# Contract section 8: 15% of the crashes that fall on a side-effect step fall between the action
# and the checkpoint.
GAP_SHARE = 0.15
# Share of the C runs whose gateway is killed too, with `--kill-gateway` and no value.
GATEWAY_KILL_SHARE = 0.05
# How long after the agent says "about to send" the gateway is killed: a few milliseconds, so the
# kill lands before, during or after the gateway's claim, forward and store.
GATEWAY_KILL_WINDOW = 0.015
EXIT_UNKNOWN = 3  # a worker's exit status when its action's outcome is unknown
MAX_PROCESSES_PER_RUN = 8  # a run needing more is a bug: it is reported as failed


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    title: str
    checkpoints: bool
    through_gateway: bool  # with a stable key per action
    order: Order = "act-then-save"


STRATEGIES = {
    "A": Strategy("A", "restart from step 1", checkpoints=False, through_gateway=False),
    "B": Strategy("B", "checkpoint after each step", checkpoints=True, through_gateway=False),
    "C": Strategy("C", "checkpoint + stable keys via oncegate", True, through_gateway=True),
    "D": Strategy("D", "save first, then act", True, False, order="save-then-act"),
}


@dataclass(frozen=True, slots=True)
class Crash:
    step: int
    gap: bool  # between the action and its checkpoint (D: between the checkpoint and the action)

    def point(self, strategy: Strategy) -> tuple[str, int]:
        """Where the worker is killed, as a runner event (`oncegate.agent.runner.EventHook`)."""
        if self.gap:
            return ("done" if strategy.order == "act-then-save" else "saved", self.step)
        if self.step in ACTION_STEPS:
            return ("prepared", self.step)  # parameters computed, nothing sent
        return ("started", self.step)


def draw_crashes(runs: int, seed: int) -> list[Crash]:
    rng = random.Random(seed)  # noqa: S311 - a reproducible experiment, not a secret
    crashes = []
    for _ in range(runs):
        step = rng.randint(1, STEPS)
        crashes.append(Crash(step, step in ACTION_STEPS and rng.random() < GAP_SHARE))
    return crashes


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
    failure: str | None = None
    finished: bool = False

    @property
    def redone(self) -> int:
        return sum(count - 1 for count in self.done.values() if count > 1)


@dataclass(frozen=True, slots=True)
class Figures:
    redone_avg: float
    duplicate_runs_pct: float
    lost_runs_pct: float


@dataclass
class Outcome:
    runs: int
    seed: int
    strategies: dict[str, Figures]
    seconds: float
    failures: list[str]
    gateway: dict[str, int] | None  # with --kill-gateway

    def document(self) -> dict[str, Any]:
        """Contract section 8's JSON (plus `gateway_kills` with --kill-gateway)."""
        document: dict[str, Any] = {
            "runs": self.runs,
            "seed": self.seed,
            "strategies": {
                name: {
                    "redone_avg": figures.redone_avg,
                    "duplicate_runs_pct": figures.duplicate_runs_pct,
                    "lost_runs_pct": figures.lost_runs_pct,
                }
                for name, figures in self.strategies.items()
            },
        }
        if self.gateway is not None:
            document["gateway_kills"] = self.gateway
        return document


class Forgetful:
    """Strategy A's checkpoint store: remembers nothing, so every process starts at step 1."""

    async def load(self, run_id: str) -> Checkpoint | None:
        return None

    async def save(self, checkpoint: Checkpoint) -> None:
        return None

    async def close(self) -> None:
        return None


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


# --- the worker: a forked child that runs (or resumes) one run and may be killed --------------


@dataclass
class Worker:
    run: Run
    pid: int
    fd: int
    crash_point: tuple[str, int] | None
    buffer: bytes = b""
    killed: bool = False


def fork_worker(run: Run, environment: Environment, crash_point: tuple[str, int] | None) -> Worker:
    """Fork a worker that runs `run` until it ends or reaches `crash_point`."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        status = 1
        try:
            os.close(read_fd)
            status = _worker(run, environment, crash_point, write_fd)
        except BaseException:
            traceback.print_exc()
        finally:
            # Not sys.exit: the lab's atexit handlers (its embedded PostgreSQL) are not ours.
            os._exit(status)
    os.close(write_fd)
    run.processes += 1
    return Worker(run, pid, read_fd, crash_point)


def _worker(
    run: Run, environment: Environment, crash_point: tuple[str, int] | None, pipe: int
) -> int:
    def report(event: str, step: int) -> None:
        os.write(pipe, f"{event} {step}\n".encode())
        if (event, step) == crash_point:
            os.write(pipe, b"kill-me\n")
            while True:  # frozen at the crash point until the SIGKILL arrives
                time.sleep(60)

    async def main() -> int:
        strategy = run.strategy
        store: Any
        if strategy.checkpoints:
            store = await PostgresCheckpoints.connect(
                environment.database_url, flush_each_save=environment.flush_each_save
            )
        else:
            store = Forgetful()
        base_url = environment.gateway_url if strategy.through_gateway else environment.upstream_url
        try:
            async with httpx.AsyncClient(
                verify=environment.ssl_context, trust_env=False, timeout=10.0
            ) as http:
                client = ActionClient(http, base_url, policy=RetryPolicy(deadline=60.0))
                await run_agent(
                    run.run_id,
                    support_task(run.run_id),
                    store,
                    client,
                    use_keys=strategy.through_gateway,
                    order=strategy.order,
                    on_event=report,
                )
        except OutcomeUnknown as exc:
            os.write(pipe, f"unknown {exc.key}\n".encode())
            return EXIT_UNKNOWN
        finally:
            await store.close()
        return 0

    return asyncio.run(main())


# --- the lab: runs, kills, resumes, counts -------------------------------------------------------


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
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if kill_gateway and stack.gateway is None:
            raise ValueError("--kill-gateway needs the lab's own gateway (no --gateway)")
        self.stack = stack
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
        )
        session = secrets.token_hex(3)  # several labs may share one upstream or database
        self.prefix = f"lab-{session}"
        crashes = draw_crashes(runs, seed)
        kills = random.Random(seed + 1)  # noqa: S311 - reproducible, not a secret
        self.plan: list[Run] = []
        for number, crash in enumerate(crashes, start=1):
            for name in strategies:
                strategy = STRATEGIES[name]
                self.plan.append(Run(strategy, number, f"{self.prefix}-{name}-run-{number}", crash))
        # The share of the gateway's runs, and at least one: a short demo (5% of 40) shows a kill.
        through_gateway = [run for run in self.plan if run.strategy.through_gateway]
        if kill_gateway and through_gateway:
            count = max(1, round(kill_gateway * len(through_gateway)))
            for run in kills.sample(through_gateway, count):
                step = kills.choice(sorted(ACTION_STEPS))
                run.gateway_kill = GatewayKill(step, kills.uniform(0, GATEWAY_KILL_WINDOW))
        self.kill_gateway = kill_gateway
        self.gateway_kills = 0
        self._http = httpx.Client(trust_env=False, timeout=30.0)

    def run(self) -> Outcome:
        started = time.monotonic()
        queue = collections.deque(self.plan)
        selector = selectors.DefaultSelector()
        timers: list[tuple[float, Run]] = []
        active = 0
        finished = 0
        try:
            while queue or active:
                while queue and active < self.jobs:
                    run = queue.popleft()
                    self._start(selector, run, run.crash.point(run.strategy))
                    active += 1
                timeout = None
                if timers:
                    timeout = max(0.0, min(when for when, _ in timers) - time.monotonic())
                for selected, _ in selector.select(timeout):
                    worker: Worker = selected.data
                    data = os.read(worker.fd, 65536)
                    if data:
                        self._read(worker, data, timers)
                        continue
                    selector.unregister(worker.fd)
                    os.close(worker.fd)
                    _, status = os.waitpid(worker.pid, 0)
                    if self._ended(worker, status, selector):
                        active -= 1
                        finished += 1
                        if self.progress is not None:
                            self.progress(finished, len(self.plan))
                now = time.monotonic()
                for due in [timer for timer in timers if timer[0] <= now]:
                    timers.remove(due)
                    self._kill_gateway(due[1])
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
        self, selector: selectors.BaseSelector, run: Run, point: tuple[str, int] | None
    ) -> None:
        worker = fork_worker(run, self.environment, point)
        selector.register(worker.fd, selectors.EVENT_READ, worker)

    def _read(self, worker: Worker, data: bytes, timers: list[tuple[float, Run]]) -> None:
        worker.buffer += data
        *lines, worker.buffer = worker.buffer.split(b"\n")
        run = worker.run
        for line in lines:
            word, _, argument = line.decode().partition(" ")
            if word == "done":
                run.done[int(argument)] += 1
            elif word == "kill-me":
                os.kill(worker.pid, signal.SIGKILL)  # the crash: nothing of the worker runs on
                worker.killed = True
            elif word == "unknown":
                run.unknown_keys.append(argument)
            elif (
                word == "prepared"
                and run.gateway_kill is not None
                and not run.gateway_killed
                and int(argument) == run.gateway_kill.step
            ):
                run.gateway_killed = True
                timers.append((time.monotonic() + run.gateway_kill.delay, run))

    def _ended(self, worker: Worker, status: int, selector: selectors.BaseSelector) -> bool:
        """Handle a worker's end; True when its run is over."""
        run = worker.run
        code = os.waitstatus_to_exitcode(status)
        if worker.killed and code == -signal.SIGKILL:
            return self._again(run, selector)
        if code == 0 and worker.crash_point is None:
            run.finished = True
            return True
        if code == EXIT_UNKNOWN and run.unknown_keys:
            try:
                run.resolutions.append(self._resolve(run.unknown_keys[-1]))
            except (RuntimeError, httpx.HTTPError) as exc:
                run.failure = f"{run.run_id}: its key went unknown and was not resolved: {exc}"
                return True
            return self._again(run, selector)
        run.failure = f"{run.run_id}: worker {worker.pid} ended with status {code}"
        return True

    def _again(self, run: Run, selector: selectors.BaseSelector) -> bool:
        if run.processes >= MAX_PROCESSES_PER_RUN:
            run.failure = f"{run.run_id}: still not finished after {run.processes} processes"
            return True
        self._start(selector, run, None)
        return False

    def _kill_gateway(self, run: Run) -> None:
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
            figures[name] = Figures(
                redone_avg=round(sum(run.redone for run in runs) / len(runs), 3),
                duplicate_runs_pct=round(100 * duplicated / len(runs), 2),
                lost_runs_pct=round(100 * lost / len(runs), 2),
            )
        gateway = None
        if self.kill_gateway:
            gateway = {
                "kills": self.gateway_kills,
                "runs_with_unknown_key": sum(bool(run.unknown_keys) for run in self.plan),
                "resolved_completed": sum(run.resolutions.count("complete") for run in self.plan),
                "resolved_released": sum(run.resolutions.count("release") for run in self.plan),
            }
        failures = [run.failure for run in self.plan if run.failure is not None]
        self._http.close()
        return Outcome(self.runs, self.seed, figures, seconds, failures, gateway)


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


def table(outcome: Outcome) -> str:
    rows = [
        f"crash-recovery lab: {outcome.runs} runs per strategy, seed {outcome.seed}, "
        f"{outcome.seconds:.0f} s",
        "",
        f"{'strategy':<42} {'steps redone':>13} {'action twice':>13} {'action lost':>12}",
    ]
    for name, figures in outcome.strategies.items():
        title = f"{name}  {STRATEGIES[name].title}"
        rows.append(
            f"{title:<42} {figures.redone_avg:>13.2f} {figures.duplicate_runs_pct:>12.1f}% "
            f"{figures.lost_runs_pct:>11.1f}%"
        )
    rows.append("")
    rows.append(
        "steps redone: finished steps done again, per run (avg); action twice / lost: runs "
        "(%) in which demo-upstream performed an action twice / never"
    )
    if outcome.gateway is not None:
        gateway = outcome.gateway
        rows.append(
            f"gateway SIGKILLed {gateway['kills']} times; {gateway['runs_with_unknown_key']} "
            f"C runs had a key go unknown, resolved from the upstream's records: "
            f"{gateway['resolved_completed']} completed, {gateway['resolved_released']} released"
        )
    return "\n".join(rows)
