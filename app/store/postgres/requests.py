"""The request path: claims, reads, take-overs and settles, batched (`batching.Batcher`).

Design rules:
- Every statement is autocommitted: one round trip, no transaction held open.
- Concurrent claims share one statement and one commit, as do concurrent completes, releases,
  take-overs. A lone operation goes at once, alone. Each keeps its own result (`operations`);
  the SQL is in queries.sql. On plain PostgreSQL, and on Citus through the coordinator, each
  kind has statements of its own. On a Citus worker claims and completes share one batcher
  (`Dialect.together`), and a batch that holds both is one statement: one fence and one commit
  for a forward's complete and the next forwards' claims. (On plain PostgreSQL one statement of
  both saved PostgreSQL no CPU and cost the gateway more: docs/performance.md.)
- A claim commits synchronously, with the server's own `synchronous_commit` (the `requests`
  pool), because a claim lost in a PostgreSQL crash could let a retry forward twice. A complete
  commits with `synchronous_commit` = `store_answer_commit` (the `answers` pool): `off` by
  default, without waiting for the WAL flush. A lost `complete` cannot forward twice: the row
  falls back to its durable in-flight claim, whose lease runs out into `unknown`. What a
  failover lost that way is counted and logged (`failover.RecentAnswers`). A Citus worker's
  statement of both commits with the worker's own setting (`workers`).
- A request that stops waiting after its claim was sent may still win it: the claim is then
  settled for nobody (`_claimed_for_nobody`, `_taken_for_nobody`), so nothing is left to turn
  `unknown` although nothing was forwarded, and the client's retry claims the key anew. Only a
  claim a batch task carries can be abandoned: a keyed request's claim sent alone goes in its
  shielded task, which never stops waiting, and is forwarded when won (`service.flow`).
  `close` ends the claims before those settles.
- The statements are the dialect's (`dialect.Dialect`), each naming the batch's keys, and the
  dialect sends them: on Citus, claims and completes per worker, straight to the worker's shard
  tables (`workers`), the rest per shard through the coordinator, which sends each to its shard
  alone. A batch whose shards moved meanwhile is sent again, operation by operation (`Rerouted`).
- A settle returns whether someone waits on each row it settled (`Prefer: wait`), and the store
  announces those rows (`notify`) once it committed, on the plain server or the Citus
  coordinator, where the gateways LISTEN, never on a worker. Without a waiter nothing more is
  sent.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import asyncpg

from ...model.answers import SealedRequest, StoredAnswer
from ...model.records import SETTLES, Claim, Record
from ...settings import StoreOptions
from ...telemetry import tracing
from .. import claimant
from ..batching import Batcher, PerShard
from ..errors import DRIVER_ERRORS, Outage, isolable, translated
from ..notify import Watch
from .connections import Listener, Pools
from .dialect import Dialect
from .failover import RecentAnswers
from .operations import (
    Claiming,
    Completing,
    OnKey,
    Reclaiming,
    Settling,
    TakingOver,
    answer_size,
    claimed_row,
    request_size,
    settled_by_rows,
    taken_by_rows,
    to_send,
)
from .pool import Pool
from .rows import answer_columns, record_of
from .workers import Rerouted

log = logging.getLogger("oncegate.store.postgres")


Keyed = TypeVar("Keyed", bound=OnKey)
Outcome = TypeVar("Outcome")

# Answers, and the requests claims keep, are sent to PostgreSQL as one array per batch. A batch
# of one kind holds at most this many bytes of them; the queue a Citus worker's claims and
# completes share holds twice this (8 MiB, whatever the mix: all of it bodies of completes, or
# kept requests of claims, or both); one operation larger goes alone. So up to 64 large answers
# or kept requests (128 on a worker) never make one huge parameter (PostgreSQL refuses a message
# past 1 GiB, and would fail every operation of the batch with it).
BATCH_BYTES = 4 * 1024 * 1024
# An answer or kept request this large is heavy: sent at once in a statement of its own, and no
# other key's operation waits behind it (`batching.Batcher`). PostgreSQL's time for a claim grows
# with the request it keeps (about 12 ms a MiB of JSON on a quiet machine: TOAST's compression,
# its chunks and their WAL, against well under a millisecond for a small claim); at 256 KiB one
# costs several small batches' round trips, and on a machine short of CPU seconds per MiB.
HEAVY_BYTES = 256 * 1024


class RequestPath:
    """The request path (`service.ports.RequestStore`): every statement a request waits for,
    each batched with its concurrent twins, and the watches of a waiting retry."""

    def __init__(
        self,
        pools: Pools,
        options: StoreOptions,
        outage: Outage,
        dialect: Dialect,
        listener: Listener,
    ) -> None:
        self._listener = listener  # closed by the store, after this room
        self._pool = pools.requests
        self._answer_pool = pools.answers
        self._options = options
        self.outage = outage
        self._dialect = dialect
        self._statements = dialect.statements
        # Who claims keys: this gateway process, as the operator sees it (`claimed_by`).
        self.claimant = claimant()
        self._claims: Batcher[Any, Any] | PerShard[Any, Any]
        self._completes: Batcher[Any, Any] | PerShard[Any, Any]
        # Heavy statements in flight at once, per kind, so that small claims and settles always
        # find connections beside them: claims half the request pool (`store_pool_size`),
        # completes half the answers pool (half as large), reclaims (on the request pool, with
        # the claims) a quarter of it.
        heavy_claims = max(1, options.pool_size // 2)
        heavy_others = max(1, options.pool_size // 4)
        if dialect.together:
            # One batcher, one statement for both where the dialect can (a Citus worker's claims
            # and completes: one fence and one commit for both). It closes with the claims
            # (`close`); the gateway has drained its requests by then, so no complete comes
            # after. It carries what the two statements it replaces would: twice
            # `store_batch_size` operations and twice `BATCH_BYTES`, whatever the mix. With one
            # cap for both, 256 requests in flight over two Citus workers made statements of
            # 36-58 operations against the one server's 51-53 claims and 50-53 completes
            # (docs/scaling.md).
            self._claims = self._completes = self._batcher(
                "claim_complete",
                self._claim_complete_batch,
                size=2 * options.batch_size,
                on_abandoned=self._claimed_for_nobody,  # a complete's outcome is no claim
                weight=_weight,
                max_weight=2 * BATCH_BYTES,
                heavy=HEAVY_BYTES,
                max_heavy=heavy_claims,
            )
        else:
            self._claims = self._batcher(
                "claim",
                self._claim_batch,
                on_abandoned=self._claimed_for_nobody,
                weight=request_size,
                max_weight=BATCH_BYTES,
                heavy=HEAVY_BYTES,
                max_heavy=heavy_claims,
            )
            self._completes = self._batcher(
                "complete",
                self._complete_batch,
                weight=answer_size,
                max_weight=BATCH_BYTES,
                heavy=HEAVY_BYTES,
                max_heavy=heavy_others,
            )
        self._reclaims = self._batcher(
            "reclaim_expired",
            self._reclaim_batch,
            on_abandoned=self._claimed_for_nobody,
            weight=request_size,  # a reclaim keeps its request as a claim does
            max_weight=BATCH_BYTES,
            heavy=HEAVY_BYTES,
            max_heavy=heavy_others,
        )
        self._take_overs = self._batcher(
            "take_over", self._take_over_batch, on_abandoned=self._taken_for_nobody
        )
        self._releases = self._batcher("release", functools.partial(self._settle_batch, "release"))
        self._unknowns = self._batcher(
            "mark_unknown", functools.partial(self._settle_batch, "mark_unknown")
        )
        # Closed in two steps: the claims, whose orphans are settled, before the settles.
        self._claiming: tuple[Batcher[Any, Any] | PerShard[Any, Any], ...] = (
            self._claims, self._reclaims, self._take_overs,
        )  # fmt: skip
        self._settling: tuple[Batcher[Any, Any] | PerShard[Any, Any], ...] = (
            *((self._completes,) if self._completes is not self._claims else ()),
            self._releases, self._unknowns,
        )  # fmt: skip
        self._cleanups: set[asyncio.Task[bool]] = set()
        self._answers = RecentAnswers(pools.operator, self._statements, options)
        pools.primary.on_change.append(self._answers.failed_over)
        pools.primary.on_same_host.append(self._answers.back_on_same_host)

    def _batcher(
        self,
        operation: str,
        send: Callable[[Sequence[Keyed]], Awaitable[Sequence[Outcome]]],
        size: int | None = None,
        **options: Any,
    ) -> Batcher[Keyed, Outcome] | PerShard[Keyed, Outcome]:
        """The operation's batcher, as the dialect batches (on Citus, per worker or per shard).
        A batch the dialect refuses as sent (`Rerouted`: on Citus its shards moved, and the map
        was read again; nothing was written) is sent again operation by operation, each through
        the batcher to where it goes now, each keeping its own outcome or failure."""

        async def send_or_reroute(batch: Sequence[Keyed]) -> Sequence[Outcome | Exception]:
            try:
                return await send(batch)
            except Rerouted as exc:
                log.info("a %s batch of %d is sent again: %s", operation, len(batch), exc)
                again = await asyncio.gather(
                    *(batcher.run(each) for each in batch), return_exceptions=True
                )
                return [_failure(found) if isinstance(found, BaseException) else found
                        for found in again]  # fmt: skip

        def make() -> Batcher[Keyed, Outcome]:
            most = self._options.batch_size if size is None else size
            return Batcher(operation, send_or_reroute, most, isolate=isolable, **options)

        batcher = self._dialect.batcher(operation, make)
        return batcher

    async def close(self) -> None:
        """End the batchers: the claims first, then the settles of claims nobody waited for,
        then the settles."""
        for batcher in self._claiming:
            await batcher.close()
        while self._cleanups:
            await asyncio.gather(*self._cleanups, return_exceptions=True)
        for batcher in self._settling:
            await batcher.close()
        await self._answers.close()

    def watch(self, record_id: int) -> Watch:
        return self._listener.watch(record_id)

    def claims_idle(self) -> bool:
        return self._claims.idle()

    def on_server(self, key: str) -> bool:
        """Whether `key`'s claim and complete go to the store's server (`errors.translated`'s
        `routed`): on Citus they go to the key's worker, which the coordinator's `Outage` must
        not hear of."""
        return self._dialect.on_server(key)

    @translated("renew")
    async def renew(self, claim: Claim, lease: float) -> bool:
        row = await self._dialect.fetchrow(
            self._pool, "renew",
            {"key": claim.key, "id": claim.id, "token": claim.token, "lease": lease},
        )  # fmt: skip
        return row is not None

    @translated("mark_waited")
    async def mark_waited(self, record: Record) -> bool:
        row = await self._dialect.fetchrow(
            self._pool, "mark_waited", {"key": record.key, "id": record.id, "token": record.token}
        )
        return row is not None

    async def _fetch_batch(
        self, operation: str, pool: Pool, sent: Sequence[Keyed], **arrays: object
    ) -> list[asyncpg.Record]:
        """One batched statement: its parameters are arrays, one element per operation, the
        keys among them (each row is named by (key, id); on Citus the keys say where it goes)."""
        arrays["keys"] = [each.key for each in sent]
        rows = await self._dialect.fetch(operation, pool, arrays)
        if operation in SETTLES:
            await self._wake(rows)
        return rows

    async def _wake(self, settled: Sequence[asyncpg.Record]) -> None:
        """Notify the rows a committed settle returned as waited on, where gateways LISTEN.
        Best effort: the settle has committed, so a notification that fails (the coordinator
        restarting) must not fail it, or a batch's committed claims would be resent or lost
        with it; a waiter that misses it finds the row at its next poll (`notify.Watch`)."""
        waited = [row["id"] for row in settled if row["waited"]]
        if not waited:
            return
        notify = self._statements["notify"]
        try:
            async with self._pool.acquire() as connection:
                await connection.execute(notify.sql, *notify.arguments({"ids": waited}))
        except DRIVER_ERRORS as exc:
            log.warning(
                "%d settled keys were not announced to their waiters (%s: %s); they poll",
                len(waited), type(exc).__name__, exc,
            )  # fmt: skip

    @translated("claim", routed=lambda path, route, scope, key, *_, **__: key)
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
        wanted = Claiming(route, scope, key, fingerprint, lease, ttl, request)
        with tracing.store_operation("claim"):
            claimed: Claim | Record | None = await self._claims.run(wanted)
        return claimed

    async def _claim_batch(self, batch: Sequence[Claiming]) -> list[Claim | Record | None]:
        sent, arrays = self._claim_arrays(batch)
        rows = await self._fetch_batch("claim", self._pool, sent, **arrays)
        return _claims_found(batch, sent, rows)

    def _claim_arrays(self, batch: Sequence[Claiming]) -> tuple[list[Claiming], dict[str, object]]:
        """The claims to send, and the statement's arrays but the keys (`_fetch_batch`'s).
        One row per key: of two copies of a key in one batch, the first is sent, and the copy
        sees the row the first one found or made, as it would a statement later
        (`_claims_found`). Written in one order, so two batches wait for each other rather than
        deadlock."""
        first: dict[tuple[bytes, str], Claiming] = {}
        for wanted in batch:
            first.setdefault((wanted.scope, wanted.key), wanted)
        sent = sorted(first.values(), key=lambda wanted: (wanted.scope, wanted.key))
        return sent, {
            **self._dialect.claim_arguments(sent),
            "routes": [wanted.route for wanted in sent],
            "scopes": [wanted.scope for wanted in sent],
            "fingerprints": [wanted.fingerprint for wanted in sent],
            "leases": [wanted.lease for wanted in sent],
            "ttls": [wanted.ttl for wanted in sent],
            **self._kept(sent),
            "claimant": self.claimant,
        }

    async def _claim_complete_batch(
        self, batch: Sequence[Claiming | Completing]
    ) -> list[Claim | Record | bool | Exception | None]:
        """Claims and completes of one place (`Dialect.together`: a Citus worker's), in one
        statement when the batch has both; each operation keeps its own outcome (or
        failure), in the batch's order. Where they cannot share a statement (through the Citus
        coordinator) the dialect batches each kind apart, so a batch holds one kind: a failure
        of the completes' statement never touches claims that committed in another."""
        claims = [each for each in batch if isinstance(each, Claiming)]
        completes = [each for each in batch if isinstance(each, Completing)]
        if not completes:
            return list(await self._claim_batch(claims))
        if not claims:
            return list(await self._complete_batch(completes))
        claimed, claim_arrays = self._claim_arrays(claims)
        completed, complete_arrays = self._complete_arrays(completes)
        claim_rows, complete_rows = await self._dialect.fetch_both(
            {**claim_arrays, "keys": [each.key for each in claimed]},
            {**complete_arrays, "keys": [each.key for each in completed]},
        )
        await self._wake(complete_rows)
        # A claim read the rows holding its key before its statement's completes wrote them: a
        # row one of them completed is read again, committed (None: `claim`), so a retry that
        # met its own request's answer in one statement replays it rather than hear 409
        # `request-in-progress` for a request no longer in flight.
        now_completed = {row["id"] for row in complete_rows}
        claim_outcomes = iter(
            None if isinstance(found, Record) and found.id in now_completed else found
            for found in _claims_found(claims, claimed, claim_rows)
        )
        stored = iter(settled_by_rows(completes, completed, complete_rows))
        return [next(claim_outcomes) if isinstance(each, Claiming) else next(stored)
                for each in batch]  # fmt: skip

    def _claimed_for_nobody(self, _: object, outcome: Claim | Record | None) -> None:
        """A request stopped waiting for its claim (or its reclaim of an expired key) after the
        statement was sent, and the claim was won: release it, or the key would read `unknown`
        once its lease runs out although nothing was forwarded."""
        if isinstance(outcome, Claim):
            self._clean_up(self.release(outcome))

    def _taken_for_nobody(self, _: object, outcome: Claim | None) -> None:
        """The same for a take-over of an `unknown` key: it goes back to `unknown` (with the
        new token), still in the operator's queue, rather than being forgotten."""
        if outcome is not None:
            self._clean_up(self.mark_unknown(outcome))

    def _clean_up(self, settlement: Coroutine[Any, Any, bool]) -> None:
        cleanup = asyncio.create_task(settlement)
        self._cleanups.add(cleanup)
        cleanup.add_done_callback(self._cleaned_up)

    def _cleaned_up(self, cleanup: asyncio.Task[bool]) -> None:
        self._cleanups.discard(cleanup)
        if not cleanup.cancelled() and cleanup.exception() is not None:
            log.warning("could not settle a claim nobody waited for: %s", cleanup.exception())

    @translated("get")
    async def get(self, scope: bytes, key: str) -> Record | None:
        row = await self._dialect.fetchrow(self._pool, "get", {"scope": scope, "key": key})
        return record_of(row, key) if row is not None else None

    @translated("reclaim_expired")
    async def reclaim_expired(
        self,
        record: Record,
        route: str,
        fingerprint: bytes,
        lease: float,
        ttl: float,
        request: SealedRequest | None = None,
    ) -> Claim | None:
        taking = Reclaiming(
            record.id, record.token, record.key, route, fingerprint, lease, ttl, request
        )
        # No span: the trace's store children are the claim and the settles (`tracing`).
        return await self._reclaims.run(taking)

    async def _reclaim_batch(self, batch: Sequence[Reclaiming]) -> list[Claim | None]:
        sent = to_send(batch)
        rows = await self._fetch_batch(
            "reclaim_expired",
            self._pool,
            sent,
            ids=[taking.id for taking in sent],
            tokens=[taking.token for taking in sent],
            routes=[taking.route for taking in sent],
            fingerprints=[taking.fingerprint for taking in sent],
            leases=[taking.lease for taking in sent],
            ttls=[taking.ttl for taking in sent],
            **self._kept(sent),
            claimants=[self.claimant] * len(sent),
        )
        return taken_by_rows(batch, sent, rows)

    def _kept(self, sent: Sequence[Claiming] | Sequence[Reclaiming]) -> dict[str, object]:
        """The columns of the request behind each key a claim or reclaim writes."""
        return {
            "requests": [None if each.request is None else each.request.data for each in sent],
            "requests_sealed_with": [
                None if each.request is None else each.request.key_name for each in sent
            ],
        }

    @translated("take_over")
    async def take_over(self, record: Record, lease: float) -> Claim | None:
        taking = TakingOver(record.id, record.token, record.key, lease)
        # No span: the trace's store children are the claim and the settles (`tracing`).
        return await self._take_overs.run(taking)

    async def _take_over_batch(self, batch: Sequence[TakingOver]) -> list[Claim | None]:
        sent = to_send(batch)
        rows = await self._fetch_batch(
            "take_over",
            self._pool,
            sent,
            ids=[taking.id for taking in sent],
            tokens=[taking.token for taking in sent],
            leases=[taking.lease for taking in sent],
            claimants=[self.claimant] * len(sent),
        )
        return taken_by_rows(batch, sent, rows)

    @translated("complete", routed=lambda path, claim, *_, **__: claim.key)
    async def complete(self, claim: Claim, answer: StoredAnswer) -> bool:
        completing = Completing(claim.id, claim.token, claim.key, answer)
        with tracing.store_operation("complete"):
            try:
                stored: bool = await self._completes.run(completing)
            except DRIVER_ERRORS:
                self._answers.unstored(claim)
                raise
        if stored:
            self._answers.stored(claim)
        return stored

    async def _complete_batch(self, batch: Sequence[Completing]) -> list[bool]:
        sent, arrays = self._complete_arrays(batch)
        rows = await self._fetch_batch("complete", self._answer_pool, sent, **arrays)
        return settled_by_rows(batch, sent, rows)

    def _complete_arrays(
        self, batch: Sequence[Completing]
    ) -> tuple[list[Completing], dict[str, object]]:
        """The completes to send (`to_send`), and the statement's arrays but the keys."""
        sent = to_send(batch)
        columns = [answer_columns(completing.answer) for completing in sent]
        return sent, {
            "ids": [completing.id for completing in sent],
            "tokens": [completing.token for completing in sent],
            "statuses": [column["status"] for column in columns],
            "stored": [column["stored"] for column in columns],
            "headers": [column["headers"] for column in columns],
            "bodies": [column["body"] for column in columns],
            "sealed_with": [column["sealed_with"] for column in columns],
            "sealed_headers": [column["sealed_headers"] for column in columns],
        }

    @translated("release")
    async def release(self, claim: Claim) -> bool:
        with tracing.store_operation("release"):
            return await self._releases.run(Settling(claim.id, claim.token, claim.key))

    @translated("mark_unknown")
    async def mark_unknown(self, claim: Claim, failure: str | None = None) -> bool:
        settling = Settling(claim.id, claim.token, claim.key, failure)
        with tracing.store_operation("mark_unknown"):
            return await self._unknowns.run(settling)

    async def _settle_batch(self, operation: str, batch: Sequence[Settling]) -> list[bool]:
        sent = to_send(batch)
        failures = {}
        if operation == "mark_unknown":
            failures["failures"] = [settling.failure for settling in sent]
        rows = await self._fetch_batch(
            operation,
            self._pool,
            sent,
            ids=[settling.id for settling in sent],
            tokens=[settling.token for settling in sent],
            **failures,
        )
        return settled_by_rows(batch, sent, rows)


