"""The JOSE side of `tokens` (read its rules): an issuer's key sets, read from a JWKS file or
URL and kept fresh, and the checks a token passes, on PyJWT. Imported only by a gateway with a
route that scopes by a token (`tokens.Identities`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request

import jwt

from ..model import errors
from ..settings import TokenScope

log = logging.getLogger("oncegate.service.tokens")

# A token naming a key id the set lacks reads the set again, but not more often than this: a
# client sending made-up key ids must not turn into a stream of reads of the issuer's URL.
MIN_REFRESH = 30.0
# A JWKS document is a few KiB; more than this is not one.
MAX_JWKS_BYTES = 1024 * 1024
FETCH_TIMEOUT = 5.0


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

    async def verified(self, scope: TokenScope, token: str) -> tuple[str, str]:
        """The issuer and subject of `token` on a route of `scope` (whose source this set is),
        when it passes every check of `tokens`' rules; else `errors.InvalidToken`, or
        `errors.TokenKeysUnavailable` when the set was never read."""
        return await verified(scope, self, token)

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


async def verified(scope: TokenScope, key_set: KeySet, token: str) -> tuple[str, str]:
    """The issuer and subject of a token that passes every check of `tokens`' rules."""
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
            # Not where from (the log says it, `KeySet.read`): a file's path or a URL, whose
            # query may carry a credential, is the operator's, not every client's.
            raise errors.TokenKeysUnavailable(
                "the keys that verify this route's tokens could not be read; nothing was "
                "claimed, retry later"
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
