"""One `routes:` entry (contract section 3): its options, their defaults and their checks."""

from __future__ import annotations

import functools
import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .. import headers, keys
from .units import Duration, Size, Wait

DEFAULT_TTL = 24 * 3600.0
DEFAULT_TIMEOUT = 30.0
DEFAULT_BODY_LIMIT = 10 * 1024**2
DEFAULT_MAX_WAIT = 10.0
_METHOD = re.compile(r"^[A-Z]+$")
# A route name: a metric label, a log field and the admin API's `route=`.
ROUTE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
KEY_HEADER = "Idempotency-Key"
# What a `key_header` cannot be, besides hop-by-hop fields and the route's scope headers:
# fields the gateway or the HTTP layers below it read, set or rewrite (the client's request
# head, its body's description, credentials, `Prefer`, the request id, trace context), so a
# key there would not reach the upstream as sent, or would mean two things at once.
UNUSABLE_KEY_HEADERS = frozenset(
    {
        "content-type",
        "content-encoding",
        "authorization",
        "cookie",
        headers.PREFER,
        headers.REQUEST_ID,
        "traceparent",
        "tracestate",
    }
)


def check_upstream(value: str) -> str:
    parts = urlsplit(value)
    if "@" in parts.netloc:
        # Credentials in the URL would be logged with every route line and mixed into requests
        # that carry their own Authorization; the upstream's credentials are the client's job.
        # The message shows the URL without them.
        shown = parts._replace(netloc="…@" + parts.netloc.rpartition("@")[2]).geturl()
        raise ValueError(
            f"{shown!r}: an upstream URL must not carry credentials (user:password@); let "
            "clients send their own Authorization header"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r}: an upstream URL takes no query or fragment")
    return value.rstrip("/")


