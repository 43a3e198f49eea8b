"""What batching could break, on a real PostgreSQL (store/batching.py, the `unnest` statements
in store/queries.sql): copies of one key in one batch, a superseded token among rows that
settle, PostgreSQL stopped while a batch is in flight, a batch of the maximum size, and one
waiter that gives up.

To put operations in one batch for sure, a test sends a first operation (it goes at once, alone)
and, before that statement can return, the ones it wants batched: they queue behind it and go
together. The histogram `oncegate_store_batch_size` shows that they did.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import asyncpg
import pytest
from asyncpg.transaction import Transaction
from prometheus_client import REGISTRY

from oncegate import settings
from oncegate.kernel import keys
from oncegate.kernel.sealing import plaintext
from oncegate.model import errors
from oncegate.model.answers import SealedRequest, StoredAnswer
from oncegate.model.records import Claim, Record
from oncegate.service import Gateway, ProxyRequest
from oncegate.settings import StoreOptions
from oncegate.store.postgres import PostgresStore
from oncegate.store.postgres.requests import HEAVY_BYTES
from tests.e2e.test_store_down import server, start, stop
from tests.fake_upstream import FakeUpstream, Respond
from tests.helpers import digest, new_key, stored

__all__ = ["server"]  # the fixture: a PostgreSQL of this module's own, to stop

ROUTE = "batched"
SCOPE = hashlib.sha256(b"batched scope").digest()
LONG = 600.0  # a lease or TTL that cannot run out during a test
HANG = 60.0  # a waiter that has no answer by then hangs: the test fails instead of hanging

T = TypeVar("T")


def batches(operation: str) -> tuple[float, float]:
    """(statements sent, operations carried) so far for `operation`."""
    labels = {"operation": operation}
    count = REGISTRY.get_sample_value("oncegate_store_batch_size_count", labels) or 0.0
    total = REGISTRY.get_sample_value("oncegate_store_batch_size_sum", labels) or 0.0
    return count, total


async def answered(pending: Awaitable[T]) -> T:
    return await asyncio.wait_for(pending, HANG)


async def hold(connection: asyncpg.Connection, key: str, scope: bytes = SCOPE) -> Transaction:
    """An uncommitted in-flight row for `key`, in a transaction left open: a claim of the key
    waits on it inside PostgreSQL until the transaction ends, and holds its whole batch there."""
    transaction = connection.transaction()
    await transaction.start()
    await hold_too(connection, key, scope)
    return transaction


async def hold_too(connection: asyncpg.Connection, key: str, scope: bytes = SCOPE) -> None:
    """One more uncommitted in-flight row, in the transaction `hold` left open."""
    await connection.execute(
        "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token, "
        "lease_expires_at, expires_at) VALUES ($1, $2, $3, $4, 'in_progress', 1, "
        "now() + interval '1 minute', now() + interval '1 hour')",
        ROUTE,
        scope,
        key,
        digest("held"),
    )


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PostgresStore]:
    store = await PostgresStore.connect(database_url, StoreOptions(batch_size=8))
    try:
        yield store
    finally:
        await store.close()


def claim(store: PostgresStore, key: str, fingerprint: bytes = digest("a")) -> Awaitable[Any]:
    return store.requests.claim(ROUTE, SCOPE, key, fingerprint, LONG, LONG)


async def test_copies_of_one_key_in_one_batch_one_wins_and_the_others_see_its_row(
    store: PostgresStore,
) -> None:
    key = new_key()
    before = batches("claim")
    first, *copies = await answered(
        asyncio.gather(
            claim(store, new_key()),  # alone; the copies queue behind it
            claim(store, key, digest("one")),
            claim(store, key, digest("one")),
            claim(store, key, digest("two")),
            claim(store, key, digest("one")),
        )
    )
    assert batches("claim") == (before[0] + 2, before[1] + 5)  # [first], [the four copies]
    assert isinstance(first, Claim)
    winners = [copy for copy in copies if isinstance(copy, Claim)]
    assert len(winners) == 1 and isinstance(copies[0], Claim)  # the first copy sent wins
    winner = winners[0]
    for seen in copies[1:]:
        assert isinstance(seen, Record)
        assert (seen.id, seen.token, seen.state) == (winner.id, winner.token, "in_progress")
        assert seen.fingerprint == digest("one")  # the winner's request, not its own
    stored = await store.requests.get(SCOPE, key)
    assert stored is not None and stored.state == "in_progress"
    assert (stored.id, stored.token, stored.fingerprint) == (
        winner.id,
        winner.token,
        digest("one"),
    )


async def test_copies_of_a_held_key_in_one_batch_all_read_the_row(store: PostgresStore) -> None:
    key = new_key()
    held = await claim(store, key)
    assert isinstance(held, Claim)
    await store.requests.complete(
        held, StoredAnswer(201, plaintext([("content-type", "text/plain")], b"done"))
    )
    _, *seen = await answered(
        asyncio.gather(claim(store, new_key()), *(claim(store, key) for _ in range(3)))
    )
    for record in seen:
        assert isinstance(record, Record)
        assert (record.id, record.state) == (held.id, "completed")
        assert stored(record)[::2] == (201, b"done")


async def test_a_superseded_token_in_a_batch_settles_nothing_while_the_others_settle(
    store: PostgresStore,
) -> None:
    keys = [new_key() for _ in range(5)]
    claims = [await claim(store, key) for key in keys]
    assert all(isinstance(claimed, Claim) for claimed in claims)
    # The third key's request lost its answer, and another gateway took the key over.
    assert await store.requests.mark_unknown(claims[2])
    unknown = await store.requests.get(SCOPE, keys[2])
    assert unknown is not None and unknown.state == "unknown"
    taken = await store.requests.take_over(unknown, LONG)
    assert taken is not None and taken.token == claims[2].token + 1

    answer = plaintext([], b"{}")
    before = batches("complete")
    settled = await answered(
        asyncio.gather(
            store.requests.complete(
                claims[0], StoredAnswer(201, answer)
            ),  # alone; the rest go in one batch
            *(
                store.requests.complete(claimed, StoredAnswer(201, answer))
                for claimed in claims[1:]
            ),
        )
    )
    assert batches("complete") == (before[0] + 2, before[1] + 5)
    assert settled == [True, True, False, True, True]
    for index, key in enumerate(keys):
        record = await store.requests.get(SCOPE, key)
        assert record is not None
        if index == 2:  # still the new holder's, in flight, with nothing stored
            assert (record.state, record.token, record.answer) == ("in_progress", taken.token, None)
        else:
            assert (record.state, stored(record).status) == ("completed", 201)


async def unknown_record(store: PostgresStore) -> Record:
    key = new_key()
    claimed = await claim(store, key)
    assert isinstance(claimed, Claim) and await store.requests.mark_unknown(claimed)
    record = await store.requests.get(SCOPE, key)
    assert record is not None and record.state == "unknown"
    return record


async def test_copies_of_one_take_over_in_a_batch_one_wins(store: PostgresStore) -> None:
    other, unknown = await unknown_record(store), await unknown_record(store)
    before = batches("take_over")
    results = await answered(
        asyncio.gather(
            store.requests.take_over(other, LONG),  # alone; the copies go together after it
            store.requests.take_over(unknown, LONG),
            store.requests.take_over(unknown, LONG),
            store.requests.take_over(unknown, LONG),
        )
    )
    assert batches("take_over") == (before[0] + 2, before[1] + 4)
    assert results[0] == Claim(other.id, other.token + 1, other.key)
    assert results[1:] == [Claim(unknown.id, unknown.token + 1, unknown.key), None, None]


async def test_copies_of_one_reclaim_of_an_expired_key_in_a_batch_one_wins(
    store: PostgresStore,
) -> None:
    """Contract section 4, "key expired: as a new key": of several requests that found the
    same expired row and reclaim it in one batch, one claims it; the rest find it changed."""
    other_key, key = new_key(), new_key()
    for expiring in (other_key, key):
        claimed = await store.requests.claim(ROUTE, SCOPE, expiring, digest("old"), 0.1, 0.2)
        assert isinstance(claimed, Claim)
    expired: list[Record] = []
    for expiring in (other_key, key):
        for _ in range(100):  # until its TTL has run out (it can only run out more under load)
            found = await store.requests.get(SCOPE, expiring)
            if found is not None and found.state == "expired":
                break
            await asyncio.sleep(0.05)
        assert found is not None and found.state == "expired"
        expired.append(found)
    other, row = expired
    before = batches("reclaim_expired")
    results = await answered(
        asyncio.gather(
            store.requests.reclaim_expired(other, ROUTE, digest("new"), LONG, LONG),  # alone
            *(
                store.requests.reclaim_expired(row, ROUTE, digest("new"), LONG, LONG)
                for _ in range(3)
            ),
        )
    )
    assert batches("reclaim_expired") == (before[0] + 2, before[1] + 4)
    assert results == [
        Claim(other.id, other.token + 1, other.key),
        Claim(row.id, row.token + 1, row.key),
        None,
        None,
    ]
    now = await store.requests.get(SCOPE, key)
    assert now is not None
    assert (now.state, now.token, now.fingerprint) == ("in_progress", row.token + 1, digest("new"))


async def test_a_batch_of_the_maximum_size(database_url: str) -> None:
    store = await PostgresStore.connect(database_url, StoreOptions(batch_size=8))
    try:
        keys = [new_key() for _ in range(1 + 8 + 8 + 4)]
        before = batches("claim")
        claims = await answered(asyncio.gather(*(claim(store, key) for key in keys)))
        sent, carried = batches("claim")
        # [1], then a full [8] starts beside it, and another, and the last 4 when one returns.
        assert (sent - before[0], carried - before[1]) == (4, 21)
        bucket = REGISTRY.get_sample_value(
            "oncegate_store_batch_size_bucket", {"operation": "claim", "le": "4.0"}
        )
        assert bucket is not None
        assert all(isinstance(claimed, Claim) for claimed in claims)
        assert len({claimed.id for claimed in claims}) == len(keys)
        for key, claimed in zip(keys, claims, strict=True):
            record = await store.requests.get(SCOPE, key)
            assert record is not None and record.id == claimed.id
    finally:
        await store.close()


async def test_claims_keeping_large_requests_go_in_statements_of_at_most_4_mib_of_them(
    store: PostgresStore,
) -> None:
    # A claim keeps its request (up to a route's max_body, 10 MiB by default): a batch of 64 of
    # them would be one parameter of 640 MiB, and past 1 GiB PostgreSQL refuses the message and
    # fails every claim of the batch. A batch weighs what it keeps, as completes weigh answers.
    kept = SealedRequest(None, b"r" * (3 * 1024 * 1024))
    keys = [new_key() for _ in range(3)]
    before = batches("claim")
    claims = await answered(
        asyncio.gather(
            *(
                store.requests.claim(ROUTE, SCOPE, key, digest("a"), LONG, LONG, kept)
                for key in keys
            )
        )
    )
    sent, carried = batches("claim")
    # Each alone, at once: a request this large makes its claim heavy (`HEAVY_BYTES`), and two
    # would be 6 MiB.
    assert (sent - before[0], carried - before[1]) == (3, 3)
    assert all(isinstance(claimed, Claim) for claimed in claims)
    for key in keys:
        record = await store.requests.get(SCOPE, key)
        assert record is not None and record.state == "in_progress"


async def test_each_claim_of_a_batch_keeps_its_own_request_byte_for_byte(
    store: PostgresStore, database_url: str
) -> None:
    """The claim takes each kept request from its array by position after the batch's rows are
    put in key order: claims sent in the reverse of that order each keep their own bytes."""
    first = new_key()
    keys = sorted((new_key() for _ in range(4)), reverse=True)
    requests = {key: SealedRequest(None, bytes([index]) * (1000 + index) + key.encode())
                for index, key in enumerate(keys)}  # fmt: skip
    holder = await asyncpg.connect(database_url)
    try:
        transaction = await hold(holder, first)
        held = asyncio.create_task(claim(store, first))
        await waiting_on_a_lock(holder)
        before = batches("claim")
        queued = [asyncio.create_task(store.requests.claim(ROUTE, SCOPE, key, digest("a"), LONG,
                                                           LONG, requests[key]))
                  for key in keys]  # fmt: skip
        await asyncio.sleep(0)
        await transaction.rollback()
        assert isinstance(await answered(held), Claim)
        claims = await answered(asyncio.gather(*queued))
        assert all(isinstance(claimed, Claim) for claimed in claims)
        sent, carried = batches("claim")
        assert (sent - before[0], carried - before[1]) == (1, 4)  # one statement carried them
        rows = await holder.fetch(
            "SELECT key, request FROM oncegate_keys WHERE key = ANY($1::text[])", keys
        )
        assert {row["key"]: row["request"] for row in rows} == {
            key: kept.data for key, kept in requests.items()
        }
    finally:
        await holder.close()


def stalls(operation: str) -> float:
    """`oncegate_store_stalled_batches_total` of `operation` so far: statements sent beside one
    that had not returned within the stall time, carrying what waited behind it."""
    labels = {"operation": operation}
    return REGISTRY.get_sample_value("oncegate_store_stalled_batches_total", labels) or 0.0


async def test_a_claim_keeping_a_large_request_holds_up_no_other_key(
    store: PostgresStore, database_url: str
) -> None:
    """A claim keeping a large request costs PostgreSQL time in proportion to its bytes (TOAST
    compression, chunks, WAL: seconds for a few MiB on a machine short of CPU). It goes in a
    statement of its own, and the other keys' claims never wait behind it: here it is held
    inside PostgreSQL (an uncommitted row for its key) while small claims come and go, none of
    them kept back until the stall timer sends it beside."""
    large, small = SealedRequest(None, b"r" * HEAVY_BYTES), SealedRequest(None, b"s" * 100)
    held = new_key()
    holder = await asyncpg.connect(database_url)
    try:
        transaction = await hold(holder, held)
        heavy = asyncio.create_task(
            store.requests.claim(ROUTE, SCOPE, held, digest("a"), LONG, LONG, large)
        )
        await waiting_on_a_lock(holder)
        before = stalls("claim")
        for _ in range(3):
            claimed = await answered(
                store.requests.claim(ROUTE, SCOPE, new_key(), digest("a"), LONG, LONG, small)
            )
            assert isinstance(claimed, Claim)
        assert not heavy.done()
        assert stalls("claim") == before  # none waited behind the large claim
        await transaction.rollback()
        assert isinstance(await answered(heavy), Claim)
    finally:
        await holder.close()


async def test_a_waiter_that_gives_up_leaves_the_batch_to_the_others_and_claims_nothing(
    store: PostgresStore, database_url: str
) -> None:
    """One request of a batch is cancelled (its client hung up) while the statement is in
    flight: the others get their claims, and the key it won for nobody is released, so a retry
    is forwarded instead of reading `unknown` once the lease runs out."""
    blocked, quitter, stayer = new_key(), new_key(), new_key()
    # Hold the first statement inside PostgreSQL: an uncommitted row for its key makes its
    # insert wait. The next batch queues behind it.
    holder = await asyncpg.connect(database_url)
    try:
        transaction = await hold(holder, blocked)
        first = asyncio.create_task(claim(store, blocked))
        await asyncio.sleep(0.2)  # the first statement is sent, and waits on the lock
        queued = asyncio.create_task(claim(store, quitter))
        staying = asyncio.create_task(claim(store, stayer))
        await asyncio.sleep(0)
        queued.cancel()  # gives up before its batch is sent: never sent at all
        await transaction.rollback()
        assert isinstance(await answered(first), Claim)
        assert isinstance(await answered(staying), Claim)
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert await store.requests.get(SCOPE, quitter) is None

        # Now give up while the statement is in PostgreSQL.
        again, gone, kept = new_key(), new_key(), new_key()
        lock = await hold(holder, again)
        alone = asyncio.create_task(claim(store, new_key()))
        together = [asyncio.create_task(claim(store, key)) for key in (again, gone, kept)]
        await asyncio.sleep(0.2)  # [alone] returned, [again, gone, kept] waits on the lock
        assert isinstance(await answered(alone), Claim)
        together[1].cancel()
        await asyncio.sleep(0.1)
        await lock.rollback()
        assert isinstance(await answered(together[0]), Claim)
        assert isinstance(await answered(together[2]), Claim)
        with pytest.raises(asyncio.CancelledError):
            await together[1]
        for _ in range(100):  # the release of the claim nobody received follows the batch
            if await store.requests.get(SCOPE, gone) is None:
                break
            await asyncio.sleep(0.05)
        assert await store.requests.get(SCOPE, gone) is None
        # ... and a retry of that key is a new claim.
        assert isinstance(await claim(store, gone), Claim)
    finally:
        await holder.close()


@pytest.mark.parametrize("held", ["claim", "settle"])
async def test_a_caller_that_stops_waiting_mid_statement_leaves_its_key_forwarded_and_settled(
    store: PostgresStore, database_url: str, held: str
) -> None:
    """A keyed request's claim, forward and settle run in one shielded task, and its lone
    statements go in that task rather than in a batch task of their own: a caller cancelled
    (its client hung up) while the claim, or the settle, waits inside PostgreSQL cuts neither
    short. The claim is won, the request forwarded once and its answer stored; the retry is
    replayed, never forwarded again, and no key is left `in_progress` to turn `unknown`."""
    route = settings.Route(name=ROUTE, match="/", upstream="http://upstream.test")
    key = new_key()
    request = ProxyRequest(
        method="POST", path="/emails", query="", body=b"{}",
        headers=[("idempotency-key", key), ("content-type", "application/json")],
    )  # fmt: skip
    scope = keys.scope(route.name, [[] for _ in route.scope_headers])
    arrived, answer_now = asyncio.Event(), asyncio.Event()
    upstream = FakeUpstream()
    upstream.will(Respond(arrived=arrived, until=answer_now))
    gateway = Gateway(store.requests, upstream)
    claims, completes = batches("claim"), batches("complete")
    holder = await asyncpg.connect(database_url)
    try:
        if held == "claim":
            # An uncommitted row of the key: the claim's statement waits on it in PostgreSQL.
            lock = await hold(holder, key, scope)
            caller = asyncio.create_task(gateway.handle(route, request))
            await waiting_on_a_lock(holder)
            answer_now.set()
        else:
            caller = asyncio.create_task(gateway.handle(route, request))
            await answered(arrived.wait())  # claimed, and at the upstream
            # The key's row locked: the complete's statement waits on it in PostgreSQL.
            lock = holder.transaction()
            await lock.start()
            await holder.execute("SELECT 1 FROM oncegate_keys WHERE key = $1 FOR UPDATE", key)
            answer_now.set()
            await waiting_on_a_lock(holder)
        caller.cancel()  # the client hangs up with the statement inside PostgreSQL
        with pytest.raises(asyncio.CancelledError):
            await caller
        await lock.rollback()
        await answered(gateway.drain())
    finally:
        await holder.close()
    row = await store.requests.get(scope, key)
    assert row is not None and row.state == "completed"
    assert len(upstream.requests(key)) == 1
    # Each of the two went alone, in one statement of its own: none of them was resent.
    assert batches("claim") == (claims[0] + 1, claims[1] + 1)
    assert batches("complete") == (completes[0] + 1, completes[1] + 1)
    retry = await answered(gateway.handle(route, request))
    assert (retry.status, retry.outcome, retry.body) == (201, "replayed", b'{"performed": true}')
    assert len(upstream.requests(key)) == 1


async def waiting_on_a_lock(connection: asyncpg.Connection) -> None:
    """Return once another session's statement waits on a lock (one this session holds)."""
    for _ in range(int(HANG / 0.01)):
        waiting = await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database() AND pid <> pg_backend_pid()"
        )
        if waiting:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("no statement came to wait on the lock")


