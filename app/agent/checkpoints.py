"""What a run remembers between two processes, and where it keeps it: the checkpoint record
(`Checkpoint`, `Pending`, `CheckpointError`, defined in `oncegate.model.checkpoint` and named
here for the agent's users; its invariants are listed there) and the `CheckpointStore` Protocol that
`oncegate.store.checkpoints.PostgresCheckpoints` implements.
"""

from __future__ import annotations

from typing import Protocol

from ..model.checkpoint import JSON, Checkpoint, CheckpointError, Pending, utc_now

__all__ = [
    "JSON",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "Pending",
    "check_belongs",
    "utc_now",
]


class CheckpointStore(Protocol):
    async def load(self, run_id: str) -> Checkpoint | None:
        """The run's latest checkpoint, or None if it never saved one."""

    async def save(self, checkpoint: Checkpoint) -> None:
        """Save the run's checkpoint, replacing the previous one.

        Raises `CheckpointError` when the stored checkpoint of that run id belongs to another
        task or is further along (a larger `next_step`) than this one."""


def check_belongs(checkpoint: Checkpoint, run_id: str, task: str) -> None:
    """Refuse a loaded checkpoint that is not this run of this task."""
    if checkpoint.run_id != run_id:
        raise CheckpointError(
            f"asked for run {run_id!r}, got the checkpoint of {checkpoint.run_id!r}"
        )
    if checkpoint.task != task:
        raise CheckpointError(
            f"run {run_id!r} was started by task {checkpoint.task!r}, not {task!r}: a run id "
            "names one run of one task (its action keys would collide)"
        )
