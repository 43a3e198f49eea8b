"""A PostgreSQL primary and a streaming standby, started by a test, to fail over under load.

Built on Debian's PostgreSQL server packages (`postgresql-15`, installed by `make test-tools` when
it runs as root; its binaries are in `/usr/lib/postgresql/N/bin`): `initdb` makes the primary,
`pg_basebackup` copies it into the standby, which streams from it (synchronously when asked:
`synchronous_standby_names` names it). Both listen on 127.0.0.1, each on a port of its own, so a
gateway reaches them with one libpq multi-host URL (`Pair.url`). As root the servers run as the
`postgres` user (PostgreSQL refuses to run as root); otherwise as the current user.

What a failover is here:
- `Server.kill` SIGKILLs the postmaster and every process it started (backends, WAL sender,
  writer, checkpointer) at once: a machine that died, not a shutdown. Nothing the primary had
  not yet sent reaches the standby.
- `Pair.promote` runs `pg_ctl promote` on the standby and waits until it takes writes.
- `Pair.rejoin` makes the old primary, once the standby was promoted, the new primary's standby:
  `pg_rewind` (its WAL rewound to where the two timelines parted; the servers run with
  `wal_log_hints` and keep 256 MB of WAL for it) or a fresh `pg_basebackup`; the two servers
  swap roles, so a pair can fail over again and again.
- `Pair.stall_standby` stops the primary's WAL sender (SIGSTOP) for a while: a standby that lags,
  as an asynchronous one does under load, so what the primary commits meanwhile is lost with it.

`fsync = off` for the tests: the servers are killed, never the machine under them, and the
operating system keeps every write a killed process made; what a kill loses is what PostgreSQL
had not written yet, which `fsync` does not change. A benchmark asks for `fsync=True`, so that a
commit that waits for the standby waits for its disk too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psutil

from oncegate.store import migrate
from tests.helpers import free_port

STANDBY_NAME = "standby"  # its application_name, which synchronous_standby_names names
START_TIMEOUT = 60.0
SERVER_USER = "postgres"


def binaries() -> Path | None:
    """The newest Debian PostgreSQL server's binaries (15 or newer), if one is installed."""
    found = [
        path.parent
        for path in Path("/usr/lib/postgresql").glob("*/bin/pg_basebackup")
        if path.parent.parent.name.isdigit() and int(path.parent.parent.name) >= 15
    ]
    return max(found, key=lambda path: int(path.parent.name), default=None)


def unavailable() -> str | None:
    """Why a primary and a standby cannot be started here, or None when they can."""
    if binaries() is None:
        return (
            "needs Debian's PostgreSQL server (postgresql-15: /usr/lib/postgresql/15/bin), which "
            "`make test-tools` installs when it runs as root with apt-get"
        )
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"runs PostgreSQL as the {SERVER_USER!r} user, which does not exist here"
    return None


