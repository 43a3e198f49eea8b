"""One `routes:` entry (contract section 3): its options, their defaults and their checks."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..kernel import headers, keys, urls
from .units import Duration, Size, Wait

DEFAULT_TTL = 24 * 3600.0
DEFAULT_TIMEOUT = 30.0
DEFAULT_BODY_LIMIT = 10 * 1024**2
DEFAULT_MAX_WAIT = 10.0
_METHOD = re.compile(r"^[A-Z]+\Z")
# A route name: a metric label, a log field and the admin API's `route=`.
ROUTE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")
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
    # Each message shows the URL without a password or the query's values (`urls.shown`): a
    # refused URL is the operator's, and so may be an API key in its query.
    if "@" in parts.netloc:
        # Credentials in the URL would be logged with every route line and mixed into requests
        # that carry their own Authorization; the upstream's credentials are the client's job.
        raise ValueError(
            f"{urls.shown(value)!r}: an upstream URL must not carry credentials"
            " (user:password@); let clients send their own Authorization header"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{urls.shown(value)!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise ValueError(f"{urls.shown(value)!r}: an upstream URL takes no query or fragment")
    return value.rstrip("/")


# The signature algorithms a `scope_jwt` may accept: never `none`, and one per key type, so a
# key is only ever used with the algorithm its type means (no RSA public key as an HMAC secret).
TOKEN_ALGORITHMS = frozenset({"RS256", "ES256", "HS256"})
DEFAULT_TOKEN_LEEWAY = 30.0
DEFAULT_TOKEN_KEYS_REFRESH = 300.0


class TokenScope(BaseModel):
    """A route's `scope_jwt`: keys are scoped by who a verified JWT says the client is (its
    issuer and subject), so a refreshed token keeps its keys (oncegate.service.tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    issuer: str = Field(min_length=1)  # the `iss` every token must carry, compared exactly
    audience: str | None = None  # when set, the token's `aud` must hold it
    jwks_file: Path | None = None
    jwks_url: str | None = None
    algorithms: frozenset[str] = frozenset({"RS256", "ES256"})
    # Where the token is, as `Bearer <token>`; kept in lower case, as requests' names are.
    header: str = Field("Authorization", validate_default=True)
    leeway: Duration = DEFAULT_TOKEN_LEEWAY  # clock skew allowed on exp, nbf and iat
    refresh: Duration = DEFAULT_TOKEN_KEYS_REFRESH  # how often the key set is read again

    @field_validator("algorithms", mode="before")
    @classmethod
    def _algorithms(cls, value: object) -> object:
        names = [value] if isinstance(value, str) else value
        if isinstance(names, list | tuple | set | frozenset):
            unknown = sorted(str(name) for name in names if name not in TOKEN_ALGORITHMS)
            if unknown or not names:
                raise ValueError(
                    f"{unknown or 'none'}: scope_jwt takes one or more of "
                    f"{', '.join(sorted(TOKEN_ALGORITHMS))}"
                )
            return frozenset(names)
        raise ValueError(f"a list of algorithms, like [RS256, ES256], not {value!r}")

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not headers.NAME.match(value):
            raise ValueError(f"{value!r} is not a header name")
        return value.lower()

    @field_validator("jwks_url")
    @classmethod
    def _jwks_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if "@" in parts.netloc:  # it would be logged with every failed read
                raise ValueError("a jwks_url must not carry credentials (user:password@)")
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"{urls.shown(value)!r} is not an http:// or https:// URL with a host"
                )
        return value

    @model_validator(mode="after")
    def _one_source(self) -> TokenScope:
        if (self.jwks_file is None) == (self.jwks_url is None):
            raise ValueError("scope_jwt takes its keys from one of jwks_file or jwks_url")
        return self

    @property
    def source(self) -> str:
        """Where the keys are read from, for the operator's log: a URL without its query's
        values (`urls.shown`: a JWKS URL may carry its credential there, `?token=...`)."""
        if self.jwks_file is not None:
            return str(self.jwks_file)
        assert self.jwks_url is not None  # one of the two (`_one_source`)
        return urls.shown(self.jwks_url)


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
    # The request behind a key (method, path, query, forwarded headers, body) is kept from its
    # claim until it settles, so an operator can see and re-send the request of an `unknown`
    # key; `never`: not kept (bodies that must not be written to the database).
    keep_request: Literal["until_settled", "never"] = "until_settled"
    # Where the key is (contract section 10): a header of another name (`PayPal-Request-Id`),
    # passed upstream under that name, or a string field of a JSON body, named by an RFC 6901
    # pointer (`/idempotency_key`). Unset: the `Idempotency-Key` header.
    key_header: str | None = None
    key_from_body: str | None = None
    # How long a duplicate of an in-flight key waits for its answer without asking (`Prefer:
    # wait`), so clients that retry on their own timeout get the replay instead of 409.
    wait: Wait = 0.0
    # Keys scoped by a verified JWT's issuer and subject instead of raw header values; then
    # `scope_headers` defaults to none (a refreshed token is the same client).
    scope_jwt: TokenScope | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_token_in_scope_headers_by_default(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("scope_jwt") is not None:
            data = {"scope_headers": [], **data}
        return data

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
            if not headers.NAME.match(name):
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
        if not headers.NAME.match(value):
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
    def _token_not_in_scope_headers(self) -> Route:
        if self.scope_jwt is not None and self.scope_jwt.header in self.scope_headers:
            raise ValueError(
                f"scope_headers names {self.scope_jwt.header!r}, the header whose token "
                "scope_jwt verifies: every refreshed token would be a scope of its own; leave "
                "it out (the token's issuer and subject scope the keys)"
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
    def forwards_unknown(self) -> bool:
        """Whether a retry of an `unknown` key is taken over and forwarded again
        (`on_unknown: forward`), rather than refused until an operator resolves it."""
        return self.on_unknown == "forward"

    @property
    def key_header_shown(self) -> str:
        """The header the key is in, as the route spells it (`key_header`, else
        `Idempotency-Key`): for messages."""
        return self.key_header or keys.HEADER

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
