"""The admin page's sessions (`/admin/ui`, contract section 9): how the browser carries the admin
token, and the dependency that finds the operator behind a request (`SessionDep`).

How the browser carries the admin token, and why:
- A browser cannot be made to send `Authorization: Bearer` from a plain form or link, so the page
  starts with a login form: the operator pastes `ONCEGATE_ADMIN_TOKEN`, compared in constant
  time, and gets a session cookie. The token itself never goes into the cookie: the cookie is an
  expiry and a random nonce signed with HMAC-SHA256 under the token, so it stops working when it
  expires or when the token is changed. A logout ends it for real: its digest is stored in
  PostgreSQL until its expiry (`oncegate_ended_sessions`), so every gateway and worker refuses
  it, after restarts too.
- The cookie is `HttpOnly` (no script could read it, were there one), `SameSite=Strict` (another
  site's page cannot make the browser send it), `Path=/admin/ui`, and `Secure` when the page is
  served over https.
- Every form that changes something carries a CSRF token, the HMAC of the session cookie under
  the admin token, checked in constant time: a second defence for browsers that do not honour
  SameSite. Changes are POSTs only; a GET never settles a key.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Request

from ..model import errors
from .deps import RuntimeDep

COOKIE = "oncegate_session"
# A working day: long enough not to interrupt an incident, short enough that a cookie left in a
# shared browser stops working by the next shift.
SESSION_SECONDS = 8 * 3600


def _sign(token: str, purpose: str, value: str) -> str:
    return hmac.new(token.encode(), f"{purpose}|{value}".encode(), hashlib.sha256).hexdigest()


def new_session(token: str, now: float) -> str:
    """`expiry.nonce.signature`: the nonce makes each login's session its own, so a logout ends
    that one and not another made in the same second."""
    value = f"{int(now) + SESSION_SECONDS}.{secrets.token_hex(16)}"
    return f"{value}.{_sign(token, 'session', value)}"


# An expiry is a Unix time in seconds: 10 digits until the year 2286, 12 for ever after.
EXPIRY_DIGITS = 12


def session_valid(token: str, cookie: str, now: float) -> bool:
    """Whether `cookie` is a session this token signed that has not expired. A cookie is
    attacker input: anything but ASCII digits, a dot and ASCII is simply not a session."""
    value, _, signature = cookie.rpartition(".")
    expires = value.partition(".")[0]
    if not (expires.isascii() and expires.isdigit() and len(expires) <= EXPIRY_DIGITS):
        return False  # '²'.isdigit() is true, and int() of 5,000 digits refuses
    if not signature.isascii() or int(expires) <= now:
        return False
    return hmac.compare_digest(signature.encode(), _sign(token, "session", value).encode())


def csrf_token(token: str, cookie: str) -> str:
    return _sign(token, "csrf", cookie)


class Session:
    """The operator behind a request: the admin token and their session cookie."""

    def __init__(self, token: str, cookie: str) -> None:
        self.token = token
        self.cookie = cookie

    @property
    def csrf(self) -> str:
        return csrf_token(self.token, self.cookie)

    @property
    def digest(self) -> bytes:
        """What a logout records (the cookie holds no secret; its digest is shorter)."""
        return hashlib.sha256(self.cookie.encode()).digest()

    @property
    def expires_at(self) -> datetime:
        return datetime.fromtimestamp(int(self.cookie.partition(".")[0]), UTC)


class LoginNeeded(Exception):
    """No valid session: answered with the login form."""


def admin_token(runtime: RuntimeDep) -> str:
    token = runtime.settings.admin_token
    if not token:
        raise errors.AdminDisabled(
            "the admin page is off: start the gateway with ONCEGATE_ADMIN_TOKEN set to a secret"
        )
    return token


async def require_session(request: Request, runtime: RuntimeDep) -> Session:
    token = admin_token(runtime)
    cookie = request.cookies.get(COOKIE, "")
    if not session_valid(token, cookie, time.time()):
        raise LoginNeeded
    session = Session(token, cookie)
    if await runtime.operator.session_ended(session.digest):
        raise LoginNeeded  # logged out: on any gateway, before any restart
    return session


SessionDep = Annotated[Session, Depends(require_session)]