def _claims_found(
    batch: Sequence[Claiming], sent: Sequence[Claiming], rows: Sequence[asyncpg.Record]
) -> list[Claim | Record | None]:
    """Each claim's outcome from the rows of the claims `sent` (`n`: a claim's position among
    them): won (a `Claim`), the row that holds the key, or None (a concurrent claim's row, not
    seen yet: the caller reads it). A copy of a key sent once sees the row its first made."""
    found: dict[tuple[bytes, str], Claim | Record | None] = {}
    for row in rows:
        wanted = sent[row["n"] - 1]
        if row["id"] is None:
            found[wanted.scope, wanted.key] = None
        elif row["claimed"]:
            found[wanted.scope, wanted.key] = Claim(row["id"], row["fencing_token"], wanted.key)
        else:
            found[wanted.scope, wanted.key] = record_of(row, wanted.key)
    firsts = {(wanted.scope, wanted.key): wanted for wanted in sent}
    outcomes: list[Claim | Record | None] = []
    for wanted in batch:
        outcome = found[wanted.scope, wanted.key]
        first = firsts[wanted.scope, wanted.key]
        if wanted is not first and isinstance(outcome, Claim):
            outcome = claimed_row(outcome, first)
        outcomes.append(outcome)
    return outcomes


def _weight(operation: Claiming | Completing) -> int:
    """What an operation weighs in a batch of claims and completes: its answer's bytes, or
    those of the request it keeps."""
    return answer_size(operation) if isinstance(operation, Completing) else request_size(operation)


def _failure(found: BaseException) -> Exception:
    """An operation's failure when its batch was sent again: its own exception, or, for a
    cancellation (the store closing), one the caller's future can carry."""
    if isinstance(found, Exception):
        return found
    return RuntimeError(f"the operation was not sent again: {type(found).__name__}")
