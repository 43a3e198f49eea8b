"""The step runner: resume a run where its last checkpoint left it, send each action once.

For each step from the checkpoint's `next_step` on:
1. The step's pure part computes its output from the earlier outputs; for an action step, the
   output is the action's parameters.
2. An action step saves those parameters as the checkpoint's `pending` action *before* sending
   it, so a resumed run sends the very same request (same key, same body: the gateway replays
   it instead of answering 422). A resumed run never recomputes a pending action.
3. The action is sent with its key, `run-81:step-10:charge` (`keys.action_key`).
4. The checkpoint moves to the next step with the step's output (the action's answer).

A crash between 3 and 4 is the one the key is for: the resumed run sends the action again, and
the gateway answers with the stored answer of the first attempt.

Only as long as the gateway keeps the key: a run resumed after its key expired would have the
action performed again. So a pending action saved longer ago than the client's key lifetime
(less its margin, `client.KeyLifetime`) is not resent: the run stops with `StaleAction`, and an
operator reconciles it from the upstream's records with `mark_done` (it was performed: record its
answer) or `allow_resend` (it was not), then resumes the run.

`order="save-then-act"` swaps 3 and 4 (the checkpoint first, with the parameters as the output).
It exists to show, in the lab, that the swap turns duplicates into lost actions; do not use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, Protocol

import httpx

from . import keys
from .checkpoints import (
    JSON,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    Pending,
    check_belongs,
    utc_now,
)
from .client import KeyLifetime

Order = Literal["act-then-save", "save-then-act"]
# Called at each point of a step: `started`, `prepared` (an action's parameters are computed and
# saved, nothing sent yet), `done` (the step's work happened: computed, or the action answered),
# `saved` (its checkpoint is written). The lab uses it to crash a run at a chosen point.
EventHook = Callable[[str, int], None]


@dataclass(frozen=True, slots=True)
class Action:
    name: str  # the last part of the key: `charge`
    path: str  # where it is POSTed: `/charges`


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    # Pure: the outputs of steps 1..n-1 -> this step's output, or its action's parameters. No
    # side effects, no clock, no random numbers: a resumed run must compute the same thing.
    compute: Callable[[Sequence[JSON]], JSON]
    action: Action | None = None


class Sender(Protocol):
    # How long the gateway keeps a key; None: never refuse a resend for its age.
    key_lifetime: KeyLifetime | None

    async def send(self, path: str, body: JSON, key: str | None) -> httpx.Response: ...


class StaleAction(Exception):
    """A pending action saved longer ago than the gateway keeps keys: resending it with its key
    could perform it a second time, so the run stops for an operator to reconcile it."""

    def __init__(self, run_id: str, step: int, key: str, age: timedelta, lifetime: KeyLifetime):
        self.run_id, self.step, self.key, self.age = run_id, step, key, age
        super().__init__(
            f"run {run_id!r} stopped at step {step}: its action (key {key}) was saved "
            f"{describe(age)} ago, and the gateway keeps keys {describe(lifetime.ttl)} (resent "
            f"up to {describe(lifetime.resend_until)}): sent again, it may be performed twice. "
            f"Check the upstream's records for key {key}, then either record the answer of the "
            f"action it performed with mark_done(store, {run_id!r}, {step}, answer) or, if it "
            f"performed none, allow the resend with allow_resend(store, {run_id!r}, {step}) "
            f"(oncegate.agent.runner), and resume the run."
        )


def describe(age: timedelta) -> str:
    """`42.0 s`, `15 min`, `23.5 h`, `3.2 days`: an age as an operator reads it."""
    seconds = age.total_seconds()
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def task_name(steps: Sequence[Step]) -> str:
    """A name for a list of steps: a run is never resumed by a different list."""
    digest = hashlib.sha256("\n".join(step.name for step in steps).encode()).hexdigest()
    return f"{len(steps)}-steps-{digest[:16]}"


async def run_agent(
    run_id: str,
    steps: Sequence[Step],
    store: CheckpointStore,
    client: Sender,
    *,
    task: str | None = None,
    use_keys: bool = True,
    order: Order = "act-then-save",
    on_event: EventHook | None = None,
) -> tuple[JSON, ...]:
    """Run (or resume) `run_id` to its end and return every step's output."""
    task = task or task_name(steps)
    checkpoint = await store.load(run_id)
    if checkpoint is None:
        checkpoint = Checkpoint.start(run_id, task)
    else:
        check_belongs(checkpoint, run_id, task)
    if checkpoint.next_step > len(steps) + 1:
        raise ValueError(f"run {run_id!r} is at step {checkpoint.next_step} of {len(steps)}")

    def emit(event: str, number: int) -> None:
        if on_event is not None:
            on_event(event, number)

    outputs = list(checkpoint.outputs)
    for number in range(checkpoint.next_step, len(steps) + 1):
        step = steps[number - 1]
        emit("started", number)
        if step.action is None:
            output = step.compute(tuple(outputs))
            emit("done", number)
            checkpoint = Checkpoint(run_id, task, number + 1, (*outputs, output))
            await store.save(checkpoint)
            emit("saved", number)
            outputs.append(output)
            continue

        key = keys.action_key(run_id, number, step.action.name) if use_keys else None
        if order == "act-then-save":
            pending = checkpoint.pending
            if pending is not None and pending.step == number:
                # Computed by an earlier process, maybe sent already: resent with its key only
                # while the gateway still has that key.
                if key is not None:
                    _check_age(run_id, pending, key, client.key_lifetime)
                params = pending.params
            else:
                params = step.compute(tuple(outputs))
                checkpoint = checkpoint.with_pending(params)
                await store.save(checkpoint)
            emit("prepared", number)
            output = await _perform(client, step.action, params, key)
            emit("done", number)
            checkpoint = Checkpoint(run_id, task, number + 1, (*outputs, output))
            await store.save(checkpoint)
            emit("saved", number)
        else:
            params = step.compute(tuple(outputs))
            emit("prepared", number)
            checkpoint = Checkpoint(run_id, task, number + 1, (*outputs, params))
            await store.save(checkpoint)
            emit("saved", number)
            output = await _perform(client, step.action, params, key)
            emit("done", number)
        outputs.append(output)
    return tuple(outputs)


