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

What plays a run in the worker is the lab's `Runtime` (`worker`): the agent library's runner by
default, or the same task as a LangGraph graph (`langgraph_runtime.RUNTIME`, strategies A, B, C
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

The rooms: `model` (strategies, crashes, runs, the expected figures), `worker` (the process that
plays a run), this module (the lab that starts, kills, resumes and counts) and `report` (the
figures, the JSON and the table).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import secrets
import selectors
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .model import (
    LATE_STRATEGIES,
    STRATEGIES,
    Crash,
    GatewayKill,
    Reconciliation,
    Run,
    draw_crashes,
)
from .report import Figures, Outcome
from .stack import LATE_TTL, Stack
from .task import ACTION_STEPS, CHECKPOINT_SAVE_SECONDS
from .worker import EXIT_STALE, EXIT_UNKNOWN, RUNNER, Environment, Runtime, Worker, fork_worker

# How long after the agent says "about to send" the gateway is killed: a few milliseconds, so the
# kill lands before, during or after the gateway's claim, forward and store.
GATEWAY_KILL_WINDOW = 0.015
# How long after its crash a late run (E, F) is resumed: past the `/late` route's key TTL by a
# second, so its keys have expired whatever the gateway's and the lab's clocks say.
LATE_WAIT = LATE_TTL + 1.0
MAX_PROCESSES_PER_RUN = 8  # a run needing more is a bug: it is reported as failed


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
