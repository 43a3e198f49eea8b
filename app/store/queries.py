"""Named queries: `-- name: NAME` starts a query, which runs to the next one.

Parameters are named (`:fingerprint`), not numbered: a call passes each by name and the loader
turns them into asyncpg's `$1, $2, ...` in the order they first appear, so swapping two values
of the same type (a lease and a TTL) cannot pass unnoticed. A call that misses a parameter or
passes one the query does not have fails at once.

queries.sql is one dialect for two servers: a statement is written once for both, or, where
the two must differ, once per server (`-- name: NAME [postgres]`, `-- name: NAME [citus]`).
`DIALECTS[server]` holds what that server runs: asking it for a statement it has no shape of
raises, it never hands over another server's.

A part that statements share is written once as a fragment (`-- fragment: NAME`) and named in a
statement, or in a fragment written after it, as `{NAME}`: the statement holds the fragment's
text there. A fragment too may be shaped per server (`-- fragment: NAME [citus]`): a
statement written once then holds each server's shape of it. `FRAGMENTS[server]` holds them for
the statements written at run time (store/postgres/workers.py), so both say the same thing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Server = Literal["postgres", "citus"]
SERVERS: tuple[Server, ...] = ("postgres", "citus")

_NAME = re.compile(r"^-- (name|fragment): (\w+)(?: \[(\w+)\])?\s*$", re.MULTILINE)
# `{name}`: a fragment, in a statement whose comments are gone.
_FRAGMENT = re.compile(r"\{(\w+)\}")
# `:name`, but not the second colon of a `::type` cast.
_PARAMETER = re.compile(r"(?<![:\w]):([a-z_]+)\b")
_COMMENT = re.compile(r"--[^\n]*")


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    sql: str  # with asyncpg's numbered parameters
    parameters: tuple[str, ...]

    def arguments(self, values: Mapping[str, object]) -> tuple[object, ...]:
        """`values` in the query's parameter order: exactly the query's parameters, or
        TypeError. One pass, no generator: every statement of the request path calls it (two
        generators over the names were 6% of a lone claim's CPU in the store)."""
        try:
            found = tuple([values[name] for name in self.parameters])
        except KeyError:
            found = None
        if found is None or len(values) != len(found):
            raise TypeError(
                f"query {self.name} takes {sorted(self.parameters)}, was given {sorted(values)}"
            )
        return found


class Statements(Mapping[str, Query]):
    """The statements one server runs: those written for both, and its own shapes."""

    def __init__(self, server: str, queries: dict[str, Query]) -> None:
        self.server = server
        self._queries = queries

    def __getitem__(self, name: str) -> Query:
        try:
            return self._queries[name]
        except KeyError:
            raise KeyError(f"queries.sql has no statement {name!r} for {self.server}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._queries)

    def __len__(self) -> int:
        return len(self._queries)


def load(text: str) -> dict[str, Query]:
    """The statements of a file written for any server (no `[server]` shapes)."""
    entries, parts = _read(text)
    for name, server, _ in entries:
        if server is not None:
            raise ValueError(f"fragment {name} is shaped for {server} in a file of one dialect")
    fragments = _fragments(entries, None)
    queries: dict[str, Query] = {}
    for name, server, body in parts:
        if server is not None:
            raise ValueError(f"query {name} is written for {server} in a file of one dialect")
        if name in queries:
            raise ValueError(f"query {name} is written twice")
        queries[name] = _numbered(name, body, fragments)
    return queries


def load_dialects(text: str) -> dict[Server, Statements]:
    """Per server, what it runs. A name is either written once for every server or shaped per
    server, never both (which one would win is what this refuses to decide)."""
    entries, parts = _read(text)
    fragments = {server: _fragments(entries, server) for server in SERVERS}
    shared: dict[str, str] = {}
    shaped: dict[str, dict[str, str]] = {server: {} for server in SERVERS}
    for name, server, body in parts:
        if server is not None and server not in shaped:
            raise ValueError(f"query {name} is shaped for {server}, which is none of {SERVERS}")
        written = shared if server is None else shaped[server]
        if name in written:
            raise ValueError(f"query {name} is written twice for {server or 'every server'}")
        written[name] = body
    for server, own in shaped.items():
        both = own.keys() & shared.keys()
        if both:
            raise ValueError(f"queries {sorted(both)} are written for every server and {server}")
    return {
        server: Statements(
            server,
            {
                name: _numbered(name, body, fragments[server])
                for name, body in {**shared, **shaped[server]}.items()
            },
        )
        for server in SERVERS
    }


def load_fragments(text: str, server: Server | None = None) -> dict[str, str]:
    """The fragments of a file as `server` holds them (its shapes; None: a file of one
    dialect), each without its comments and with the fragments it names in place."""
    return _fragments(_read(text)[0], server)


Part = tuple[str, str | None, str]  # (name, the server it is shaped for or None, its text)


def _read(text: str) -> tuple[list[Part], list[Part]]:
    """The file's fragments (uncommented) and statements, in the file's order."""
    fragments: list[Part] = []
    statements: list[Part] = []
    parts = _NAME.split(text)
    # parts = [preamble, kind1, name1, server1 or None, body1, kind2, ...]
    for kind, name, server, body in zip(
        parts[1::4], parts[2::4], parts[3::4], parts[4::4], strict=True
    ):
        if kind == "name":
            statements.append((name, server, body))
        else:
            fragments.append((name, server, _uncommented(body).rstrip(";").strip()))
    return fragments, statements


def _fragments(entries: list[Part], server: Server | None) -> dict[str, str]:
    """The fragments `server` sees, written for every server or shaped for it, each with the
    fragments written before it in place. A name is written once for every server or shaped
    per server, never both."""
    fragments: dict[str, str] = {}
    written: dict[str, set[str | None]] = {}
    for name, shaped, body in entries:
        if shaped is not None and shaped not in SERVERS:
            raise ValueError(f"fragment {name} is shaped for {shaped}, which is none of {SERVERS}")
        seen = written.setdefault(name, set())
        if shaped in seen or (seen and (None in seen or shaped is None)):
            raise ValueError(f"fragment {name} is written twice for {shaped or 'every server'}")
        seen.add(shaped)
        if shaped is None or shaped == server:
            fragments[name] = _expanded(f"fragment {name}", body, fragments)
    return fragments


def compose(name: str, sql: str) -> Query:
    """A statement written at run time (on Citus, one that names the shard tables a worker
    holds: store/postgres/workers.py), with named parameters as in queries.sql."""
    return _numbered(name, sql, None)


def _uncommented(sql: str) -> str:
    return _COMMENT.sub("", sql.strip()).strip()


def _expanded(where: str, sql: str, fragments: Mapping[str, str]) -> str:
    """`sql` (`where`'s) with the fragments it names in place."""

    def fragment(match: re.Match[str]) -> str:
        try:
            return fragments[match.group(1)]
        except KeyError:
            raise ValueError(f"{where} names no fragment of the file: {match[0]}") from None

    return _FRAGMENT.sub(fragment, sql)


def _numbered(name: str, sql: str, fragments: Mapping[str, str] | None) -> Query:
    """`sql` with asyncpg's numbered parameters; a file's statement (`fragments` given) with its
    fragments in place, the text of one written at run time as it is."""
    sql = _uncommented(sql)
    if fragments is not None:
        sql = _expanded(f"query {name}", sql, fragments)
    parameters: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in parameters:
            parameters.append(match.group(1))
        return f"${parameters.index(match.group(1)) + 1}"

    return Query(name, _PARAMETER.sub(number, sql), tuple(parameters))


_TEXT = (Path(__file__).parent / "queries.sql").read_text()
DIALECTS = load_dialects(_TEXT)
FRAGMENTS = {server: load_fragments(_TEXT, server) for server in SERVERS}
