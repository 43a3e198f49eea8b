"""Log lines: JSON, one object per line, for machines (the default); or text for a terminal.

A record may carry structured fields (`extra={"fields": {...}}`); the JSON form merges them into
the line. Nothing logs request bodies or credentials: the proxy's request line holds route,
method, outcome, status, timings and the request id only.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from datetime import UTC, datetime
from typing import Any

# Libraries that are chatty at INFO: httpx (the agent client's and the lab's; the gateway
# forwards with aiohttp) logs every request, a line and a cost per call; alembic announces its
# plugins; pgserver narrates its housekeeping; uvicorn says "Started server process" and
# "Shutting down" once per server, and the gateway runs two: the gateway's own start-up summary
# and shutdown line say it once (oncegate.http.server).
_QUIET = ("alembic.runtime.plugins", "httpx", "httpcore", "uvicorn.error")
# Libraries whose warnings and errors the gateway says better itself, once: pgserver prints whole
# command lines and server logs when PostgreSQL fails to start (oncegate.store.embedded names the
# log and quotes its end); asyncpg's pool logs a traceback every second while PostgreSQL is down
# (oncegate.store says once that it is down, and once that it is back).
_SAID_BETTER = ("pgserver", "asyncpg.pool")


# One encoder for every line (json.dumps with `default` makes a new one per call).
_ENCODER = json.JSONEncoder(default=str)


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        self._second = -1
        self._second_text = ""

    def _time(self, created: float) -> str:
        """`created` as `datetime.fromtimestamp(created, UTC).isoformat(timespec=
        "milliseconds")` writes it, with the date and time of day formatted once a second."""
        second = int(created)
        micros = round((created - second) * 1_000_000)
        if micros >= 1_000_000:
            second, micros = second + 1, 0
        if second != self._second:
            self._second = second
            self._second_text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        return f"{self._second_text}.{micros // 1000:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self._time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _ENCODER.encode(line)


class TextFormatter(logging.Formatter):
    """`2026-12-02T15:09:35.123Z INFO oncegate.request: ...`: UTC to the millisecond, as the
    JSON lines, so the two formats of one event read the same time."""

    converter = staticmethod(time.gmtime)
    default_time_format = "%Y-%m-%dT%H:%M:%S"
    default_msec_format = "%s.%03dZ"

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")


def configure(log_format: str, level: str) -> None:
    # Neither format shows the caller, the thread or the process, and the proxy logs a line per
    # request: without these, a record is made without walking the stack for its caller (a
    # third of a request line's cost) or asking for the thread's and process's names.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _SAID_BETTER:
        logging.getLogger(name).setLevel(logging.CRITICAL)