async def test_postgres_stopped_while_a_batch_is_in_flight(server: Any) -> None:
    """Every waiter of the batch gets `StoreUnavailable` (503, never forwarded), none hangs, no
    claim of it survives, an answer of it is not stored (its key still held by its claim, which
    the lease turns `unknown`: a retry is never forwarded again), and once PostgreSQL is back the
    next batch works, with no restart."""
    url = server.get_uri()
    store = await PostgresStore.connect(url, StoreOptions(batch_size=8))
    holder = await asyncpg.connect(url)
    keys = [new_key() for _ in range(5)]
    completing = await claim(store, new_key())
    assert isinstance(completing, Claim)
    try:
        await hold(holder, keys[0])  # ended by the stop below
        # ... and the row the answer completes locked in the same transaction: its statement
        # waits too.
        await holder.execute("SELECT FROM oncegate_keys WHERE id = $1 FOR UPDATE", completing.id)
        claims_before, completes_before = batches("claim"), batches("complete")
        alone = asyncio.create_task(claim(store, new_key()))
        waiting = [asyncio.create_task(claim(store, key)) for key in keys]
        waiting.append(
            asyncio.create_task(
                store.requests.complete(completing, StoredAnswer(201, plaintext([], b"{}")))
            )
        )
        await answered(alone)
        # [alone], [keys]; the answer in a statement of its own.
        assert batches("claim") == (claims_before[0] + 2, claims_before[1] + 6)
        assert batches("complete") == (completes_before[0] + 1, completes_before[1] + 1)
        await asyncio.sleep(0.2)  # [keys] and [answer] are in PostgreSQL, waiting on the locks
        await asyncio.to_thread(stop, server, "immediate")
        results = await answered(asyncio.gather(*waiting, return_exceptions=True))
        assert all(isinstance(result, errors.StoreUnavailable) for result in results), results
    finally:
        await asyncio.to_thread(start, server)
        await holder.close()
    try:
        for _ in range(50):  # the pool replaces its dead connections as they are used
            try:
                claims = await answered(asyncio.gather(*(claim(store, key) for key in keys)))
                break
            except errors.StoreUnavailable:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the store did not come back after PostgreSQL did")
        # Nothing of the failed batch was kept: every key is claimed anew, token 1.
        assert all(isinstance(claimed, Claim) and claimed.token == 1 for claimed in claims)
        record = await store.requests.get(SCOPE, completing.key)
        assert record is not None
        assert (record.state, record.token, record.answer) == (
            "in_progress",
            completing.token,
            None,
        )
    finally:
        await store.close()


