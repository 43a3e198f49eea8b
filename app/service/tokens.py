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
signature check written here would be one more place for algorithm confusion to hide. It lives
in `token_keys` (the key sets and the checks), imported when a route scopes by a token: a
gateway without one never loads PyJWT (a tenth of a start's CPU, bench/gateway_start.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..model import errors
from ..settings import Route

if TYPE_CHECKING:
    from . import token_keys

_SCOPE_MARK = "jwt"  # the scope part's first value: never a header's list of values


class Identities:
    """Who a keyed request's token says the client is, for the routes that scope by one."""

    def __init__(self, routes: Sequence[Route] = ()) -> None:
        # One key set per source: routes that trust one issuer share its reads.
        by_source: dict[str, token_keys.KeySet] = {}
        self._key_sets: dict[str, token_keys.KeySet] = {}
        for route in routes:
            if route.scope_jwt is not None:
                from . import token_keys  # PyJWT: loaded by a gateway that verifies tokens only

                source = route.scope_jwt.source
                key_set = by_source.setdefault(source, token_keys.KeySet(route.scope_jwt))
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
        issuer, subject = await key_set.verified(scope, bearer(values, scope.header))
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
