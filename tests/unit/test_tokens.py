"""oncegate.service.tokens: keys scoped by a verified JWT's issuer and subject (a route's
`scope_jwt`), with real keys and tokens signed here; the key set is a JWKS file."""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path
from typing import Any

import jwt
import pytest

from oncegate import settings
from oncegate.kernel import keys
from oncegate.model import errors
from oncegate.service import token_keys, tokens
from tests.helpers import free_port
from tests.issuer import ISSUER, Issuer


@pytest.fixture
def issuer(tmp_path: Path) -> Issuer:
    return Issuer(tmp_path / "jwks.json")


def route(issuer: Issuer, **options: Any) -> settings.Route:
    scope = {"issuer": ISSUER, "jwks_file": str(issuer.jwks_file),
             "algorithms": ["RS256", "ES256", "HS256"], **options}  # fmt: skip
    return settings.Route(name="paypal", match="/", upstream="http://upstream.test",
                          scope_jwt=scope)  # fmt: skip


async def scope_of(identities: tokens.Identities, route: settings.Route, *values: str) -> bytes:
    """The scope a request with these `Authorization` values gets, as the gateway makes it."""
    part = await identities.scope_part(route, list(values))
    return keys.scope(route.name, [[] for _ in route.scope_headers] + part)


async def started(*routes: settings.Route) -> tokens.Identities:
    identities = tokens.Identities(routes)
    await identities.start()
    return identities


@pytest.mark.parametrize("kid", ["rsa-1", "ec-1", "hmac-1"])
async def test_a_refreshed_token_of_one_subject_keeps_its_scope(issuer: Issuer, kid: str) -> None:
    paypal = route(issuer)
    identities = await started(paypal)
    try:
        first = await scope_of(identities, paypal, f"Bearer {issuer.token(kid=kid)}")
        refreshed = issuer.token(kid=kid, lifetime=900)
        assert await scope_of(identities, paypal, f"bearer  {refreshed} ") == first
        other = await scope_of(identities, paypal, f"Bearer {issuer.token('client-2', kid)}")
        assert other != first
    finally:
        await identities.close()


def test_scope_headers_default_to_none_and_cannot_hold_the_token(issuer: Issuer) -> None:
    assert route(issuer).scope_headers == ()
    assert route(issuer, header="X-Token").scope_jwt is not None
    with pytest.raises(ValueError, match="every refreshed token would be a scope of its own"):
        settings.Route(
            name="paypal", match="/", upstream="http://upstream.test",
            scope_headers=["Authorization"],
            scope_jwt={"issuer": ISSUER, "jwks_file": str(issuer.jwks_file)},
        )  # fmt: skip
    with pytest.raises(ValueError, match="one of jwks_file or jwks_url"):
        route(issuer, jwks_url="https://issuer.test/jwks")
    config = issuer.jwks_file.with_name("oncegate.yaml")
    config.write_text(
        "routes:\n  - {name: a, match: /, upstream: 'http://u.test', scope_jwt: {issuer: x, "
        "jwks_url: 'https://user:Secret1@issuer.test/jwks'}}\n"
    )
    with pytest.raises(errors.ConfigError) as raised:  # as `serve` reports it
        settings.load({}, {}, config)
    assert "must not carry credentials" in str(raised.value)
    assert "Secret1" not in str(raised.value)
    with pytest.raises(ValueError, match="scope_jwt takes one or more of"):
        route(issuer, algorithms=["none"])
    with pytest.raises(ValueError, match="scope_jwt takes one or more of"):
        route(issuer, algorithms=["RS512"])


def unsigned(issuer: Issuer) -> str:
    def part(document: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(document).encode()).rstrip(b"=").decode()

    now = int(time.time())
    claims = {"iss": ISSUER, "sub": "client-1", "iat": now, "exp": now + 600}
    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}."


