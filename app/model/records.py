"""The records the gateway keeps: a key's claim and row as the request path sees them, as the
operator sees them, and the store's own state (its count by state, its standbys). Values only:
every store (PostgreSQL, memory) returns them, and the service and the admin API read them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from .answers import SealedRequest, StoredAnswer

# The three writes that settle a claim: store its answer, delete it, or say its outcome is
# unknown. Each ends the claim; only these may wake a request waiting on the key.
Settle = Literal["complete", "release", "mark_unknown"]
SETTLES: frozenset[Settle] = frozenset(("complete", "release", "mark_unknown"))

# What a key is now (`oncegate_key_state` in SQL, migrations/schema.sql): `in_progress` while
# its lease runs, `expired` past its TTL (a new key), `unknown` when marked so or its lease ran
# out, `completed` with its answer stored.
State = Literal["in_progress", "completed", "unknown", "expired"]


@dataclass(frozen=True, slots=True)
class Claim:
    """Ownership of a key: only the holder of the current fencing token may settle it. A settle
    names the row by (key, id, token): `key` is the key table's distribution column on Citus,
    so the statement reaches the one shard that holds the row."""

    id: int  # the row's, as `Record.id`
    token: int
    key: str


@dataclass(frozen=True, slots=True)
class Record:
    """A key that someone claimed earlier, as the store sees it now."""

    id: int
    token: int
    key: str
    fingerprint: bytes
    state: State
    answer: StoredAnswer | None  # None until the key completes


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A key as an operator sees it (the admin API)."""

    id: int
    route: str
    scope: bytes
    key: str
    state: State
    answer: StoredAnswer | None  # None until the key completes
    created_at: datetime
    completed_at: datetime | None
    expires_at: datetime
    token: int = 1  # the fencing token: with the id, the claim a sealed answer is bound to
    # The request behind the key, while it can turn `unknown` (None once it completes, or on a
    # route with `keep_request: never`); who claimed it and what they saw when it turned
    # `unknown` (JSON documents, `service.evidence` writes and reads them).
    request: SealedRequest | None = None
    claimed_by: str | None = None
    failure: str | None = None
    # The fingerprint of the request the row's claim stood for (a kept request is bound to it).
    fingerprint: bytes = b""

    @property
    def scope_fingerprint(self) -> str:
        """A short name of the record's scope, so an operator can tell apart the records of one
        key used by two credentials. The scope is already a SHA-256 of the route and the scope
        headers' values: its first 6 bytes name it without saying more about a credential than
        the digest does (one key rarely has more than a few scopes; 48 bits never collide)."""
        return self.scope[:6].hex()


# How a key turned `unknown`, read from what its last writer stored (not from the clock):
# `answer_lost`: its gateway sent the request and marked the key, because the upstream timed out
# or broke the connection before its whole answer came back; `lease_expired`: its gateway never
# settled it (the gateway died, or PostgreSQL failed when it tried to store the answer) and the
# lease ran out.
Cause = Literal["answer_lost", "lease_expired"]
# The states the gauge `oncegate_keys` and the operator's queue know. `expired` keys are new keys
# waiting for the purger: nobody acts on them.
Listed = Literal["in_progress", "completed", "unknown"]
LISTED_STATES: tuple[Listed, ...] = ("in_progress", "completed", "unknown")


@dataclass(frozen=True, slots=True)
class QueuedKey:
    """A key in the operator's queue: what the gateway knows about it without its answer."""

    id: int
    route: str
    key: str
    state: State
    cause: Cause | None  # set when `state` is `unknown`
    status: int | None  # the upstream's status, when an answer was stored
    created_at: datetime  # claimed, and sent upstream right after
    lease_expires_at: datetime | None  # in flight: until when; `lease_expired`: when it ran out
    completed_at: datetime | None
    expires_at: datetime  # after this a retry is a new request, forwarded again


@dataclass(frozen=True, slots=True)
class KeyCount:
    """One page of the sweep that counts keys by state: rows `after` < id <= `last_id`."""

    last_id: int | None  # None: no rows past `after`
    rows: int
    counts: dict[Listed, int]
    last: bool = False  # no rows past `last_id`: the sweep ends here


@dataclass(frozen=True, slots=True)
class HeldKeys:
    """How many keys a store holds, as the start-up line says it: exact up to the number the
    store counts (`counted` < `cap`), beyond it PostgreSQL's estimate from the table's
    statistics (`estimated`, None where it has none yet)."""

    counted: int
    cap: int
    estimated: int | None = None

    @property
    def exact(self) -> bool:
        return self.counted < self.cap

    @property
    def keys(self) -> int:
        """The figure: the count, or the estimate (never below what was counted)."""
        if self.exact or self.estimated is None:
            return self.counted
        return max(self.counted, self.estimated)

    def __str__(self) -> str:
        if self.exact:
            return str(self.counted)
        if self.estimated is None or self.estimated <= self.counted:
            return f"{self.counted} or more"
        return f"about {self.estimated} (PostgreSQL's estimate; {self.counted} or more counted)"


# synchronous_commit values under which a commit waits for a synchronous standby to flush it.
DURABLE_ON_STANDBY = ("on", "remote_apply")


@dataclass(frozen=True, slots=True)
class Replication:
    """The primary's streaming standbys, as its `pg_stat_replication` shows them to the gateway's
    role, and the `synchronous_commit` its sessions (and so its claims) commit with."""

    standbys: int
    synchronous: int | None  # None: the role may not see sync_state (grant it pg_monitor)
    synchronous_standby_names: str
    synchronous_commit: str

    def risk(self) -> str | None:
        """What a failover can do to this deployment's keys, in words, or None when a claim the
        gateway acknowledged is on a synchronous standby before any client hears of it."""
        if self.standbys == 0:
            return None
        if self.synchronous == 0 or (
            self.synchronous is None and not self.synchronous_standby_names
        ):
            why = f"PostgreSQL has {self.standbys} streaming standby(s) and none is synchronous"
            fix = "set synchronous_standby_names on the primary to name a standby"
        elif self.synchronous_commit not in DURABLE_ON_STANDBY:
            why = (
                f"PostgreSQL commits with synchronous_commit = {self.synchronous_commit}, which "
                "does not wait for the synchronous standby to flush a commit"
            )
            fix = "set synchronous_commit = on for the gateway's role or database"
        else:
            return None
        return (
            f"{why}: claims acknowledged by the primary can be missing on the standby it fails "
            f"over to, so a retry after a failover could be performed twice. To avoid it, {fix} "
            '(docs/operations.md, "PostgreSQL with a standby")'
        )
