"""The ports the service uses: what it needs of the key store, one Protocol per consumer.

- `RequestStore`: the request path (`Gateway`, and its waiting room): claim a key, read it, take
  it over, settle it, and be woken when someone else's claim settles.
- `UpkeepStore`: the purger, the gauge `oncegate_keys`, the health and readiness checks.
- `OperatorStore`: the operator's desk (the admin API, its page, `oncegate keys`).

The composition root (`http.runtime`) hands each consumer the room of the store that implements
its port (`store.postgres.PostgresStore`'s `requests`, `upkeep`, `operator`); the in-memory
store (`store.memory.MemoryStore`) implements all three on one object, and one conformance suite
(tests/store/test_conformance.py) runs against both. Every method raises
`errors.StoreUnavailable` when the database cannot answer, never a driver's exception.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from ..model.answers import SealedRequest, StoredAnswer
from ..model.records import Claim, KeyCount, KeyRecord, Listed, QueuedKey, Record, Replication
from ..store.notify import Watch


class RequestStore(Protocol):
    """The request path's store: every statement a request waits for."""

    async def claim(
        self,
        route: str,
        scope: bytes,
        key: str,
        fingerprint: bytes,
        lease: float,
        ttl: float,
        request: SealedRequest | None = None,
    ) -> Claim | Record | None:
        """Insert the key (with the request it stands for, kept until it settles), or return
        the row that already holds it. None when a concurrent claim committed it too recently
        to be read in the same statement: read it with `get`."""

    def claims_idle(self) -> bool:
        """Whether a claim made now would be sent at once, alone: no statement of claims in
        flight or queued (a claim keeping a large request is sent at once, alone, whatever
        this says, and its statement in flight makes no other claim wait). The flow then claims
        from the shielded task that forwards, where a lone statement goes without a task of the
        store's own (`model.reach.SHIELDED`); a claim that would queue waits in its caller's
        task, where it costs no more."""

    async def get(self, scope: bytes, key: str) -> Record | None: ...

    async def reclaim_expired(
        self,
        record: Record,
        route: str,
        fingerprint: bytes,
        lease: float,
        ttl: float,
        request: SealedRequest | None = None,
    ) -> Claim | None:
        """Take over a row past its TTL as a new claim; None if someone changed it meanwhile."""

    async def take_over(self, record: Record, lease: float) -> Claim | None:
        """Claim an `unknown` key again with a new fencing token; None if it changed meanwhile."""

    async def complete(self, claim: Claim, answer: StoredAnswer) -> bool:
        """Store the answer. False if the claim was lost."""

    async def release(self, claim: Claim) -> bool:
        """Delete the key so the next request is forwarded. False if the claim was lost."""

    async def mark_unknown(self, claim: Claim, failure: str | None = None) -> bool:
        """The request may have reached the upstream and its answer is lost; `failure` says
        what the gateway saw (JSON)."""

    async def renew(self, claim: Claim, lease: float) -> bool:
        """Run the claim's lease again for `lease` seconds from now, while its answer is still
        being relayed. False when the claim is not in flight any more (settled, taken over, or
        its lease already ran out)."""

    async def mark_waited(self, record: Record) -> bool:
        """Ask to be told when this in-flight claim settles (`watch`). False when it is not in
        flight any more: there is nothing to wait for."""

    def watch(self, record_id: int) -> Watch:
        """A `Watch` woken when the row settles, for as long as it is not closed."""


class UpkeepStore(Protocol):
    """The store's upkeep: expired keys purged in batches, keys counted by state, the schema's
    revision and the primary's standbys."""

    async def purge(self, batch_size: int) -> int:
        """Delete one batch of expired keys; return how many."""

    async def schema_revision(self) -> str | None:
        """The migration the database is at; None before the first one."""

    async def replication(self) -> Replication:
        """The primary's standbys and the commit setting its sessions run with."""

    async def count_keys(self, after: int, limit: int) -> KeyCount:
        """Count by state the first `limit` rows whose id is above `after`, in id order."""

    async def take_key_count(self) -> bool:
        """True when this process is the one to sweep the keys for the gauge now: one per
        database holds the turn (PostgreSQL: an advisory lock on the process's listening
        connection) until it stops or loses its connection; the others try again next time."""

    async def publish_key_count(self, totals: dict[Listed, int]) -> None:
        """Announce a sweep's totals to every gateway process on the database, this one
        included: each sets `oncegate_keys{state}` from them when they arrive."""


class OperatorStore(Protocol):
    """What the operator's desk needs: find a key, list the keys in a state, release a key, or
    settle an `unknown` one; and the admin page's ended sessions."""

    async def find(self, key: str, route: str | None) -> list[KeyRecord]: ...

    async def by_id(self, record_id: int) -> KeyRecord | None: ...

    async def delete(self, record_id: int) -> bool | None:
        """Delete a key: True; False when its request is in flight now; None if no such key."""

    async def resolve_completed(self, record_id: int, token: int, answer: StoredAnswer) -> bool:
        """Complete an `unknown` key whose fencing token is still `token`, raising it by one (the
        answer is sealed for that new token); False if there is no such `unknown` key."""

    async def scope_of(self, record_id: int) -> tuple[bytes, int] | None:
        """The scope and fencing token of a key (sealing binds them), or None if there is no
        such key."""

    async def resolve_released(self, record_id: int) -> bool:
        """Delete an `unknown` key; False if there is no such `unknown` key."""

    async def queue(
        self,
        state: Listed,
        route: str | None,
        since: datetime | None,
        after: tuple[datetime, int] | None,
        limit: int,
    ) -> list[QueuedKey]:
        """Keys in `state`, oldest first (`created_at`, then `id`), claimed at or after `since`,
        and after the key `after` names (created_at, id): at most `limit`."""

    async def describe(self, record_id: int) -> QueuedKey | None: ...

    async def end_session(self, session: bytes, expires_at: datetime) -> None:
        """Refuse the operator page's session `session` (a digest) until `expires_at`."""

    async def session_ended(self, session: bytes) -> bool:
        """Whether `end_session` was called for `session` (and it has not expired)."""
