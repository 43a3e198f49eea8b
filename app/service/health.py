"""Whether this gateway can serve (`/readyz`): PostgreSQL answers, and its schema is the one
this gateway's code was written for; and what a failover could cost (`Replication.risk`), said
but never refused."""

from __future__ import annotations

from dataclasses import dataclass

from ..model import errors
from ..store import migrate
from .ports import UpkeepStore


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    head: str  # the schema revision this gateway needs
    detail: str = ""  # why it is not ready, in words
    replication: str | None = None  # what a failover could lose, when ready


class Health:
    def __init__(self, store: UpkeepStore) -> None:
        self._store = store

    async def readiness(self) -> Readiness:
        head = migrate.head()
        try:
            revision = await self._store.schema_revision()
            risk = (await self._store.replication()).risk()
        except errors.StoreUnavailable:
            return Readiness(False, head, "PostgreSQL does not answer")
        if revision != head:
            return Readiness(
                False, head, f"schema at revision {revision or 'none'}, this gateway needs {head}"
            )
        return Readiness(True, head, replication=risk)
