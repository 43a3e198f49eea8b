"""The gateway's errors: one class per problem name of the contract (section 4).

Each class knows its HTTP status, its problem name (rendered as the RFC 9457 `type`
`urn:oncegate:problem:<name>`), its title and the `outcome` label its request is counted under.
The HTTP layer renders every `GatewayError` the same way; nothing else builds a problem body.

Each also says whether the same request, retried with the same key, can get another answer
(`should_retry`): the one signal client libraries read whatever API they were written for, sent
as `x-should-retry` (Stainless-generated SDKs) and `Stripe-Should-Retry` (Stripe's). None says
nothing, and leaves a client to its defaults.
"""

from __future__ import annotations

from typing import ClassVar

from .outcomes import BlockReason, Outcome

PROBLEM_TYPE_PREFIX = "urn:oncegate:problem:"
PROBLEM_MEDIA_TYPE = "application/problem+json"  # RFC 9457


class GatewayError(Exception):
    """An answer the gateway gives itself, instead of (or on behalf of) the upstream."""

    status: ClassVar[int] = 500
    name: ClassVar[str] = "internal-error"
    title: ClassVar[str] = "Internal gateway error"
    outcome: ClassVar[Outcome] = Outcome.ERROR
    # Set on errors that answer a retry of a known key without calling the upstream: the
    # `reason` of oncegate_duplicates_blocked_total.
    blocked: ClassVar[BlockReason | None] = None
    # Whether a retry of the same request with the same key can be answered otherwise.
    should_retry: ClassVar[bool | None] = None

    def __init__(
        self,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        status: int | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}
        self._status = status
        self._retry = retry

    @property
    def retry_advised(self) -> bool | None:
        """Whether a retry can help: the class's answer, unless this instance knows better."""
        return self.should_retry if self._retry is None else self._retry

    @property
    def status_code(self) -> int:
        """The status sent to the client: the class's, unless this instance chose one."""
        return self.status if self._status is None else self._status

    @property
    def blocked_reason(self) -> BlockReason | None:
        return self.blocked

    @property
    def type_uri(self) -> str:
        return PROBLEM_TYPE_PREFIX + self.name

    def problem(self) -> dict[str, object]:
        return {
            "type": self.type_uri,
            "title": self.title,
            "status": self.status_code,
            "detail": self.detail,
            # An extension member (RFC 9457 §3.2) repeating the detail: client libraries that
            # read no RFC 9457 show a vendor error's `message` (PayPal's ErrorException,
            # Twilio's TwilioRestException, GoCardless's ApiError), and showed None without
            # it. No `code`: Twilio's library takes a body with `code` for one of its own
            # services' problems and raises another exception class than its callers catch.
            "message": self.detail,
        }


class RouteNotFound(GatewayError):
    status = 404
    name = "route-not-found"
    title = "No route matches this path"
    outcome = Outcome.NO_ROUTE
    should_retry = False


class InvalidPath(GatewayError):
    status = 400
    name = "invalid-path"
    title = "The request path is not a valid path"
    outcome = Outcome.INVALID_PATH
    should_retry = False


class InvalidHeader(GatewayError):
    status = 400
    name = "invalid-header"
    title = "A header value cannot be forwarded unchanged"
    outcome = Outcome.INVALID_HEADER
    should_retry = False


class RequestTimeout(GatewayError):
    """A client that sent no whole request head in time: the connection is closed after it."""

    status = 408
    name = "request-timeout"
    title = "The request's head did not arrive in time"
    outcome = Outcome.REQUEST_TIMEOUT


class UnsupportedTransferCoding(GatewayError):
    """A transfer coding other than chunked: the gateway reads the body without it and sends it
    with a Content-Length, so the upstream would get bytes it cannot decode (RFC 9112 §6.1)."""

    status = 501
    name = "unsupported-transfer-coding"
    title = "The request's transfer coding is not supported"
    outcome = Outcome.UNSUPPORTED_TRANSFER_CODING
    should_retry = False


class MissingKey(GatewayError):
    status = 400
    name = "missing-key"
    title = "The idempotency key is missing"
    outcome = Outcome.MISSING_KEY
    should_retry = False


class InvalidKey(GatewayError):
    status = 400
    name = "invalid-key"
    title = "The idempotency key is malformed"
    outcome = Outcome.INVALID_KEY
    should_retry = False


class InvalidToken(GatewayError):
    """A route that scopes keys by a verified JWT (`scope_jwt`) got a keyed request whose token
    is missing or fails a check: never scoped by anything weaker (RFC 6750 §3)."""

    status = 401
    name = "invalid-token"
    title = "The bearer token could not be verified"
    outcome = Outcome.INVALID_TOKEN
    should_retry = False

    def __init__(self, detail: str, *, sent: bool = True) -> None:
        # No error code when no token was sent at all (RFC 6750 §3.1).
        challenge = 'Bearer error="invalid_token"' if sent else "Bearer"
        super().__init__(detail, headers={"WWW-Authenticate": challenge})


