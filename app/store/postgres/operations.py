"""One operation of a batch, as the batcher queues it, and what a batch's rows say each one got.

A batch sends each (row, fencing token) once, and in id order; an operation learns its result
from the tokens that come back: a settle whose (id, token) came back settled its row; a take-over
or reclaim whose row came back with the next token won it. A copy of an operation in the same
batch gets what a second statement would: nothing, the first one did it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import asyncpg

from ...model.answers import SealedRequest, StoredAnswer
from ...model.records import Claim, Record


@dataclass(frozen=True, slots=True)
class Claiming:
    route: str
    scope: bytes
    key: str
    fingerprint: bytes
    lease: float
    ttl: float
    request: SealedRequest | None = None


@dataclass(frozen=True, slots=True)
class Reclaiming:
    id: int
    token: int
    key: str
    route: str
    fingerprint: bytes
    lease: float
    ttl: float
    request: SealedRequest | None = None


@dataclass(frozen=True, slots=True)
class TakingOver:
    id: int
    token: int
    key: str
    lease: float


@dataclass(frozen=True, slots=True)
class Completing:
    id: int
    token: int
    key: str
    answer: StoredAnswer


@dataclass(frozen=True, slots=True)
class Settling:
    id: int
    token: int
    key: str
    failure: str | None = None  # mark_unknown's: what the gateway saw (JSON)


class OnKey(Protocol):
    """An operation on one key (on Citus, the key says which shard it goes to)."""

    @property
    def key(self) -> str: ...


class OnRow(Protocol):
    @property
    def id(self) -> int: ...
    @property
    def token(self) -> int: ...
    @property
    def key(self) -> str: ...


Operation = TypeVar("Operation", bound=OnRow)


def to_send(batch: Sequence[Operation]) -> list[Operation]:
    """The operations to send: one per (row, token), the first, in id order (every batch writes
    its rows in one order, so two batches never deadlock). A copy gets what a second statement
    would: nothing, the first one did it."""
    first: dict[tuple[int, int], Operation] = {}
    for operation in batch:
        first.setdefault((operation.id, operation.token), operation)
    return sorted(first.values(), key=lambda operation: operation.id)


def settled_by_rows(
    batch: Sequence[Operation], sent: Sequence[Operation], rows: Sequence[asyncpg.Record]
) -> list[bool]:
    """Which operations settled their row: those whose (id, token) came back. A superseded
    token settles nothing, whatever the rest of the batch does."""
    done = {(row["id"], row["fencing_token"]) for row in rows}
    firsts = {id(operation) for operation in sent}
    return [id(operation) in firsts and (operation.id, operation.token) in done
            for operation in batch]  # fmt: skip


def taken_by_rows(
    batch: Sequence[Operation], sent: Sequence[Operation], rows: Sequence[asyncpg.Record]
) -> list[Claim | None]:
    """The claims won by a take-over or reclaim: the row came back with the token after the one
    it was read with."""
    taken = {(row["id"], row["fencing_token"] - 1): row["fencing_token"] for row in rows}
    firsts = {id(operation) for operation in sent}
    outcomes: list[Claim | None] = []
    for operation in batch:
        token = taken.get((operation.id, operation.token))
        won = token is not None and id(operation) in firsts
        won_claim = Claim(operation.id, token, operation.key) if won and token is not None else None
        outcomes.append(won_claim)
    return outcomes


def request_size(claiming: Claiming | Reclaiming) -> int:
    """What a claim (or reclaim) weighs in a batch: the request it keeps (up to a route's
    `max_body`)."""
    return 0 if claiming.request is None else len(claiming.request.data)


def answer_size(completing: Completing) -> int:
    content = completing.answer.content
    if content is None:
        return 0
    return len(content.body or b"") + len(content.headers)


def claimed_row(claim: Claim, wanted: Claiming) -> Record:
    """The row a claim just made, as a copy of its key in the same batch sees it."""
    return Record(
        id=claim.id,
        token=claim.token,
        key=wanted.key,
        fingerprint=wanted.fingerprint,
        state="in_progress",
        answer=None,
    )
