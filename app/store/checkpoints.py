"""The agent library's checkpoint store on PostgreSQL
(it implements `oncegate.agent.checkpoints.CheckpointStore`, without importing the agent: the
record it stores is `oncegate.model.checkpoint`'s).

Design rules:
- One statement per operation, autocommitted (queries in `checkpoints.sql`).
- One connection, not a pool: an agent process runs its steps one after the other, and a process
  that may be killed at any moment should cost PostgreSQL as little as possible to open.
- Driver errors become `errors.StoreUnavailable`, as in the gateway's store (`translated`).
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from .. import settings
from ..model.checkpoint import Checkpoint, CheckpointError, Pending
from . import embedded
from .embedded import EmbeddedPostgres
from .errors import translated
from .queries import load

QUERIES = load((Path(__file__).parent / "checkpoints.sql").read_text())
CONNECT_TIMEOUT = 5.0
COMMAND_TIMEOUT = 10.0


class PostgresCheckpoints:
    def __init__(
        self, connection: asyncpg.Connection, embedded_server: EmbeddedPostgres | None = None
    ) -> None:
        self._connection = connection
        self._embedded = embedded_server

    @classmethod
    @translated("checkpoint_connect", "cannot connect to PostgreSQL")
    async def connect(
        cls, url: str | None = None, *, flush_each_save: bool = True
    ) -> PostgresCheckpoints:
        """Checkpoints in the database at `url`; without one, the gateway's own default:
        `ONCEGATE_DATABASE_URL`, or else the embedded PostgreSQL in `ONCEGATE_DATA_DIR` (the
        user's data directory by default), joined if a gateway runs it, started and migrated
        otherwise, and let go by `close`.

        `flush_each_save=False` (`synchronous_commit = off`) makes a save visible at once but
        flushed to disk a moment later: a checkpoint then survives the agent's death, not the
        database server's. Only for a throwaway database, like the lab's own."""
        server = None
        if url is None:
            where = settings.load_part(settings.DatabaseSettings)
            url = where.database_url
            if url is None:
                server = await asyncio.to_thread(embedded.start_migrated, where.data_dir)
                url = server.url
        session = {} if flush_each_save else {"synchronous_commit": "off"}
        try:
            connection = await asyncpg.connect(
                url, timeout=CONNECT_TIMEOUT, command_timeout=COMMAND_TIMEOUT,
                server_settings=session,
            )  # fmt: skip
        except BaseException:
            if server is not None:
                await asyncio.to_thread(server.stop)
            raise
        return cls(connection, server)

    async def close(self) -> None:
        await self._connection.close()
        if self._embedded is not None:
            await asyncio.to_thread(self._embedded.stop)

    @translated("checkpoint_load")
    async def load(self, run_id: str) -> Checkpoint | None:
        row = await self._run("fetchrow", "checkpoint_load", run_id)
        if row is None:
            return None
        pending = None
        if row["pending"] is not None:
            document = json.loads(row["pending"])
            saved_at = document.get("saved_at")
            pending = Pending(
                document["step"],
                document["params"],
                row["updated_at"] if saved_at is None else datetime.fromisoformat(saved_at),
            )
        return Checkpoint(
            run_id=row["run_id"],
            task=row["task"],
            next_step=row["next_step"],
            outputs=tuple(json.loads(row["outputs"])),
            pending=pending,
        )

    @translated("checkpoint_save")
    async def save(self, checkpoint: Checkpoint) -> None:
        pending = checkpoint.pending
        saved = await self._run(
            "fetchval",
            "checkpoint_save",
            checkpoint.run_id,
            checkpoint.task,
            checkpoint.next_step,
            json.dumps(list(checkpoint.outputs)),
            None
            if pending is None
            else json.dumps(
                {
                    "step": pending.step,
                    "params": pending.params,
                    "saved_at": pending.saved_at.isoformat(),
                }
            ),
        )
        if saved is not None:
            return
        stored = await self._run("fetchrow", "checkpoint_describe", checkpoint.run_id)
        if stored is not None and stored["task"] != checkpoint.task:
            raise CheckpointError(
                f"run {checkpoint.run_id!r} belongs to task {stored['task']!r}, "
                f"not {checkpoint.task!r}"
            )
        raise CheckpointError(
            f"run {checkpoint.run_id!r} is already at step "
            f"{stored['next_step'] if stored else '?'}; refusing to rewind it to step "
            f"{checkpoint.next_step}"
        )

    @translated("checkpoint_delete")
    async def delete(self, run_id: str) -> bool:
        return await self._run("fetchval", "checkpoint_delete", run_id) is not None

    async def _run(self, method: str, query: str, *arguments: Any) -> Any:
        return await getattr(self._connection, method)(QUERIES[query].sql, *arguments)
