"""Log lines: JSON, one object per line, for machines (the default); or text for a terminal.

A record may carry structured fields (`extra={"fields": {...}}`); the JSON form merges them into
the line. Nothing logs request bodies or credentials: the proxy's request line holds route,
method, outcome, status, timings and the request id only.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

# Libraries that are chatty at INFO: httpx logs every request (a line per forward, and a cost on
# the request path); alembic announces its plugins; pgserver narrates its housekeeping.
_QUIET = ("pgserver", "alembic.runtime.plugins", "httpx", "httpcore")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(log_format: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
