"""The state machine in one process: `decide` for every row of the contract's table (section 4),
and `Gateway.handle`'s laps through the in-memory store, including the races no timing makes
happen on demand against PostgreSQL (a claim that committed while ours ran, a row that changes
hands on every look). The in-memory store passes the PostgreSQL store's conformance suite
(tests/store/test_conformance.py); the upstream is the port's in-process fake
(tests/fake_upstream.py; tests/faults/test_upstream_port.py holds it to the real client's
promises). Every outcome a client can see is in tests/unit/test_outcomes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
from collections.abc import Iterator

import psutil
import pytest

from oncegate import service, settings
from oncegate.kernel import fingerprint, headers, keys
from oncegate.kernel.key_workers import KeyWorkers
from oncegate.kernel.sealing import Sealer, plaintext
from oncegate.model import errors
from oncegate.model.answers import StoredAnswer
from oncegate.model.records import Claim, Record, State
from oncegate.service import (
    Gateway,
    InFlight,
    ProxyRequest,
    Reclaim,
    Refuse,
    Replay,
    TakeOver,
    decide,
)
from oncegate.service.waiting import Wait, WaitingRoom
from oncegate.store.memory import MemoryStore
from oncegate.upstream.client import HttpUpstream
from tests.fake_upstream import FakeUpstream
from tests.faults.conftest import RawUpstream
from tests.helpers import stored as stored_parts

FINGERPRINT = hashlib.sha256(b"the request").digest()
PLAIN = Sealer(None)  # answers stored in plaintext
SCOPE = b"s" * 32
OTHER = hashlib.sha256(b"another request").digest()
REQUEST = fingerprint.Fingerprint(FINGERPRINT)  # a request whose digest is FINGERPRINT


def route(**options: object) -> settings.Route:
    return settings.Route(name="r", match="/", upstream="http://127.0.0.1:9", **options)


def record(state: State, fingerprint: bytes = FINGERPRINT, stored: bool = True) -> Record:
    content = plaintext([("location", "/a/1")], b"{}") if stored else None
    answer = StoredAnswer(201, content) if state == "completed" else None
    return Record(id=1, token=1, key="k", fingerprint=fingerprint, state=state, answer=answer)


@pytest.mark.parametrize("state", ["in_progress", "completed", "unknown"])
def test_a_different_request_under_a_known_key_is_refused_as_reused(state: State) -> None:
    decision = decide(record(state, fingerprint=OTHER), REQUEST, route(), PLAIN, SCOPE)
    assert isinstance(decision, Refuse) and isinstance(decision.error, errors.KeyReused)
    assert decision.error.status_code == 422 and decision.error.outcome == "mismatch"


def test_a_completed_key_is_replayed() -> None:
    decision = decide(record("completed"), REQUEST, route(), PLAIN, SCOPE)
    assert isinstance(decision, Replay)
    assert decision.answer.status == 201
    assert ("idempotent-replayed", "true") in decision.answer.headers
    assert (decision.answer.outcome, decision.answer.blocked) == ("replayed", "replayed")


def test_a_completed_key_whose_answer_was_too_large_is_refused_with_its_status() -> None:
    decision = decide(record("completed", stored=False), REQUEST, route(), PLAIN, SCOPE)
    assert isinstance(decision, Refuse) and isinstance(decision.error, errors.ResponseNotStored)
    assert "201" in decision.error.detail
    assert (decision.error.status_code, decision.error.outcome) == (409, "replayed")


def test_a_key_in_flight_is_409_with_retry_after() -> None:
    decision = decide(record("in_progress"), REQUEST, route(), PLAIN, SCOPE)
    assert isinstance(decision, InFlight) and isinstance(decision.error, errors.RequestInProgress)
    assert decision.error.headers["Retry-After"] == str(service.IN_PROGRESS_RETRY_AFTER)
    assert decision.error.blocked_reason == "in_progress"


def test_an_unknown_key_is_409_without_retry_after_unless_the_route_forwards() -> None:
    decision = decide(record("unknown"), REQUEST, route(), PLAIN, SCOPE)
    assert isinstance(decision, Refuse) and isinstance(decision.error, errors.OutcomeUnknown)
    assert decision.error.status_code == 409 and "Retry-After" not in decision.error.headers
    assert decision.error.blocked_reason == "unknown"
    forwarding = route(on_unknown="forward")
    assert isinstance(decide(record("unknown"), REQUEST, forwarding, PLAIN, SCOPE), TakeOver)


def test_a_key_stored_under_the_byte_rule_is_the_same_request_as_its_own_bytes() -> None:
    """A form body's key stored before forms were canonicalised holds the byte rule's digest
    (`as_bytes`): a retry with the same bytes is replayed, not refused as reused."""
    stored = record("completed", fingerprint=OTHER)
    retry = fingerprint.Fingerprint(FINGERPRINT, as_bytes=OTHER)
    assert isinstance(decide(stored, retry, route(), PLAIN, SCOPE), Replay)
    reordered = fingerprint.Fingerprint(FINGERPRINT, as_bytes=hashlib.sha256(b"x").digest())
    assert isinstance(decide(stored, reordered, route(), PLAIN, SCOPE), Refuse)


@pytest.mark.parametrize("fingerprint", [FINGERPRINT, OTHER])
def test_an_expired_key_is_a_new_key_whatever_was_sent_under_it(fingerprint: bytes) -> None:
    expired = record("expired", fingerprint=fingerprint)
    assert isinstance(decide(expired, REQUEST, route(), PLAIN, SCOPE), Reclaim)


# Laps of Gateway.handle


@pytest.fixture
def upstream() -> FakeUpstream:
    return FakeUpstream()


@pytest.fixture(scope="module")
def upstream_server() -> Iterator[RawUpstream]:
    server = RawUpstream()
    try:
        yield server
    finally:
        server.close()


# What the gateway computes for `request(key)` on a route without scope headers sent.
REQUEST_FINGERPRINT = fingerprint.of_request("POST", "/kept", "", "application/json", b"{}").digest


def scope_of(route: settings.Route) -> bytes:
    return keys.scope(route.name, [[] for _ in route.scope_headers])


def request(key: str) -> ProxyRequest:
    return ProxyRequest(
        method="POST", path="/kept", query="", body=b"{}",
        headers=[("idempotency-key", key), ("content-type", "application/json")],
    )  # fmt: skip


def served_route(**options: object) -> settings.Route:
    return settings.Route(name="r", match="/", upstream="http://upstream.test", **options)


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def claim(self, *args: object, **kwargs: object) -> Claim | Record | None:
        self.calls.append("claim")
        return await super().claim(*args, **kwargs)  # type: ignore[arg-type]

    async def get(self, scope: bytes, key: str) -> Record | None:
        self.calls.append("get")
        return await super().get(scope, key)


async def test_a_new_key_is_claimed_forwarded_and_completed(upstream: FakeUpstream) -> None:
    store = CountingStore()
    answer = await Gateway(store, upstream).handle(served_route(), request("k1"))
    assert (answer.status, answer.outcome) == (201, "forwarded")
    [found] = await store.find("k1", None)
    assert found.state == "completed" and stored_parts(found).status == 201
    assert store.calls == ["claim"]
    assert len(upstream.requests("k1")) == 1


async def test_a_claim_that_committed_while_ours_ran_is_read_and_replayed(
    upstream: FakeUpstream,
) -> None:
    class CommittedMeanwhile(CountingStore):
        # PostgreSQL's claim sees neither its insert nor the row when a concurrent claim
        # commits after the statement's snapshot: it returns nothing, and the row is there.
        async def claim(self, *args: object, **kwargs: object) -> Claim | Record | None:
            if not self.calls:
                self.calls.append("claim")
                winner = await MemoryStore.claim(self, *args, **kwargs)  # type: ignore[arg-type]
                assert isinstance(winner, Claim)
                await self.complete(
                    winner, StoredAnswer(201, plaintext([("location", "/a/1")], b'{"first": true}'))
                )
                return None
            return await super().claim(*args, **kwargs)

    store = CommittedMeanwhile()
    answer = await Gateway(store, upstream).handle(served_route(), request("k2"))
    assert (answer.status, answer.outcome, answer.body) == (201, "replayed", b'{"first": true}')
    assert store.calls == ["claim", "get"]
    assert upstream.requests("k2") == []


async def test_a_key_released_between_claim_and_read_is_claimed_again(
    upstream: FakeUpstream,
) -> None:
    class ReleasedMeanwhile(CountingStore):
        async def claim(self, *args: object, **kwargs: object) -> Claim | Record | None:
            if not self.calls:
                self.calls.append("claim")
                return None  # committed after our snapshot, and released before our read
            return await super().claim(*args, **kwargs)

    store = ReleasedMeanwhile()
    answer = await Gateway(store, upstream).handle(served_route(), request("k3"))
    assert (answer.status, answer.outcome) == (201, "forwarded")
    assert store.calls == ["claim", "get", "claim"]
    assert len(upstream.requests("k3")) == 1


async def test_a_key_that_changes_hands_on_every_look_gives_up_without_forwarding(
    upstream: FakeUpstream,
) -> None:
    class EverChanging(CountingStore):
        async def take_over(self, record: Record, lease: float) -> Claim | None:
            self.calls.append("take_over")
            return None  # another gateway took it first, every time

    store = EverChanging()
    forwarding = served_route(on_unknown="forward")
    claimed = await store.claim("r", scope_of(forwarding), "k4", REQUEST_FINGERPRINT, 600, 600)
    assert isinstance(claimed, Claim) and await store.mark_unknown(claimed)
    gateway = Gateway(store, upstream)
    with pytest.raises(errors.RequestInProgress, match="changed hands"):
        await gateway.handle(forwarding, request("k4"))
    assert store.calls.count("take_over") == service.CLAIM_ATTEMPTS
    assert upstream.requests("k4") == []


async def test_an_unknown_key_on_a_forwarding_route_is_taken_over_and_forwarded(
    upstream: FakeUpstream,
) -> None:
    store = CountingStore()
    gateway = Gateway(store, upstream)
    forwarding = served_route(on_unknown="forward")
    first = await store.claim("r", scope_of(forwarding), "k5", REQUEST_FINGERPRINT, 600, 600)
    assert isinstance(first, Claim) and await store.mark_unknown(first)
    answer = await gateway.handle(forwarding, request("k5"))
    assert (answer.status, answer.outcome) == (201, "forwarded")
    [found] = await store.find("k5", None)
    assert found.state == "completed"
    assert not await store.complete(
        first, StoredAnswer(500, plaintext([], b"late"))
    )  # the old token settles nothing


def waiting(key: str, gone: asyncio.Event | None = None) -> ProxyRequest:
    async def hung_up() -> None:
        assert gone is not None
        await gone.wait()

    plain = request(key)
    return ProxyRequest(
        method=plain.method, path=plain.path, query=plain.query, body=plain.body,
        headers=[*plain.headers, ("prefer", "wait=10")],
        client_gone=hung_up if gone is not None else None,
    )  # fmt: skip


async def test_a_waiting_request_is_woken_by_the_settle_and_replayed(
    upstream: FakeUpstream,
) -> None:
    store = MemoryStore()
    route = served_route()
    first = await store.claim("r", scope_of(route), "w1", REQUEST_FINGERPRINT, 600, 600)
    assert isinstance(first, Claim)
    waiter = asyncio.create_task(Gateway(store, upstream).handle(route, waiting("w1")))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # waiting, not answered 409
    assert await store.complete(
        first, StoredAnswer(201, plaintext([("location", "/a/1")], b"settled"))
    )
    answer = await asyncio.wait_for(waiter, 10)
    assert (answer.status, answer.body, answer.outcome) == (201, b"settled", "replayed")
    assert ("preference-applied", "wait=10") in answer.headers
    assert upstream.requests("w1") == []


async def test_a_waiting_request_whose_client_hangs_up_stops_and_claims_nothing(
    upstream: FakeUpstream,
) -> None:
    store = MemoryStore()
    route = served_route()
    first = await store.claim("r", scope_of(route), "w2", REQUEST_FINGERPRINT, 600, 600)
    assert isinstance(first, Claim)
    gone = asyncio.Event()
    waiter = asyncio.create_task(Gateway(store, upstream).handle(route, waiting("w2", gone)))
    await asyncio.sleep(0.05)
    gone.set()
    with pytest.raises(service.ClientGone):
        await asyncio.wait_for(waiter, 10)
    assert await store.release(first)  # the first claim is untouched, still its owner's
    assert upstream.requests("w2") == []


@pytest.mark.parametrize(
    ("values", "seconds"),
    [
        (["wait=5"], 5),
        (["respond-async, wait=7"], 7),
        (["wait = 3 ; extra"], 3),
        (['wait="4"'], 4),
        (["handling=lenient", "wait=2"], 2),
        (["wait=soon"], None),
        (["wait=-1"], None),
        ([], None),
        # RFC 9111 §1.2.2: too large to hold is 2^31, never ignored (`max_wait` caps it later).
        (["wait=2147483647"], 2147483647),
        (["wait=2147483648"], 2**31),
        (["wait=99999999999"], 2**31),
        (["wait=" + "9" * 5000], 2**31),
        (["wait=0000000000000007"], 7),
        (["wait=0"], 0),
    ],
)
def test_the_wait_preference_is_read_as_rfc_7240_says(
    values: list[str], seconds: int | None
) -> None:
    assert headers.requested_wait(values) == seconds


# A route's `wait` (contract section 10), and the bounds on waiting


async def in_flight(store: MemoryStore, route: settings.Route, key: str) -> Claim:
    first = await store.claim("r", scope_of(route), key, REQUEST_FINGERPRINT, 600, 600)
    assert isinstance(first, Claim)
    return first


async def test_a_route_with_wait_holds_a_duplicate_without_being_asked(
    upstream: FakeUpstream,
) -> None:
    store = MemoryStore()
    route = served_route(wait="10s")
    first = await in_flight(store, route, "rw1")
    waiter = asyncio.create_task(Gateway(store, upstream).handle(route, request("rw1")))
    await asyncio.sleep(0.05)
    assert not waiter.done()  # waiting, not answered 409
    assert await store.complete(first, StoredAnswer(201, plaintext([], b"settled")))
    answer = await asyncio.wait_for(waiter, 10)
    assert (answer.status, answer.body, answer.outcome) == (201, b"settled", "replayed")
    assert not [name for name, _ in answer.headers if name == "preference-applied"]  # not asked
    assert upstream.requests("rw1") == []


async def test_prefer_wait_never_waits_past_a_fractional_max_wait() -> None:
    plain = request("mw1")
    asked = ProxyRequest(plain.method, plain.path, plain.query,
                         [*plain.headers, ("prefer", "wait=10")], plain.body)  # fmt: skip
    wait = Wait.asked(asked, served_route(max_wait="1500ms"), MemoryStore(), WaitingRoom(10, 10))
    assert wait is not None and wait.applied == "wait=1"  # whole seconds, never more than granted
    assert wait._deadline - asyncio.get_running_loop().time() <= 1.5


async def test_prefer_wait_0_answers_at_once_on_a_route_with_wait(upstream: FakeUpstream) -> None:
    store = MemoryStore()
    route = served_route(wait="10s")
    await in_flight(store, route, "rw2")
    plain = request("rw2")
    asked = ProxyRequest(plain.method, plain.path, plain.query,
                         [*plain.headers, ("prefer", "wait=0")], plain.body)  # fmt: skip
    with pytest.raises(errors.RequestInProgress):
        await asyncio.wait_for(Gateway(store, upstream).handle(route, asked), 5)


async def test_past_the_per_key_bound_duplicates_are_answered_409_at_once(
    upstream: FakeUpstream,
) -> None:
    store = MemoryStore()
    route = served_route(wait="10s")
    first = await in_flight(store, route, "rw3")
    gateway = Gateway(store, upstream, waiters=(100, 2))
    copies = [asyncio.create_task(gateway.handle(route, request("rw3"))) for _ in range(5)]
    done, waiting = await asyncio.wait(copies, timeout=2)
    assert len(done) == 3 and len(waiting) == 2  # the three over the bound did not wait
    for refused in done:
        error = refused.exception()
        assert isinstance(error, errors.RequestInProgress)
        assert error.headers["Retry-After"] == str(service.IN_PROGRESS_RETRY_AFTER)
    assert await store.complete(first, StoredAnswer(201, plaintext([], b"settled")))
    for replayed in waiting:
        assert (await asyncio.wait_for(replayed, 10)).outcome == "replayed"
    # The places are free again: the next duplicates wait too.
    second = await in_flight(store, route, "rw4")
    again = [asyncio.create_task(gateway.handle(route, request("rw4"))) for _ in range(2)]
    assert not (await asyncio.wait(again, timeout=0.2))[0]
    assert await store.complete(second, StoredAnswer(201, plaintext([], b"settled")))
    await asyncio.wait_for(asyncio.gather(*again), 10)


async def test_past_the_total_bound_a_duplicate_of_any_key_is_answered_409_at_once(
    upstream: FakeUpstream,
) -> None:
    store = MemoryStore()
    route = served_route(wait="10s")
    claims = [await in_flight(store, route, key) for key in ("rw5", "rw6")]
    gateway = Gateway(store, upstream, waiters=(3, 100))
    copies = [
        asyncio.create_task(gateway.handle(route, request(key)))
        for key in ("rw5", "rw5", "rw6", "rw6")
    ]
    done, waiting = await asyncio.wait(copies, timeout=2)
    assert len(done) == 1 and len(waiting) == 3
    assert isinstance(done.pop().exception(), errors.RequestInProgress)
    for claim in claims:
        assert await store.complete(claim, StoredAnswer(201, plaintext([], b"settled")))
    answers = await asyncio.wait_for(asyncio.gather(*waiting), 10)
    assert {answer.outcome for answer in answers} == {"replayed"}


def test_the_waiting_room_counts_places_in_all_and_per_row() -> None:
    room = WaitingRoom(most=3, most_per_key=2)
    assert room.enter(1) and room.enter(1) and not room.enter(1)
    assert room.enter(2) and not room.enter(3)  # 3 in all
    room.leave(1)
    assert room.enter(3) and room.waiting == 3
    for row in (1, 2, 3):
        room.leave(row)
    assert room.waiting == 0 and room.enter(1) and room.enter(1)


# Where the key is: another header, or a field of the JSON body


def keyed_request(headers_: list[tuple[str, str]], body: bytes = b"{}") -> ProxyRequest:
    return ProxyRequest("POST", "/kept", "", [("content-type", "application/json"), *headers_],
                        body)  # fmt: skip


async def test_a_key_header_route_takes_the_key_there_and_passes_it_upstream(
    upstream_server: RawUpstream, http_upstream: HttpUpstream
) -> None:
    # On a socket: that the client drops what `Connection` names but the key is the real
    # client's doing (upstream.client), which the fake cannot show.
    store = MemoryStore()
    route = settings.Route(
        name="r", match="/", upstream=upstream_server.url, key_header="PayPal-Request-Id"
    )
    gateway = Gateway(store, http_upstream)
    with pytest.raises(errors.MissingKey, match="PayPal-Request-Id"):
        await gateway.handle(route, keyed_request([("idempotency-key", "kh1")]))
    sent = [("paypal-request-id", "kh1"), ("connection", "paypal-request-id")]
    answer = await gateway.handle(route, keyed_request(sent))
    assert answer.outcome == "forwarded"
    # Passed upstream under its name, though the client named it in Connection.
    [forwarded] = [
        seen for seen in upstream_server.received if seen.headers.get("paypal-request-id") == "kh1"
    ]
    assert "connection" not in forwarded.headers
    [found] = await store.find("kh1", None)
    assert found.state == "completed"
    again = await gateway.handle(route, keyed_request(sent))
    assert again.outcome == "replayed"


async def test_a_body_key_route_takes_the_key_from_the_body(upstream: FakeUpstream) -> None:
    store = MemoryStore()
    route = served_route(key_from_body="/payment/idempotency_key")
    gateway = Gateway(store, upstream)
    body = b'{"payment": {"idempotency_key": "kb1", "amount": 1}}'
    assert (await gateway.handle(route, keyed_request([], body))).outcome == "forwarded"
    found = await store.get(scope_of(route), "kb1")
    assert found is not None  # and its fingerprint covers the whole body, key included
    assert (
        found.fingerprint
        == fingerprint.of_request("POST", "/kept", "", "application/json", body).digest
    )
    with pytest.raises(errors.MissingKey, match="/payment/idempotency_key"):
        await gateway.handle(route, keyed_request([("idempotency-key", "kb2")], b'{"a": 1}'))
    with pytest.raises(errors.InvalidKey, match="number"):
        await gateway.handle(route, keyed_request([], b'{"payment": {"idempotency_key": 7}}'))
    optional = served_route(key_from_body="/k", key="optional")
    assert (await gateway.handle(optional, keyed_request([], b"[]"))).outcome == "unprotected"


def key_worker_processes() -> list[psutil.Process]:
    """This process's children that are key workers (`python -m oncegate.kernel.key_workers`)."""
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            if KeyWorkers.__module__ in child.cmdline():
                found.append(child)
    return found


