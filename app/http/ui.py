"""`/admin/ui`: the operator's page on the admin port (contract section 9).

Server-rendered HTML and one stylesheet from this port; no script at all, so nothing runs in the
operator's browser but forms, and the Content-Security-Policy says so (`default-src 'none'`).

- The operator logs in with the admin token and holds a signed session cookie; every form that
  changes something carries the session's CSRF token, checked here in constant time (how and
  why: `http.sessions`). Changes are POSTs only; a GET never settles a key.
- The rules are the admin API's: the page calls the same `service.Operator`, so a key in flight
  is never released, and only an `unknown` key is resolved.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import ValidationError

from .. import service
from ..model import errors
from ..model.records import QueuedKey
from ..service.evidence import masked, masked_query
from .admin import Resolution, read_bounded
from .deps import RuntimeDep
from .sessions import COOKIE, SESSION_SECONDS, Session, SessionDep, admin_token, new_session

router = APIRouter(prefix="/admin/ui", include_in_schema=False)

# Forms hold a status, a few headers and a body an operator types or pastes: far below this.
MAX_FORM_BYTES = 1024 * 1024
# The login form holds the admin token and nothing else; it is the one form read before anyone
# is known, so it is held to what a token needs.
MAX_LOGIN_BYTES = 16 * 1024
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}

STYLE = """
body { font: 15px/1.4 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.4em; } h1 a { color: inherit; text-decoration: none; }
table { border-collapse: collapse; width: 100%; margin: 1em 0; }
th, td { text-align: left; padding: .3em .6em; border-bottom: 1px solid #ddd; }
th { background: #f4f4f4; } td code { font-size: .9em; }
.note { background: #eef6ee; padding: .6em 1em; } .error { background: #fbeaea; padding: .6em 1em; }
form.inline { display: inline; } fieldset { margin: 1em 0; border: 1px solid #ccc; }
label { display: block; margin: .4em 0; } textarea { width: 100%; font-family: monospace; }
header form { float: right; }
"""


def page(title: str, content: str, status: int = 200, session: Session | None = None) -> Response:
    logout = ""
    if session is not None:
        logout = (
            '<form method="post" action="/admin/ui/logout">'
            f"{_csrf_field(session)}<button>Log out</button></form>"
        )
    document = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} · oncegate</title>
<link rel="stylesheet" href="/admin/ui/style.css"></head>
<body><header>{logout}<h1><a href="/admin/ui">oncegate</a> · {escape(title)}</h1></header>
{content}
</body></html>"""
    return HTMLResponse(document, status_code=status, headers=SECURITY_HEADERS)


def login_page(message: str = "", status: int = 401) -> Response:
    shown = f'<p class="error">{escape(message)}</p>' if message else ""
    return page(
        "log in",
        f"""{shown}
<form method="post" action="/admin/ui/login">
<label>Admin token (ONCEGATE_ADMIN_TOKEN)
<input type="password" name="token" autocomplete="current-password" required autofocus></label>
<button>Log in</button></form>""",
        status,
    )


def _csrf_field(session: Session) -> str:
    return f'<input type="hidden" name="csrf" value="{escape(session.csrf)}">'


async def _form(request: Request, limit: int = MAX_FORM_BYTES) -> dict[str, str]:
    """The fields of an urlencoded form, each given once; never more than `limit` bytes read.
    Every form but the login is read after the session was checked (`SessionDep`)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != (
        "application/x-www-form-urlencoded"
    ):
        raise errors.InvalidRequest("send the page's form (application/x-www-form-urlencoded)")
    body = await read_bounded(request, limit, "the limit of the page's forms")
    try:
        fields = parse_qs(body.decode(), keep_blank_values=True, max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        raise errors.InvalidRequest("the form is not valid UTF-8 url-encoded text") from None
    return {name: values[-1] for name, values in fields.items()}


def _forged(session: Session, form: Mapping[str, str]) -> Response | None:
    """The refusal of a form that did not come from this page, or None when it did."""
    if hmac.compare_digest(form.get("csrf", "").encode(), session.csrf.encode()):
        return None
    message = (
        "This form did not come from the admin page (its CSRF token is missing or wrong): "
        "nothing was changed. Reload the page and try again."
    )
    return page("refused", f'<p class="error">{message}</p>', 403, session)


async def login_needed(request: Request, error: Exception) -> Response:
    return login_page()


@router.get("/style.css")
async def style() -> Response:
    return Response(STYLE, media_type="text/css", headers=SECURITY_HEADERS)


@router.post("/login")
async def login(request: Request, runtime: RuntimeDep) -> Response:
    token = admin_token(runtime)
    form = await _form(request, MAX_LOGIN_BYTES)
    if not hmac.compare_digest(form.get("token", "").encode(), token.encode()):
        return login_page("That is not the admin token.")
    response = RedirectResponse("/admin/ui", status_code=303, headers=SECURITY_HEADERS)
    response.set_cookie(
        COOKIE,
        new_session(token, time.time()),
        max_age=SESSION_SECONDS,
        path="/admin/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.post("/logout")
async def logout(request: Request, runtime: RuntimeDep, session: SessionDep) -> Response:
    refused = _forged(session, await _form(request))
    if refused is not None:
        return refused
    # The browser forgets the cookie, and the store remembers it ended: a copy of it (another
    # browser, a proxy's log) is refused too, until it would have expired anyway.
    await runtime.operator.end_session(session.digest, session.expires_at)
    response = RedirectResponse("/admin/ui", status_code=303, headers=SECURITY_HEADERS)
    response.delete_cookie(COOKIE, path="/admin/ui", httponly=True, samesite="strict")
    return response


def _time(moment: datetime | None) -> str:
    return "—" if moment is None else escape(moment.isoformat(timespec="seconds"))


CAUSES = {
    "answer_lost": "answer lost: the upstream timed out or broke the connection after the "
    "request was sent",
    "lease_expired": "lease ran out: its gateway never settled it (it died, or PostgreSQL failed "
    "when it stored the answer)",
}
SETTLED = {
    "complete": "settled as completed: retries get that answer",
    "release": "released: the next retry is forwarded",
    "resend": "re-sent: its request was forwarded once more and the key settled with the "
    "upstream's answer (the key's page shows how)",
}
FAILURES = {
    "read_timeout": "the upstream's answer did not come back in time",
    "no_answer": "the connection broke (reset, closed or a malformed answer) before a status line",
    "answer_broken": "the connection broke while the answer's body came",
    "answer_cut": "the gateway stopped reading the answer's body (it was shutting down, or the "
    "client had gone and the key reached its ttl); the rest of the body was lost",
}


@router.get("")
async def queue(
    runtime: RuntimeDep,
    session: SessionDep,
    route: str = "",
    since: str = "",
    cursor: str = "",
    settled: int | None = None,
    action: str = "",
) -> Response:
    note = ""
    if settled is not None and action in SETTLED:
        note = f'<p class="note">Key {settled} {SETTLED[action]}.</p>'
    try:
        moment = datetime.fromisoformat(since) if since else None
    except ValueError:
        return _queue_page(session, route, since, note, error="since is not an ISO 8601 time")
    try:
        listed = await runtime.operator.queue("unknown", route or None, moment, cursor or None)
    except errors.InvalidRequest as exc:
        return _queue_page(session, route, since, note, error=exc.detail)
    return _queue_page(session, route, since, note, listed)


def _queue_page(
    session: Session,
    route: str,
    since: str,
    note: str,
    listed: service.QueuePage | None = None,
    error: str = "",
) -> Response:
    shown = f'<p class="error">{escape(error)}</p>' if error else ""
    filters = f"""<form method="get" action="/admin/ui">
<label>Route <input name="route" value="{escape(route)}"></label>
<label>Claimed since (ISO 8601, with a zone) <input name="since" value="{escape(since)}"
 placeholder="2026-12-03T06:00:00Z"></label>
<button>Filter</button></form>"""
    rows = ""
    if listed is not None:
        rows = "".join(_queue_row(record) for record in listed.records)
    table = (
        "<table><thead><tr><th>id</th><th>route</th><th>key</th><th>claimed</th>"
        "<th>how it turned unknown</th><th>expires</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
        if rows
        else "<p>No key waits for an operator.</p>"
    )
    more = ""
    if listed is not None and listed.cursor is not None:
        query = urlencode({"route": route, "since": since, "cursor": listed.cursor})
        more = f'<p><a href="/admin/ui?{escape(query)}">Next page</a></p>'
    explanation = (
        "<p>Keys in state <b>unknown</b>, oldest first: their request may or may not have been "
        "performed upstream. Retries get 409 until each is resolved here; after it expires a "
        "retry is forwarded again.</p>"
    )
    return page(
        "unknown keys",
        f"{note}{shown}{explanation}{filters}{table}{more}",
        400 if error else 200,
        session,
    )


def _queue_row(record: QueuedKey) -> str:
    cause = record.cause or ""
    return (
        f'<tr><td><a href="/admin/ui/keys/{record.id}">{record.id}</a></td>'
        f"<td>{escape(record.route)}</td><td><code>{escape(record.key)}</code></td>"
        f"<td>{_time(record.created_at)}</td><td>{escape(CAUSES.get(cause, cause))}</td>"
        f"<td>{_time(record.expires_at)}</td></tr>"
    )


@router.get("/keys/{record_id}")
async def key_page(runtime: RuntimeDep, session: SessionDep, record_id: int) -> Response:
    try:
        record = await runtime.operator.describe(record_id)
    except errors.NotFound as exc:
        return page("no such key", f'<p class="error">{escape(exc.detail)}</p>', 404, session)
    return _key_page(session, record, await _evidence(runtime.operator, record.id))


async def _evidence(operator: service.Operator, record_id: int) -> str:
    """The request behind the key (credentials masked, a JSON or form body readable), who
    claimed it and what it saw, as rows of the key's table."""
    try:
        record = await operator.by_id(record_id)
    except errors.NotFound:
        return ""
    rows: list[tuple[str, str]] = []
    kept = await operator.kept_request(record)
    if kept is not None:
        query = masked_query(kept.query)
        target = kept.path + (f"?{query}" if query else "")
        rows.append(("request", f"<code>{escape(kept.method)} {escape(target)}</code>"))
        shown = "\n".join(f"{name}: {value}" for name, value in masked(kept.headers))
        rows.append(("request headers (credentials masked)", f"<pre>{escape(shown)}</pre>"))
        rows.append(("request body", f"<pre>{escape(kept.readable_body())}</pre>"))
    elif record.request is not None:
        rows.append(("request", "kept, but sealed with a key this gateway does not hold"))
    elif record.state in ("unknown", "in_progress"):
        rows.append(("request", "not kept (the route says keep_request: never)"))
    if record.claimed_by is not None:
        claimed = json.loads(record.claimed_by)
        rows.append(("gateway", escape(
            f"{claimed.get('host')}, pid {claimed.get('pid')}, started {claimed.get('started_at')}"
        )))  # fmt: skip
    if record.failure is not None:
        seen = json.loads(record.failure)
        status = "not received" if not seen.get("status_line_received") else (
            f"received ({seen.get('status')})"
        )  # fmt: skip
        rows.append(("what it saw", escape(
            f"{FAILURES.get(seen.get('kind'), seen.get('kind'))}; status line {status}; "
            f"{seen.get('bytes_received', 0)} bytes of the body; {seen.get('detail', '')}"
        )))  # fmt: skip
    return "".join(f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in rows)


def _key_page(
    session: Session,
    record: QueuedKey,
    evidence: str,
    error: str = "",
    status: int = 200,
    form: Mapping[str, str] | None = None,
) -> Response:
    form = form or {}
    facts: Sequence[tuple[str, str]] = [
        ("id", str(record.id)),
        ("route", escape(record.route)),
        ("key", f"<code>{escape(record.key)}</code>"),
        ("state", escape(record.state)),
        ("how it turned unknown", escape(CAUSES.get(record.cause or "", "—"))),
        ("upstream status", str(record.status) if record.status is not None else "— (no answer)"),
        ("claimed and sent", _time(record.created_at)),
        ("lease ends / ended", _time(record.lease_expires_at)),
        ("completed", _time(record.completed_at)),
        ("expires (then a retry is forwarded again)", _time(record.expires_at)),
    ]
    table = "<table>" + "".join(
        f"<tr><th>{name}</th><td>{value}</td></tr>" for name, value in facts
    )
    table += evidence + "</table>"
    shown = f'<p class="error">{escape(error)}</p>' if error else ""
    actions = "<p>Only an <b>unknown</b> key can be resolved here.</p>"
    if record.state == "unknown":
        target = f"/admin/ui/keys/{record.id}/resolve"
        actions = f"""<p>Ask the upstream whether it performed this request (it received the
Idempotency-Key above), then settle the key with the answer it gave, or release it.</p>
<form method="post" action="{target}"><fieldset><legend>It was performed</legend>
{_csrf_field(session)}<input type="hidden" name="action" value="complete">
<label>Status <input name="status" type="number" min="200" max="599" required
 value="{escape(form.get("status", ""))}"></label>
<label>Headers, one <code>Name: value</code> a line
<textarea name="headers" rows="3">{escape(form.get("headers", ""))}</textarea></label>
<label>Body (UTF-8 text)<textarea name="body" rows="6">{escape(form.get("body", ""))}</textarea>
</label><button>Settle as completed</button></fieldset></form>
<form method="post" action="{target}"><fieldset><legend>It was not performed</legend>
{_csrf_field(session)}<input type="hidden" name="action" value="release">
<button>Release: the next retry is forwarded</button></fieldset></form>
<form method="post" action="{target}"><fieldset><legend>It was not performed: send it now</legend>
{_csrf_field(session)}<input type="hidden" name="action" value="resend">
<button>Re-send: forward the request above once more, store its answer</button>
</fieldset></form>"""
    return page(f"key {record.id}", f"{shown}{table}{actions}", status, session)


def _resolution(form: Mapping[str, str]) -> Resolution:
    """The form as the admin API's resolution, validated by the same rules."""
    if form["action"] in ("release", "resend"):
        return Resolution(action=form["action"])
    pairs = []
    for line in form.get("headers", "").splitlines():
        if line.strip():
            name, colon, value = line.partition(":")
            if not colon:
                raise ValueError(f"{line!r} is not a 'Name: value' header line")
            pairs.append((name.strip(), value.strip()))
    status = form.get("status", "").strip()
    return Resolution(
        action="complete",
        status=int(status) if status.isdigit() else None,
        headers=pairs,
        body=form.get("body", ""),
    )


@router.post("/keys/{record_id}/resolve")
async def resolve(
    request: Request, runtime: RuntimeDep, session: SessionDep, record_id: int
) -> Response:
    form = await _form(request)
    refused = _forged(session, form)
    if refused is not None:
        return refused
    operator = runtime.operator
    record = await operator.describe(record_id)
    if form.get("action") not in SETTLED:
        # Only the two buttons' actions exist: anything else settles nothing, least of all a
        # release that would let the next retry be forwarded again.
        actions = " or ".join(repr(action) for action in SETTLED)
        error = f"the action is {form.get('action')!r}: it is {actions}; nothing was changed"
        return _key_page(session, record, await _evidence(operator, record_id), error, 400, form)
    try:
        resolution = _resolution(form)
    except (ValidationError, ValueError) as exc:
        message = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        message = message.removeprefix("Value error, ")
        return _key_page(session, record, await _evidence(operator, record_id), message, 422, form)
    try:
        if resolution.action == "resend":
            await operator.resend(record_id)
        else:
            await operator.resolve(record_id, resolution.answer())
    except (errors.KeyNotUnknown, errors.RequestNotKept, errors.OutcomeUnknown,
            errors.UpstreamUnavailable) as exc:  # fmt: skip
        evidence = await _evidence(operator, record_id)
        return _key_page(session, record, evidence, exc.detail, exc.status_code, form)
    query = urlencode({"settled": record_id, "action": resolution.action})
    return RedirectResponse(f"/admin/ui?{query}", status_code=303, headers=SECURITY_HEADERS)
