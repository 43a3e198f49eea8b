"""A PostgreSQL of the soak's own, to stop, restart and `kill -9` at will.

Built on pgserver's real binaries (its `get_server` runs initdb and starts the server on a Unix
socket, as an unprivileged `pgserver` user when we are root). Stopping goes through `pg_ctl stop`
(`fast`: clients cut, clean shutdown; `immediate`: no shutdown checkpoint, crash recovery at the
next start); `kill` sends SIGKILL to the postmaster the data directory names, which is the
crash that loses commits made with `synchronous_commit = off`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import psutil

from tests.conftest import start_embedded

# How long PostgreSQL's orphaned backends get to notice their postmaster died; they check at
# once, so this is only a bound for a loaded machine.
ORPHANS_GRACE = 15.0
START_ATTEMPTS = 10


def _pg_ctl(server: Any, *args: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver._commands import pg_ctl
    pg_ctl(list(args), pgdata=server.pgdata, user=server.system_user, timeout=60)


class Postgres:
    def __init__(self, directory: Path) -> None:
        self.server: Any = start_embedded(directory)

    def url(self, database: str = "postgres") -> str:
        uri: str = self.server.get_uri(database)
        return uri

    def postmaster(self) -> psutil.Process | None:
        pid_file = Path(self.server.pgdata) / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, psutil.NoSuchProcess):
            pid = int(pid_file.read_text().split("\n", 1)[0])
            process = psutil.Process(pid)
            if process.name().startswith("postgres"):
                return process
        return None

    def stop(self, mode: str) -> None:
        _pg_ctl(self.server, "-w", "-m", mode, "stop")

    def kill(self) -> None:
        """SIGKILL the postmaster, then wait for its backends to go (or SIGKILL them too, as
        they are ours), so the next start finds no shared memory still in use."""
        postmaster = self.postmaster()
        if postmaster is None:
            return
        children = postmaster.children()
        os.kill(postmaster.pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(children, timeout=ORPHANS_GRACE)
        for child in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            postmaster.wait(ORPHANS_GRACE)

    def start(self) -> None:
        for attempt in range(START_ATTEMPTS):
            try:
                self.server.ensure_postgres_running()
                return
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired, AssertionError):
                # A start right after a crash can find the old shared memory still attached for a
                # moment; PostgreSQL then refuses to start, and a second later it does not.
                if attempt == START_ATTEMPTS - 1:
                    raise
                time.sleep(1)

    def close(self) -> None:
        """Stop the server (if it runs) and delete its data."""
        self.server.cleanup()
