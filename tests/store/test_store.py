"""The PostgreSQL store on a real server: claims, fencing, leases, expiry, purge, constraints."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timedelta, timezone

import asyncpg
import pytest

from oncegate import service
from oncegate.kernel.sealing import Keyring, Unopenable, plaintext
from oncegate.model import errors
from oncegate.model.answers import SealedRequest, StoredAnswer
from oncegate.model.records import Claim, Record
from oncegate.settings import StoreOptions
from oncegate.store.postgres import PostgresStore
from tests.helpers import digest, insert_completed_keys, new_key, stored

ROUTE = "payments"
LEASE = 60.0
TTL = 3600.0


SCOPE = digest("tenant-a")
FINGERPRINT = digest("POST /charges {}")


async def claim(store: PostgresStore, key: str, *, lease: float = LEASE, ttl: float = TTL) -> Claim:
    """Claim a key this test made up: it must be won."""
    claimed = await store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, lease, ttl)
    assert isinstance(claimed, Claim)
    return claimed


async def test_first_claim_wins_and_the_next_one_reads_the_row(store: PostgresStore) -> None:
    key = new_key()
    first = await claim(store, key)
    second = await store.requests.claim(ROUTE, SCOPE, key, digest("another request"), LEASE, TTL)
    assert isinstance(second, Record)
    record = await store.requests.get(SCOPE, key)
    assert record == second
    assert (record.id, record.token) == (first.id, first.token)
    assert record.state == "in_progress"
    assert record.fingerprint == FINGERPRINT  # the first request's, not the second's


async def test_same_key_in_another_scope_is_another_key(store: PostgresStore) -> None:
    key = new_key()
    await claim(store, key)
    other = await store.requests.claim(ROUTE, digest("tenant-b"), key, FINGERPRINT, LEASE, TTL)
    assert isinstance(other, Claim)
    assert await store.requests.get(digest("tenant-c"), key) is None


async def test_many_connections_racing_for_one_key_exactly_one_wins(database_url: str) -> None:
    racers = 40
    store = await PostgresStore.connect(
        database_url, StoreOptions(pool_size=racers), min_size=racers
    )
    try:
        for _ in range(5):
            key = new_key()
            results = await asyncio.gather(
                *(
                    store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, LEASE, TTL)
                    for _ in range(racers)
                )
            )
            winners = [result for result in results if isinstance(result, Claim)]
            assert len(winners) == 1
            # Every loser learns who holds the key, in the same statement or by reading it.
            for result in results:
                if isinstance(result, Record):
                    assert (result.id, result.token) == (winners[0].id, winners[0].token)
    finally:
        await store.close()


async def test_complete_stores_the_answer_and_only_for_the_token_holder(
    store: PostgresStore,
) -> None:
    key = new_key()
    owner = await claim(store, key)
    stale = Claim(owner.id, owner.token - 1, owner.key)
    assert not await store.requests.complete(stale, StoredAnswer(500, plaintext([], b"wrong")))
    headers = [("content-type", "application/json"), ("location", "/charges/1")]
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext(headers, b'{"id": 1}')))
    record = await store.requests.get(SCOPE, key)
    assert record is not None
    assert record.state == "completed"
    assert stored(record) == (201, headers, b'{"id": 1}', True)
    # A completed key cannot be completed or released again, even by its owner.
    assert not await store.requests.complete(owner, StoredAnswer(500, plaintext([], b"again")))
    assert not await store.requests.release(owner)


@pytest.mark.citus  # rekey reads and writes back a batch in each dialect's own statements
async def test_an_answer_too_large_to_store_keeps_its_headers_sealed_and_rekeyed(
    store: PostgresStore, db: asyncpg.Connection
) -> None:
    old = Keyring([("k1", bytes(range(32)))])
    newer = Keyring([("k2", bytes(range(1, 33))), ("k1", bytes(range(32)))])
    sealed_key, plain_key = new_key(), new_key()
    receipt = [("x-receipt", "r-1")]
    sealed_owner, plain_owner = await claim(store, sealed_key), await claim(store, plain_key)
    too_large = StoredAnswer(200, old.seal((sealed_owner.id, sealed_owner.token), SCOPE,
                                           receipt, None))  # fmt: skip
    assert await store.requests.complete(sealed_owner, too_large)
    assert await store.requests.complete(plain_owner, StoredAnswer(200, plaintext(receipt, None)))

    async def columns(key: str) -> asyncpg.Record:
        return await db.fetchrow(
            "SELECT response_status, response_stored, response_body, response_headers,"
            " sealed_with, sealed_headers FROM oncegate_keys WHERE key = $1",
            key,
        )

    # What the store holds: the status and the headers, sealed or plaintext; no body.
    row = await columns(sealed_key)
    assert (row["response_status"], row["response_stored"], row["response_body"]) == (
        200, False, None,
    )  # fmt: skip
    assert (row["sealed_with"], row["response_headers"]) == ("k1:2", None)
    assert b"r-1" not in row["sealed_headers"]
    row = await columns(plain_key)
    assert (row["response_stored"], row["response_body"], row["sealed_with"]) == (False, None, None)
    assert row["response_headers"] == '[["x-receipt", "r-1"]]'

    # `oncegate rekey` re-seals the headers of both under the newest key, the body still none.
    after, done = 0, False
    while not done:
        batch = await store.rekeying.rekey(newer, 100, after)
        after, done = batch.last, batch.done
    for key in (sealed_key, plain_key):
        row = await columns(key)
        assert (row["sealed_with"], row["response_headers"], row["response_body"]) == (
            "k2:2", None, None,
        )  # fmt: skip
        (record,) = await store.operator.find(key, None)
        assert record.answer is not None and not record.answer.stored
        assert record.answer.content is not None
        claim_of = (record.id, record.token)
        assert newer.open(claim_of, SCOPE, record.answer.content) == (receipt, None)


async def test_release_deletes_the_row_and_the_key_can_be_claimed_again(
    store: PostgresStore,
) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert not await store.requests.release(Claim(owner.id, owner.token + 1, owner.key))
    assert await store.requests.release(owner)
    assert await store.requests.get(SCOPE, key) is None
    again = await claim(store, key)
    # A new row: the released claim names the old one, so it can settle nothing here.
    assert again.id != owner.id
    assert not await store.requests.complete(
        owner, StoredAnswer(500, plaintext([], b"from the released claim"))
    )
    assert not await store.requests.release(owner)


async def test_replays_commit_no_transaction(store: PostgresStore, db: asyncpg.Connection) -> None:
    """A replay's claim statement finds the row and takes no transaction id, so it never waits
    for a WAL flush. (Sequences drawn by the conflicting insert once made one replay in 16
    commit a transaction: migration 0004.)"""
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"{}")))
    before = await db.fetchval("SELECT pg_current_xact_id()")
    for _ in range(200):
        found = await store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, LEASE, TTL)
        assert isinstance(found, Record) and found.state == "completed"
    after = await db.fetchval("SELECT pg_current_xact_id()")
    # Our own two probes take one id each; anything the replays took would show in between.
    assert int(after) - int(before) <= 2


async def test_the_owner_of_a_claim_whose_lease_ran_out_may_still_settle_it(
    store: PostgresStore,
) -> None:
    # Which state such a key is in is the rule's (tests/store/test_state_rule.py); that its
    # late owner's answer is still taken is the settle's: it is real information.
    key = new_key()
    owner = await claim(store, key, lease=0.2)
    await asyncio.sleep(0.4)
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"late")))
    record = await store.requests.get(SCOPE, key)
    assert record is not None and (record.state, stored(record).body) == ("completed", b"late")


async def test_take_over_fences_off_the_previous_owner(store: PostgresStore) -> None:
    key = new_key()
    owner = await claim(store, key)
    record = await store.requests.get(SCOPE, key)
    assert record is not None
    # A live in-flight claim cannot be taken over.
    assert await store.requests.take_over(record, LEASE) is None
    assert await store.requests.mark_unknown(owner)
    record = await store.requests.get(SCOPE, key)
    assert record is not None and record.state == "unknown"
    successor = await store.requests.take_over(record, LEASE)
    assert successor is not None and successor.token > owner.token
    # Only one of two gateways taking over the same unknown key succeeds.
    assert await store.requests.take_over(record, LEASE) is None
    assert not await store.requests.complete(
        owner, StoredAnswer(500, plaintext([], b"from the lost owner"))
    )
    assert not await store.requests.release(owner)
    assert await store.requests.complete(
        successor, StoredAnswer(201, plaintext([], b"from the new owner"))
    )
    record = await store.requests.get(SCOPE, key)
    assert record is not None and stored(record).body == b"from the new owner"


async def test_an_expired_key_is_reclaimed_once_as_a_new_claim(store: PostgresStore) -> None:
    key = new_key()
    owner = await claim(store, key, lease=0.1, ttl=0.3)
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"old")))
    await asyncio.sleep(0.5)
    record = await store.requests.get(SCOPE, key)
    assert record is not None and record.state == "expired"
    new_fingerprint = digest("another request")
    results = await asyncio.gather(
        *(
            store.requests.reclaim_expired(record, ROUTE, new_fingerprint, LEASE, TTL)
            for _ in range(5)
        )
    )
    winners = [result for result in results if result is not None]
    assert len(winners) == 1
    fresh = await store.requests.get(SCOPE, key)
    assert fresh is not None
    assert (fresh.state, fresh.fingerprint) == ("in_progress", new_fingerprint)
    assert fresh.answer is None
    assert not await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"stale")))


async def test_an_expired_key_still_in_flight_is_not_reclaimed(
    store: PostgresStore, db: asyncpg.Connection
) -> None:
    key = new_key()
    owner = await claim(store, key, lease=60.0, ttl=120.0)
    record = await store.requests.get(SCOPE, key)
    assert record is not None
    # Pretend the TTL passed while the lease still runs: the in-flight claim must survive.
    await db.execute(
        "UPDATE oncegate_keys SET created_at = now() - interval '2 hours',"
        " expires_at = now() - interval '1 second' WHERE id = $1",
        owner.id,
    )
    in_flight = await store.requests.get(SCOPE, key)
    assert in_flight is not None and in_flight.state == "in_progress"  # the lease comes first
    assert await store.requests.reclaim_expired(record, ROUTE, FINGERPRINT, LEASE, TTL) is None
    assert await store.upkeep.purge(100) == 0
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"done")))


async def test_store_errors_become_store_unavailable() -> None:
    with pytest.raises(errors.StoreUnavailable):
        await PostgresStore.connect("postgresql://nobody@127.0.0.1:1/none")


@pytest.mark.parametrize("refused", ["moment", "nul"])
async def test_a_value_the_store_refuses_is_bad_input_never_an_outage(
    store: PostgresStore, refused: str, caplog: pytest.LogCaptureFixture
) -> None:
    # What the layers above check first, sent straight to the store: the driver cannot put
    # 0001-01-01T00:00:00+05:00 in UTC (its DataError), PostgreSQL refuses a NUL (class 22).
    with pytest.raises(errors.StoreRefusedValue):
        if refused == "moment":
            edge = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))
            await store.operator.queue("unknown", None, edge, None, 10)
        else:
            await store.operator.find("a\x00b", None)
    assert not store.outage.down
    assert "unavailable" not in caplog.text
    assert await store.operator.find(new_key(), None) == []  # and the store goes on


# Rows the gateway never writes, each with the check that refuses it: a column's type (a domain,
# migration 0013), `key`'s own check (the distribution column on Citus), or a check across
# columns. tests/store/test_citus_schema.py sends the same rows to a Citus cluster.
INSERT_ROW = (
    "INSERT INTO {table} ({id}route, scope, key, fingerprint, state, fencing_token,"
    " lease_expires_at, expires_at, response_status)"
    " VALUES ({given}$1, $2, $3, $4, $5, 1, now(), now() + interval '1h', $6)"
)
BAD_ROWS = [
    ((ROUTE, SCOPE, "k" * 256, FINGERPRINT, "in_progress", None), "oncegate_keys_key_check"),
    ((ROUTE, SCOPE, "", FINGERPRINT, "in_progress", None), "oncegate_keys_key_check"),
    (("r" * 65, SCOPE, "route-long", FINGERPRINT, "in_progress", None), "oncegate_route_length"),
    (("", SCOPE, "route-empty", FINGERPRINT, "in_progress", None), "oncegate_route_length"),
    ((ROUTE, SCOPE, "state", FINGERPRINT, "done", None), "oncegate_state_known"),
    ((ROUTE, b"short", "scope", FINGERPRINT, "in_progress", None), "oncegate_sha256_length"),
    ((ROUTE, SCOPE, "fingerprint", b"short", "in_progress", None), "oncegate_sha256_length"),
    ((ROUTE, SCOPE, "status-low", FINGERPRINT, "completed", 99), "oncegate_status_http"),
    ((ROUTE, SCOPE, "status-high", FINGERPRINT, "completed", 600), "oncegate_status_http"),
    ((ROUTE, SCOPE, "no-status", FINGERPRINT, "completed", None),
     "oncegate_keys_completed_has_status"),
]  # fmt: skip


def insert_row(table: str = "oncegate_keys", shard: bool = False) -> str:
    """INSERT_ROW into `table`; into a Citus shard table, which has no identity, with an id."""
    return INSERT_ROW.format(table=table, id="id, " if shard else "", given="1, " if shard else "")


async def refusals(
    db: asyncpg.Connection, table: str = "oncegate_keys", shard: bool = False
) -> list[tuple[str, str]]:
    """Each of BAD_ROWS inserted into `table`: (SQLSTATE, the constraint its error names)."""
    found = []
    for row, _ in BAD_ROWS:
        with pytest.raises(asyncpg.PostgresError) as refused:
            await db.execute(insert_row(table, shard), *row)
        named = re.search(r'constraint "(\w+)"', str(refused.value))
        found.append((refused.value.sqlstate, named.group(1) if named else str(refused.value)))
    return found


async def test_constraints_refuse_what_the_gateway_never_writes(
    db: asyncpg.Connection,
) -> None:
    assert await refusals(db) == [("23514", constraint) for _, constraint in BAD_ROWS]
    good = (ROUTE, SCOPE, new_key(), FINGERPRINT, "in_progress", None)
    await db.execute(insert_row(), *good)
    with pytest.raises(asyncpg.UniqueViolationError):
        await db.execute(insert_row(), *good)


async def test_purge_deletes_expired_keys_in_batches_and_nothing_else(
    store: PostgresStore, db: asyncpg.Connection
) -> None:
    await db.execute("DELETE FROM oncegate_keys")
    await insert_completed_keys(db, 2500, "now() - interval '1 day'", prefix="expired-")
    await claim(store, new_key())
    assert await service.purge_expired(store.upkeep, batch_size=1000, pause=0) == 2500
    assert await db.fetchval("SELECT count(*) FROM oncegate_keys") == 1
    assert await service.purge_expired(store.upkeep, batch_size=1000, pause=0) == 0


async def test_take_over_keeps_the_key_alive_for_its_lease(
    store: PostgresStore, db: asyncpg.Connection
) -> None:
    key = new_key()
    owner = await claim(store, key, lease=0.2, ttl=1.0)
    assert await store.requests.mark_unknown(owner)
    record = await store.requests.get(SCOPE, key)
    assert record is not None
    assert await store.requests.take_over(record, 30.0) is not None
    # Taken over shortly before its TTL: it must not expire while the new attempt is in flight.
    assert await db.fetchval(
        "SELECT expires_at > lease_expires_at FROM oncegate_keys WHERE key = $1", key
    )


async def test_a_kept_request_of_an_earlier_claim_written_back_does_not_open(
    store: PostgresStore,
) -> None:
    # Sealed like answers: an answer is bound to its claim, a kept request (written by the
    # claim's insert, before the row has an id) to its scope, key and request's fingerprint. The
    # key expired and was claimed again for another request; someone with write access to the
    # table puts the earlier claim's sealed request back into the row: it must not open, or an
    # operator's re-send would forward the earlier request under the key.
    ring = Keyring([("k1", bytes(range(32)))])
    key, earlier, now = new_key(), digest("amount=100000"), digest("amount=5")
    first = await store.requests.claim(
        ROUTE, SCOPE, key, earlier, 0.1, 0.2, ring.seal_request(SCOPE, key, earlier, b"100000")
    )
    assert isinstance(first, Claim)
    (row,) = await store.operator.find(key, None)
    written_back = row.request
    assert written_back is not None
    await asyncio.sleep(0.3)  # expired
    expired = await store.requests.claim(ROUTE, SCOPE, key, now, LEASE, TTL)
    assert isinstance(expired, Record)
    again = await store.requests.reclaim_expired(
        expired, ROUTE, now, LEASE, TTL, ring.seal_request(SCOPE, key, now, b"5")
    )
    assert isinstance(again, Claim)
    (record,) = await store.operator.find(key, None)
    assert record.fingerprint == now and record.request is not None
    assert ring.open_request(SCOPE, key, record.fingerprint, record.request) == b"5"
    with pytest.raises(Unopenable):
        ring.open_request(SCOPE, key, record.fingerprint, written_back)
    assert await store.requests.release(again)  # no kept request left for other tests' rekey


async def test_kept_requests_are_sealed_rekeyed_and_purged_with_their_keys(
    store: PostgresStore, database_url: str
) -> None:
    old = Keyring([("k1", bytes(range(32)))])
    newer = Keyring([("k2", bytes(range(1, 33))), ("k1", bytes(range(32)))])
    key, plain_key = new_key(), new_key()
    data, fingerprint = b"POST /charges {card: tok_visa}", digest("r")
    sealed = old.seal_request(SCOPE, key, fingerprint, data)
    assert data not in sealed.data and old.open_request(SCOPE, key, fingerprint, sealed) == data
    with pytest.raises(Unopenable):
        # Moved to another key: it does not open.
        old.open_request(SCOPE, plain_key, fingerprint, sealed)
    owner = await store.requests.claim(ROUTE, SCOPE, key, fingerprint, LEASE, TTL, sealed)
    plain = await store.requests.claim(
        ROUTE, SCOPE, plain_key, digest("r"), 0.1, 0.3, SealedRequest(None, data)
    )
    assert isinstance(owner, Claim) and isinstance(plain, Claim)

    remaining = await store.rekeying.rekey_remaining(newer)  # the table's, these two among them
    resealed = await store.rekeying.rekey_requests(newer, 100, 0)
    assert (resealed.resealed, resealed.unopenable) == (2, [])
    assert (
        remaining - await store.rekeying.rekey_remaining(newer) == 2
    )  # kept requests count as left
    (record,) = await store.operator.find(key, None)
    assert record.request is not None and record.request.key_name == "k2:f"
    assert record.fingerprint == fingerprint
    assert newer.open_request(SCOPE, key, fingerprint, record.request) == data
    assert (
        await store.rekeying.rekey_requests(newer, 100, 0)
    ).resealed == 0  # nothing left under k1

    # The TTL and the purger take a kept request with its key.
    await asyncio.sleep(0.5)
    while await store.upkeep.purge(100):
        pass
    assert await store.operator.find(plain_key, None) == []
    connection = await asyncpg.connect(database_url)
    try:
        assert (
            await connection.fetchval(
                "SELECT count(*) FROM oncegate_keys WHERE key = $1", plain_key
            )
            == 0
        )
    finally:
        await connection.close()
