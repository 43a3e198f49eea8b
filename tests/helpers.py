"""Helpers every test directory shares, written once: `from tests.helpers import ...`.

(The processes the suites start, the demo upstream and a gateway, are `tests/e2e/conftest.py`'s
`Process`, `DemoUpstream` and `GatewayProcess`; the chaos soak keeps its own, restarted many
times.)
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
import random
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import NamedTuple
from urllib.parse import parse_qsl, urlsplit

import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from oncegate.kernel import sealing
from oncegate.model.records import KeyRecord, Record

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


# The ports `free_port` hands out: below Linux's ephemeral range (32768-60999), where the kernel
# puts no socket of its own. A port from `bind(("127.0.0.1", 0))` was not enough: closed at once,
# it can be handed straight to the next caller, so two xdist workers (or one gateway's proxy and
# admin ports) could be given the same port, and a test then talked to another test's server
# (404s, 502s and refused connections from a module that passes alone).
PORTS = range(20000, 32000)


def _ports() -> Iterator[int]:
    """This process's turn of PORTS: xdist worker i of n takes every n-th port from i, in order
    from a random start, so no two workers of a session, nor two calls in one, get the same one;
    a port something else holds is skipped."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    mine = PORTS[worker::workers]
    start = random.randrange(len(mine))
    for port in itertools.cycle([*mine[start:], *mine[:start]]):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken by something outside the tests
        yield port


_TURN = _ports()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now and no other test of this
    session was given (PORTS)."""
    return next(_TURN)


def digest(text: str) -> bytes:
    """A SHA-256 of `text`: a scope or a fingerprint as the store takes them (32 bytes)."""
    return hashlib.sha256(text.encode()).digest()


def new_key() -> str:
    """An Idempotency-Key no other test uses."""
    return str(uuid.uuid4())


def scrape(text: str) -> Samples:
    """Every sample of a /metrics text, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample with exactly these labels (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(
        sample_value
        for (sample_name, sample_labels), sample_value in scrape(text).items()
        if sample_name == name and wanted <= sample_labels
    )


async def insert_completed_keys(
    connection: asyncpg.Connection, count: int, expires_at: str, *, prefix: str = "k"
) -> None:
    """`count` completed keys (201) written straight into the key table, claimed two days ago,
    on route `r`, keys `{prefix}1`..`{prefix}{count}`. `expires_at` is an SQL expression of the
    row number `n`, such as `now() - interval '1 day'`."""
    await connection.execute(
        "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token,"
        " response_status, created_at, expires_at)"
        " SELECT 'r', sha256(n::text::bytea), $1 || n, sha256(''::bytea), 'completed', n,"
        f" 201, now() - interval '2 days', {expires_at}"
        " FROM generate_series(1, $2::int) AS n",
        prefix,
        count,
    )


def behind_a_dead_host(url: str) -> str:
    """`url` (the tests' PostgreSQL, on a Unix socket or a TCP port) as a libpq multi-host URL
    whose first host refuses connections: what a client sees while the first host of its list
    is a primary that died. Reaching the database through it shows that a command takes the
    list and follows it to the host that answers."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    here = query.pop("host", None) or parts.netloc.rpartition("@")[2]
    credentials = parts.netloc.rpartition("@")[0]
    query["host"] = f"127.0.0.1:{free_port()},{here}"
    query["target_session_attrs"] = "read-write"
    listed = "&".join(f"{name}={value}" for name, value in query.items())
    return f"{parts.scheme}://{credentials}@{parts.path}?{listed}"


def stored(record: Record | KeyRecord | None) -> StoredParts:
    """A record's stored answer as (status, headers, body, stored), its plaintext opened:
    (None, None, None, False) before it has one; its status and headers when it was too large
    to store whole (its status alone when an earlier release completed it)."""
    if record is None or record.answer is None:
        return StoredParts(None, None, None, False)
    content = record.answer.content
    if content is None:
        return StoredParts(record.answer.status, None, None, False)
    headers, body = sealing.open_plain(content)
    return StoredParts(record.answer.status, headers, body, record.answer.stored)


class StoredParts(NamedTuple):
    status: int | None
    headers: list[tuple[str, str]] | None
    body: bytes | None
    stored: bool


KEY_TABLE_SCANS = "SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'oncegate_keys'"


async def key_table_reads_since(connection: asyncpg.Connection, before: int) -> int:
    """How many times the key table was read from end to end since `before` (its
    `KEY_TABLE_SCANS`). A backend reports its counts once out of its transaction, all at once,
    so the count is read again until it moves: a migration is one transaction, one report."""
    for _ in range(600):
        await connection.execute("SELECT pg_stat_clear_snapshot()")
        after: int = await connection.fetchval(KEY_TABLE_SCANS)
        if after != before:
            return after - before
        await asyncio.sleep(0.05)
    raise AssertionError("the key table's scan count never moved")


class ThreadedUpstream:
    """An upstream of the tests' own on 127.0.0.1, raw sockets: each connection is served by
    `serve` in a thread of its own; `performed` counts the requests per `Idempotency-Key`
    (`count`). A subclass sets what it needs before calling this `__init__`, which starts
    accepting."""

    def __init__(self, backlog: int = 128) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.performed: dict[str, int] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            head = read_head(connection)
            if head is not None:
                self.serve(connection, *head)

    def serve(self, connection: socket.socket, target: str, fields: dict[str, str]) -> None:
        """Answer one request (its target, its header fields by lower-case name)."""
        raise NotImplementedError

    def count(self, fields: dict[str, str]) -> str:
        """Count the request under its key, and return the key."""
        key = fields.get("idempotency-key", "")
        with self._lock:
            self.performed[key] = self.performed.get(key, 0) + 1
        return key

    def close(self) -> None:
        self._listener.close()


def read_head(connection: socket.socket) -> tuple[str, dict[str, str]] | None:
    """A request's target and header fields (names in lower case, values as sent) read off
    `connection`; None when it closed before the head ended."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = connection.recv(65536)
        if not data:
            return None
        head += data
    lines = head.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(": ")
        fields[name.lower()] = value
    return lines[0].split(" ")[1], fields