class TokenKeysUnavailable(GatewayError):
    """The keys a route's tokens are verified with have not been read yet (the JWKS file or URL
    failed since the gateway started): nothing was claimed, and a retry may succeed."""

    status = 503
    name = "token-keys-unavailable"
    title = "The keys that verify tokens are unavailable"
    outcome = Outcome.TOKEN_KEYS_UNAVAILABLE
    should_retry = True


class BodyTooLarge(GatewayError):
    status = 413
    name = "body-too-large"
    title = "Request body is too large"
    outcome = Outcome.BODY_TOO_LARGE
    should_retry = False


class KeyReused(GatewayError):
    status = 422
    name = "key-reused"
    title = "The idempotency key was already used for a different request"
    outcome = Outcome.MISMATCH
    should_retry = False


class RequestInProgress(GatewayError):
    status = 409
    name = "request-in-progress"
    title = "A request with this idempotency key is still in progress"
    outcome = Outcome.IN_PROGRESS
    should_retry = True
    blocked = "in_progress"


class ResponseNotStored(GatewayError):
    """The first request completed, but its answer was over `max_stored_response`.

    The contract says such answers reach the first caller and are not replayable; the request is
    never forwarded a second time, so a retry learns the original status and nothing more.
    """

    status = 409
    name = "response-not-stored"
    title = "The original response was too large to store"
    outcome = Outcome.REPLAYED
    should_retry = False
    blocked = "replayed"


class OutcomeUnknown(GatewayError):
    """The request may have reached the upstream, but its answer was lost.

    The first caller gets 504 (timed out) or 502 (connection broken); every retry gets 409 until
    an operator resolves the key or it expires.
    """

    status = 409
    name = "outcome-unknown"
    title = "The outcome of the original request is unknown"
    outcome = Outcome.UNKNOWN
    should_retry = False

    @property
    def blocked_reason(self) -> BlockReason | None:
        # The first caller's 504/502 did reach the upstream; only the 409 to a retry is a block.
        return "unknown" if self.status_code == 409 else None


class UpstreamUnavailable(GatewayError):
    status = 502
    name = "upstream-unavailable"
    title = "The upstream could not be reached"
    outcome = Outcome.UPSTREAM_UNAVAILABLE
    should_retry = True


class AnswerSealed(GatewayError):
    """The request was performed, but its stored answer cannot be opened: the key that sealed
    it is not configured, or the row was changed. Never forwarded again; replayed once the key
    is back."""

    status = 503
    name = "answer-sealed"
    title = "The stored answer cannot be opened"
    outcome = Outcome.ANSWER_SEALED
    should_retry = False

    def __init__(self, detail: str, *, key_name: str, reason: str) -> None:
        super().__init__(detail)
        self.key_name = key_name  # for the operator's log, never the client's answer
        self.reason = reason


class StoreUnavailable(GatewayError):
    status = 503
    name = "store-unavailable"
    title = "The idempotency store is unavailable"
    outcome = Outcome.STORE_UNAVAILABLE
    should_retry = True


# The admin port's problems (contract section 6): rendered like the proxy's.


class Unauthorized(GatewayError):
    status = 401
    name = "unauthorized"
    title = "A valid admin bearer token is required"


class AdminDisabled(GatewayError):
    status = 404
    name = "admin-disabled"
    title = "The admin API is not enabled"


class NotFound(GatewayError):
    status = 404
    name = "not-found"
    title = "No such resource"


class KeyInFlight(GatewayError):
    status = 409
    name = "key-in-flight"
    title = "The key's request is in flight"


class KeyNotUnknown(GatewayError):
    status = 409
    name = "key-not-unknown"
    title = "The key is not in state unknown"


class RequestNotKept(GatewayError):
    """A re-send asked for a key whose request the gateway did not keep (its route says
    `keep_request: never`, it was claimed before requests were kept, or its route is gone),
    or cannot open (sealed with a key it does not hold)."""

    status = 409
    name = "request-not-kept"
    title = "The key's request is not kept"


class InvalidRequest(GatewayError):
    """A request that does not validate: on the proxy port, HTTP a proxy must not pass on (RFC
    9112 §3.2: no Host, or two); on the admin port, a path or query (400) or a body (422)."""

    status = 400
    name = "invalid-request"
    title = "The request is not valid"
    outcome = Outcome.INVALID_REQUEST


class StoreRefusedValue(InvalidRequest):
    """A value PostgreSQL cannot hold or the driver cannot send (a moment outside the years 1 to
    9999 in UTC, ...): the input's doing, answered 400, never taken for an outage."""


class ConfigError(Exception):
    """Settings that cannot work; the message names the field. Raised before anything starts."""
