"""Keys scoped by a verified JWT (a route's `scope_jwt`): who the client is, as its token's
issuer says, whatever token it holds now.

Why: scoping by the raw `Authorization` value makes a token refreshed between a timeout and its
retry a new scope, so the retry is performed again; scoping by nothing puts every client in one
scope. A verified token's issuer and subject survive a refresh and cannot be claimed by a client
that does not hold a token the issuer signed.

Rules:
- The token is the `Bearer` credential of the route's header (`Authorization` by default): one
  header line, scheme in any case. It must be a JWS signed by a key of the route's key set (a
  JWKS file or URL), with an algorithm the route allows (RS256, ES256, HS256; never `none`) that
  is also the algorithm of the key's own type, so an RSA public key is never taken as an HMAC
  secret. It must carry `iss` equal to the route's issuer, a string `sub` and an `exp` not past;
  `nbf` and `iat` not in the future (each with the route's leeway); and, when the route names an
  audience, an `aud` that holds it.
- The scope part is (issuer, subject): two tokens of one subject share their keys; another
  subject or another issuer does not.
- Nothing falls back to a weaker scope: a keyed request without a token, or with one that fails
  any check, is 401 `invalid-token`, before anything is claimed or forwarded. A route whose keys
  were never read answers 503 `token-keys-unavailable`. Requests the gateway does not key
  (methods not under control, no key on a `key: optional` route) are forwarded as before: the
  upstream authenticates them.
- Key sets are read at start, again every `refresh`, and at once when a token names a key id
  the set lacks (the issuer rotated its keys), at most every `MIN_REFRESH`. A read that fails is
  logged and the keys held are kept.
- Nothing of a token is logged or put in a message: messages say which check failed.

PyJWT does the JOSE work (parsing, signatures with `cryptography`, the registered claims): a
signature check written here would be one more place for algorithm confusion to hide.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.request
from collections.abc import Sequence

import jwt

from ..model import errors
from ..settings import Route, TokenScope

log = logging.getLogger("oncegate.service.tokens")

# A token naming a key id the set lacks reads the set again, but not more often than this: a
# client sending made-up key ids must not turn into a stream of reads of the issuer's URL.
MIN_REFRESH = 30.0
# A JWKS document is a few KiB; more than this is not one.
MAX_JWKS_BYTES = 1024 * 1024
FETCH_TIMEOUT = 5.0
_SCOPE_MARK = "jwt"  # the scope part's first value: never a header's list of values


class KeySet:
    """The keys of one JWKS file or URL, read again now and then."""

    def __init__(self, source: TokenScope) -> None:
        self._source = source
        self._keys: dict[str | None, jwt.PyJWK] = {}
        self._loaded = False
        self._last_read = -MIN_REFRESH
        self._reading = asyncio.Lock()

    @property
    def loaded(self) -> bool:
        return self._loaded

    async def read(self) -> bool:
        """Read the set; on failure log why and keep the keys held. True when it was read."""
        async with self._reading:
            self._last_read = time.monotonic()
            try:
                text = await asyncio.to_thread(_fetch, self._source)
                found = jwt.PyJWKSet.from_json(text).keys
            except (OSError, ValueError, jwt.PyJWKSetError, jwt.PyJWKError) as exc:
                log.error("could not read the token keys at %s: %s", self._source.source, exc)
                return False
            self._keys = {key.key_id: key for key in found}
            self._loaded = True
            return True

    async def key(self, key_id: str | None) -> jwt.PyJWK | None:
        """The key a token names (its `kid`; with none, the set's only key), reading the set
        again first when it lacks that key and was not read in the last `MIN_REFRESH`."""
        found = self._find(key_id)
        if found is None and time.monotonic() - self._last_read >= MIN_REFRESH:
            await self.read()
            found = self._find(key_id)
        return found

    def _find(self, key_id: str | None) -> jwt.PyJWK | None:
        if key_id is None and len(self._keys) == 1:
            return next(iter(self._keys.values()))
        return self._keys.get(key_id)

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._source.refresh)
            await self.read()


def _fetch(source: TokenScope) -> str:
    if source.jwks_file is not None:
        with source.jwks_file.open("rb") as document:
            raw = document.read(MAX_JWKS_BYTES + 1)
    else:
        assert source.jwks_url is not None  # TokenScope holds one source
        # S310: TokenScope admits http:// and https:// URLs only.
        request = urllib.request.Request(  # noqa: S310
            source.jwks_url, headers={"Accept": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT) as answer:  # noqa: S310
            raw = answer.read(MAX_JWKS_BYTES + 1)
    if len(raw) > MAX_JWKS_BYTES:
        raise ValueError(f"the document is larger than {MAX_JWKS_BYTES} bytes")
    return raw.decode("utf-8")


class Identities:
    """Who a keyed request's token says the client is, for the routes that scope by one."""

    def __init__(self, routes: Sequence[Route] = ()) -> None:
        # One key set per source: routes that trust one issuer share its reads.
        by_source: dict[str, KeySet] = {}
        self._key_sets: dict[str, KeySet] = {}
        for route in routes:
            if route.scope_jwt is not None:
                source = route.scope_jwt.source
                key_set = by_source.setdefault(source, KeySet(route.scope_jwt))
                self._key_sets[route.name] = key_set
        self._sets = list(by_source.values())
        self._refreshers: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Read every key set once (a failure is logged; its routes answer 503 until a read
        succeeds) and keep them fresh."""
        await asyncio.gather(*(key_set.read() for key_set in self._sets))
        self._refreshers = [
            asyncio.create_task(key_set.refresh_forever()) for key_set in self._sets
        ]

    async def close(self) -> None:
        for task in self._refreshers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def scope_part(self, route: Route, values: Sequence[str]) -> list[list[str]]:
        """The part of the route's scope that names the client: `[]` for a route without
        `scope_jwt`, else its verified issuer and subject. `values` are the values of the
        route's token header. Raises `errors.InvalidToken`, `errors.TokenKeysUnavailable`."""
        scope = route.scope_jwt
        if scope is None:
            return []
        key_set = self._key_sets.get(route.name)
        if key_set is None:  # a Gateway built without this route's identities
            raise errors.TokenKeysUnavailable(f"route {route.name!r} has no token keys")
        issuer, subject = await verified(scope, key_set, bearer(values, scope.header))
        return [[_SCOPE_MARK, issuer, subject]]


def bearer(values: Sequence[str], header: str) -> str:
    """The token of a `Bearer` credential in the only line of `header`."""
    if not values:
        raise errors.InvalidToken(
            f"this route scopes idempotency keys by a verified token: send {header}: Bearer <JWT>",
            sent=False,
        )
    if len(values) > 1:
        raise errors.InvalidToken(f"send one {header} header line, not {len(values)}")
    scheme, _, token = values[0].strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise errors.InvalidToken(f"the {header} header is not a Bearer token")
    return token


async def verified(scope: TokenScope, key_set: KeySet, token: str) -> tuple[str, str]:
    """The issuer and subject of a token that passes every check of the module's rules."""
    try:
        header = jwt.get_unverified_header(token)
    except jwt.DecodeError:
        raise errors.InvalidToken("the bearer token is not a signed JWT") from None
    algorithm = header.get("alg")
    if algorithm not in scope.algorithms:
        raise errors.InvalidToken(
            f"the token is signed with {str(algorithm)[:16]!r}; this route accepts "
            f"{', '.join(sorted(scope.algorithms))}"
        )
    key_id = header.get("kid")
    key = await key_set.key(key_id if isinstance(key_id, str) else None)
    if key is None:
        if not key_set.loaded:
            raise errors.TokenKeysUnavailable(
                f"the keys that verify this route's tokens could not be read from "
                f"{scope.source}; nothing was claimed, retry later"
            )
        raise errors.InvalidToken("the token's signing key is not among the issuer's keys")
    if key.algorithm_name != algorithm:
        raise errors.InvalidToken(
            f"the token says {algorithm}, but its key is a {key.algorithm_name} key"
        )
    try:
        claims = jwt.decode(
            token,
            key.key,
            algorithms=[algorithm],
            issuer=scope.issuer,
            audience=scope.audience,
            leeway=scope.leeway,
            options={"require": ["exp", "iss", "sub"], "verify_aud": scope.audience is not None},
        )
    except jwt.ExpiredSignatureError:
        raise errors.InvalidToken("the token has expired; refresh it and retry") from None
    except jwt.InvalidTokenError as exc:
        raise errors.InvalidToken(f"the token failed verification: {_reason(exc)}") from None
    subject = claims["sub"]
    if not isinstance(subject, str) or not subject:
        raise errors.InvalidToken("the token's subject (sub) is not a string")
    return scope.issuer, subject


def _reason(error: jwt.InvalidTokenError) -> str:
    """Which check failed, in words that hold nothing of the token."""
    match error:
        case jwt.InvalidSignatureError():
            return "its signature does not match"
        case jwt.InvalidIssuerError():
            return "it was issued by another issuer"
        case jwt.InvalidAudienceError():
            return "it is meant for another audience"
        case jwt.ImmatureSignatureError():
            return "it is not valid yet (nbf)"
        case jwt.InvalidIssuedAtError():
            return "it was issued in the future (iat)"
        case jwt.exceptions.InvalidSubjectError():
            return "its subject (sub) is not a string"
        case jwt.MissingRequiredClaimError():
            return f"it has no {error.claim} claim"
        case _:
            return "it is malformed"
