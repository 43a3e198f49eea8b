"""How a request on the proxy port was answered: one closed set of names.

An `Outcome` is the `outcome` label of `oncegate_requests_total` and
`oncegate_request_duration_seconds`, the request's log line field and its span's
`oncegate.outcome`; docs/reference.md lists every one (tests/unit/test_reference.py checks it).
A `BlockReason` is why a request with a known key did not reach the upstream: the `reason` label
of `oncegate_duplicates_blocked_total`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args


class Outcome(StrEnum):
    # The upstream's answer, relayed.
    PASSTHROUGH = "passthrough"  # the method is not under idempotency control
    UNPROTECTED = "unprotected"  # no key, and the route says `key: optional`
    FORWARDED = "forwarded"  # a new (or expired, or taken over) key: forwarded, answer stored
    RELEASED = "released"  # forwarded; the upstream's status was one that frees the key
    REPLAYED = "replayed"  # the stored answer (or 409 response-not-stored: none was stored)
    # The gateway's own answers, one per problem (errors.py).
    ERROR = "error"
    NO_ROUTE = "no_route"
    INVALID_PATH = "invalid_path"
    INVALID_HEADER = "invalid_header"
    INVALID_REQUEST = "invalid_request"
    REQUEST_TIMEOUT = "request_timeout"
    UNSUPPORTED_TRANSFER_CODING = "unsupported_transfer_coding"
    MISSING_KEY = "missing_key"
    INVALID_KEY = "invalid_key"
    INVALID_TOKEN = "invalid_token"  # noqa: S105 - an outcome's name, no secret
    TOKEN_KEYS_UNAVAILABLE = "token_keys_unavailable"  # noqa: S105 - an outcome's name
    BODY_TOO_LARGE = "body_too_large"
    MISMATCH = "mismatch"
    IN_PROGRESS = "in_progress"
    UNKNOWN = "unknown"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    ANSWER_SEALED = "answer_sealed"
    STORE_UNAVAILABLE = "store_unavailable"


BlockReason = Literal["replayed", "in_progress", "unknown"]
BLOCK_REASONS: tuple[BlockReason, ...] = get_args(BlockReason)