async def test_a_row_postgresql_refuses_fails_alone_and_the_rest_of_its_batch_settles(
    store: PostgresStore,
) -> None:
    """A status PostgreSQL's check refuses (the table allows 100-599) fails the whole statement;
    the batch is then sent again one row at a time, so only that row fails."""
    keys = [new_key() for _ in range(4)]
    claims = [await claim(store, key) for key in keys]
    answer = plaintext([], b"{}")
    statuses = [201, 201, 42, 201]
    results = await answered(
        asyncio.gather(
            store.requests.complete(
                await claim(store, new_key()), StoredAnswer(201, answer)
            ),  # alone
            *(
                store.requests.complete(claimed, StoredAnswer(status, answer))
                for claimed, status in zip(claims, statuses, strict=True)
            ),
            return_exceptions=True,
        )
    )
    assert results[:3] == [True, True, True] and results[4] is True
    assert isinstance(results[3], errors.StoreUnavailable)
    for key, status in zip(keys, statuses, strict=True):
        record = await store.requests.get(SCOPE, key)
        assert record is not None
        expected = ("in_progress", None) if status == 42 else ("completed", 201)
        assert (record.state, stored(record).status) == expected


async def test_a_take_over_nobody_waits_for_puts_the_key_back_to_unknown(
    store: PostgresStore, database_url: str
) -> None:
    key = new_key()
    claimed = await claim(store, key)
    assert isinstance(claimed, Claim) and await store.requests.mark_unknown(claimed)
    unknown = await store.requests.get(SCOPE, key)
    assert unknown is not None
    holder = await asyncpg.connect(database_url)
    try:
        lock = holder.transaction()
        await lock.start()
        await holder.execute("SELECT FROM oncegate_keys WHERE id = $1 FOR UPDATE", unknown.id)
        taking = asyncio.create_task(store.requests.take_over(unknown, LONG))
        await asyncio.sleep(0.2)  # the take-over waits inside PostgreSQL on the row lock
        taking.cancel()
        await lock.rollback()
        with pytest.raises(asyncio.CancelledError):
            await taking
    finally:
        await holder.close()
    for _ in range(100):  # the take-over lands, then its orphan is marked unknown again
        found = await store.requests.get(SCOPE, key)
        if found is not None and found.token == unknown.token + 1 and found.state == "unknown":
            break
        await asyncio.sleep(0.05)
    assert found is not None
    assert (found.token, found.state) == (unknown.token + 1, "unknown")  # kept, not deleted


