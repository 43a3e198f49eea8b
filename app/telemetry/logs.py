"""Log lines: JSON, one object per line, for machines (the default); or text for a terminal.

A record may carry structured fields (`extra={"fields": {...}}`); the JSON form merges them into
the line. Nothing logs request bodies or credentials: the proxy's request line holds route,
method, outcome, status, timings and the request id only.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ..model import jsontext

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


# One encoder for every line, made once (`model.jsontext`).
_write_json = jsontext.writer(default=str)
# The handler `configure` puts on the root logger, when it writes JSON: `info_line` writes to it.
_json_handler: logging.StreamHandler[Any] | None = None


class JsonFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__()
        # (second, its text), replaced as one value: the request line's fast path formats
        # outside the handler's lock, so two threads may read and write it at once.
        self._second: tuple[int, str] = (-1, "")

    def _time(self, created: float) -> str:
        """`created` as `datetime.fromtimestamp(created, UTC).isoformat(timespec=
        "milliseconds")` writes it, with the date and time of day formatted once a second."""
        second = int(created)
        micros = round((created - second) * 1_000_000)
        if micros >= 1_000_000:
            second, micros = second + 1, 0
        cached, text = self._second
        if second != cached:
            text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            self._second = (second, text)
        return f"{text}.{micros // 1000:03d}+00:00"

    def format(self, record: logging.LogRecord) -> str:
        line = self.line(record.created, record.levelname, record.name, record.getMessage())
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _write_json(line)

    def line(self, created: float, level: str, logger: str, message: str) -> dict[str, Any]:
        return {
            "time": self._time(created),
            "level": level.lower(),
            "logger": logger,
            "message": message,
        }


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
    global _json_handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    _json_handler = handler if log_format == "json" else None
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in _SAID_BETTER:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def info_line(
    logger: logging.Logger, message: str, arguments: tuple[object, ...], fields: Mapping[str, Any]
) -> None:
    """`logger.info(message, *arguments, extra={"fields": fields})`, for a line logged on every
    request: when the record would reach the JSON handler `configure` installed and nothing else
    (no filter on the way, no other handler, the handler's level at most INFO), the line is
    written to the handler's stream as that handler writes it, without making a `LogRecord`
    and passing it down the chain: the same bytes for about half the CPU (a record, its
    attributes, the lookups of the chain). Anything else (a test's capturing handler, the
    tracing filter) gets the record as before."""
    if not logger.isEnabledFor(logging.INFO):
        return
    handler = _json_handler
    if handler is None or not _reaches_only(logger, handler):
        logger.info(message, *arguments, extra={"fields": fields})
        return
    formatter = handler.formatter
    assert isinstance(formatter, JsonFormatter)  # `configure` set it
    line = formatter.line(time.time(), "INFO", logger.name, message % arguments)
    line.update(fields)
    text = _write_json(line) + handler.terminator
    handler.acquire()
    try:
        handler.stream.write(text)
        handler.stream.flush()
    except Exception:  # as StreamHandler.emit: reported by the handler, never raised
        handler.handleError(
            logger.makeRecord(logger.name, logging.INFO, "", 0, message, arguments, None)
        )
    finally:
        handler.release()


def _reaches_only(logger: logging.Logger, handler: logging.Handler) -> bool:
    """Whether an INFO record of `logger` reaches `handler` alone, on the root logger, with no
    filter on its way (`Logger.handle` and `callHandlers`' walk up the hierarchy)."""
    if handler.filters or handler.level > logging.INFO or logger.disabled:
        return False
    current: logging.Logger | None = logger
    while current is not None:
        if current.filters:
            return False
        if current.handlers:
            return current is logging.root and current.handlers == [handler]
        if not current.propagate:
            return False
        current = current.parent
    return False