class Route(BaseModel):
    """One `routes:` entry. Defaults are the contract's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    match: str
    upstream: str
    strip_prefix: bool = False
    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    key: Literal["required", "optional"] = "required"
    ttl: Duration = DEFAULT_TTL
    timeout: Duration = DEFAULT_TIMEOUT
    lease: Duration | None = None
    max_body: Size = DEFAULT_BODY_LIMIT
    max_stored_response: Size = DEFAULT_BODY_LIMIT
    scope_headers: tuple[str, ...] = Field(("Authorization",), validate_default=True)
    release_statuses: frozenset[int] = frozenset({429, 503})
    on_unknown: Literal["reject", "forward"] = "reject"
    # The longest a request with `Prefer: wait=N` waits for its key to settle (contract section 9).
    max_wait: Duration = DEFAULT_MAX_WAIT
    # `status_only`: keep the status and headers of answers, not their bodies (for APIs whose
    # answers must not be kept); a replay then has an empty body.
    store: Literal["full", "status_only"] = "full"
    # Where the key is (contract section 10): a header of another name (`PayPal-Request-Id`),
    # passed upstream under that name, or a string field of a JSON body, named by an RFC 6901
    # pointer (`/idempotency_key`). Unset: the `Idempotency-Key` header.
    key_header: str | None = None
    key_from_body: str | None = None
    # How long a duplicate of an in-flight key waits for its answer without asking (`Prefer:
    # wait`), so clients that retry on their own timeout get the replay instead of 409.
    wait: Wait = 0.0

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not ROUTE_NAME.match(value):
            raise ValueError(
                f"{value!r}: a route name is 1-64 letters, digits, '.', '_' or '-' "
                "(it becomes a metric label)"
            )
        return value

    @field_validator("match")
    @classmethod
    def _match(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"{value!r}: a path prefix starts with '/'")
        return value

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, value: str) -> str:
        return check_upstream(value)

    @field_validator("methods", mode="before")
    @classmethod
    def _methods(cls, value: object) -> object:
        if isinstance(value, str):  # `methods: POST` or `methods: POST, PATCH`
            value = [part.strip() for part in value.split(",")]
        if isinstance(value, list | tuple | set | frozenset):
            methods = [str(method).upper() for method in value]
            for method in methods:
                if not _METHOD.match(method):
                    raise ValueError(f"{method!r} is not an HTTP method")
            return frozenset(methods)
        raise ValueError(f"a list of HTTP methods, like [POST, PATCH], not {value!r}")

    @field_validator("scope_headers")
    @classmethod
    def _scope_headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not _HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a header name")
        return tuple(name.lower() for name in value)

    @field_validator("release_statuses")
    @classmethod
    def _release_statuses(cls, value: frozenset[int]) -> frozenset[int]:
        for status in value:
            if not 100 <= status <= 599:
                raise ValueError(f"{status} is not an HTTP status code")
        return value

    @field_validator("key_header")
    @classmethod
    def _key_header(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _HEADER_NAME.match(value):
            raise ValueError(f"{value!r} is not a header name")
        lowered = value.lower()
        if lowered in headers.HOP_BY_HOP or lowered in headers.REQUEST_ONLY:
            raise ValueError(
                f"{value!r} is a hop-by-hop or connection field: it never reaches the upstream, "
                "so it cannot carry a key"
            )
        if lowered in UNUSABLE_KEY_HEADERS:
            raise ValueError(
                f"{value!r} means something else to the gateway or to HTTP; name the header "
                "your API takes its key in (e.g. PayPal-Request-Id)"
            )
        return value

    @field_validator("key_from_body")
    @classmethod
    def _key_from_body(cls, value: str | None) -> str | None:
        if value is not None:
            keys.parse_pointer(value)  # its ValueError says what is wrong
        return value

    @model_validator(mode="after")
    def _where_the_key_is(self) -> Route:
        if self.key_header is not None and self.key_from_body is not None:
            raise ValueError(
                "key_header and key_from_body both say where the key is; a route takes one"
            )
        if self.key_header is not None and self.key_header.lower() in self.scope_headers:
            raise ValueError(
                f"key_header {self.key_header!r} is also a scope header: every key would be a "
                "scope of its own"
            )
        return self

    @model_validator(mode="after")
    def _wait(self) -> Route:
        if self.wait > self.max_wait:
            raise ValueError(
                f"wait ({self.wait:g}s) exceeds max_wait ({self.max_wait:g}s), the longest a "
                "client may ask to wait with Prefer: wait; raise max_wait too"
            )
        return self

    @property
    def key_header_shown(self) -> str:
        """The header the key is in, as the route spells it (`key_header`, else
        `Idempotency-Key`): for messages."""
        return self.key_header or KEY_HEADER

    @functools.cached_property
    def key_header_name(self) -> str:
        """The header the key is in, lower case, as requests' header names are."""
        return self.key_header_shown.lower()

    @functools.cached_property
    def key_pointer(self) -> tuple[str, ...] | None:
        """`key_from_body`'s reference tokens, or None when the key is in a header."""
        return None if self.key_from_body is None else keys.parse_pointer(self.key_from_body)

    @model_validator(mode="after")
    def _lease_and_ttl(self) -> Route:
        if self.lease_seconds <= self.timeout:
            raise ValueError(
                f"lease ({self.lease_seconds:g}s) must exceed timeout ({self.timeout:g}s), or a "
                "second request could be forwarded while the first is still in flight"
            )
        if self.ttl <= self.lease_seconds:
            source = "" if self.lease is not None else ", twice the timeout"
            raise ValueError(
                f"ttl ({self.ttl:g}s) must exceed lease ({self.lease_seconds:g}s{source}): a key "
                "cannot expire while its request is still in flight"
            )
        return self

    @property
    def lease_seconds(self) -> float:
        """How long a claim is held. By default twice the timeout: an in-flight claim must
        outlive the upstream call it guards, or a second gateway could take the key over while
        the first is still waiting for the answer."""
        return self.lease if self.lease is not None else 2 * self.timeout
