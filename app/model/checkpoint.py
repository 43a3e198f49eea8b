"""A checkpoint: what a run remembers between two processes: its next step, its outputs, its
pending action. The record the agent library (`oncegate.agent`) and its PostgreSQL store
(`oncegate.store.checkpoints`) both speak, kept apart from either so the store never depends
on the agent. The agent's public names for these are in `oncegate.agent.checkpoints`.

Invariants (also enforced by the table's constraints, migration 0002):
- `outputs` has one entry per finished step: `len(outputs) == next_step - 1`.
- `pending`, when set, belongs to `next_step`: the parameters of the action that step is about
  to send (or may have sent), saved before it was sent so a resumed run sends the same request.
  Its `saved_at` is when they were saved, so before the gateway could have claimed their key:
  an age counted from it is never less than the key's own (see `agent.runner.StaleAction`).
- A checkpoint belongs to one run of one task. A store refuses to overwrite a run's checkpoint
  with one of another task or with an older one (a smaller `next_step`): a stale process that
  wakes up late cannot rewind a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TypeAlias

JSON: TypeAlias = "bool | int | float | str | list[JSON] | dict[str, JSON] | None"


class CheckpointError(Exception):
    """A checkpoint that does not belong here: another run's, another task's, or an older one."""


@dataclass(frozen=True, slots=True)
class Pending:
    """The action of step `step`: its parameters as computed once, before it was first sent."""

    step: int
    params: JSON
    saved_at: datetime  # aware; when the parameters were saved (or an operator allowed a resend)

    def __post_init__(self) -> None:
        if self.saved_at.tzinfo is None:
            raise CheckpointError("a pending action's saved_at needs a time zone")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    run_id: str
    task: str  # names the list of steps; a run id is never resumed by another task
    next_step: int  # 1-based: the first step not finished yet
    outputs: tuple[JSON, ...] = ()
    pending: Pending | None = field(default=None)

    def __post_init__(self) -> None:
        if self.next_step < 1:
            raise CheckpointError(f"next_step must be 1 or more, not {self.next_step}")
        if len(self.outputs) != self.next_step - 1:
            raise CheckpointError(
                f"a checkpoint at step {self.next_step} needs {self.next_step - 1} outputs, "
                f"not {len(self.outputs)}"
            )
        if self.pending is not None and self.pending.step != self.next_step:
            raise CheckpointError(
                f"a pending action of step {self.pending.step} in a checkpoint at step "
                f"{self.next_step}"
            )

    @classmethod
    def start(cls, run_id: str, task: str) -> Checkpoint:
        return cls(run_id, task, 1)

    def finish(self, output: JSON) -> Checkpoint:
        """The checkpoint after `next_step` finished with `output`."""
        return Checkpoint(self.run_id, self.task, self.next_step + 1, (*self.outputs, output))

    def with_pending(self, params: JSON, saved_at: datetime | None = None) -> Checkpoint:
        """This checkpoint with `params` as its step's pending action, saved at `saved_at` (now
        when not given)."""
        pending = Pending(self.next_step, params, saved_at or utc_now())
        return Checkpoint(self.run_id, self.task, self.next_step, self.outputs, pending)


def utc_now() -> datetime:
    return datetime.now(UTC)