def _as_server_user(arguments: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", SERVER_USER, "--", *arguments]
    return arguments


def _give_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        record = pwd.getpwnam(SERVER_USER)
        os.chown(path, record.pw_uid, record.pw_gid)


class Server:
    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.data = directory / name
        self.log = directory / f"{name}.log"
        self.port = free_port()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, tool: str, *arguments: str) -> None:
        binary = binaries()
        assert binary is not None
        command = _as_server_user([str(binary / tool), *arguments])
        subprocess.run(command, check=True, capture_output=True, timeout=START_TIMEOUT)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w",
                  "-t", str(int(START_TIMEOUT)), "start")  # fmt: skip

    def stop_with(self, mode: str) -> None:
        """`pg_ctl stop -m mode`: `fast` (clients cut, a clean shutdown) or `immediate`."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def stop(self) -> None:
        if self.postmaster() is not None:
            with contextlib.suppress(subprocess.SubprocessError):
                self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        self.kill()

    def postmaster(self) -> psutil.Process | None:
        with contextlib.suppress(OSError, ValueError, psutil.NoSuchProcess):
            pid = int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
            process = psutil.Process(pid)
            if process.name().startswith("postgres") and process.status() != "zombie":
                return process
        return None

    def kill(self) -> None:
        """SIGKILL the postmaster and every process it started, all at once."""
        postmaster = self.postmaster()
        if postmaster is None:
            return
        processes = [postmaster, *postmaster.children(recursive=True)]
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        psutil.wait_procs(processes, timeout=15)

    def child(self, title: str) -> psutil.Process:
        """A process of this server by its title (`walreceiver`, `walsender`)."""
        postmaster = self.postmaster()
        assert postmaster is not None, f"{self.name} is not running"
        for process in postmaster.children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if title in " ".join(process.cmdline()):
                    return process
        raise LookupError(f"{self.name} has no {title} process")


class Pair:
    """A primary and its streaming standby (`synchronous`: commits wait for the standby)."""

    def __init__(self, directory: Path, *, synchronous: bool, fsync: bool = False) -> None:
        self.directory = directory
        self.synchronous = synchronous
        self.fsync = fsync
        self.primary = Server("primary", directory)
        self.standby = Server("standby", directory)

    def url(self, database: str = "postgres") -> str:
        """The libpq multi-host URL a gateway is given: the primary first, then the standby."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
            f"/{database}?target_session_attrs=read-write"
        )

    def migrated_database(self, name: str = "oncegate") -> str:
        """Create database `name` on the primary and migrate it; its multi-host URL."""

        async def create() -> None:
            connection = await asyncpg.connect(self.primary.url())
            try:
                await connection.execute(f'CREATE DATABASE "{name}"')
            finally:
                await connection.close()

        asyncio.run(create())
        url = self.url(name)
        migrate.upgrade(url)  # migrate takes the host list too
        return url

    def start(self) -> None:
        primary, standby = self.primary, self.standby
        primary._run("initdb", "-D", str(primary.data), "-U", "postgres", "--auth=trust",
                     "--no-sync", "-E", "UTF8", "--locale=C")  # fmt: skip
        with (primary.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"listen_addresses = '127.0.0.1'\nport = {primary.port}\n"
                f"unix_socket_directories = '{self.directory}'\n"
                "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\n"
                # pg_rewind needs the old primary's WAL back to the checkpoint before the
                # timelines parted, which its own crash recovery's checkpoints would recycle.
                "wal_log_hints = on\nwal_keep_size = 256MB\n"
                "max_connections = 300\nshared_buffers = 32MB\n"
                f"fsync = {'on' if self.fsync else 'off'}\n"
                "wal_receiver_status_interval = 1s\nwal_retrieve_retry_interval = 1s\n"
                f"synchronous_standby_names = '{STANDBY_NAME if self.synchronous else ''}'\n"
            )
        with (primary.data / "pg_hba.conf").open("a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        primary.start()
        standby._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U",
                     "postgres", "-D", str(standby.data), "-X", "stream", "-c", "fast",
                     "--no-sync")  # fmt: skip
        self._follow(standby, primary)
        standby.start()
        asyncio.run(self._wait_streaming())

    def _follow(self, standby: Server, primary: Server) -> None:
        """`standby`'s data directory set to stream from `primary`. Written whole: a copy of the
        primary's (base backup, rewind) carries the primary's own port and settings."""
        # The standby, once promoted, has no standby of its own: it must not wait for one.
        (standby.data / "postgresql.auto.conf").write_text(
            f"port = {standby.port}\nsynchronous_standby_names = ''\n"
            f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user=postgres "
            f"application_name={STANDBY_NAME}'\n"
        )
        (standby.data / "standby.signal").touch()
        for path in (standby.data / "postgresql.auto.conf", standby.data / "standby.signal"):
            _give_to_server_user(path)

    async def _wait_streaming(self) -> None:
        wanted = "sync" if self.synchronous else "async"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            connection = await asyncpg.connect(self.primary.url())
            try:
                state = await connection.fetchrow(
                    "SELECT state, sync_state FROM pg_stat_replication WHERE application_name = $1",
                    STANDBY_NAME,
                )
            finally:
                await connection.close()
            if state is not None and (state["state"], state["sync_state"]) == ("streaming", wanted):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby is not streaming ({state}); see {self.directory}")
            await asyncio.sleep(0.1)

    def promote(self) -> None:
        """Make the standby the primary, and wait until it takes writes."""
        self.standby._run("pg_ctl", "-D", str(self.standby.data), "-w", "promote")

    def rejoin(self, *, fresh: bool = False) -> str:
        """After `promote`: the old primary (dead, or killed here) made the standby of the
        promoted one, and the roles swapped; with a synchronous pair the new primary waits for it
        again once it streams. `pg_rewind`, or a fresh base backup when `fresh` or when the rewind
        fails; returns which ("rewind" or "base backup")."""
        old, new = self.primary, self.standby
        old.kill()
        how = "base backup" if fresh else "rewind"
        if not fresh:
            # pg_rewind reads the source's timeline from its control file, which a promoted
            # server updates at its first checkpoint; before it, pg_rewind finds both on the old
            # timeline, says no rewind is needed, and the old primary cannot follow.
            asyncio.run(self._checkpoint(new))
            try:
                # A server that crashed is first recovered in single-user mode by pg_rewind
                # itself (PostgreSQL 13 and newer), then rewound to where the timelines parted.
                source = f"host=127.0.0.1 port={new.port} user=postgres"
                old._run("pg_rewind", "-D", str(old.data), f"--source-server={source}")
            except subprocess.CalledProcessError:
                how = "base backup"
        if how == "base backup":
            shutil.rmtree(old.data)
            old._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(new.port), "-U", "postgres",
                     "-D", str(old.data), "-X", "stream", "-c", "fast", "--no-sync")  # fmt: skip
        self._follow(old, new)
        old.start()
        self.primary, self.standby = new, old
        if self.synchronous:
            asyncio.run(self._wait_for_standby())
        asyncio.run(self._wait_streaming())
        return how

    @staticmethod
    async def _checkpoint(server: Server) -> None:
        connection = await asyncpg.connect(server.url())
        try:
            await connection.execute("CHECKPOINT")
        finally:
            await connection.close()

    async def _wait_for_standby(self) -> None:
        """The primary's commits wait for the standby again (they did not while it was away)."""
        connection = await asyncpg.connect(self.primary.url())
        try:
            await connection.execute(
                f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"
            )
            await connection.execute("SELECT pg_reload_conf()")
        finally:
            await connection.close()

    @contextlib.contextmanager
    def stall_standby(self) -> Iterator[None]:
        """The primary's WAL sender stopped (SIGSTOP) for the block: the standby falls behind, as
        an asynchronous one does under load. (The sender, not the standby's receiver: what was
        sent before the stop would still reach the standby from its socket.)"""
        sender = self.primary.child("walsender")
        sender.suspend()
        try:
            yield
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                sender.resume()

    def stop(self) -> None:
        for server in (self.standby, self.primary):
            server.stop()


@contextlib.contextmanager
def running_pair(*, synchronous: bool, fsync: bool = False) -> Iterator[Pair]:
    """A started primary and standby, stopped and deleted at the end. Not under pytest's
    temporary tree: pytest makes its directories private, and the servers run as `postgres`."""
    directory = Path(tempfile.mkdtemp(prefix="oncegate-failover-"))
    directory.chmod(0o755)
    _give_to_server_user(directory)
    pair = Pair(directory, synchronous=synchronous, fsync=fsync)
    try:
        pair.start()
        yield pair
    finally:
        pair.stop()
        shutil.rmtree(directory, ignore_errors=True)