def _check_age(run_id: str, pending: Pending, key: str, lifetime: KeyLifetime | None) -> None:
    if lifetime is None:
        return
    # A clock behind the one that saved the action reads a negative age; the margin covers it.
    age = max(timedelta(0), utc_now() - pending.saved_at)
    if age > lifetime.resend_until:
        raise StaleAction(run_id, pending.step, key, age, lifetime)


async def mark_done(store: CheckpointStore, run_id: str, step: int, output: JSON) -> Checkpoint:
    """Reconcile a stopped run whose pending action the upstream did perform: finish `step`
    with `output` (the upstream's answer), so the resumed run goes on without sending it."""
    checkpoint, _ = await _stopped_at(store, run_id, step)
    finished = checkpoint.finish(output)
    await store.save(finished)
    return finished


async def allow_resend(
    store: CheckpointStore, run_id: str, step: int, now: datetime | None = None
) -> Checkpoint:
    """Reconcile a stopped run whose pending action the upstream did not perform: save it
    again as of `now`, so the resumed run sends it (same parameters, same key) as a fresh one."""
    checkpoint, pending = await _stopped_at(store, run_id, step)
    renewed = checkpoint.with_pending(pending.params, now or utc_now())
    await store.save(renewed)
    return renewed


async def _stopped_at(store: CheckpointStore, run_id: str, step: int) -> tuple[Checkpoint, Pending]:
    checkpoint = await store.load(run_id)
    if checkpoint is None:
        raise CheckpointError(f"run {run_id!r} has no checkpoint")
    pending = checkpoint.pending
    if pending is None or pending.step != step:
        raise CheckpointError(
            f"run {run_id!r} has no pending action at step {step} (it is at step "
            f"{checkpoint.next_step}, pending: {'none' if pending is None else pending.step})"
        )
    return checkpoint, pending


async def _perform(client: Sender, action: Action, params: JSON, key: str | None) -> JSON:
    response = await client.send(action.path, params, key)
    return answer_of(response)


def answer_of(response: httpx.Response) -> JSON:
    """What the run records of a performed action's answer: its JSON, or, when the answer has no
    JSON body (a 204, text, an empty body), `{"status": ..., "text": ...}`: the action was
    performed either way, and a decoding error here would leave it pending for every resume."""
    try:
        answer: JSON = response.json()
    except ValueError:
        return {"status": response.status_code, "text": response.text}
    return answer
