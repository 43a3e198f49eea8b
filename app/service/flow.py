"""The gateway's state machine (contract sections 4 and 5): claim -> forward -> settle.

Read `Gateway.handle` top to bottom:
1. A method not under control, or a missing key on a `key: optional` route, is forwarded
   untouched and nothing is stored.
2. Otherwise the key is parsed (from `Idempotency-Key`, the route's `key_header`, or the JSON
   body's field at `key_from_body`), its scope and the request's fingerprint computed, and the key
   claimed with one insert, which returns the existing row instead when there is one (one round
   trip either way). The unique constraint decides who owns it.
3. The owner forwards the request with no transaction open, then settles the key with its
   fencing token: `completed` with the answer, released (row deleted) when nothing was sent or the
   upstream asked for a retry, or `unknown` when the request may have been performed but the
   answer was lost. A token that was superseded settles nothing.
4. Anyone else gets the row, and `decide` (pure, no I/O) says what to do with it: an expired
   row is reclaimed as a new key; a different fingerprint is a reused key (422); a completed key
   is replayed; an in-flight one is 409 with Retry-After; an `unknown` one (including a claim
   whose lease ran out because its gateway died) is 409 until resolved, or with
   `on_unknown: forward` is taken over with a new token and forwarded again. A reclaim or a
   take-over that finds the row changed since it was read looks again, a few times at most.

Changing the lease rule (when an in-flight claim counts as abandoned) safely: the rule lives in
one SQL function, `oncegate_key_is` (as it is now: migrations/schema.sql; change it with a new
migration and that file), which every write tests and `oncegate_key_state`, through which every
read and the admin API name a state, asks; `decide` acts on the state a read returns and never
on the clock. `tests/store/test_state_rule.py` holds the rule
as a table and runs it through the SQL function and its Python twin (`store.memory.key_state`)
on one clock, cell by cell.
A route's lease must outlive its upstream timeout (`settings.Route`): shorter, and a slow but
live request would read as `unknown`, and be taken over under `on_unknown: forward`.

The forward and settlement of a claim won run in a task of their own, shielded from the request:
a client that hangs up does not cancel them, so the retry finds the answer stored. A claim that
would be sent alone (`RequestStore.claims_idle`) runs in that task too, before the forward, and
the store sends a lone statement of that task in the task itself, without a task of its own; a
claim that would queue behind a statement in flight waits in the request's task, and the store's
batch task carries it (and settles it, if won for a caller that stopped waiting). Either way a
claim in flight is never cut short. So a client that hangs up while its claim waits inside
PostgreSQL has its request forwarded (the claim went from the shielded task) or the key
released (it queued), and its retry replayed or forwarded once: never performed twice. `drain`
waits for every such task at shutdown, and for the pumps of answers relayed as they come
(`streaming`), cutting those still relayed a grace period after the stop began. If PostgreSQL
is unreachable at claim time the request is refused (503) and never forwarded; if it fails at
settle time the caller still gets its answer and the key turns `unknown` when its lease runs
out: the safe direction.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar, assert_never

from ..kernel import fingerprint, headers, keys
from ..kernel.key_workers import KeyWorkers
from ..kernel.sealing import Keyring, Sealer
from ..model import errors, reach
from ..model.answers import SealedRequest, StoredAnswer
from ..model.outcomes import Outcome
from ..model.records import Claim, Record
from ..settings import DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY, Route
from ..telemetry import metrics
from ..upstream import AnswerLost, NotSent, Upstream, UpstreamResponse
from . import evidence
from .decision import IN_PROGRESS_RETRY_AFTER, InFlight, Reclaim, Refuse, Replay, TakeOver, decide
from .messages import Answer, ProxyRequest
from .ports import RequestStore
from .routing import upstream_url
from .streaming import SHUTDOWN, Broken, Reading, Relay
from .tokens import Identities
from .waiting import PREFERENCE_APPLIED, Wait, WaitingRoom

log = logging.getLogger("oncegate.service")

Done = TypeVar("Done")

# Claim, read, claim again: the row can change between two statements (released, expired, taken
# over). Each lap means another request made progress, so a few laps are plenty.
CLAIM_ATTEMPTS = 5
# Bodies larger than this are fingerprinted in a worker thread; smaller ones hash in well under
# a millisecond, less than handing them to a thread costs.
OFF_LOOP_BODY = 1024 * 1024
# A key in a JSON body larger than this is read in a worker process (`key_workers`): parsing JSON
# holds the interpreter about 85 ms per MiB, in a thread as much as on the event loop; up to
# this size it is a few milliseconds (fingerprint.CANONICAL_JSON_LIMIT says the same of the
# fingerprint's canonical form), less than the trip to a worker.
OFF_LOOP_JSON = fingerprint.CANONICAL_JSON_LIMIT
DEFAULT_WAITERS = (DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITERS_PER_KEY)
EXAMPLE_KEY = "8e03978e-40d5-43e8-bc93-6894a57f9324"
# A re-send's answers that release its key, beside the route's release_statuses: the upstream
# refused the kept credentials, so nothing was performed (`Gateway.resend`).
RESEND_REFUSALS = frozenset({401, 403})


class Gateway:
    def __init__(
        self,
        store: RequestStore,
        upstream: Upstream,
        keyring: Keyring | None = None,
        waiters: tuple[int, int] = DEFAULT_WAITERS,
        key_workers: KeyWorkers | None = None,
        identities: Identities | None = None,
    ) -> None:
        self._store = store
        # Where keys of large JSON bodies are read; its owner closes it (the runtime does).
        self._key_workers = key_workers or KeyWorkers()
        # Who a route's verified tokens say the client is (`scope_jwt`); its owner starts and
        # closes it (the runtime does).
        self._identities = identities or Identities()
        self._upstream = upstream
        # Seals every stored answer when a keyring is set (ONCEGATE_ENCRYPTION_KEYS).
        self._sealer = Sealer(keyring)
        # The shielded tasks (`_shielded`): claims, forwards and settles, whoever waits for them.
        self._inflight: set[asyncio.Task[Any]] = set()
        # The pumps of answers relayed as they come (`_relay`), each with its reading: each
        # settles its key at the end.
        self._pumps: dict[asyncio.Task[None], Reading] = {}
        # Past the grace period of a shutdown: answers still relayed are cut (`stop_relaying`).
        self._cutting = False
        self._cut_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unopenable_logged: set[str] = set()
        # Who waits for a key in flight, at most `waiters` (in all, on one key).
        self._waiting = WaitingRoom(*waiters)

    async def handle(self, route: Route, request: ProxyRequest) -> Answer:
        if request.method not in route.methods:
            return await self._forward_unprotected(route, request, Outcome.PASSTHROUGH)
        key = await _key(route, request, self._key_workers)
        if key is None:
            if route.key == "optional":
                return await self._forward_unprotected(route, request, Outcome.UNPROTECTED)
            raise errors.MissingKey(_missing_key(route, request.method))
        # A route's `scope_jwt` adds who its verified token says the client is (or refuses).
        identity = await self._identities.scope_part(
            route, request.header_values(route.scope_jwt.header) if route.scope_jwt else []
        )
        scope = keys.scope(
            route.name, [request.header_values(name) for name in route.scope_headers] + identity
        )
        digest = await _fingerprint(request)
        kept = None
        if route.keep_request != "never":
            encoded = evidence.KeptRequest.of(route, request).encode()
            kept = self._sealer.seal_request(scope, key, digest.digest, encoded)
        wait = Wait.asked(request, route, self._store, self._waiting)
        try:
            answer = await self._claim_or_answer(route, request, scope, key, digest, wait, kept)
        except errors.GatewayError as error:
            if wait is not None and wait.used and wait.applied:
                error.headers[PREFERENCE_APPLIED] = wait.applied
            raise
        finally:
            if wait is not None:
                wait.end(route)
        if wait is not None and wait.used and wait.applied:
            answer.headers = [*answer.headers, (PREFERENCE_APPLIED, wait.applied)]
        return answer

    async def _claim_or_answer(
        self,
        route: Route,
        request: ProxyRequest,
        scope: bytes,
        key: str,
        digest: fingerprint.Fingerprint,
        wait: Wait | None,
        kept: SealedRequest | None,
    ) -> Answer:
        laps = 0
        while laps < CLAIM_ATTEMPTS:
            claiming = self._claim_and_forward(route, request, scope, key, digest, kept)
            if self._store.claims_idle():
                # Sent alone at once: from the task that forwards, without one of the store's.
                found = await self._shielded(claiming)
            else:
                # Queued behind a statement in flight: awaited here, a task for a winner only.
                found = await claiming
            if isinstance(found, Answer):
                return found  # claimed, forwarded and settled
            if found is None:
                # Held by a claim that committed while ours ran: read it now.
                found = await self._store.get(scope, key)
            match found:
                case None:
                    laps += 1
                    continue  # and already released: claim again
                case Record():
                    decision = decide(found, digest, route, self._sealer, scope)
                case _:
                    assert_never(found)
            match decision:
                case Replay(answer):
                    return answer
                case Refuse(error):
                    self._log_sealed(error)
                    raise error
                case InFlight(error):
                    if wait is not None and await wait.until_settled(found, scope, key):
                        continue  # it settled (or changed): answer as if we came after it
                    raise error
                case Reclaim():
                    claimed = await self._store.reclaim_expired(
                        found, route.name, digest.digest, route.lease_seconds, route.ttl, kept
                    )
                case TakeOver():
                    claimed = await self._store.take_over(found, route.lease_seconds)
                case _:
                    assert_never(decision)
            if claimed is None:
                laps += 1
                continue  # it changed since we read it: look again
            return await self._forward_protected(route, request, claimed, scope)
        raise errors.RequestInProgress(
            "this idempotency key changed hands several times while we looked at it; retry",
            headers={"Retry-After": str(IN_PROGRESS_RETRY_AFTER)},
        )

    def _log_sealed(self, error: errors.GatewayError) -> None:
        """Say once per key name that stored answers cannot be opened: an operator must add
        the key; every retry meanwhile gets 503 answer-sealed."""
        if isinstance(error, errors.AnswerSealed) and error.key_name not in self._unopenable_logged:
            self._unopenable_logged.add(error.key_name)
            log.error("stored answers sealed with key %r cannot be opened: %s", error.key_name,
                      error.reason)  # fmt: skip

    async def _claim_and_forward(
        self,
        route: Route,
        request: ProxyRequest,
        scope: bytes,
        key: str,
        digest: fingerprint.Fingerprint,
        kept: SealedRequest | None,
    ) -> Answer | Record | None:
        """Claim the key and, when the claim wins it, forward and settle: the answer; otherwise
        what the claim found (the row that holds the key, or None). Run shielded
        (`_shielded`), or in the caller's task, where the store's batch task carries the claim
        and settles one won for nobody; either way a claim in flight is never cut short, and a
        claim won for a caller still waiting is forwarded and settled, shielded."""
        found = await self._store.claim(
            route.name, scope, key, digest.digest, route.lease_seconds, route.ttl, kept
        )
        if not isinstance(found, Claim):
            return found
        if reach.SHIELDED.get():
            return await self._forward_and_settle(route, request, found, scope)
        return await self._forward_protected(route, request, found, scope)

    async def _forward_protected(
        self, route: Route, request: ProxyRequest, claim: Claim, scope: bytes
    ) -> Answer:
        return await self._shielded(self._forward_and_settle(route, request, claim, scope))

    def _shielded(self, work: Coroutine[Any, Any, Done]) -> Awaitable[Done]:
        """Run `work` in a task of its own, shielded from the caller: a client that hangs up
        (or a caller that cancels) stops waiting for it, never cancels it; `drain` waits for
        it. The task says so in its context (`reach.SHIELDED`), so the store sends a lone
        statement of it in the task itself rather than in one of its own."""
        loop = self._loop
        if loop is None:  # the first request's; kept (asking costs a getpid() on Python 3.11)
            loop = self._loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        context.run(reach.SHIELDED.set, True)
        task = loop.create_task(work, context=context)
        self._inflight.add(task)
        # What `asyncio.shield(task)` gives the caller, with one future and one callback where
        # the shield added a second callback to the task and one to its own future (about
        # 1.4 µs a shielded task on this machine: docs/performance.md, "Smaller cuts"). The
        # caller that stops waiting cancels `outer` alone; the task runs on.
        outer: asyncio.Future[Done] = loop.create_future()
        task.add_done_callback(functools.partial(self._forget, outer))
        return outer

    def _forget(self, outer: asyncio.Future[Any], task: asyncio.Task[Any]) -> None:
        self._inflight.discard(task)
        if task.cancelled():
            if not outer.done():
                outer.cancel()  # the loop's end: the caller, if it still waits, is cut too
            return
        # Retrieved either way, so an answer nobody waits for (the client hung up) is not
        # reported as "never retrieved"; the store already holds what matters.
        failure = task.exception()
        if outer.done():
            return  # its caller stopped waiting
        if failure is None:
            outer.set_result(task.result())
        else:
            outer.set_exception(failure)

    def stop_relaying(self, grace: float) -> None:
        """The gateway is stopping: in `grace` seconds, cut every answer still relayed (an
        endless stream would hold the shutdown for ever), and any whose head comes later. Each
        settles as `streaming` says. A forward still waiting for its head is left to finish:
        the route's timeout bounds it."""
        if self._cut_timer is None:
            self._cut_timer = asyncio.get_running_loop().call_later(grace, self._cut)

    def _cut(self) -> None:
        self._cutting = True
        for reading in list(self._pumps.values()):
            reading.stop(SHUTDOWN)

    async def drain(self, grace: float | None = None) -> None:
        """Wait for every forward in flight to finish and be settled; answers still relayed
        `grace` seconds after the gateway was told to stop (`stop_relaying`, or now) are cut
        (None: none is cut here)."""
        if grace is not None:
            self.stop_relaying(grace)
        while self._inflight or self._pumps:
            await asyncio.gather(*self._inflight, *self._pumps, return_exceptions=True)
        if self._cut_timer is not None:
            self._cut_timer.cancel()

    async def _forward_and_settle(
        self, route: Route, request: ProxyRequest, claim: Claim, scope: bytes
    ) -> Answer:
        try:
            response = await self._send(route, request)
        except NotSent as exc:
            await self._settle("release", self._store.release(claim))
            raise errors.UpstreamUnavailable(
                f"the upstream of route {route.name!r} could not be reached; nothing was sent, "
                "the key was released, and a retry with the same key is safe"
            ) from exc
        except AnswerLost as exc:
            seen = evidence.failure(exc)
            await self._settle("mark_unknown", self._store.mark_unknown(claim, seen))
            raise errors.OutcomeUnknown(
                f"the upstream of route {route.name!r} received the request but its answer was "
                f"{'not back in time' if exc.timed_out else 'lost'}; it may have been performed. "
                + (
                    "A retry with the same key is forwarded again (the route's on_unknown)"
                    if route.forwards_unknown
                    else "Retries get 409 until an operator resolves the key"
                ),
                status=504 if exc.timed_out else 502,
                retry=route.forwards_unknown,
            ) from exc
        if response.stream is not None:
            released = response.status in route.release_statuses
            outcome = Outcome.RELEASED if released else Outcome.FORWARDED
            return self._relay(route, response, outcome, claim, scope)
        kept = [response.body] if len(response.body) <= route.max_stored_response else None
        await self._settle_answer(route, response, claim, scope, kept)
        released = response.status in route.release_statuses
        return _answer(response, Outcome.RELEASED if released else Outcome.FORWARDED)

    async def resend(
        self, route: Route, request: ProxyRequest, record: Record, scope: bytes
    ) -> Answer:
        """Forward the kept request of an `unknown` key once more, under the same key: the key
        is taken over with a new fencing token, as every forward claims it, and settled with
        what comes back (an operator's re-send). `KeyNotUnknown` when it is not `unknown` any
        more (another re-send or retry took it)."""
        claim = await self._store.take_over(record, route.lease_seconds)
        if claim is None:
            raise errors.KeyNotUnknown(
                f"key {record.id} is no longer in state unknown: nothing was sent"
            )
        # The kept request carries the credentials of its first attempt, which may have expired
        # since: an upstream that refuses them performed nothing, and storing its 401 would
        # answer the client's own retry (with fresh credentials, in the same scope) with it.
        refused = route.release_statuses | RESEND_REFUSALS
        answer = await self._forward_protected(
            route.model_copy(update={"release_statuses": refused}), request, claim, scope
        )
        if answer.stream is not None:  # the operator gets it whole, up to what is stored
            body = bytearray()
            try:
                async for chunk in answer.stream:
                    if len(body) < route.max_stored_response:
                        body += chunk[: route.max_stored_response - len(body)]
            except Broken:
                raise errors.OutcomeUnknown(
                    "the re-sent request's answer broke off: the key is unknown again",
                    status=502,
                ) from None
            answer.body, answer.stream = bytes(body), None
        return answer

    async def _forward_unprotected(
        self, route: Route, request: ProxyRequest, outcome: Outcome
    ) -> Answer:
        try:
            response = await self._send(route, request)
        except NotSent as exc:
            raise errors.UpstreamUnavailable(
                f"the upstream of route {route.name!r} could not be reached"
            ) from exc
        except AnswerLost as exc:
            raise errors.OutcomeUnknown(
                f"the upstream of route {route.name!r} did not answer"
                f"{' in time' if exc.timed_out else ''}",
                status=504 if exc.timed_out else 502,
            ) from exc
        if response.stream is not None:
            return self._relay(route, response, outcome, None, b"")
        return _answer(response, outcome)

    def _relay(
        self,
        route: Route,
        response: UpstreamResponse,
        outcome: Outcome,
        claim: Claim | None,
        scope: bytes,
    ) -> Answer:
        """The answer, its body relayed as it comes by a pump of its own (`streaming`), which
        settles `claim` when the body ends, breaks or is cut (an unprotected forward has none)."""
        stream = response.stream
        assert stream is not None
        relay = Relay(route.timeout)
        # A copy for the store only of a body it will hold: not of one stored as its status
        # (`store: status_only`), nor of an answer whose status releases the key.
        copying = route.store == "full" and response.status not in route.release_statuses
        limit = route.max_stored_response if claim is not None else None
        reading = Reading(stream, limit, copying, route.ttl)
        relay.when_abandoned(reading.let_go)
        pump = asyncio.get_running_loop().create_task(
            self._pump(route, response, claim, scope, relay, reading)
        )
        self._pumps[pump] = reading
        pump.add_done_callback(self._pump_done)
        if self._cutting:
            reading.stop(SHUTDOWN)  # its head came after the grace period: nothing is relayed
        answer = _answer(response, outcome)
        answer.stream = relay
        return answer

    def _pump_done(self, pump: asyncio.Task[None]) -> None:
        reading = self._pumps.pop(pump, None)
        if reading is not None:
            reading.forget()

    async def _pump(
        self,
        route: Route,
        response: UpstreamResponse,
        claim: Claim | None,
        scope: bytes,
        relay: Relay,
        reading: Reading,
    ) -> None:
        renewing = None
        if claim is not None:
            renew = self._renew(route, claim, response.duration)
            renewing = asyncio.get_running_loop().create_task(renew)
        try:
            await self._relay_body(route, response, claim, scope, relay, reading, renewing)
        except Exception:  # a bug: the client's copy must not look complete, nor hang
            log.exception("route %s: relaying an answer failed unexpectedly", route.name)
            relay.abandon()
        finally:
            if renewing is not None:
                renewing.cancel()

    async def _renew(self, route: Route, claim: Claim, waited: float) -> None:
        """Keep the claim's lease running while its answer is relayed (and read on for the store
        after its client left, `streaming.Reading`): a lease that ran out would make the key
        `unknown` (a retry told so, or sent again under `on_unknown: forward`) while its first
        answer is still arriving. The lease has run since the claim, `waited` (the upstream's
        time to the head) and a little more ago: the first renewal comes a third of the lease
        after the forward began, at once if the head took longer (it comes within the route's
        timeout, which the lease exceeds), then every third of the lease."""
        lease = route.lease_seconds
        pause = max(0.0, lease / 3 - waited)
        while True:
            await asyncio.sleep(pause)
            pause = lease / 3
            try:
                renewed = await self._store.renew(claim, lease)
            except errors.StoreUnavailable:
                log.warning(
                    "route %s: could not renew the lease of a key whose answer is still relayed: "
                    "the store is unavailable; trying again",
                    route.name,
                )
                continue
            if not renewed:
                log.warning(
                    "route %s: could not renew the lease of a key whose answer is still relayed: "
                    "it was settled or taken over",
                    route.name,
                )
                return

    async def _relay_body(
        self,
        route: Route,
        response: UpstreamResponse,
        claim: Claim | None,
        scope: bytes,
        relay: Relay,
        reading: Reading,
        renewing: asyncio.Task[None] | None,
    ) -> None:
        stream = response.stream
        assert stream is not None
        try:
            async for chunk in stream:
                reading.take(chunk)
                await relay.put(chunk)
                if reading.cut is not None:
                    break
        except AnswerLost as exc:
            if reading.cut is None:  # not ours: the upstream's answer broke off
                log.warning("route %s: %s %s: the answer broke off after %d bytes: %s",
                            route.name, response.status, route.upstream, exc.received,
                            exc)  # fmt: skip
                if renewing is not None:
                    renewing.cancel()
                if claim is not None:
                    seen = evidence.failure(exc)
                    await self._settle("mark_unknown", self._store.mark_unknown(claim, seen))
                await relay.end(Broken())
                return
        except BaseException:
            stream.close()
            raise
        if renewing is not None:
            renewing.cancel()  # the answer is whole, or cut: the settle does not need the lease
        if reading.cut is not None:
            await relay.end(await self._settle_cut(route, response, claim, scope, reading))
        elif claim is not None:
            await self._settle_answer(route, response, claim, scope, reading.kept)
            await relay.end()
        else:
            await relay.end()

    async def _settle_cut(
        self,
        route: Route,
        response: UpstreamResponse,
        claim: Claim | None,
        scope: bytes,
        reading: Reading,
    ) -> Broken:
        """Settle the key of an answer the gateway stopped reading (`Reading.cut`) as what is
        known of it, and say so to its client, if one is still there."""
        why = reading.cut
        assert why is not None
        log.info("route %s: %s %s: stopped reading the answer after %d bytes: %s",
                 route.name, response.status, route.upstream, reading.received, why)  # fmt: skip
        said = f"the gateway stopped relaying the answer: {why}"
        if claim is None or response.status in route.release_statuses or not reading.storable:
            # Nothing of it would have been stored beyond its status and headers: settled as
            # if it had been read to its end.
            if claim is not None:
                await self._settle_answer(route, response, claim, scope, reading.kept)
            return Broken(said, unknown=False)
        seen = evidence.cut(why, response.status, reading.received)
        await self._settle("mark_unknown", self._store.mark_unknown(claim, seen))
        return Broken(said, unknown=True)

    async def _settle_answer(
        self,
        route: Route,
        response: UpstreamResponse,
        claim: Claim,
        scope: bytes,
        kept: list[bytes] | None,
    ) -> None:
        """Settle `claim` with the upstream's whole answer, read whole or relayed: released for a
        release status, else completed with its status, headers and the body `kept` (None: too
        large to store, the status and headers only; none on a `status_only` route)."""
        if response.status in route.release_statuses:
            await self._settle("release", self._store.release(claim))
            return
        body: bytes | None = None  # past max_stored_response: the status and headers only
        if route.store != "full":
            body = b""  # a route that keeps no body replays none, whatever the answer's size
        elif kept is not None:
            body = b"".join(kept)
        content = self._sealer.seal(
            (claim.id, claim.token), scope, headers.storable(response.headers), body
        )
        stored = StoredAnswer(response.status, content)
        await self._settle("complete", self._store.complete(claim, stored))

    async def _send(self, route: Route, request: ProxyRequest) -> UpstreamResponse:
        inflight = metrics.labelled(metrics.INFLIGHT, route.name)
        inflight.inc()
        url = upstream_url(route, request.path, request.query)
        try:
            response = await self._upstream.send(
                request.method, url, request.headers, request.body, route.timeout,
                route.key_header_name,
            )  # fmt: skip
        except (NotSent, AnswerLost) as exc:
            # The address is for the operator's log; the client's answer names the route only.
            log.warning(
                "route %s: %s %s: %s: %s",
                route.name, request.method, route.upstream, type(exc).__name__, exc,
            )  # fmt: skip
            raise
        finally:
            inflight.dec()
        metrics.labelled(metrics.UPSTREAM_REQUEST_DURATION, route.name).observe(response.duration)
        return response

    async def _settle(self, operation: str, settlement: Awaitable[bool]) -> None:
        """Run a store write after the upstream answered. The caller gets the upstream's answer
        whatever happens here: it was performed, and hiding it would only cause a retry."""
        try:
            settled = await settlement
        except errors.StoreUnavailable:
            log.error(
                "could not %s a key after the upstream answered: the store is unavailable; "
                "the key turns unknown when its lease runs out",
                operation,
            )
            return
        except errors.StoreRefusedValue as exc:
            log.error(
                "could not %s a key after the upstream answered: the store refused a value of "
                "the answer (%s); the key turns unknown when its lease runs out",
                operation,
                exc.detail,
            )
            return
        if not settled:
            log.warning(
                "could not %s a key: its claim was taken over (fencing token superseded)",
                operation,
            )


