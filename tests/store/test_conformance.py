"""One suite, two stores: the PostgreSQL store and the in-memory one keep the same promises.

The in-memory store exists for in-process tests of the state machine (tests/unit/
test_gateway.py, tests/unit/test_outcomes.py); this suite is what makes those tests say
something about the real one.
Waits here only let a lease or a TTL run out (it can only run out more under load); nothing
asserts how long anything took.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from prometheus_client import REGISTRY

from oncegate import service
from oncegate.kernel.sealing import plaintext
from oncegate.model import errors
from oncegate.model.answers import SealedRequest, StoredAnswer
from oncegate.model.records import Claim, Listed, Record
from oncegate.service.ports import OperatorStore, RequestStore, UpkeepStore
from oncegate.store.checkpoints import PostgresCheckpoints
from oncegate.store.memory import MemoryStore
from oncegate.store.postgres import ROOMS, PostgresStore
from oncegate.store.postgres.operator import OperatorQueries
from oncegate.store.postgres.requests import RequestPath
from oncegate.store.postgres.upkeep import Upkeep
from tests.helpers import digest, new_key, stored

ROUTE = "conformance"
SCOPE = hashlib.sha256(b"conformance scope").digest()
OTHER_SCOPE = hashlib.sha256(b"another scope").digest()
LONG = 600.0  # a lease or TTL that cannot run out during a test


FINGERPRINT = digest("the request")


@dataclass(frozen=True)
class Ports:
    """One store's ports, as the composition root hands them out: the PostgreSQL store's rooms,
    or the in-memory store three times."""

    requests: RequestStore
    upkeep: UpkeepStore
    operator: OperatorStore


# The PostgreSQL store runs on the embedded PostgreSQL and on a Citus cluster (`backend`).
pytestmark = pytest.mark.citus


@pytest.fixture(params=["postgres", "memory"])
async def store(
    request: pytest.FixtureRequest, backend: str, database_url: str
) -> AsyncIterator[Ports]:
    if request.param == "memory":
        if backend != "postgresql":
            pytest.skip("the in-memory store has no database: it runs once, beside postgresql")
        memory = MemoryStore()
        yield Ports(memory, memory, memory)
        return
    postgres = await PostgresStore.connect(database_url)
    try:
        yield Ports(postgres.requests, postgres.upkeep, postgres.operator)
    finally:
        await postgres.close()


async def claim(store: Ports, key: str, lease: float = LONG, ttl: float = LONG) -> Claim:
    claimed = await store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, lease, ttl)
    assert isinstance(claimed, Claim)
    return claimed


async def record(store: Ports, key: str) -> Record:
    found = await store.requests.get(SCOPE, key)
    assert found is not None
    return found


async def test_the_first_claim_wins_and_the_next_reads_the_row(store: Ports) -> None:
    key = new_key()
    first = await claim(store, key)
    second = await store.requests.claim(ROUTE, SCOPE, key, digest("another request"), LONG, LONG)
    assert isinstance(second, Record)
    assert (second.id, second.token, second.state) == (first.id, first.token, "in_progress")
    assert second.fingerprint == FINGERPRINT  # the first request's


async def test_of_many_concurrent_claims_one_wins(store: Ports) -> None:
    key = new_key()
    results = await asyncio.gather(
        *(store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, LONG, LONG) for _ in range(20))
    )
    assert len([result for result in results if isinstance(result, Claim)]) == 1


async def test_the_same_key_in_another_scope_is_another_key(store: Ports) -> None:
    key = new_key()
    await claim(store, key)
    other = await store.requests.claim(ROUTE, OTHER_SCOPE, key, FINGERPRINT, LONG, LONG)
    assert isinstance(other, Claim)


async def test_a_completed_key_holds_its_answer(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.complete(
        owner, StoredAnswer(201, plaintext([("location", "/a/1")], b'{"id": 1}'))
    )
    found = await record(store, key)
    assert found.state == "completed"
    assert stored(found) == (201, [("location", "/a/1")], b'{"id": 1}', True)


async def test_an_answer_too_large_to_store_keeps_its_status_and_headers(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    too_large = StoredAnswer(201, plaintext([("location", "/a/1")], None))
    assert not too_large.stored
    assert await store.requests.complete(owner, too_large)
    found = await record(store, key)
    assert (found.state, stored(found)) == ("completed", (201, [("location", "/a/1")], None, False))


async def test_an_earlier_release_s_answer_too_large_to_store_keeps_its_status(
    store: Ports,
) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.complete(owner, StoredAnswer(201, None))
    found = await record(store, key)
    assert (found.state, stored(found)) == ("completed", (201, None, None, False))


async def test_release_deletes_the_key_and_the_next_claim_wins(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.release(owner)
    assert await store.requests.get(SCOPE, key) is None
    assert isinstance(await store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, LONG, LONG), Claim)


async def test_a_superseded_token_settles_nothing(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.mark_unknown(owner)
    found = await record(store, key)
    assert found.state == "unknown"
    new_owner = await store.requests.take_over(found, LONG)
    assert new_owner is not None and new_owner.token > owner.token
    assert not await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"stale")))
    assert not await store.requests.release(owner)
    assert not await store.requests.mark_unknown(owner)
    assert await store.requests.complete(new_owner, StoredAnswer(201, plaintext([], b"fresh")))
    assert stored(await record(store, key)).body == b"fresh"


async def test_a_take_over_needs_the_token_it_read(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.mark_unknown(owner)
    found = await record(store, key)
    assert await store.requests.take_over(found, LONG) is not None
    assert await store.requests.take_over(found, LONG) is None  # the token moved on


async def test_only_an_unknown_key_is_taken_over(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.take_over(await record(store, key), LONG) is None  # in flight
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"done")))
    assert await store.requests.take_over(await record(store, key), LONG) is None  # completed


async def test_a_claim_whose_lease_ran_out_is_unknown_and_taken_over_once(store: Ports) -> None:
    # Section 4's "a gateway died mid-flight and its lease ran out", through each store's own
    # statements (on Citus: the claim function on the worker, the reads and the take-over on
    # the coordinator); the rule's every cell is tests/store/test_state_rule.py's.
    key = new_key()
    dead = await claim(store, key, lease=0.1)
    await asyncio.sleep(0.3)
    again = await store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, LONG, LONG)
    assert isinstance(again, Record) and again.state == "unknown"
    found = await record(store, key)
    assert found.state == "unknown"
    results = await asyncio.gather(*(store.requests.take_over(found, LONG) for _ in range(5)))
    taken = [result for result in results if result is not None]
    assert len(taken) == 1
    assert not await store.requests.complete(
        dead, StoredAnswer(201, plaintext([], b"late"))
    )  # fenced off
    assert await store.requests.complete(taken[0], StoredAnswer(201, plaintext([], b"again")))
    settled = await record(store, key)
    assert (settled.state, stored(settled).body) == ("completed", b"again")


async def test_an_expired_key_reads_expired_and_is_reclaimed_once(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key, lease=0.1, ttl=0.3)
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"old")))
    await asyncio.sleep(0.5)
    found = await record(store, key)
    assert found.state == "expired"
    results = await asyncio.gather(
        *(store.requests.reclaim_expired(found, ROUTE, digest("new"), LONG, LONG) for _ in range(5))
    )
    assert len([result for result in results if result is not None]) == 1
    fresh = await record(store, key)
    assert (fresh.state, fresh.fingerprint, fresh.answer) == ("in_progress", digest("new"), None)
    assert not await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"stale")))


async def test_purge_deletes_expired_keys_only(store: Ports) -> None:
    kept, gone = new_key(), new_key()
    await claim(store, kept)
    owner = await claim(store, gone, lease=0.1, ttl=0.3)
    assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"old")))
    await asyncio.sleep(0.5)
    purged = 0
    while deleted := await store.upkeep.purge(100):
        purged += deleted
    assert purged >= 1
    assert await store.requests.get(SCOPE, gone) is None
    assert (await record(store, kept)).state == "in_progress"


async def test_an_operator_settles_or_releases_only_unknown_keys(store: Ports) -> None:
    settled, released, in_flight = new_key(), new_key(), new_key()
    for key in (settled, released):
        assert await store.requests.mark_unknown(await claim(store, key))
    busy = await claim(store, in_flight)
    settled_id, released_id = (await record(store, settled)).id, (await record(store, released)).id
    assert await store.operator.scope_of(settled_id) == (SCOPE, 1)
    stale = plaintext([], b"sealed for another token")
    assert not await store.operator.resolve_completed(
        settled_id, 2, StoredAnswer(201, stale)
    )  # the token moved on
    assert await store.operator.resolve_completed(
        settled_id, 1, StoredAnswer(201, plaintext([("x-a", "b")], b"found"))
    )
    assert not await store.operator.resolve_completed(
        settled_id, 2, StoredAnswer(201, plaintext([], b"twice"))
    )  # completed now
    found = await record(store, settled)
    assert (found.state, stored(found).body, found.token) == ("completed", b"found", 2)
    assert await store.operator.resolve_released(released_id)
    assert await store.requests.get(SCOPE, released) is None
    assert not await store.operator.resolve_released(busy.id)
    assert not await store.operator.resolve_completed(
        busy.id, 1, StoredAnswer(201, plaintext([], b""))
    )
    assert await store.operator.delete(busy.id) is False  # its request is in flight
    assert await store.operator.delete(settled_id) is True
    assert await store.operator.delete(settled_id) is None
    assert [row.key for row in await store.operator.find(in_flight, None)] == [in_flight]
    assert await store.operator.find(in_flight, "another-route") == []


async def test_a_renewal_runs_the_lease_again_for_the_token_holder_in_flight_only(
    store: Ports,
) -> None:
    key = new_key()
    owner = await claim(store, key)
    assert await store.requests.renew(owner, 0.1)  # its lease now runs out in 0.1 s, not in LONG
    await asyncio.sleep(0.3)
    assert (await record(store, key)).state == "unknown"
    assert not await store.requests.renew(owner, LONG)  # ran out: a key once unknown stays so
    assert (await record(store, key)).state == "unknown"
    taken = await store.requests.take_over(await record(store, key), LONG)
    assert taken is not None
    assert not await store.requests.renew(owner, LONG)  # the token moved on
    assert await store.requests.renew(taken, LONG)
    assert (await record(store, key)).state == "in_progress"
    assert await store.requests.complete(taken, StoredAnswer(201, plaintext([], b"done")))
    assert not await store.requests.renew(taken, LONG)  # settled
    assert (await record(store, key)).state == "completed"


async def test_a_settle_wakes_the_watch_of_a_row_marked_waited(store: Ports) -> None:
    for settle in ("complete", "release", "mark_unknown"):
        key = new_key()
        owner = await claim(store, key)
        watch = store.requests.watch(owner.id)
        try:
            assert await store.requests.mark_waited(await record(store, key))
            if settle == "complete":
                assert await store.requests.complete(
                    owner, StoredAnswer(201, plaintext([], b"done"))
                )
            else:
                assert await getattr(store.requests, settle)(owner)
            assert await watch.wait(10), settle
        finally:
            watch.close()


async def test_only_an_in_flight_claim_can_be_waited_on(store: Ports) -> None:
    key = new_key()
    owner = await claim(store, key)
    found = await record(store, key)
    assert await store.requests.mark_waited(found)
    assert await store.requests.mark_unknown(owner)
    assert not await store.requests.mark_waited(found)  # settled
    taken = await store.requests.take_over(await record(store, key), LONG)
    assert taken is not None
    assert not await store.requests.mark_waited(found)  # another claim now (its token moved on)
    assert await store.requests.mark_waited(await record(store, key))


async def test_a_settle_of_a_row_nobody_waits_on_wakes_no_one(store: Ports) -> None:
    # First a watched settle, so that the listening connection is up and has caught up.
    await test_a_settle_wakes_the_watch_of_a_row_marked_waited(store)
    key = new_key()
    owner = await claim(store, key)
    watch = store.requests.watch(owner.id)
    try:
        assert await store.requests.complete(owner, StoredAnswer(201, plaintext([], b"done")))
        assert not await watch.wait(0.5)  # nothing was sent: the waiter would poll instead
    finally:
        watch.close()


async def test_the_queue_lists_a_state_oldest_first_with_how_keys_turned_unknown(
    store: Ports,
) -> None:
    route = "queue-" + new_key()[:8]  # the listing is by route: this test's keys only

    async def claimed(lease: float = LONG) -> Claim:
        owner = await store.requests.claim(route, SCOPE, new_key(), FINGERPRINT, lease, LONG)
        assert isinstance(owner, Claim)
        return owner

    lost = await claimed()
    assert await store.requests.mark_unknown(lost)  # its gateway saw the answer lost
    abandoned = await claimed(lease=0.1)  # its gateway "died": nobody settles it
    done = await claimed()
    assert await store.requests.complete(done, StoredAnswer(201, plaintext([], b"done")))
    busy = await claimed()
    await asyncio.sleep(0.3)  # the abandoned lease runs out

    unknown = await store.operator.queue("unknown", route, None, None, 10)
    assert [(entry.id, entry.cause) for entry in unknown] == [
        (lost.id, "answer_lost"),
        (abandoned.id, "lease_expired"),
    ]
    assert unknown[0].created_at <= unknown[1].created_at
    assert unknown[0].lease_expires_at is None  # a marked key keeps no lease
    assert unknown[1].lease_expires_at is not None  # when the abandoned lease ran out
    assert all(entry.state == "unknown" and entry.status is None for entry in unknown)
    (completed,) = await store.operator.queue("completed", route, None, None, 10)
    assert (completed.id, completed.status, completed.cause) == (done.id, 201, None)
    (in_flight,) = await store.operator.queue("in_progress", route, None, None, 10)
    assert (in_flight.id, in_flight.cause) == (busy.id, None)

    first = unknown[0]
    assert await store.operator.queue("unknown", route, None, None, 1) == [first]
    after_first = await store.operator.queue(
        "unknown", route, None, (first.created_at, first.id), 10
    )
    assert after_first == unknown[1:]
    assert (
        await store.operator.queue("unknown", route, unknown[1].created_at, None, 10) == unknown[1:]
    )
    assert await store.operator.queue("unknown", route + "-other", None, None, 10) == []
    assert await store.operator.describe(abandoned.id) == unknown[1]
    assert await store.operator.describe(2**62) is None


async def test_counting_keys_by_pages_misses_none_and_counts_none_twice(
    store: Ports,
) -> None:
    owners = [await claim(store, new_key()) for _ in range(3)]
    assert await store.requests.mark_unknown(owners[0])
    assert await store.requests.complete(owners[1], StoredAnswer(201, plaintext([], b"")))
    # Page by page in id order, two rows a page: every row once. (Ids only grow per node on
    # Citus, where each worker hands out ids from a range of its own: walk them all.)
    ids: list[int] = []
    after = 0
    while (page := await store.upkeep.count_keys(after, 2)).last_id is not None:
        assert 1 <= page.rows <= 2 and page.last_id > after
        ids.append(page.last_id)
        after = page.last_id
    assert page.rows == 0
    assert ids == sorted(set(ids)) and max(owner.id for owner in owners) <= ids[-1]
    ours = sorted(owner.id for owner in owners)
    one_by_one = [await store.upkeep.count_keys(record_id - 1, 1) for record_id in ours]
    assert [(page.last_id, page.rows) for page in one_by_one] == [(id_, 1) for id_ in ours]
    assert {
        state: sum(page.counts[state] for page in one_by_one) for state in one_by_one[0].counts
    } == {"in_progress": 1, "completed": 1, "unknown": 1}

    # The sweep's totals, in pages of two, are the same as in pages of a million: one page of
    # everything on PostgreSQL; on Citus, where a page is a range of ids, one per worker's.
    whole = await service.count_keys(store.upkeep, page_size=10**6, pause=0)
    totals = await service.count_keys(store.upkeep, page_size=2, pause=0)
    assert totals == whole
    for state, count in totals.items():
        assert REGISTRY.get_sample_value("oncegate_keys", {"state": state}) == count


async def test_one_store_per_database_takes_the_key_count_and_every_one_hears_it(
    database_url: str,
) -> None:
    # Two gateway processes' stores on one database: the first to try holds the key count's
    # lock (on its listening connection) and keeps it; the other is refused while it does, and
    # takes it once the holder's session ends. An announcement reaches the gauge through the
    # listening connection (both stores here set this one process's gauge).
    first = await PostgresStore.connect(database_url)
    second = await PostgresStore.connect(database_url)
    open_ = [first, second]
    try:
        assert await first.upkeep.take_key_count()
        assert not await second.upkeep.take_key_count()
        assert await first.upkeep.take_key_count()
        assert not await second.upkeep.take_key_count()
        announced: dict[Listed, int] = {"in_progress": 1001, "completed": 1002, "unknown": 1003}
        await first.upkeep.publish_key_count(announced)
        for _ in range(200):  # a deadline only: the NOTIFY arrives in a few milliseconds
            shown = {state: REGISTRY.get_sample_value("oncegate_keys", {"state": state})
                     for state in announced}  # fmt: skip
            if shown == announced:
                break
            await asyncio.sleep(0.05)
        assert shown == announced

        await open_.pop(0).close()
        for _ in range(200):  # the server ends the holder's session, and its lock, by itself
            if await second.upkeep.take_key_count():
                break
            await asyncio.sleep(0.05)
        assert await second.upkeep.take_key_count()
    finally:
        for store in open_:
            await store.close()


def public_coroutines(kind: type) -> dict[str, Any]:
    found = {}
    for name, member in vars(kind).items():
        function = member.__func__ if isinstance(member, classmethod) else member
        if not name.startswith("_") and name != "close" and inspect.iscoroutinefunction(function):
            found[name] = function
    return found


@pytest.mark.parametrize("kind", [*ROOMS, PostgresCheckpoints])
def test_every_method_that_talks_to_postgresql_translates_driver_errors(kind: type) -> None:
    # Wearing `store.errors.translated` is what keeps asyncpg's exceptions inside store/.
    for name, function in public_coroutines(kind).items():
        assert getattr(function, "store_operation", None), f"{kind.__name__}.{name}"


def test_the_postgres_store_relays_nothing_and_each_port_is_one_room() -> None:
    # The service calls a room's own method (each wears `translated`, above): the store only
    # opens and closes its rooms, and each port the composition root hands out is one of them.
    assert set(public_coroutines(PostgresStore)) == {"connect"}
    for port, room in (
        (RequestStore, RequestPath),
        (UpkeepStore, Upkeep),
        (OperatorStore, OperatorQueries),
    ):
        wanted = {name for name in vars(port) if not name.startswith("_")}
        assert wanted and wanted <= set(dir(room)), (port.__name__, wanted - set(dir(room)))
        assert room in ROOMS


async def test_a_refused_connection_is_store_unavailable() -> None:
    with pytest.raises(errors.StoreUnavailable, match="cannot connect to PostgreSQL"):
        await PostgresStore.connect("postgresql://nobody@127.0.0.1:1/none")


async def test_the_request_behind_a_key_is_kept_until_it_completes(
    store: Ports,
) -> None:
    kept = SealedRequest(None, b"the request\x00\xff")
    lost, settled = new_key(), new_key()
    owners = []
    for key in (lost, settled):
        owner = await store.requests.claim(ROUTE, SCOPE, key, FINGERPRINT, LONG, LONG, kept)
        assert isinstance(owner, Claim)
        owners.append(owner)
    seen = '{"kind": "read_timeout", "bytes_received": 0}'
    assert await store.requests.mark_unknown(owners[0], seen)
    assert await store.requests.complete(owners[1], StoredAnswer(201, plaintext([], b"done")))

    (unknown,) = await store.operator.find(lost, None)
    assert (unknown.state, unknown.request) == ("unknown", kept)
    assert unknown.failure is not None and json.loads(unknown.failure) == json.loads(seen)
    assert unknown.claimed_by is not None and json.loads(unknown.claimed_by)["pid"] > 0
    assert await store.operator.by_id(unknown.id) == unknown
    (completed,) = await store.operator.find(settled, None)
    assert (completed.request, completed.claimed_by) == (None, None)
    assert await store.operator.by_id(2**62) is None
    # A take-over is a new claim: who holds it now, and nothing seen yet; the request stays.
    taken = await store.requests.take_over(await record(store, lost), LONG)
    assert taken is not None
    (again,) = await store.operator.find(lost, None)
    assert (again.state, again.request, again.failure) == ("in_progress", kept, None)
