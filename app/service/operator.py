"""The operator's side of the keys (contract sections 6 and 9): look up, the queue and its
cursors, release, resolve."""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from ..kernel import headers, keys, sealing
from ..kernel.sealing import Keyring, Sealer
from ..model import errors
from ..model.answers import StoredAnswer
from ..model.records import LISTED_STATES, KeyRecord, Listed, QueuedKey, Record
from ..settings import ROUTE_NAME, Route
from ..telemetry import metrics
from .evidence import KeptRequest
from .flow import Gateway
from .messages import Answer
from .ports import OperatorStore

log = logging.getLogger("oncegate.operator")

# One page of the operator's queue: enough for a screen, small enough to scan quickly.
QUEUE_PAGE_SIZE = 100
QUEUE_MAX_PAGE_SIZE = 1000


class Operator:
    """What an operator may do to keys, for the admin API, its page and `oncegate keys` (contract
    sections 6 and 9): look a key up in every scope, list the queue of keys in a state, release
    a key, or settle an `unknown` one. The rules are here, not in the HTTP layer: a key in
    flight is never released under its request, only an `unknown` key is resolved, and input
    that cannot name a key never reaches the store. With a keyring, the answers it stores
    are sealed and the ones it shows are opened."""

    def __init__(
        self,
        store: OperatorStore,
        keyring: Keyring | None = None,
        gateway: Gateway | None = None,
        routes: Sequence[Route] = (),
    ) -> None:
        self._store = store
        self._sealer = Sealer(keyring)
        # A re-send forwards through the request path's gateway, on the key's route.
        self._gateway = gateway
        self._routes = {route.name: route for route in routes}

    def opened(self, record: KeyRecord) -> tuple[list[tuple[str, str]] | None, bytes | None]:
        """A record's stored headers and body, opened; (None, None) when it has none or they
        cannot be opened; (headers, None) for an answer too large to store whole."""
        if record.answer is None or record.answer.content is None:
            return None, None
        try:
            return self._sealer.open((record.id, record.token), record.scope, record.answer.content)
        except sealing.Unopenable:
            return None, None

    async def queue(
        self,
        state: str,
        route: str | None = None,
        since: datetime | None = None,
        cursor: str | None = None,
        limit: int = QUEUE_PAGE_SIZE,
    ) -> QueuePage:
        """Keys in `state` (the operator's queue: `unknown`), oldest first, one page. The
        cursor is opaque to clients: the (created_at, id) of the last key of a page, so a page
        is never shifted by keys settled or added while an operator reads the one before."""
        listed = _listed(state)
        _check_route(route)
        if since is not None:
            if since.tzinfo is None:
                raise errors.InvalidRequest(
                    "since needs a time zone, e.g. 2026-12-03T06:00:00Z, so it names one moment"
                )
            since = in_utc(since, "since")
        if not 0 < limit <= QUEUE_MAX_PAGE_SIZE:
            raise errors.InvalidRequest(f"limit must be 1 to {QUEUE_MAX_PAGE_SIZE}")
        after = decode_cursor(cursor) if cursor is not None else None
        # One more than asked for says whether another page follows.
        found = await self._store.queue(listed, route, since, after, limit + 1)
        records = found[:limit]
        return QueuePage(records, encode_cursor(records[-1]) if len(found) > limit else None)

    async def end_session(self, session: bytes, expires_at: datetime) -> None:
        """A logout of the operator's page: its session is refused until it expires, by every
        gateway, after a restart too."""
        await self._store.end_session(session, expires_at)

    async def session_ended(self, session: bytes) -> bool:
        return await self._store.session_ended(session)

    async def describe(self, record_id: int) -> QueuedKey:
        found = await self._store.describe(_existing_id(record_id))
        if found is None:
            raise errors.NotFound(f"no key with id {record_id}")
        return found

    async def find(self, key: str, route: str | None) -> list[KeyRecord]:
        if not 0 < len(key) <= keys.MAX_KEY_LENGTH or not (key.isascii() and key.isprintable()):
            raise errors.InvalidRequest(
                f"key must be 1 to {keys.MAX_KEY_LENGTH} printable ASCII characters, as every "
                "Idempotency-Key is"
            )
        _check_route(route)
        return await self._store.find(key, route)

    async def release(self, record_id: int) -> None:
        deleted = await self._store.delete(_existing_id(record_id))
        if deleted is None:
            raise errors.NotFound(f"no key with id {record_id}")
        if not deleted:
            raise errors.KeyInFlight(
                f"key {record_id} has a request in flight; deleting it now would let a retry be "
                "forwarded while the first is still at the upstream. Try again when it has "
                "settled."
            )

    async def kept_request(self, record: KeyRecord) -> KeptRequest | None:
        """The request behind a key, opened; None when none is kept or it cannot be opened."""
        if record.request is None:
            return None
        try:
            return KeptRequest.decode(
                self._sealer.open_request(
                    record.scope, record.key, record.fingerprint, record.request
                )
            )
        except sealing.Unopenable:
            return None

    async def by_id(self, record_id: int) -> KeyRecord:
        found = await self._store.by_id(_existing_id(record_id))
        if found is None:
            raise errors.NotFound(f"no key with id {record_id}")
        return found

    async def resolve(
        self, record_id: int, answer: tuple[int, Sequence[tuple[str, str]], bytes] | None
    ) -> None:
        """Settle an `unknown` key: as completed with `answer` (status, headers, body), or
        released when `answer` is None. Audited: a log line and `oncegate_resolutions_total`."""
        action = "release" if answer is None else "complete"
        try:
            await self._resolve(record_id, answer)
        except errors.GatewayError as error:
            _audit(record_id, action, "refused", error.detail)
            raise
        _audit(record_id, action, "done", "")

    async def resend(self, record_id: int) -> Answer:
        """Re-send the kept request of an `unknown` key once, under the same key, fenced as
        every forward; the key is settled with what comes back, and that answer returned (a
        lost answer again: `OutcomeUnknown`, the key `unknown` again with its request)."""
        try:
            record = await self.by_id(record_id)
            if record.state != "unknown":
                raise errors.KeyNotUnknown(f"key {record_id} is {record.state}, not unknown")
            route = self._routes.get(record.route)
            if route is None or self._gateway is None:
                raise errors.RequestNotKept(
                    f"key {record_id} was claimed on route {record.route!r}, which this gateway "
                    "does not have: nothing was sent"
                )
            kept = await self.kept_request(record)
            if kept is None:
                why = (
                    "its request was not kept (keep_request: never, or claimed before requests "
                    "were kept)"
                    if record.request is None
                    else "its kept request cannot be opened (ONCEGATE_ENCRYPTION_KEYS lacks the "
                    "key that sealed it)"
                )
                raise errors.RequestNotKept(f"key {record_id}: {why}; nothing was sent")
            claimed = Record(record.id, record.token, record.key, b"", "unknown", None)
            answer = await self._gateway.resend(route, kept.to_proxy(), claimed, record.scope)
        except errors.GatewayError as error:
            result = "refused" if error.status_code in (404, 409) else error.outcome.value
            _audit(record_id, "resend", result, error.detail)
            raise
        _audit(record_id, "resend", answer.outcome.value, f"upstream status {answer.status}")
        return answer

    async def _resolve(
        self, record_id: int, answer: tuple[int, Sequence[tuple[str, str]], bytes] | None
    ) -> None:
        record_id = _existing_id(record_id)
        found = await self._store.scope_of(record_id)
        if found is None:
            raise errors.NotFound(f"no key with id {record_id}")
        scope, token = found
        if answer is None:
            settled = await self._store.resolve_released(record_id)
        else:
            status, answer_headers, body = answer
            # Content-Length is recomputed on replay, and credentials are never stored.
            storable = headers.storable(answer_headers)
            # Sealed for the claim the resolution makes: the token it raises the row to.
            sealed = self._sealer.seal((record_id, token + 1), scope, storable, body)
            settled = await self._store.resolve_completed(
                record_id, token, StoredAnswer(status, sealed)
            )
        if not settled:
            raise errors.KeyNotUnknown(f"key {record_id} does not exist or is not in state unknown")


