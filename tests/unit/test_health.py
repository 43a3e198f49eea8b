"""`/readyz`'s rule, in the service (`service.Health`): ready when PostgreSQL answers and its
schema is at this gateway's head; otherwise why not, in words. The answer on the admin port is
tested in tests/e2e/test_admin.py and tests/e2e/test_store_down.py."""

from __future__ import annotations

from oncegate import service
from oncegate.model import errors
from oncegate.store import migrate
from oncegate.store.memory import MemoryStore


class AtRevision(MemoryStore):
    def __init__(self, revision: str | None) -> None:
        super().__init__()
        self.revision = revision

    async def schema_revision(self) -> str | None:
        return self.revision


class Down(MemoryStore):
    async def schema_revision(self) -> str | None:
        raise errors.StoreUnavailable("PostgreSQL is down")


async def test_a_database_at_head_is_ready() -> None:
    readiness = await service.Health(AtRevision(migrate.head())).readiness()
    assert readiness == service.Readiness(True, migrate.head())


async def test_a_database_behind_or_never_migrated_is_not_ready_and_says_which() -> None:
    head = migrate.head()
    behind = await service.Health(AtRevision("0001")).readiness()
    assert not behind.ready
    assert behind.detail == f"schema at revision 0001, this gateway needs {head}"
    never = await service.Health(AtRevision(None)).readiness()
    assert not never.ready
    assert never.detail == f"schema at revision none, this gateway needs {head}"


async def test_a_database_that_does_not_answer_is_not_ready() -> None:
    readiness = await service.Health(Down()).readiness()
    assert readiness == service.Readiness(False, migrate.head(), "PostgreSQL does not answer")