def confused(issuer: Issuer) -> str:
    """HS256 with the RSA key's public half as the HMAC secret: the algorithm confusion attack
    (PyJWT refuses PEM keys as secrets itself, so the MAC is computed by hand)."""
    import hashlib
    import hmac

    public = jwt.algorithms.RSAAlgorithm.to_jwk(issuer.keys["rsa-1"][1].public_key())

    def part(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    now = int(time.time())
    head = part(json.dumps({"alg": "HS256", "kid": "rsa-1"}).encode())
    body = part(json.dumps({"iss": ISSUER, "sub": "client-1", "exp": now + 600}).encode())
    signature = hmac.new(public.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{part(signature)}"


FAILURES = {
    "expired": (lambda issuer: issuer.token(lifetime=-120), "has expired"),
    "another-issuer": (lambda issuer: issuer.token(claims={"iss": "https://evil.test/"}),
                       "another issuer"),
    "another-key": (lambda issuer: Issuer(issuer.jwks_file.with_name("other.json")).token(),
                    "signature does not match"),
    "no-subject": (lambda issuer: issuer.token(claims={"sub": None}), "sub"),
    "a-number-subject": (lambda issuer: issuer.token(claims={"sub": 7}), "sub"),
    "not-yet": (lambda issuer: issuer.token(claims={"nbf": int(time.time()) + 600}),
                "not valid yet"),
    "no-expiry": (lambda issuer: jwt.encode({"iss": ISSUER, "sub": "c"}, issuer.keys["rsa-1"][1],
                                            algorithm="RS256", headers={"kid": "rsa-1"}),
                  "no exp claim"),
    "alg-none": (unsigned, "signed with 'none'"),
    "alg-confusion": (confused, "its key is a RS256 key"),
    "unknown-kid": (lambda issuer: issuer.token(headers={"kid": "nobody"}), "not among"),
    "not-a-jwt": (lambda issuer: "not.a.jwt", "not a signed JWT"),
}  # fmt: skip


@pytest.mark.parametrize("case", FAILURES.values(), ids=FAILURES.keys())
async def test_a_token_that_fails_any_check_is_401_never_a_weaker_scope(
    issuer: Issuer, case: tuple[Any, str]
) -> None:
    make, reason = case
    paypal = route(issuer)
    identities = await started(paypal)
    try:
        with pytest.raises(errors.InvalidToken) as raised:
            await identities.scope_part(paypal, [f"Bearer {make(issuer)}"])
    finally:
        await identities.close()
    assert raised.value.status == 401 and reason in raised.value.detail
    assert raised.value.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'


@pytest.mark.parametrize(
    ("values", "sent"),
    [
        ([], False),
        (["Basic dXNlcjpwYXNz"], True),
        (["Bearer"], True),
        (["Bearer a", "Bearer b"], True),
    ],
    ids=["none", "basic", "empty", "two-lines"],
)
async def test_no_bearer_token_is_401(issuer: Issuer, values: list[str], sent: bool) -> None:
    paypal = route(issuer)
    identities = await started(paypal)
    try:
        with pytest.raises(errors.InvalidToken) as raised:
            await identities.scope_part(paypal, values)
    finally:
        await identities.close()
    challenge = 'Bearer error="invalid_token"' if sent else "Bearer"
    assert raised.value.headers["WWW-Authenticate"] == challenge


async def test_the_audience_is_checked_when_the_route_names_one(issuer: Issuer) -> None:
    paypal = route(issuer, audience="payments-api")
    identities = await started(paypal)
    try:
        ours = issuer.token(claims={"aud": ["payments-api", "other"]})
        assert await identities.scope_part(paypal, [f"Bearer {ours}"])
        with pytest.raises(errors.InvalidToken, match="another audience"):
            await identities.scope_part(paypal, [f"Bearer {issuer.token(claims={'aud': 'x'})}"])
        with pytest.raises(errors.InvalidToken, match="it has no aud claim"):
            await identities.scope_part(paypal, [f"Bearer {issuer.token()}"])
    finally:
        await identities.close()


async def test_a_rotated_key_is_read_when_a_token_names_it(
    issuer: Issuer, monkeypatch: pytest.MonkeyPatch
) -> None:
    paypal = route(issuer)
    identities = await started(paypal)
    try:
        issuer.add("rsa-2", "RS256")  # the issuer rotates: a key the gateway has not read
        token = f"Bearer {issuer.token(kid='rsa-2')}"
        # Read at start a moment ago: not again before MIN_REFRESH, whatever tokens say.
        with pytest.raises(errors.InvalidToken, match="not among"):
            await identities.scope_part(paypal, [token])
        monkeypatch.setattr(token_keys, "MIN_REFRESH", 0.0)
        assert await identities.scope_part(paypal, [token]) == [["jwt", ISSUER, "client-1"]]
    finally:
        await identities.close()


async def test_keys_that_cannot_be_read_are_503_and_kept_when_a_later_read_fails(
    issuer: Issuer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = route(issuer, jwks_file=str(tmp_path / "missing.json"))
    identities = await started(missing)
    try:
        with pytest.raises(errors.TokenKeysUnavailable) as raised:
            await identities.scope_part(missing, [f"Bearer {issuer.token()}"])
        assert raised.value.status == 503 and raised.value.retry_advised
        # Where the keys are read from is the operator's (the log says it), never the client's:
        # a file's path, or a URL that may carry a token in its query.
        assert "missing.json" not in raised.value.detail and str(tmp_path) not in str(raised.value)
    finally:
        await identities.close()
    paypal = route(issuer)
    identities = await started(paypal)
    try:
        issuer.jwks_file.write_text("not json")
        monkeypatch.setattr(token_keys, "MIN_REFRESH", 0.0)
        issuer_token = f"Bearer {issuer.token()}"
        assert await identities.scope_part(paypal, [issuer_token])  # the keys held still verify
    finally:
        await identities.close()


async def test_the_log_names_a_jwks_url_that_cannot_be_read_without_its_querys_values(
    issuer: Issuer, caplog: pytest.LogCaptureFixture
) -> None:
    # A JWKS URL may carry its credential in the query; the operator's log says where the keys
    # could not be read from, and that a query was there, never the credential. (Nothing
    # listens on the port: the read is refused, as a JWKS host that is down refuses it.)
    secret_url = f"http://127.0.0.1:{free_port()}/jwks?token=Secret7&tenant=acme"
    unreachable = route(issuer, jwks_file=None, jwks_url=secret_url)
    caplog.set_level(logging.ERROR, "oncegate.service.tokens")
    identities = await started(unreachable)
    try:
        with pytest.raises(errors.TokenKeysUnavailable):
            await identities.scope_part(unreachable, [f"Bearer {issuer.token()}"])
    finally:
        await identities.close()
    said = [record.getMessage() for record in caplog.records]
    assert any("could not read the token keys" in line for line in said), said
    assert "Secret7" not in caplog.text and "acme" not in caplog.text
    assert secret_url.split("?")[0] + "?token=***&tenant=***" in caplog.text


async def test_a_route_without_scope_jwt_adds_nothing(issuer: Issuer) -> None:
    plain = settings.Route(name="plain", match="/", upstream="http://upstream.test")
    identities = await started(plain)
    try:
        assert await identities.scope_part(plain, []) == []
    finally:
        await identities.close()
