"""The operator's queries (`service.ports.OperatorStore`): finding, listing, releasing and
resolving keys (the admin API and `oncegate keys`), and the admin page's ended sessions. They run
on the operator's pool, never on a connection a request waits for, one autocommitted statement
each.

A write finds its row by id, then names it by (id, key), as the request path does (on Citus,
on the row's shard alone). The delete takes the dialect's shape of work (`dialect.Dialect`).
"""

from __future__ import annotations

from datetime import datetime

from ...model.answers import StoredAnswer
from ...model.records import KeyRecord, Listed, QueuedKey
from ..errors import translated
from .room import OperatorRoom
from .rows import answer_columns, key_record_of


class OperatorQueries(OperatorRoom):
    async def _key_of(self, record_id: int) -> str | None:
        row = await self._fetchrow("key_of", id=record_id)
        return None if row is None else str(row["key"])

    @translated("admin_find")
    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        query = self._statements["admin_find"]
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            rows = await connection.fetch(query.sql, *query.arguments({"key": key, "route": route}))
        return [key_record_of(row) for row in rows]

    @translated("admin_by_id")
    async def by_id(self, record_id: int) -> KeyRecord | None:
        row = await self._fetchrow("admin_by_id", id=record_id)
        return None if row is None else key_record_of(row)

    @translated("admin_delete")
    async def delete(self, record_id: int) -> bool | None:
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            return await self._dialect.delete(connection, record_id)

    @translated("admin_resolve_completed")
    async def resolve_completed(self, record_id: int, token: int, answer: StoredAnswer) -> bool:
        key = await self._key_of(record_id)
        if key is None:
            return False
        row = await self._fetchrow(
            "admin_resolve_completed",
            key=key,
            id=record_id,
            token=token,
            **answer_columns(answer),
        )
        return row is not None

    @translated("admin_scope")
    async def scope_of(self, record_id: int) -> tuple[bytes, int] | None:
        row = await self._fetchrow("admin_scope", id=record_id)
        return None if row is None else (bytes(row["scope"]), row["fencing_token"])

    @translated("admin_resolve_released")
    async def resolve_released(self, record_id: int) -> bool:
        key = await self._key_of(record_id)
        if key is None:
            return False
        return await self._fetchrow("admin_resolve_released", key=key, id=record_id) is not None

    @translated("admin_queue")
    async def queue(
        self,
        state: Listed,
        route: str | None,
        since: datetime | None,
        after: tuple[datetime, int] | None,
        limit: int,
    ) -> list[QueuedKey]:
        return await self._queued(
            id=None, state=state, route=route, since=since, after=after, limit=limit
        )

    @translated("admin_describe")
    async def describe(self, record_id: int) -> QueuedKey | None:
        found = await self._queued(
            id=record_id, state=None, route=None, since=None, after=None, limit=1
        )
        return found[0] if found else None

    async def _queued(
        self, after: tuple[datetime, int] | None, **parameters: object
    ) -> list[QueuedKey]:
        query = self._statements["admin_queue"]
        after_time, after_id = after if after is not None else (None, None)
        arguments = query.arguments({**parameters, "after_time": after_time, "after_id": after_id})
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            rows = await connection.fetch(query.sql, *arguments)
        return [
            QueuedKey(
                id=row["id"],
                route=row["route"],
                key=row["key"],
                state=row["state"],
                cause=row["cause"],
                status=row["response_status"],
                created_at=row["created_at"],
                lease_expires_at=row["lease_expires_at"],
                completed_at=row["completed_at"],
                expires_at=row["expires_at"],
            )
            for row in rows
        ]

    @translated("end_session")
    async def end_session(self, session: bytes, expires_at: datetime) -> None:
        query = self._statements["end_session"]
        async with self._pool.acquire(timeout=self._options.acquire_timeout) as connection:
            await connection.execute(
                query.sql, *query.arguments({"session": session, "expires_at": expires_at})
            )

    @translated("session_ended")
    async def session_ended(self, session: bytes) -> bool:
        row = await self._fetchrow("session_ended", session=session)
        ended: bool = row["ended"]
        return ended