# Claims and completes go in statements of their own, each kind on its pool: a claim commits with
# the server's `synchronous_commit`, an answer with `store_answer_commit`, and a statement of one
# kind that waits inside PostgreSQL holds up none of the other kind.


async def test_claims_and_completes_in_flight_at_once_go_in_statements_of_their_own(
    store: PostgresStore,
) -> None:
    """Each kind in its own statements, each operation with its own outcome: a claim beside a
    complete never shares its statement."""
    done, held, superseded = [await claim(store, new_key()) for _ in range(3)]
    won = [await claim(store, new_key()) for _ in range(2)]
    assert all(isinstance(each, Claim) for each in (done, held, superseded, *won))
    answer = StoredAnswer(201, plaintext([("content-type", "text/plain")], b"done"))
    assert await store.requests.complete(done, answer)
    # The superseded claim's key was taken over by another gateway: its token is stale.
    assert await store.requests.mark_unknown(superseded)
    unknown = await store.requests.get(SCOPE, superseded.key)
    assert unknown is not None and await store.requests.take_over(unknown, LONG) is not None
    new = [new_key() for _ in range(2)]
    claims_before, completes_before = batches("claim"), batches("complete")
    results = await answered(
        asyncio.gather(
            claim(store, new_key()),  # alone; the other claims queue behind it
            claim(store, new[0]),
            store.requests.complete(won[0], StoredAnswer(201, plaintext([], b"first"))),  # alone
            claim(store, done.key),  # a stored answer: its row
            claim(store, new[0]),  # a copy: the row its first made
            store.requests.complete(superseded, StoredAnswer(201, plaintext([], b"late"))),
            claim(store, held.key),  # in flight: its row
            store.requests.complete(won[1], StoredAnswer(202, plaintext([], b"second"))),
            claim(store, new[1]),
        )
    )
    # [alone], [the other five claims]; [the first complete], [the other two].
    assert batches("claim") == (claims_before[0] + 2, claims_before[1] + 6)
    assert batches("complete") == (completes_before[0] + 2, completes_before[1] + 3)
    alone, first, stored_first, replay, copy, late, in_flight, stored_second, second = results
    assert isinstance(alone, Claim) and isinstance(first, Claim) and isinstance(second, Claim)
    assert (stored_first, late, stored_second) == (True, False, True)
    assert isinstance(replay, Record) and (replay.id, replay.state) == (done.id, "completed")
    assert stored(replay)[::2] == (201, b"done")
    assert isinstance(copy, Record) and (copy.id, copy.state) == (first.id, "in_progress")
    assert isinstance(in_flight, Record) and (in_flight.id, in_flight.state) == (
        held.id,
        "in_progress",
    )
    for key, status, body in ((won[0].key, 201, b"first"), (won[1].key, 202, b"second")):
        record = await store.requests.get(SCOPE, key)
        assert record is not None and record.state == "completed"
        assert stored(record)[::2] == (status, body)
    for claimed in (first, second):
        record = await store.requests.get(SCOPE, claimed.key)
        assert record is not None and (record.id, record.state) == (claimed.id, "in_progress")
    taken = await store.requests.get(SCOPE, superseded.key)
    assert taken is not None and (taken.state, taken.token, taken.answer) == (
        "in_progress",
        superseded.token + 1,
        None,
    )