async def _key(route: Route, request: ProxyRequest, workers: KeyWorkers) -> str | None:
    """The request's key, where its route says it is; None when it has none."""
    pointer = route.key_pointer
    if pointer is None:
        return keys.parse(request.header_values(route.key_header_name), route.key_header_shown)
    arguments = (request.body, pointer, route.key_from_body or "")
    if len(request.body) <= OFF_LOOP_JSON:
        return keys.from_body(*arguments)
    return await workers.from_body(*arguments)


def _missing_key(route: Route, method: str) -> str:
    if route.key_from_body is not None:
        return (
            f"{method} requests on route {route.name!r} carry their key in the JSON body, as "
            f"the string at {route.key_from_body}; this body has none there, or is not JSON"
        )
    header = route.key_header_shown
    return (
        f"{method} requests on route {route.name!r} carry their key in the {header} header, "
        f'e.g. {header}: "{EXAMPLE_KEY}"'
    )


async def _fingerprint(request: ProxyRequest) -> fingerprint.Fingerprint:
    # The two headers the fingerprint reads, in one pass over the request's headers: the first
    # Content-Type, and every Content-Encoding line (their codings in order).
    content_type: str | None = None
    codings: list[str] = []
    for name, value in request.headers:
        if name == "content-type":
            if content_type is None:
                content_type = value
        elif name == "content-encoding":
            codings.append(value)
    arguments = (
        request.method,
        request.path,
        request.query,
        content_type,
        request.body,
        ", ".join(codings) or None,
    )
    if len(request.body) <= OFF_LOOP_BODY:
        return fingerprint.of_request(*arguments)
    # SHA-256 releases the GIL over large buffers, so a worker thread hashes a large body
    # without holding up the requests on the event loop (10 MiB: about 10 ms of hashing).
    return await asyncio.to_thread(fingerprint.of_request, *arguments)


def _answer(response: UpstreamResponse, outcome: Outcome) -> Answer:
    return Answer(
        status=response.status,
        headers=response.headers,
        body=response.body,
        outcome=outcome,
        upstream_seconds=response.duration,
    )