async def test_a_large_body_key_is_found_off_the_event_loop(upstream: FakeUpstream) -> None:
    store = MemoryStore()
    route = served_route(key_from_body="/k")
    body = b'{"k": "kb3", "pad": "' + b"x" * (2 * service.flow.OFF_LOOP_JSON) + b'"}'
    before = {process.pid for process in key_worker_processes()}
    workers = KeyWorkers()  # the gateway's owner closes them, as the runtime does
    try:
        answer = await Gateway(store, upstream, key_workers=workers).handle(
            route, keyed_request([], body)
        )
        assert answer.outcome == "forwarded"
        assert [found.key for found in await store.find("kb3", None)] == ["kb3"]
        started = [process for process in key_worker_processes() if process.pid not in before]
        assert len(started) == 1  # the key was read in a worker process
    finally:
        await workers.close()
    # Closed, the worker has exited: no idle process outlives the gateway until the session ends.
    assert not psutil.wait_procs(started, timeout=10)[1]


async def test_a_shielded_task_outlives_its_caller_and_hands_on_what_it_ends_with() -> None:
    """`Gateway._shielded` (a claim won, forwarded and settled): a caller that stops waiting
    (its client hung up) cuts nothing, and `drain` still waits for the work; a caller that
    waits gets its result or its exception; the loop's cancellation of the work reaches the
    caller. No exception is left unretrieved (the loop would report it)."""
    gateway = Gateway(MemoryStore(), FakeUpstream())
    reported: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
    release = asyncio.Event()
    finished: list[str] = []

    async def work(result: str, failure: Exception | None = None) -> str:
        await release.wait()
        finished.append(result)
        if failure is not None:
            raise failure
        return result

    abandoned = asyncio.ensure_future(gateway._shielded(work("abandoned")))
    failed_for_nobody = asyncio.ensure_future(
        gateway._shielded(work("failed for nobody", RuntimeError("nobody hears this")))
    )
    waited = gateway._shielded(work("waited"))
    failed = gateway._shielded(work("failed", ValueError("the caller hears this")))
    await asyncio.sleep(0)
    for caller in (abandoned, failed_for_nobody):
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
    release.set()
    assert await waited == "waited"
    with pytest.raises(ValueError, match="the caller hears this"):
        await failed
    await gateway.drain()
    assert sorted(finished) == ["abandoned", "failed", "failed for nobody", "waited"]
    assert not gateway._inflight

    cut = gateway._shielded(asyncio.Event().wait())
    await asyncio.sleep(0)
    [task] = gateway._inflight
    task.cancel()  # as the loop's end cancels what is left
    with pytest.raises(asyncio.CancelledError):
        await cut
    await asyncio.sleep(0)
    assert not gateway._inflight
    gc.collect()  # a future whose exception nobody retrieved reports it when collected
    assert reported == []