async def prepared(pool: Any) -> str:
    """The statements the pool's one connection has prepared, as one text."""
    async with pool.acquire() as connection:
        rows = await connection.fetch("SELECT statement FROM pg_prepared_statements")
    return "\n".join(row["statement"] for row in rows)


async def test_a_complete_goes_on_the_answers_pool_and_a_claim_on_the_requests_pool_always(
    database_url: str,
) -> None:
    """A complete goes on the answers pool (`store_answer_commit`, `off` by default: no WAL
    flush to wait for), alone or with claims in flight beside it; a claim on the requests pool,
    with the server's setting. (What each commits with, whatever the two settings:
    tests/store/test_answer_commit.py.)"""
    store = await PostgresStore.connect(database_url, StoreOptions(pool_size=1, batch_size=8))
    try:
        claimed = await claim(store, new_key())
        assert isinstance(claimed, Claim)
        assert await store.requests.complete(claimed, StoredAnswer(201, plaintext([], b"{}")))
        completing = await claim(store, new_key())
        assert isinstance(completing, Claim)
        _, claimed, stored_now = await answered(
            asyncio.gather(
                claim(store, new_key()),  # alone; the next claim queues behind it
                claim(store, new_key()),
                store.requests.complete(completing, StoredAnswer(201, plaintext([], b"{}"))),
            )
        )
        assert isinstance(claimed, Claim) and stored_now is True
        on_requests, on_answers = (
            await prepared(store._pools.requests),
            await prepared(store._pools.answers),
        )
        assert "INSERT INTO oncegate_keys" in on_requests
        assert "INSERT INTO oncegate_keys" not in on_answers
        assert "SET state = 'completed'" in on_answers
        assert "SET state = 'completed'" not in on_requests
    finally:
        await store.close()


