"""PostgreSQL URLs in libpq's syntax, with one host or several, read in one place.

`ONCEGATE_DATABASE_URL` (and the lab's `--database-url`) may be any of:

- `postgresql://user:password@db:5432/oncegate`: one host;
- `postgresql://user@db1:5432,db2:5432/oncegate?target_session_attrs=read-write`: several hosts,
  tried in order until one takes writes (libpq's multi-host URL);
- `postgresql://user@/oncegate?host=db1:5432,db2:5432&target_session_attrs=read-write`: the same
  list in the query, a port beside each host;
- `postgresql://user@/oncegate?host=db1,db2&port=5432,5433&target_session_attrs=read-write`: the
  same with the ports apart (one port for all, or one per host);
- `postgresql:///oncegate?host=/run/postgresql`: a Unix socket directory.

The driver (asyncpg) connects with the URL as given; this module checks it first, so a mistake is
one clear sentence at start-up rather than a traceback from deep inside a pool, and it is the one
place that says where a URL points (`describe`) or prints it (`without_password`): no log line
ever carries a password.

Several hosts need `target_session_attrs=read-write` (or `primary`): every claim writes, and
without it a gateway whose primary is down would settle on a standby, where every claim fails,
and stay there after the failover.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, unquote, urlsplit

SCHEMES = ("postgresql", "postgres")
# Query parameters no log line may show.
SECRET_PARAMETERS = ("password", "sslpassword")
DEFAULT_PORT = 5432
# libpq's values; the gateway writes, so only those that guarantee a session that takes writes
# (or, for one host, whatever that host is) are accepted.
WRITABLE_SESSIONS = ("read-write", "primary")
ALL_SESSIONS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")
# libpq's, which asyncpg takes too; any other value it refuses only when it connects, past the
# edge (where `oncegate serve` and `migrate` ended in a traceback).
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


class InvalidDatabaseUrl(ValueError):
    """The URL is not one PostgreSQL can be reached with; the message says why (never with the
    password in it)."""


@dataclass(frozen=True, slots=True)
class Host:
    name: str  # a host name, an IP address (IPv6 without brackets), or a socket directory
    port: int

    @property
    def is_socket(self) -> bool:
        return self.name.startswith("/")

    def __str__(self) -> str:
        if self.is_socket:
            return f"the Unix socket in {self.name}"
        if ":" in self.name:
            return f"[{self.name}]:{self.port}"
        return f"{self.name}:{self.port}"


@dataclass(frozen=True, slots=True)
class DatabaseUrl:
    hosts: tuple[Host, ...]
    database: str | None
    user: str | None
    target_session_attrs: str | None

    def describe(self) -> str:
        """Where the URL points, for messages: the host (or the host list, and which one is
        wanted) and the database; never the user or password."""
        database = self.database or "(default database)"
        if len(self.hosts) == 1:
            return f"{self.hosts[0]}, database {database}"
        wanted = f" ({self.target_session_attrs})" if self.target_session_attrs else ""
        listed = ", ".join(str(host) for host in self.hosts)
        return f"hosts {listed}{wanted}, database {database}"

    def host_at(self, address: object) -> Host | None:
        """The host of this URL a connection reached, from the driver's address: a (host, port)
        pair, or a socket file path (`/dir/.s.PGSQL.5432`)."""
        if isinstance(address, str):
            directory, _, socket_file = address.rpartition("/")
            port = socket_file.rpartition(".")[2]
            address = (directory or "/", int(port) if port.isdigit() else DEFAULT_PORT)
        if not isinstance(address, tuple) or len(address) < 2:
            return None
        for host in self.hosts:
            if (host.name, host.port) == (address[0], address[1]):
                return host
        return Host(str(address[0]), int(address[1]))


def parse(url: str) -> DatabaseUrl:
    """Read a PostgreSQL URL; `InvalidDatabaseUrl` says what is wrong with it."""
    scheme, separator, _ = url.partition("://")
    if not separator or scheme not in SCHEMES:
        raise InvalidDatabaseUrl("the database URL must be a postgresql:// URL")
    parts = urlsplit(url)
    after_authority = parts.path + parts.query + parts.fragment
    if "@" not in parts.netloc and ":" in parts.netloc and "@" in after_authority:
        # `user:pass/word@host`, `user:pass?word@host`, `user:pass#word@host`: the authority
        # ended inside the password (libpq reads on to the '@', asyncpg stops at the '/', '?' or
        # '#'), so its first part would read as a host and a port, and the rest as the database
        # or the query: never say either.
        raise InvalidDatabaseUrl(
            "the database URL has an '@' after its host: percent-encode '/', '?' and '#' in the "
            "password (%2F, %3F, %23), and '@' in a database name or a query's value (%40)"
        )
    if parts.netloc.count("@") > 1:
        # `user:pass@word@host`: asyncpg and libpq end the password at the first '@', so the
        # rest of it would be taken for the host.
        raise InvalidDatabaseUrl(
            "the database URL has more than one '@' before its host: percent-encode '@' in the "
            "user name or password (%40)"
        )
    try:
        parameters = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise InvalidDatabaseUrl(
            "the database URL's query is not name=value pairs joined by &"
        ) from None
    query: dict[str, str] = {}
    for name, value in parameters:
        if name in query and name in ("host", "port", "target_session_attrs", "dbname"):
            raise InvalidDatabaseUrl(
                f"the database URL gives {name}= twice: list several hosts in one parameter, "
                "host=db1:5432,db2:5432"
            )
        query[name] = value
    credentials, at, hostspec = parts.netloc.rpartition("@")
    if not at:
        credentials, hostspec = "", parts.netloc
    user = unquote(credentials.partition(":")[0]) or query.get("user") or None
    if query.get("host"):
        if hostspec:
            raise InvalidDatabaseUrl(
                "the database URL names hosts twice, before the path and in host=: give one list"
            )
        hosts = _hosts(query["host"], query.get("port"), quoted=False)
    else:
        hosts = _hosts(hostspec or "localhost", query.get("port"), quoted=True)
    database = unquote(parts.path.lstrip("/")) or query.get("dbname") or None
    if query.get("sslmode", "") not in ("", *SSL_MODES):  # empty: unset, as asyncpg reads it
        raise InvalidDatabaseUrl(  # its value not repeated: a mangled URL may hold a secret there
            f"the database URL's sslmode is not one of {', '.join(SSL_MODES)}"
        )
    session = query.get("target_session_attrs") or None
    if session is not None and session not in ALL_SESSIONS:
        raise InvalidDatabaseUrl(
            f"target_session_attrs={session} is not one of {', '.join(ALL_SESSIONS)}"
        )
    if session is not None and session not in ("any", *WRITABLE_SESSIONS):
        raise InvalidDatabaseUrl(
            f"target_session_attrs={session} would let the gateway settle on a standby, where "
            "every claim fails: use target_session_attrs=read-write"
        )
    if len(hosts) > 1 and session not in WRITABLE_SESSIONS:
        raise InvalidDatabaseUrl(
            "a database URL with several hosts needs target_session_attrs=read-write: without "
            "it a gateway whose primary is down connects to a standby, where every claim fails"
        )
    return DatabaseUrl(tuple(hosts), database, user, session)


def _hosts(listed: str, ports: str | None, *, quoted: bool) -> list[Host]:
    names: list[str] = []
    beside: list[str | None] = []
    for spec in listed.split(","):
        if not spec:
            raise InvalidDatabaseUrl("the database URL's host list has an empty entry")
        bracketed = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", spec)
        if bracketed:
            name, port = bracketed.group(1), bracketed.group(2)
        elif spec.startswith("/") or (quoted and spec.startswith("%2F")):
            name, port = spec, None
        else:
            name, colon, after = spec.partition(":")
            port = after if colon else None
        names.append(unquote(name) if quoted else name)
        beside.append(port)
    given = ports.split(",") if ports else []
    if given and any(port is not None for port in beside):
        raise InvalidDatabaseUrl("the database URL gives ports beside its hosts and in port=")
    if given and len(given) not in (1, len(names)):
        raise InvalidDatabaseUrl(
            f"the database URL has {len(names)} hosts and {len(given)} ports in port=: give one "
            "port for all, or one per host"
        )
    if len(given) == 1:
        given = given * len(names)
    chosen = given or beside
    return [Host(name, _port(port, name)) for name, port in zip(names, chosen, strict=True)]


def _port(port: str | None, host: str) -> int:
    if not port:
        return DEFAULT_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        # Never the port itself: in `user:password/db`, with the '@' and host left out, the
        # password is what reads as the port (and the user name as the host).
        raise InvalidDatabaseUrl(
            f"the database URL's port for host {host!r} is not a number from 1 to 65535 (a "
            "password goes before an '@' and the host: postgresql://user:password@host/db)"
        )
    return int(port)


def for_libpq(url: str) -> str:
    """`url` as libpq (psycopg, for LangGraph's saver) reads it. libpq takes a port beside each
    host only before the path (`db1:5432,db2:5433`); in the query it wants the hosts and ports
    apart (`host=db1,db2&port=5432,5433`), where asyncpg also takes `host=db1:5432,db2:5433`.
    That one form is rewritten; every other URL is returned as it is."""
    parts = urlsplit(url)
    parameters = parse_qsl(parts.query, keep_blank_values=True)
    listed = dict(parameters).get("host")
    if not listed or "port" in dict(parameters):
        return url
    hosts = _hosts(listed, None, quoted=False)
    rewritten: list[tuple[str, str]] = []
    for name, value in parameters:
        if name == "host":
            rewritten.append(("host", ",".join(host.name for host in hosts)))
            rewritten.append(("port", ",".join(str(host.port) for host in hosts)))
        else:
            rewritten.append((name, value))
    query = "&".join(f"{quote(name)}={quote(value, safe='/:,')}" for name, value in rewritten)
    return f"{parts.scheme}://{parts.netloc}{parts.path}?{query}"


def describe(url: str) -> str:
    """`parse(url).describe()`, for a URL already checked at the edge."""
    return parse(url).describe()


def without_password(url: str) -> str:
    """`url` fit for a log line: no password, in the authority or in the query (`password`,
    and `sslpassword`, the client key's passphrase); the host list as written (not
    percent-encoded)."""
    parts = urlsplit(url)
    credentials, at, hostspec = parts.netloc.rpartition("@")
    netloc = credentials.partition(":")[0] + "@" + hostspec if at else parts.netloc
    kept = [
        (name, value)
        for name, value in parse_qsl(parts.query, keep_blank_values=True)
        if name not in SECRET_PARAMETERS
    ]
    query = "&".join(f"{quote(name)}={quote(value, safe='/:,')}" for name, value in kept)
    shown = f"{parts.scheme}://{netloc}{parts.path}"
    return f"{shown}?{query}" if query else shown
