"""`oncegate keys list|show|resolve|release`: the admin API from a terminal (contract section 9).

A thin client of the admin port: every rule (only an `unknown` key is resolved, a key in flight
is never released) is the gateway's, so the command and the page and the API can never disagree.
It reads `ONCEGATE_ADMIN_TOKEN` and sends it as a bearer token; `--admin-url` (or
`ONCEGATE_ADMIN_URL`) says where the admin port is, by default 127.0.0.1 on
`ONCEGATE_ADMIN_PORT` (8081). The gateway's problems are printed as `title: detail` and end the
command with status 1; a missing token is a configuration error (status 2).

httpx is imported when a `keys` command runs, not with this module: `oncegate`'s parser adds
this command's for every command, `serve` too, whose start should not pay for a client it never
uses.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from .. import settings
from ..kernel import urls
from ..model import errors

if TYPE_CHECKING:
    import httpx

EXIT_REFUSED = 1
# Answers on the admin port are one statement of PostgreSQL away: a generous bound still ends a
# command aimed at a wrong address quickly.
TIMEOUT = 30.0
COLUMNS = ("id", "route", "key", "state", "cause", "created_at", "expires_at")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = commands.add_parser(
        "keys",
        help="the operator's queue of unknown keys: list, show, resolve, release",
        description="Talk to a running gateway's admin API with ONCEGATE_ADMIN_TOKEN.",
    )
    keys.add_argument(
        "--admin-url",
        metavar="URL",
        help="the admin port (ONCEGATE_ADMIN_URL; default http://127.0.0.1:$ONCEGATE_ADMIN_PORT, "
        "port 8081)",
    )
    keys.set_defaults(run=run)
    actions = keys.add_subparsers(required=True, metavar="ACTION")

    listing = actions.add_parser("list", help="keys in a state, oldest first (default unknown)")
    listing.add_argument(
        "--state", default="unknown", choices=["unknown", "in_progress", "completed"]
    )
    listing.add_argument("--route", metavar="R")
    listing.add_argument(
        "--since", metavar="TIME", help="claimed at or after: ISO 8601 time, or a DURATION ago (1h)"
    )
    listing.add_argument("--limit", type=int, metavar="N", help="at most N keys (default all)")
    listing.add_argument(
        "--json",
        action="store_true",
        help="one JSON array of the keys, [] when none (written as the pages come)",
    )
    listing.set_defaults(action=_list)

    show = actions.add_parser("show", help="one key by id, or a key in every scope (--key)")
    show.add_argument("id", nargs="?", type=int, help="the key's id (from `list`)")
    show.add_argument("--key", metavar="KEY", help="the Idempotency-Key, in every scope")
    show.add_argument("--route", metavar="R", help="with --key: on this route only")
    show.add_argument(
        "--request",
        action="store_true",
        help="with --key: also the request behind each record (credentials masked), the "
        "gateway that claimed it and what it saw",
    )
    show.set_defaults(action=_show)

    resolve = actions.add_parser(
        "resolve",
        help="settle an unknown key as completed with the answer the upstream gave, or re-send "
        "its kept request (--resend)",
    )
    resolve.add_argument("id", type=int)
    resolve.add_argument(
        "--resend",
        action="store_true",
        help="the upstream did not perform it: forward its kept request once more under the "
        "same key and store what comes back",
    )
    resolve.add_argument("--status", type=int, help="the upstream's status (without --resend)")
    resolve.add_argument(
        "--header", action="append", default=[], metavar="'NAME: VALUE'", help="repeatable"
    )
    body = resolve.add_mutually_exclusive_group()
    body.add_argument("--body", metavar="TEXT", help="the body, as UTF-8 text")
    body.add_argument("--body-file", metavar="FILE", type=Path, help="the body, from a file")
    resolve.set_defaults(action=_resolve)

    release = actions.add_parser(
        "release", help="release an unknown key: the upstream did not perform it; the next "
        "retry is forwarded"
    )  # fmt: skip
    release.add_argument("id", type=int)
    release.set_defaults(action=_release)


class AdminAccess(BaseModel):
    """The part of the settings `oncegate keys` reads (`settings.load_part`): where the admin
    port is and its token. `admin_url` is this command's own (`serve` has no use for it)."""

    admin_token: str | None = None
    admin_port: settings.Port = settings.DEFAULT_ADMIN_PORT
    admin_url: str | None = None


class AdminClient:
    def __init__(self, arguments: argparse.Namespace) -> None:
        access = settings.load_part(AdminAccess)
        token = access.admin_token
        if not token:
            raise errors.ConfigError(
                "set ONCEGATE_ADMIN_TOKEN to the gateway's admin token to use `oncegate keys`"
            )
        self.url = (
            arguments.admin_url or access.admin_url or f"http://127.0.0.1:{access.admin_port}"
        ).rstrip("/")
        import httpx

        self._client = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT
        )

    def call(self, method: str, path: str, **options: Any) -> Any:
        """The answer's JSON document; a problem or an unreachable port ends the command."""
        import httpx

        try:
            response = self._client.request(method, path, **options)
        except httpx.HTTPError as exc:
            raise Refused(f"cannot reach the admin API at {urls.shown(self.url)}: {exc}") from None
        if response.is_error:
            raise Refused(_problem(response))
        return response.json() if response.content else None


class Refused(Exception):
    """The gateway said no, or could not be reached: the message says why."""


def _problem(response: httpx.Response) -> str:
    try:
        document = response.json()
        return f"{document['title']}: {document['detail']} ({response.status_code})"
    except (ValueError, KeyError, TypeError):
        return f"the admin API answered {response.status_code}: {response.text[:200]}"


