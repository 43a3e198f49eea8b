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

`order="save-then-act"` swaps 3 and 4 (the checkpoint first, with the parameters as the output).
It exists to show, in the lab, that the swap turns duplicates into lost actions; do not use it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import httpx

from . import keys
from .checkpoints import JSON, Checkpoint, CheckpointStore, check_belongs

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
    async def send(self, path: str, body: JSON, key: str | None) -> httpx.Response: ...


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
                params = pending.params  # computed by an earlier process, maybe sent already
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


async def _perform(client: Sender, action: Action, params: JSON, key: str | None) -> JSON:
    response = await client.send(action.path, params, key)
    answer: JSON = response.json()
    return answer
