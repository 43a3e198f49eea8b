"""The embedded PostgreSQL of the zero-configuration default (the `pgserver` package).

With no `ONCEGATE_DATABASE_URL`, `serve` and `purge` run a real PostgreSQL server whose data lives
in `ONCEGATE_DATA_DIR/pgdata`, reachable only through a Unix socket. Same SQL, same constraints,
same code path as production.

Several processes may share one data directory: pgserver counts the processes using the server
in `pgdata/.handle_pids.json` and the last one to exit stops it. A process killed with SIGKILL
never takes its PID off that list, so the server would never be stopped again; `start` first
drops the PIDs of processes that no longer exist. A server left running by a crash is found and
reused.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_HANDLES = ".handle_pids.json"


class EmbeddedPostgres:
    def __init__(self, server: Any, pgdata: Path) -> None:
        self._server = server
        self.pgdata = pgdata

    @property
    def url(self) -> str:
        return str(self._server.get_uri())

    def stop(self) -> None:
        """Give up this process's handle; the server stops when no process holds one."""
        self._server.cleanup()


def start(data_dir: Path) -> EmbeddedPostgres:
    """Start (or join) the embedded server under `data_dir` and return it."""
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset and falls back to /tmp: fine here.
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import PostgresServer, get_server

    pgdata = (data_dir / "pgdata").resolve()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    with PostgresServer._lock:  # the lock pgserver itself takes around its handle list
        _drop_dead_handles(pgdata / _HANDLES)
    server = get_server(pgdata, cleanup_mode="stop")
    embedded = EmbeddedPostgres(server, pgdata)
    log.info("embedded PostgreSQL running, data in %s (log: %s/log)", pgdata, pgdata)
    return embedded


def _drop_dead_handles(path: Path) -> None:
    if not path.exists():
        return
    try:
        pids = json.loads(path.read_text())
    except ValueError:
        pids = []
    alive = [pid for pid in pids if isinstance(pid, int) and _alive(pid)]
    if alive != pids:
        path.write_text(json.dumps(alive))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
