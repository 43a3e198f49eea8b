"""`run_agent` resumes a run killed with a real SIGKILL at every point of every step, and each
action is performed exactly once (counted by the demo upstream), through the real gateway.

The worker is the lab's: a process forked from this one that reports each point of each step on
a pipe and waits at the chosen one for its SIGKILL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from oncegate.agent.checkpoints import JSON, Checkpoint, CheckpointError
from oncegate.agent.client import KeyLifetime
from oncegate.agent.runner import (
    Action,
    StaleAction,
    Step,
    allow_resend,
    answer_of,
    mark_done,
    run_agent,
)
from oncegate.lab import model, worker
from oncegate.lab.task import ACTION_STEPS, STEPS, support_task
from oncegate.store.checkpoints import PostgresCheckpoints
from tests.e2e.conftest import DemoUpstream, GatewayProcess

STRATEGY_C = model.STRATEGIES["C"]


def finish(process: worker.Worker) -> tuple[list[str], int]:
    """Read the worker's reports to the end, killing it if it asks; its lines and exit code."""
    lines: list[str] = []
    buffer = b""
    while chunk := os.read(process.fd, 65536):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            lines.append(line.decode())
            if line == b"kill-me":
                os.kill(process.pid, signal.SIGKILL)
    os.close(process.fd)
    _, status = os.waitpid(process.pid, 0)
    return lines, os.waitstatus_to_exitcode(status)


async def load(database_url: str, run_id: str) -> Checkpoint | None:
    store = await PostgresCheckpoints.connect(database_url)
    try:
        return await store.load(run_id)
    finally:
        await store.close()


POINTS = [
    (event, step)
    for step in range(1, STEPS + 1)
    for event in (
        ("started", "prepared", "done", "saved") if step in ACTION_STEPS else ("started", "saved")
    )
]


@pytest.mark.parametrize(("event", "step"), POINTS, ids=[f"{e}-{s}" for e, s in POINTS])
def test_a_run_killed_at_any_point_resumes_and_performs_each_action_once(
    event: str, step: int, database_url: str, gateway: GatewayProcess, upstream: DemoUpstream
) -> None:
    run_id = f"resume-{uuid.uuid4().hex[:8]}"
    environment = worker.Environment(
        database_url, upstream.url, gateway.url, httpx.create_ssl_context()
    )
    run = model.Run(STRATEGY_C, 1, run_id, model.Crash(step, False))

    lines, code = finish(worker.fork_worker(run, environment, (event, step)))
    assert code == -signal.SIGKILL and lines[-2:] == [f"{event} {step}", "kill-me"]
    checkpoint = asyncio.run(load(database_url, run_id))
    saved_before = step + 1 if event == "saved" else step
    assert (checkpoint.next_step if checkpoint else 1) == saved_before

    lines, code = finish(worker.fork_worker(run, environment, None))
    assert code == 0
    # The resumed process starts where the checkpoint says (nothing left after the last step's
    # checkpoint), and does each step once.
    assert lines[:1] == ([f"started {saved_before}"] if saved_before <= STEPS else [])
    assert [line for line in lines if line.startswith("done")] == [
        f"done {number}" for number in range(saved_before, STEPS + 1)
    ]
    final = asyncio.run(load(database_url, run_id))
    assert final is not None and final.next_step == STEPS + 1 and final.pending is None
    for number, name in ACTION_STEPS.items():
        performed = upstream.actions(f"{run_id}:step-{number}:{name}")
        assert len(performed) == 1
        assert final.outputs[number - 1] == performed[0]  # the receipt, replayed or not


class Recorder:
    """A sender that performs nothing, for runs whose point is what the runner sends."""

    def __init__(self, key_lifetime: KeyLifetime | None = None) -> None:
        self.sent: list[tuple[str, JSON, str | None]] = []
        self.key_lifetime = key_lifetime

    async def send(self, path: str, body: JSON, key: str | None) -> httpx.Response:
        self.sent.append((path, body, key))
        return httpx.Response(201, json={"sent": len(self.sent)})


async def test_a_pending_action_is_sent_with_its_saved_parameters_not_recomputed(
    database_url: str,
) -> None:
    computed: list[int] = []

    def charge(outputs: Sequence[JSON]) -> JSON:
        computed.append(1)
        return {"amount_cents": 100 * len(computed)}  # would change if computed again

    steps = [Step("think", lambda outputs: "thought"), Step("pay", charge, Action("charge", "/c"))]
    store = await PostgresCheckpoints.connect(database_url)
    try:
        # As a process killed after saving the pending charge, before sending it, left it:
        await store.save(Checkpoint("pending-run", "pay-task", 2, ("thought",)).with_pending(
            {"amount_cents": 4200}
        ))  # fmt: skip
        sender = Recorder()
        outputs = await run_agent("pending-run", steps, store, sender, task="pay-task")
    finally:
        await store.close()
    assert computed == []
    assert sender.sent == [("/c", {"amount_cents": 4200}, "pending-run:step-2:charge")]
    assert outputs == ("thought", {"sent": 1})