def run(arguments: argparse.Namespace) -> int:
    try:
        result: int = arguments.action(AdminClient(arguments), arguments)
    except Refused as exc:
        sys.stderr.write(f"oncegate keys: {exc}\n")
        return EXIT_REFUSED
    return result


def _since(text: str) -> str:
    """An ISO 8601 time with a zone, or a DURATION before now."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        try:
            seconds = settings.parse_duration(text)
        except ValueError:
            raise errors.ConfigError(
                f"--since {text!r}: give an ISO 8601 time (2026-12-03T06:00:00Z) or a duration "
                "ago (90s, 15m, 24h, 7d)"
            ) from None
        try:
            moment = datetime.now(UTC) - timedelta(seconds=seconds)
        except OverflowError:
            raise errors.ConfigError(
                f"--since {text!r}: that reaches before the year 1; give a shorter duration"
            ) from None
    if moment.tzinfo is None:
        raise errors.ConfigError(f"--since {text!r}: give a time zone (Z or +01:00)")
    try:
        moment.astimezone(UTC)
    except OverflowError:
        raise errors.ConfigError(
            f"--since {text!r}: that is outside the years 1 to 9999 in UTC"
        ) from None
    return moment.isoformat()


def _list(client: AdminClient, arguments: argparse.Namespace) -> int:
    params: dict[str, str] = {"state": arguments.state}
    if arguments.route:
        params["route"] = arguments.route
    if arguments.since:
        params["since"] = _since(arguments.since)
    shown = 0
    rows: list[Mapping[str, Any]] = []
    if arguments.json:
        sys.stdout.write("[")
    while arguments.limit is None or shown < arguments.limit:
        document = client.call("GET", "/admin/keys", params=params)
        records = document["records"]
        if arguments.limit is not None:
            records = records[: arguments.limit - shown]
        for record in records:
            shown += 1
            if arguments.json:
                # One array, written a record at a time: a long queue is never held whole.
                sys.stdout.write(("\n" if shown == 1 else ",\n") + json.dumps(record))
            else:
                rows.append(record)
        if document["next_cursor"] is None:
            break
        params["cursor"] = document["next_cursor"]
    if arguments.json:
        sys.stdout.write("\n]\n" if shown else "]\n")
    else:
        sys.stdout.write(_table(rows) if rows else f"no {arguments.state} keys\n")
    return 0


def _table(records: list[Mapping[str, Any]]) -> str:
    cells = [[str(record.get(column) or "-") for column in COLUMNS] for record in records]
    table = [list(COLUMNS), *cells]
    widths = [max(len(row[index]) for row in table) for index in range(len(COLUMNS))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    return "\n".join(lines) + "\n"


def _show(client: AdminClient, arguments: argparse.Namespace) -> int:
    if (arguments.id is None) == (arguments.key is None):
        raise errors.ConfigError("give the key's id, or --key KEY (not both)")
    if arguments.id is not None:
        document = client.call("GET", f"/admin/keys/{arguments.id}")
    else:
        params = {"key": arguments.key, "body": "1"}
        if arguments.route:
            params["route"] = arguments.route
        if arguments.request:
            params["request"] = "1"
        document = client.call("GET", "/admin/keys", params=params)
    sys.stdout.write(json.dumps(document, indent=2) + "\n")
    return 0


def _resolve(client: AdminClient, arguments: argparse.Namespace) -> int:
    if arguments.resend:
        if (
            arguments.status is not None
            or arguments.header
            or arguments.body is not None
            or (arguments.body_file is not None)
        ):
            raise errors.ConfigError("--resend sends the kept request: give no answer with it")
        document = client.call(
            "POST", f"/admin/keys/{arguments.id}/resolve", json={"action": "resend"}
        )
        answer = document["answer"]
        settled = (
            "the key was released: the next retry is forwarded"
            if answer["outcome"] == "released"
            else "retries get that answer (or 409 response-not-stored, past the route's "
            "max_stored_response)"
        )
        sys.stdout.write(
            f"key {arguments.id} re-sent: the upstream answered {answer['status']} "
            f"({answer['outcome']}); {settled}\n"
        )
        sys.stdout.write(json.dumps(answer, indent=2) + "\n")
        return 0
    if arguments.status is None:
        raise errors.ConfigError("give --status (the answer the upstream gave), or --resend")
    headers = []
    for line in arguments.header:
        name, colon, value = line.partition(":")
        if not colon:
            raise errors.ConfigError(f"--header {line!r}: write it as 'Name: value'")
        headers.append([name.strip(), value.strip()])
    resolution: dict[str, Any] = {
        "action": "complete",
        "status": arguments.status,
        "headers": headers,
    }
    if arguments.body_file is not None:
        data = arguments.body_file.read_bytes()
        try:
            resolution["body"] = data.decode()
        except UnicodeDecodeError:
            resolution["body_base64"] = base64.b64encode(data).decode()
    elif arguments.body is not None:
        resolution["body"] = arguments.body
    client.call("POST", f"/admin/keys/{arguments.id}/resolve", json=resolution)
    sys.stdout.write(f"key {arguments.id} settled as completed with status {arguments.status}\n")
    return 0


def _release(client: AdminClient, arguments: argparse.Namespace) -> int:
    client.call("POST", f"/admin/keys/{arguments.id}/resolve", json={"action": "release"})
    sys.stdout.write(f"key {arguments.id} released: the next retry is forwarded\n")
    return 0