def _audit(record_id: int, action: str, result: str, detail: str) -> None:
    metrics.RESOLUTIONS.labels(action, result).inc()
    log.info(
        "resolution of key %d: %s, %s%s", record_id, action, result, f": {detail}" if detail else ""
    )


@dataclass(frozen=True, slots=True)
class QueuePage:
    records: list[QueuedKey]
    cursor: str | None  # where the next page starts; None on the last page


def _check_route(route: str | None) -> None:
    if route is not None and not ROUTE_NAME.match(route):
        raise errors.InvalidRequest(f"route must be a route name ({ROUTE_NAME.pattern})")


def _listed(state: str) -> Listed:
    for listed in LISTED_STATES:
        if state == listed:
            return listed
    raise errors.InvalidRequest(f"state must be one of {', '.join(LISTED_STATES)}")


def encode_cursor(record: QueuedKey) -> str:
    text = f"{record.created_at.isoformat()}|{record.id}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, int]:
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        moment, _, number = text.partition("|")
        after = (datetime.fromisoformat(moment), int(number))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest(
            "cursor is not one this gateway gave out: pass the `cursor` of the previous page "
            "unchanged"
        ) from None
    if after[0].tzinfo is None or not 0 < after[1] < 2**63:
        raise errors.InvalidRequest("cursor is not one this gateway gave out")
    return in_utc(after[0], "cursor"), after[1]


def in_utc(moment: datetime, what: str) -> datetime:
    """`moment` in UTC, or 400 when it has none: a time within a day of the years 1 or 9999
    (`0001-01-01T00:00:00+05:00`) falls outside them in UTC, and nothing can hold it."""
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise errors.InvalidRequest(
            f"{what} {moment.isoformat()} is outside the years 1 to 9999 in UTC"
        ) from None


def _existing_id(record_id: int) -> int:
    """Row ids are positive 64-bit integers: any other number names no key."""
    if not 0 < record_id < 2**63:
        raise errors.NotFound(f"no key with id {record_id}: key ids are positive 64-bit integers")
    return record_id
