"""The admin port (contract section 6): metrics, health, and the admin API over the key store.

The admin API answers 404 problem `admin-disabled` unless `ONCEGATE_ADMIN_TOKEN` is set, and 401
`unauthorized` for a missing or wrong bearer token; the token is compared in constant time.
A body is read only after the token was checked, and never past its bound (`read_bounded`): the
admin port shares its process with the proxy, so whoever can reach it must not be able to make
the gateway hold what they send.
Bodies are shown only when asked for (`?body=1`), and stored headers never hold credentials (the
proxy never stores them). Every error is a problem (`errors`), like the proxy port's; input that
cannot name a key (an id beyond 64 bits, a NUL in a key) is 400 or 404, never a store error.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
from datetime import datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError, model_validator

from .. import service
from ..kernel import headers
from ..model import errors
from ..model.records import Cause, KeyRecord, QueuedKey, State
from ..service import Operator
from ..service.evidence import masked
from ..service.messages import Answer
from ..settings import DEFAULT_BODY_LIMIT, Settings
from ..telemetry import metrics as app_metrics
from .deps import RuntimeDep
from .proxy import ClientDisconnected, read_body

# Room in a resolution for everything but its body: action, status, headers, JSON punctuation.
RESOLUTION_OVERHEAD = 64 * 1024

router = APIRouter()
_bearer = HTTPBearer(auto_error=False, description="ONCEGATE_ADMIN_TOKEN")


async def require_admin(
    runtime: RuntimeDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    token = runtime.settings.admin_token
    if not token:
        raise errors.AdminDisabled(
            "the admin API is off: start the gateway with ONCEGATE_ADMIN_TOKEN set to a secret, "
            "then send it as 'Authorization: Bearer <token>'"
        )
    given = credentials.credentials if credentials else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise errors.Unauthorized(
            "send the admin token (ONCEGATE_ADMIN_TOKEN) as 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


Admin = Depends(require_admin)


async def read_bounded(request: Request, limit: int, whose: str) -> bytes:
    """The request's body, refused with 413 as soon as it is known to exceed `limit`: by its
    Content-Length before a byte is read, else as it arrives."""
    try:
        return await read_body(request.receive, list(request.headers.items()), limit, whose)
    except ClientDisconnected:
        raise errors.InvalidRequest("the client went away before its body was sent") from None


def resolution_limit(settings: Settings) -> int:
    """The largest resolution worth reading: the largest answer a route stores, as base64 (the
    larger spelling), and its status and headers."""
    largest = max(
        (route.max_stored_response for route in settings.routes), default=DEFAULT_BODY_LIMIT
    )
    return largest * 4 // 3 + RESOLUTION_OVERHEAD


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics() -> Response:
    return Response(app_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz", summary="200 while the process runs")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="200 when PostgreSQL answers and migrations are at head, else 503",
    responses={503: {"description": "not ready"}},
)
async def readyz(runtime: RuntimeDep, response: Response) -> dict[str, str]:
    """Ready or not. A PostgreSQL whose failover could lose claims (`store.Replication.risk`)
    is said in the body under `replication`, still 200: the gateway works, and taking every
    gateway out of service over a database setting would turn a risk into an outage."""
    readiness = await runtime.health.readiness()
    if not readiness.ready:
        response.status_code = 503
        return {"status": "unavailable", "detail": readiness.detail}
    if readiness.replication is not None:
        return {"status": "ok", "revision": readiness.head, "replication": readiness.replication}
    return {"status": "ok", "revision": readiness.head}


class KeyView(BaseModel):
    id: int
    route: str
    scope: str = Field(
        description="a short fingerprint of the key's scope: two records of one key with "
        "different scopes were sent with different credentials (never the credential itself)"
    )
    key: str
    state: State
    status: int | None
    created_at: datetime
    completed_at: datetime | None
    expires_at: datetime
    body_stored: bool | None = Field(
        description="whether the answer was stored whole: false when it was larger than the "
        "route's max_stored_response (its status and headers were stored, not its body: "
        "retries get 409 response-not-stored); null before the key completes"
    )
    headers: list[tuple[str, str]] | None = Field(None, description="only with ?body=1")
    body: str | None = Field(None, description="only with ?body=1, when it is UTF-8 text")
    body_base64: str | None = Field(None, description="only with ?body=1, when it is not text")
    sealed_with: str | None = Field(
        None,
        description="the key that sealed the stored answer (ONCEGATE_ENCRYPTION_KEYS) and its "
        "binding: `k1:2` (bound to its claim), or a bare `k1` (an earlier release's: run rekey)",
    )
    request: dict[str, object] | None = Field(
        None,
        description="only with ?request=1: the request behind the key while it can turn "
        "unknown ({method, path, query, headers, body_base64}, credentials masked); null once "
        "it completed, on a route with keep_request: never, or when it cannot be opened",
    )
    claimed_by: dict[str, object] | None = Field(
        None,
        description="only with ?request=1: the gateway that claimed it (host, pid, started_at)",
    )
    failure: dict[str, object] | None = Field(
        None,
        description="only with ?request=1: what that gateway saw when the key turned unknown "
        "(kind, status_line_received, status, bytes_received, detail); null when its lease ran "
        "out instead",
    )


class KeyList(BaseModel):
    records: list[KeyView]


async def _view(
    record: KeyRecord, with_body: bool, with_request: bool, operator: Operator
) -> KeyView:
    view = KeyView(
        id=record.id,
        route=record.route,
        scope=record.scope_fingerprint,
        key=record.key,
        state=record.state,
        status=None if record.answer is None else record.answer.status,
        body_stored=None if record.answer is None else record.answer.stored,
        created_at=record.created_at,
        completed_at=record.completed_at,
        expires_at=record.expires_at,
        sealed_with=_sealed_with(record),
    )
    if with_body:
        answer_headers, body = operator.opened(record)
        view.headers = answer_headers
        if body is not None:
            try:
                view.body = body.decode("utf-8")
            except UnicodeDecodeError:
                view.body_base64 = base64.b64encode(body).decode()
    if with_request:
        kept = await operator.kept_request(record)
        view.request = None if kept is None else kept.shown()
        view.claimed_by = _document(record.claimed_by)
        view.failure = _document(record.failure)
    return view


def _document(text: str | None) -> dict[str, object] | None:
    if text is None:
        return None
    document: dict[str, object] = json.loads(text)
    return document


def _sealed_with(record: KeyRecord) -> str | None:
    if record.answer is None or record.answer.content is None:
        return None
    return record.answer.content.key_name


class QueuedView(BaseModel):
    """A key in the operator's queue, with what the gateway knows of it. Which gateway sent it
    is not known: claims do not record it."""

    id: int
    route: str
    key: str
    state: State
    cause: Cause | None = Field(
        description="how an unknown key turned unknown: answer_lost (the upstream timed out or "
        "broke the connection after the request was sent) or lease_expired (its gateway never "
        "settled it: it died, or PostgreSQL failed when it stored the answer)"
    )
    status: int | None = Field(description="the upstream's status, when an answer was stored")
    created_at: datetime = Field(description="when the key was claimed and its request sent")
    lease_expires_at: datetime | None = Field(
        description="in flight: when its lease runs out; lease_expired: when it ran out"
    )
    completed_at: datetime | None
    expires_at: datetime = Field(description="after this, a retry is forwarded as a new request")


class Queue(BaseModel):
    records: list[QueuedView]
    next_cursor: str | None = Field(
        description="pass as ?cursor= for the next page; null on the last page"
    )


def queued_view(record: QueuedKey) -> QueuedView:
    return QueuedView.model_validate(record, from_attributes=True)


@router.get(
    "/admin/keys",
    summary="A key in every scope (?key=), or the queue of keys in a state (?state=unknown)",
    dependencies=[Admin],
    responses={401: {"description": "no or wrong token"}, 404: {"description": "no token set"}},
)
async def find_keys(
    runtime: RuntimeDep,
    key: str | None = None,
    route: str | None = None,
    body: bool = False,
    request: bool = False,
    state: str | None = None,
    since: datetime | None = None,
    cursor: str | None = None,
    limit: int = service.QUEUE_PAGE_SIZE,
) -> KeyList | Queue:
    if key is not None:
        if state is not None:
            raise errors.InvalidRequest("give key (one key in every scope) or state, not both")
        records = await runtime.operator.find(key, route)
        return KeyList(
            records=[await _view(record, body, request, runtime.operator) for record in records]
        )
    if state is None:
        raise errors.InvalidRequest(
            "give key=K (one key in every scope) or state=unknown (the queue, oldest first)"
        )
    page = await runtime.operator.queue(state, route, since, cursor, limit)
    return Queue(records=[queued_view(record) for record in page.records], next_cursor=page.cursor)


@router.get(
    "/admin/keys/{record_id}",
    summary="One key by its id, with what the gateway knows of it",
    dependencies=[Admin],
    responses={404: {"description": "no such key"}},
)
async def describe_key(runtime: RuntimeDep, record_id: int) -> QueuedView:
    return queued_view(await runtime.operator.describe(record_id))


@router.delete(
    "/admin/keys/{record_id}",
    summary="Release a key: the next request with it is forwarded",
    status_code=204,
    dependencies=[Admin],
    responses={
        404: {"description": "no such key"},
        409: {"description": "its request is in flight"},
    },
)
async def delete_key(runtime: RuntimeDep, record_id: int) -> Response:
    await runtime.operator.release(record_id)
    return Response(status_code=204)


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Resolution(BaseModel):
    """How an operator settles an `unknown` key, once they know what the upstream did."""

    action: Literal["complete", "release", "resend"] = Field(
        description="complete: store this answer and replay it to every retry; "
        "release: forget the key, so the next retry is forwarded; resend: forward the kept "
        "request once more under the same key and settle it with what comes back (stored; "
        "released on one of the route's release_statuses, or on a 401 or 403: the kept "
        "credentials were refused, nothing was performed)"
    )
    status: int | None = Field(None, ge=200, le=599, description="with complete")
    headers: list[tuple[str, str]] = Field(default_factory=list, description="with complete")
    body: str | None = Field(None, description="with complete: the body as UTF-8 text")
    body_base64: str | None = Field(None, description="with complete: the body as base64")

    @model_validator(mode="after")
    def _complete_needs_status(self) -> Resolution:
        if self.action == "complete" and self.status is None:
            raise ValueError("action 'complete' needs a status")
        if self.action != "complete" and (
            self.status is not None or self.headers or self.body or self.body_base64
        ):
            raise ValueError(
                f"action {self.action!r} takes no answer (status, headers, body): only "
                "'complete' stores one; nothing was changed"
            )
        if self.body is not None and self.body_base64 is not None:
            raise ValueError("give body or body_base64, not both")
        if self.status in headers.BODILESS_STATUSES and (self.body or self.body_base64):
            raise ValueError(f"a {self.status} answer has no body")
        if self.body is not None and not _encodes(self.body):
            raise ValueError("body is not UTF-8 text (a lone surrogate?); send it as body_base64")
        for name, value in self.headers:
            if not headers.NAME.match(name):
                raise ValueError(f"{name!r} is not a header name")
            if not headers.VALUE.match(value):
                raise ValueError(f"the value of {name} is not a valid header value")
        return self

    def answer(self) -> tuple[int, list[tuple[str, str]], bytes] | None:
        """The answer a `complete` stores (status, headers, body); None for the other actions."""
        if self.action != "complete":
            return None
        assert self.status is not None  # the validator above: complete needs a status
        return self.status, self.headers, self.body_bytes()

    def body_bytes(self) -> bytes:
        if self.body_base64 is not None:
            try:
                return base64.b64decode(self.body_base64, validate=True)
            except binascii.Error:
                raise errors.InvalidRequest("body_base64 is not valid base64", status=422) from None
        return (self.body or "").encode()


@router.post(
    "/admin/keys/{record_id}/resolve",
    summary="Settle an unknown key as completed, release it, or re-send its request",
    dependencies=[Admin],
    responses={409: {"description": "the key is not unknown, or (resend) its request is not kept"}},
)
async def resolve_key(runtime: RuntimeDep, record_id: int, request: Request) -> dict[str, object]:
    # The body is read here, after `Admin` checked the token, not by FastAPI before it.
    limit = resolution_limit(runtime.settings)
    body = await read_bounded(request, limit, "the largest resolution a route can store")
    try:
        resolution = Resolution.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**detail, "loc": ("body", *detail["loc"])} for detail in exc.errors()]
        ) from None
    if resolution.action == "resend":
        sent = await runtime.operator.resend(record_id)
        return {"id": record_id, "resolved": "resend", "answer": answer_document(sent)}
    await runtime.operator.resolve(record_id, resolution.answer())
    return {"id": record_id, "resolved": resolution.action}


def answer_document(answer: Answer) -> dict[str, object]:
    """A re-send's answer as the resolve returns it: status, headers, body as text or base64."""
    document: dict[str, object] = {
        "status": answer.status,
        "outcome": answer.outcome.value,
        "headers": [list(pair) for pair in masked(answer.headers)],
    }
    try:
        document["body"] = answer.body.decode("utf-8")
    except UnicodeDecodeError:
        document["body_base64"] = base64.b64encode(answer.body).decode()
    return document