async def test_a_complete_postgresql_refuses_fails_alone_and_no_claim_beside_it_is_resent(
    store: PostgresStore,
) -> None:
    completing = [await claim(store, new_key()) for _ in range(3)]
    new = [new_key() for _ in range(2)]
    answer = plaintext([], b"{}")
    claims_before, completes_before = batches("claim"), batches("complete")
    results = await answered(
        asyncio.gather(
            claim(store, new_key()),  # alone
            store.requests.complete(completing[0], StoredAnswer(201, answer)),  # alone
            claim(store, new[0]),
            store.requests.complete(completing[1], StoredAnswer(201, answer)),
            store.requests.complete(completing[2], StoredAnswer(42, answer)),  # refused
            claim(store, new[1]),
            return_exceptions=True,
        )
    )
    assert isinstance(results[0], Claim) and results[1] is True
    assert isinstance(results[2], Claim) and results[3] is True and isinstance(results[5], Claim)
    assert isinstance(results[4], errors.StoreUnavailable)
    # The claims: [alone], [new[0], new[1]], never sent again. The completes: [the first], then
    # the two in one, refused whole, then each alone again.
    assert batches("claim") == (claims_before[0] + 2, claims_before[1] + 3)
    assert batches("complete") == (completes_before[0] + 4, completes_before[1] + 5)
    for key, expected in (
        (new[0], "in_progress"), (new[1], "in_progress"),
        (completing[0].key, "completed"), (completing[1].key, "completed"),
        (completing[2].key, "in_progress"),
    ):  # fmt: skip
        record = await store.requests.get(SCOPE, key)
        assert record is not None and record.state == expected, key
    refused = await store.requests.get(SCOPE, completing[2].key)
    assert refused is not None and refused.answer is None


async def blocked_on(looker: asyncpg.Connection, holder: asyncpg.Connection, count: int) -> int:
    """Wait until `count` statements wait on `holder`'s transaction inside PostgreSQL (or give
    up after 10 s); how many do."""
    waiting = 0
    for _ in range(200):
        waiting = await looker.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            holder.get_server_pid(),
        )
        if waiting >= count:
            break
        await asyncio.sleep(0.05)
    return int(waiting)