async def test_a_run_id_is_not_resumed_by_another_task(database_url: str) -> None:
    store = await PostgresCheckpoints.connect(database_url)
    try:
        await run_agent("shared-id", support_task("shared-id")[:3], store, Recorder())
        with pytest.raises(CheckpointError, match="started by task"):
            await run_agent("shared-id", support_task("shared-id"), store, Recorder())
    finally:
        await store.close()


# --- a resume later than the key's lifetime ---------------------------------------------------

PAY_STEPS = [
    Step("think", lambda outputs: "thought"),
    Step("pay", lambda outputs: {"amount_cents": 1}, Action("charge", "/c")),
    Step("close", lambda outputs: "closed"),
]
LIFETIME = KeyLifetime(ttl=timedelta(hours=24), margin=timedelta(hours=1))


async def left_pending(store: PostgresCheckpoints, age: timedelta) -> str:
    """A run stopped at step 2 with its charge saved `age` ago (maybe sent); its id."""
    run_id = f"late-{uuid.uuid4().hex[:8]}"
    checkpoint = Checkpoint(run_id, "pay-task", 2, ("thought",))
    await store.save(checkpoint.with_pending({"amount_cents": 4200}, datetime.now(UTC) - age))
    return run_id


async def test_an_action_saved_longer_ago_than_the_key_lifetime_is_not_resent(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(hours=30))
    sender = Recorder(LIFETIME)
    with pytest.raises(StaleAction) as raised:
        await run_agent(run_id, PAY_STEPS, checkpoints, sender, task="pay-task")
    assert sender.sent == []
    stale = raised.value
    key = f"{run_id}:step-2:charge"
    assert (stale.run_id, stale.step, stale.key) == (run_id, 2, key)
    assert timedelta(hours=30) <= stale.age < timedelta(hours=31)
    message = str(stale)
    for part in (repr(run_id), "step 2", key, "30.0 h", "mark_done(store,", "allow_resend(store,"):
        assert part in message
    # Nothing moved: the run stays stopped at its pending action until someone reconciles it.
    checkpoint = await checkpoints.load(run_id)
    assert checkpoint is not None and checkpoint.next_step == 2 and checkpoint.pending is not None


async def test_within_the_margin_of_the_lifetime_is_too_late_already(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(hours=23, minutes=30))
    with pytest.raises(StaleAction):
        await run_agent(run_id, PAY_STEPS, checkpoints, Recorder(LIFETIME), task="pay-task")


async def test_a_fresh_pending_action_is_resent_with_the_same_key(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(hours=22))
    sender = Recorder(LIFETIME)
    outputs = await run_agent(run_id, PAY_STEPS, checkpoints, sender, task="pay-task")
    assert sender.sent == [("/c", {"amount_cents": 4200}, f"{run_id}:step-2:charge")]
    assert outputs == ("thought", {"sent": 1}, "closed")


async def test_with_the_check_off_a_late_action_is_resent(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(days=3))
    sender = Recorder(key_lifetime=None)
    await run_agent(run_id, PAY_STEPS, checkpoints, sender, task="pay-task")
    assert sender.sent == [("/c", {"amount_cents": 4200}, f"{run_id}:step-2:charge")]


async def test_allowing_the_resend_explicitly_resends_it_with_the_same_key(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(days=3))
    with pytest.raises(StaleAction):
        await run_agent(run_id, PAY_STEPS, checkpoints, Recorder(LIFETIME), task="pay-task")
    await allow_resend(checkpoints, run_id, 2)
    sender = Recorder(LIFETIME)
    outputs = await run_agent(run_id, PAY_STEPS, checkpoints, sender, task="pay-task")
    assert sender.sent == [("/c", {"amount_cents": 4200}, f"{run_id}:step-2:charge")]
    assert outputs == ("thought", {"sent": 1}, "closed")


async def test_marking_the_step_done_records_the_answer_and_sends_nothing(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(days=3))
    receipt: JSON = {"id": "ch_81", "amount_cents": 4200}
    await mark_done(checkpoints, run_id, 2, receipt)
    sender = Recorder(LIFETIME)
    outputs = await run_agent(run_id, PAY_STEPS, checkpoints, sender, task="pay-task")
    assert sender.sent == []
    assert outputs == ("thought", receipt, "closed")


async def test_reconciling_a_step_that_has_nothing_pending_is_refused(
    checkpoints: PostgresCheckpoints,
) -> None:
    run_id = await left_pending(checkpoints, timedelta(days=3))
    with pytest.raises(CheckpointError, match="no pending action at step 3"):
        await mark_done(checkpoints, run_id, 3, {})
    with pytest.raises(CheckpointError, match="has no checkpoint"):
        await allow_resend(checkpoints, "never-ran", 2)


@pytest.mark.parametrize(
    ("response", "recorded"),
    [
        (httpx.Response(201, json={"id": "em_81"}), {"id": "em_81"}),
        (httpx.Response(204), {"status": 204, "text": ""}),
        (httpx.Response(200, text="queued"), {"status": 200, "text": "queued"}),
    ],
    ids=["json", "no-content", "text"],
)
def test_a_performed_action_s_answer_is_recorded_whatever_its_body(
    response: httpx.Response, recorded: JSON
) -> None:
    """The action was performed: an answer without JSON must not leave it pending for ever."""
    assert answer_of(response) == recorded
