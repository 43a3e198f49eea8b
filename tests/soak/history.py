"""What a soak run records, one JSON object per line, and how it is read back.

Four files, written by four parties that never trust each other:

- `attempts.jsonl`, by the clients: every request sent through a gateway (`Attempt`), what was
  sent, when, and what came back (or that nothing did).
- `upstream.jsonl`, by the recording upstream, fsync'ed before it answers: every request it read
  (`Performed`), whether it performed it, and the exact answer it gave.
- `keys.jsonl`, by the driver after the chaos: the key table (`Row`), as PostgreSQL holds it.
- `events.jsonl`, by the driver: every fault it injected (`Event`), for the timelines of a report.

Each client request carries a unique `X-Soak-Attempt` header, which the gateway passes upstream
untouched, and every upstream answer names the attempt it answered (`serial`, `attempt`), so the
checker can tie any answer a client saw, fresh or replayed, to the one request that produced it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

ATTEMPT_HEADER = "X-Soak-Attempt"
# Marks every answer the recording upstream writes, so an answer can be told from one the gateway
# (or a server library under it) made up.
UPSTREAM_MARK = "soak-upstream"


@dataclass(frozen=True)
class Attempt:
    """One request a client sent, and its fate."""

    attempt: str  # unique per request sent; the X-Soak-Attempt header
    route: str  # the route's name, also the first path segment
    tenant: str  # the Authorization header: the scope within the route
    key: str
    body: str  # the JSON text sent
    sent: float  # wall-clock seconds, comparable with the upstream's
    ended: float
    # "answer", "no-answer" (connection refused, reset, closed), "hung-up" (the client gave up on
    # purpose mid-request), "timeout" (no answer within the client's patience)
    outcome: str
    status: int | None = None
    content_type: str | None = None
    replayed: bool = False
    answer: str | None = None  # the answer's body as text
    gateway: str = ""
    phase: str = "chaos"  # "chaos", or "probe" for the checks sent after the chaos stopped
    scenario: str = ""  # the store the gateway it went through is on (driver.SCENARIOS)


@dataclass(frozen=True)
class Performed:
    """One request the upstream read."""

    serial: int  # the upstream's own counter
    attempt: str | None
    route: str
    tenant: str
    key: str | None
    body: str
    received: float
    # What the upstream did with it: "answer" (201), "slow" (performed, answered after the route
    # timeout), "error500" (performed, then failed), "reset" (performed, connection reset instead
    # of an answer), "429"/"503" (refused: not performed, the key is to be released).
    fault: str
    performed: bool
    status: int | None  # None when no answer was sent (reset)
    answer: str | None


@dataclass(frozen=True)
class Row:
    """One row of the key table after the chaos, with its effective state."""

    route: str
    tenant: str
    key: str
    state: str  # in_progress (lease not over), completed, unknown (marked or lease over)
    status: int | None
    answer: str | None
    stored: bool
    # What its gateway saw when it marked the key `unknown` (the key table's `failure`):
    # "read_timeout" (the route's timeout fired), "no_answer", "answer_broken"; else None.
    failure: str | None = None


@dataclass(frozen=True)
class Event:
    """One injected fault, or a process coming back."""

    at: float
    what: str  # gateway-kill, gateway-term, gateway-start, postgres-fast, citus-worker-stop, ...
    target: str = ""  # the gateway's name, or the scenario whose store it hit


Record = TypeVar("Record", Attempt, Performed, Row, Event)


def write(path: Path, records: Iterable[Attempt | Performed | Row | Event]) -> None:
    with path.open("w") as file:
        for record in records:
            file.write(json.dumps(dataclasses.asdict(record)) + "\n")


def read(path: Path, kind: type[Record]) -> list[Record]:
    return list(iter_lines(path, kind))


def iter_lines(path: Path, kind: type[Record]) -> Iterator[Record]:
    names = {field.name for field in dataclasses.fields(kind)}
    with path.open() as file:
        for line in file:
            if line.strip():
                document: dict[str, Any] = json.loads(line)
                yield kind(**{name: value for name, value in document.items() if name in names})