async def test_a_claim_that_waits_inside_postgresql_holds_up_no_complete(
    store: PostgresStore, database_url: str
) -> None:
    """While a claim's statement waits on another transaction inside PostgreSQL (the same new
    key claimed there), a complete sent beside it commits: it is in a statement of its own, and
    the claim holds no lock it needs."""
    completing = await claim(store, new_key())
    assert isinstance(completing, Claim)
    blocked = new_key()
    holder = await asyncpg.connect(database_url)
    looker = await asyncpg.connect(database_url)
    try:
        lock = await hold(holder, blocked)
        claims_before, completes_before = batches("claim"), batches("complete")
        alone = asyncio.create_task(claim(store, new_key()))
        waits = asyncio.create_task(claim(store, blocked))
        completed = asyncio.create_task(
            store.requests.complete(completing, StoredAnswer(201, plaintext([], b"{}")))
        )
        assert isinstance(await answered(alone), Claim)
        assert await blocked_on(looker, holder, 1) == 1
        assert await answered(completed) is True  # while the claim still waits
        record = await store.requests.get(SCOPE, completing.key)
        assert record is not None and record.state == "completed"
        assert not waits.done()
        assert batches("claim") == (claims_before[0] + 2, claims_before[1] + 2)
        assert batches("complete") == (completes_before[0] + 1, completes_before[1] + 1)
        await lock.rollback()
        assert isinstance(await answered(waits), Claim)
    finally:
        await looker.close()
        await holder.close()


async def test_claims_are_idle_only_while_no_claim_is_queued_or_in_flight(
    store: PostgresStore, database_url: str
) -> None:
    """`claims_idle`: whether a claim now would be sent at once, alone (a keyed request claims
    from its shielded task only then). A complete waiting inside PostgreSQL leaves claims idle;
    a claim waiting there does not, nor one queued behind it; once every claim returned, claims
    are idle again."""
    requests = store.requests
    assert requests.claims_idle()
    completing = await claim(store, new_key())
    assert isinstance(completing, Claim)
    await asyncio.sleep(0)  # its batch task ends a step after the outcome reached its caller
    assert requests.claims_idle()
    blocked = new_key()
    holder = await asyncpg.connect(database_url)
    looker = await asyncpg.connect(database_url)
    try:
        lock = holder.transaction()
        await lock.start()
        await holder.execute(
            "SELECT 1 FROM oncegate_keys WHERE key = $1 FOR UPDATE", completing.key
        )
        completed = asyncio.create_task(
            requests.complete(completing, StoredAnswer(201, plaintext([], b"{}")))
        )
        assert await blocked_on(looker, holder, 1) == 1
        assert requests.claims_idle()  # a complete in flight: not a claim
        await hold_too(holder, blocked)
        waits = asyncio.create_task(claim(store, blocked))
        assert await blocked_on(looker, holder, 2) == 2
        assert not requests.claims_idle()  # a claim in flight
        behind = asyncio.create_task(claim(store, new_key()))  # queued, then sent beside it
        assert isinstance(await answered(behind), Claim)
        assert not requests.claims_idle()  # the first still waits
        await lock.rollback()
        assert await answered(completed) is True
        assert isinstance(await answered(waits), Claim)
        await asyncio.sleep(0)
        assert requests.claims_idle()
    finally:
        await looker.close()
        await holder.close()


def keyed(key: str) -> ProxyRequest:
    return ProxyRequest(
        method="POST", path="/emails", query="", body=b"{}",
        headers=[("idempotency-key", key), ("content-type", "application/json")],
    )  # fmt: skip


async def test_a_client_that_hangs_up_during_its_claim_has_it_performed_once_or_not_at_all(
    store: PostgresStore, database_url: str
) -> None:
    """Where a keyed request's claim goes depends on the claims in flight: with none
    (`claims_idle`) in the request's shielded task, otherwise in the request's own task, the
    store's batch task carrying it. Two clients hang up while their claims wait inside
    PostgreSQL, the first's sent alone, the second's after it. The first claim is won for its
    shielded task: forwarded once, the answer stored, the retry replayed. The second is won for
    nobody: the store releases the key, nothing reaches the upstream, and the retry is
    forwarded, once. Neither request is performed twice."""
    route = settings.Route(name=ROUTE, match="/", upstream="http://upstream.test")
    scope = keys.scope(route.name, [[] for _ in route.scope_headers])
    idle, busy = new_key(), new_key()
    upstream = FakeUpstream()
    gateway = Gateway(store.requests, upstream)
    releases = batches("release")
    holder = await asyncpg.connect(database_url)
    looker = await asyncpg.connect(database_url)
    try:
        # Uncommitted rows of both keys: each claim's statement waits on its row in PostgreSQL.
        lock = await hold(holder, idle, scope)
        await hold_too(holder, busy, scope)
        assert store.requests.claims_idle()
        first = asyncio.create_task(gateway.handle(route, keyed(idle)))
        assert await blocked_on(looker, holder, 1) == 1
        assert not store.requests.claims_idle()
        second = asyncio.create_task(gateway.handle(route, keyed(busy)))
        assert await blocked_on(looker, holder, 2) == 2  # queued, then sent beside the first
        for caller in (first, second):
            caller.cancel()  # the client hangs up with its claim inside PostgreSQL
            with pytest.raises(asyncio.CancelledError):
                await caller
        await lock.rollback()  # both claims win
        await answered(gateway.drain())
    finally:
        await looker.close()
        await holder.close()
    performed = await store.requests.get(scope, idle)
    assert performed is not None and performed.state == "completed"
    assert len(upstream.requests(idle)) == 1
    for _ in range(int(HANG / 0.05)):  # the release of the claim nobody received follows
        unreceived = await store.requests.get(scope, busy)
        if unreceived is None or unreceived.state != "in_progress":
            break
        await asyncio.sleep(0.05)
    assert unreceived is None
    assert batches("release") == (releases[0] + 1, releases[1] + 1)  # released, by the store
    assert upstream.requests(busy) == []

    replayed = await answered(gateway.handle(route, keyed(idle)))
    assert (replayed.status, replayed.outcome) == (201, "replayed")
    assert len(upstream.requests(idle)) == 1
    forwarded = await answered(gateway.handle(route, keyed(busy)))
    assert (forwarded.status, forwarded.outcome) == (201, "forwarded")
    assert len(upstream.requests(busy)) == 1
    again = await answered(gateway.handle(route, keyed(busy)))
    assert (again.status, again.outcome, again.body) == (201, "replayed", b'{"performed": true}')
    assert len(upstream.requests(busy)) == 1


