"""The key store: the adapters that implement the service's ports (`service.ports`).

`oncegate.store.postgres.PostgresStore` is the gateway's store, and every test that claims the
gateway works runs on it; `store.memory.MemoryStore` drives the service in one process for its
unit tests and passes the same conformance suite. Only this package imports asyncpg; driver
errors become `errors.StoreUnavailable` here.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import UTC, datetime


def claimant() -> str:
    """This gateway process, as a claim records it (`claimed_by`): its host, its pid and when
    it started (made its store), as JSON."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started_at": started})