async def test_claims_and_completes_of_two_gateways_that_cross_never_deadlock(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two gateways (two stores), each completing its own key and claiming the other's (a retry
    meeting the first request's answer) while its claims wait on a key held inside PostgreSQL:
    each complete commits in its own statement meanwhile, the claims wait for the held keys at
    most, and no statement fails (a deadlock PostgreSQL breaks by failing one) and is sent again."""
    gateways = [
        await PostgresStore.connect(database_url, StoreOptions(batch_size=8)) for _ in range(2)
    ]
    holder = await asyncpg.connect(database_url)
    looker = await asyncpg.connect(database_url)
    try:
        # The held keys sort before the crossed ones: each statement's claims wait on them first.
        held = [f"a-{new_key()}" for _ in gateways]
        own = [await claim(gateway, f"b-{new_key()}") for gateway in gateways]
        assert all(isinstance(each, Claim) for each in own)
        lock = holder.transaction()
        await lock.start()
        for key in held:
            await holder.execute(
                "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, "
                "fencing_token, lease_expires_at, expires_at) VALUES ($1, $2, $3, $4, "
                "'in_progress', 1, now() + interval '1 minute', now() + interval '1 hour')",
                ROUTE, SCOPE, key, digest("held"),
            )  # fmt: skip
        claims_before, completes_before = batches("claim"), batches("complete")
        alone = [asyncio.create_task(claim(gateway, new_key())) for gateway in gateways]
        crossed = [
            asyncio.gather(
                claim(gateway, held[index]),
                claim(gateway, own[1 - index].key),  # the other gateway's key
            )
            for index, gateway in enumerate(gateways)
        ]
        completes = [
            asyncio.create_task(
                gateway.requests.complete(own[index], StoredAnswer(201, plaintext([], b"{}")))
            )
            for index, gateway in enumerate(gateways)
        ]
        await answered(asyncio.gather(*alone))
        assert await blocked_on(looker, holder, 2) == 2  # each gateway's two claims, waiting
        assert await answered(asyncio.gather(*completes)) == [True, True]  # meanwhile
        assert not any(each.done() for each in crossed)
        # Each gateway's claim alone, then its two in one; its complete alone.
        assert batches("claim") == (claims_before[0] + 4, claims_before[1] + 6)
        assert batches("complete") == (completes_before[0] + 2, completes_before[1] + 2)
        await lock.rollback()
        for index, (claimed, retried) in enumerate(await answered(asyncio.gather(*crossed))):
            assert isinstance(claimed, Claim) and claimed.key == held[index]
            # The other's row, as the claim's statement read it (its complete may have
            # committed just after that statement began).
            assert isinstance(retried, Record) and retried.id == own[1 - index].id
        failed = [record for record in caplog.records if "sending each operation" in record.msg]
        assert failed == []  # no statement failed (a deadlock) and was sent again piecemeal
    finally:
        await looker.close()
        await holder.close()
        for gateway in gateways:
            await gateway.close()


async def test_settles_nobody_waits_on_send_no_notification_and_a_waited_one_sends_its_own(
    store: PostgresStore, database_url: str
) -> None:
    # A forward on a route with `wait` (bench/run.py's route-wait row) settles a key nobody
    # waits on: nothing may go to the channel the gateways LISTEN on, whatever the settle.
    heard: list[str] = []
    first_heard = asyncio.Event()

    def notified(connection: object, pid: int, channel: str, payload: str) -> None:
        heard.append(payload)
        first_heard.set()

    listener = await asyncpg.connect(database_url)
    try:
        await listener.add_listener("oncegate_settled", notified)
        keys = [new_key() for _ in range(6)]
        claims = [await claim(store, key) for key in keys]
        assert all(isinstance(claimed, Claim) for claimed in claims)
        answer = StoredAnswer(201, plaintext([], b"done"))
        settled = await answered(
            asyncio.gather(  # the first complete alone, the other two queued behind it
                *(store.requests.complete(claimed, answer) for claimed in claims[:3]),
                store.requests.release(claims[3]),
                store.requests.mark_unknown(claims[4]),
            )
        )
        assert settled == [True] * 5
        waited = await store.requests.get(SCOPE, keys[5])
        assert waited is not None and await store.requests.mark_waited(waited)
        assert await store.requests.complete(claims[5], answer)
        # Notifications arrive in the order their transactions committed: one sent for a
        # settle before the waited row's would be heard first.
        await answered(first_heard.wait())
        assert heard == [str(waited.id)]
    finally:
        await listener.close()
