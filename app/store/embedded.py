"""The embedded PostgreSQL of the zero-configuration default (the `pgserver` package).

With no `ONCEGATE_DATABASE_URL`, `serve`, `migrate` and `purge` run a real PostgreSQL server whose
data lives in `ONCEGATE_DATA_DIR/pgdata`, reachable only through a Unix socket. Same SQL, same
constraints, same code path as production.

Design rules:
- Never widen the permissions of a directory this process did not create. PostgreSQL refuses to
  run as root, so as root pgserver runs it as its own user `pgserver` and, to let that user in,
  adds `g+rx,o+rx` to every parent of the data directory and of its own programs. `start` checks
  those parents first and stops with a message naming the closed one; the directories it creates
  itself are made traversable when they are made.
- Several processes may share one data directory: pgserver counts the processes using the server
  in `pgdata/.handle_pids.json` and the last one to exit stops it. A process killed with SIGKILL
  never takes its PID off that list, so `start` first drops the PIDs of processes that are gone.
- A server that died (SIGKILL, the OOM killer) leaves its `postmaster.pid` behind, naming a PID
  that is gone or a zombie nobody reaps. PostgreSQL will not start while that PID exists, and
  pgserver would take the zombie for a running server; so a lock file whose postmaster is not a
  live process of this data directory is removed, after the dead server's other processes have
  left, and the server is started again (PostgreSQL's own crash recovery then replays its WAL).
- While a gateway runs, a thread checks the postmaster every second and restarts a dead one the
  same way, saying so in the log. Every step that reads or changes the server's state holds
  pgserver's inter-process lock, so gateways sharing a data directory restart it once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ..model import errors

log = logging.getLogger("oncegate.embedded")  # the name docs/reference.md gives

_HANDLES = ".handle_pids.json"
_PID_FILE = "postmaster.pid"
# The bits pgserver adds to each parent so that its own user can traverse it.
_OPEN_TO_OTHERS = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
# A Unix socket path longer than this does not fit in sockaddr_un (108 bytes with its NUL on
# Linux); pgserver then puts the socket in its runtime directory instead of the data directory.
_SOCKET_PATH_LIMIT = 107
# How often the supervisor looks at the postmaster: an outage it repairs lasts about this long
# plus PostgreSQL's start-up, and one stat and one /proc read a second cost nothing.
SUPERVISION_INTERVAL = 1.0
# How long a dead server's backends may take to notice and exit before a new server can take
# the data directory (they watch the postmaster and leave within milliseconds when idle).
_LEFTOVER_TIMEOUT = 30.0


def _pgserver() -> Any:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset and falls back to /tmp: fine here.
        warnings.simplefilter("ignore")
        try:
            import pgserver.postgres_server
        except ImportError:
            raise errors.ConfigError(
                "the embedded PostgreSQL (the pgserver package) is not installed here, as in the "
                "container image: set ONCEGATE_DATABASE_URL to your PostgreSQL, or install "
                "pgserver"
            ) from None

    return pgserver.postgres_server


class EmbeddedPostgres:
    def __init__(self, server: Any, pgdata: Path) -> None:
        self._server = server
        self.pgdata = pgdata
        self.data_dir = pgdata.parent
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return str(self._server.get_uri())

    def supervise(self, interval: float = SUPERVISION_INTERVAL) -> None:
        """Restart the server whenever it dies, until `stop`. A daemon thread: it never keeps
        the process alive, and forked workers do not inherit it."""
        if self._supervisor is not None:
            return
        self._supervisor = threading.Thread(
            target=self._watch, args=(interval,), name="embedded-postgres-supervisor", daemon=True
        )
        self._supervisor.start()

    def _watch(self, interval: float) -> None:
        failing = False
        while not self._stopping.wait(interval):
            self._keep_handle()
            if _postmaster(self.pgdata) is not None:
                continue
            try:
                restarted = self._restart()
            except (OSError, subprocess.SubprocessError, errors.StoreUnavailable) as exc:
                if not failing:
                    log.error(
                        "the embedded PostgreSQL could not be restarted (%s); trying again every "
                        "%gs. The end of its log (%s):\n%s",
                        type(exc).__name__,
                        interval,
                        self.pgdata / "log",
                        _log_tail(self.pgdata),
                    )
                failing = True
                continue
            failing = False
            if restarted is not None:
                log.warning(
                    "the embedded PostgreSQL was restarted (pid %d) after it stopped "
                    "unexpectedly; data in %s",
                    restarted,
                    self.data_dir,
                )

    def _keep_handle(self) -> None:
        """Put this process back on pgserver's list of the server's users if it is missing: a
        list that a process killed mid-write left unreadable is rebuilt from nothing
        (`_drop_dead_handles`), and without its handle another gateway leaving last would stop
        the server under this one."""
        with _pgserver().PostgresServer._lock:
            try:
                _drop_dead_handles(self.pgdata / _HANDLES)
                self._server.global_process_id_list.get_and_add(os.getpid())
            except (OSError, ValueError) as exc:  # tried again at the next tick
                log.warning("could not check the embedded PostgreSQL's list of users: %s", exc)

    def _restart(self) -> int | None:
        """Start the server again if it is still down; the PID it got, or None if another
        process sharing the data directory already did it."""
        postgres_server = _pgserver()
        with postgres_server.PostgresServer._lock:
            if _postmaster(self.pgdata) is not None:
                return None
            log.error(
                "the embedded PostgreSQL stopped unexpectedly (data in %s); restarting it",
                self.data_dir,
            )
            _clear_dead_server(self.pgdata)
            self._server.ensure_postgres_running()
        return _postmaster(self.pgdata)

    def stop(self) -> None:
        """Give up this process's handle; the server stops when no process holds one."""
        import psutil

        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
        self._keep_handle()  # pgserver stops the server when this handle is the last one
        postgres_server = _pgserver()
        with postgres_server.PostgresServer._lock:
            # What pgserver remembers may be a server that died, or one another gateway
            # restarted since: it stops the one running now, and never a zombie.
            alive = _postmaster(self.pgdata) is not None
            self._server._postmaster_info = (
                postgres_server.PostmasterInfo.read_from_pgdata(self.pgdata) if alive else None
            )
        try:
            self._server.cleanup()
        except psutil.Error as exc:  # the server died between the look above and pgserver's
            log.warning("the embedded PostgreSQL had already stopped: %s", exc)
        except ValueError as exc:  # its list of users was cut short since, by another process
            log.warning(
                "the embedded PostgreSQL's list of users is unreadable (%s); the server was "
                "left running, and the next start repairs the list",
                exc,
            )


def start(data_dir: Path) -> EmbeddedPostgres:
    """Start (or join) the embedded server under `data_dir` and return it."""
    data_dir = Path(os.path.abspath(data_dir.expanduser()))
    pgdata = data_dir / "pgdata"
    postgres_server = _pgserver()  # first: where it is not installed, nothing is created
    _make_directories(data_dir)
    if os.geteuid() == 0:
        _check_reachable(pgdata, postgres_server)
    try:
        with postgres_server.PostgresServer._lock:  # pgserver's lock around its handle list
            _drop_dead_handles(pgdata / _HANDLES)
            if pgdata.exists() and _postmaster(pgdata) is None:
                _clear_dead_server(pgdata)
        server = postgres_server.get_server(pgdata, cleanup_mode="stop")
    except (subprocess.SubprocessError, OSError) as exc:
        raise errors.StoreUnavailable(
            f"the embedded PostgreSQL in {data_dir} did not start ({type(exc).__name__}); the "
            f"end of its log ({pgdata / 'log'}):\n{_log_tail(pgdata)}"
        ) from exc
    embedded = EmbeddedPostgres(server, pgdata)
    log.info("embedded PostgreSQL running, data in %s (log: %s)", data_dir, pgdata / "log")
    return embedded


def start_migrated(data_dir: Path) -> EmbeddedPostgres:
    """The embedded server under `data_dir`, started (or joined) and migrated to the newest
    revision (idempotent): what `oncegate serve`, `migrate` and `purge`, the lab and the agent's
    checkpoints open when no database URL is given. Stopped again if the migration fails."""
    from . import migrate  # Alembic's import is not paid by `start` alone

    server = start(data_dir)
    try:
        migrate.upgrade(server.url)
    except BaseException:
        server.stop()
        raise
    log.info("embedded PostgreSQL migrated to revision %s", migrate.head())
    return server


def _make_directories(data_dir: Path) -> None:
    """Create the data directory and any missing parent. As root they must be traversable by
    pgserver's user; otherwise they are private to the user (as XDG asks of its directories)."""
    missing = []
    directory = data_dir
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    mode = 0o755 if os.geteuid() == 0 else 0o700
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue  # made by another process at the same moment
        except OSError as exc:
            raise errors.ConfigError(
                f"cannot create the data directory {directory}: {exc.strerror}. Choose another "
                "with ONCEGATE_DATA_DIR (or --data-dir)"
            ) from None
        directory.chmod(mode)  # mkdir's mode is reduced by the umask; this is exact


def _check_reachable(pgdata: Path, postgres_server: Any) -> None:
    """Refuse, rather than let pgserver open a parent to every user (see the module docstring)."""
    closed = _closed_parent(pgdata)
    if closed is not None:
        raise errors.ConfigError(
            f"the embedded PostgreSQL runs as the user 'pgserver' when oncegate runs as root, and "
            f"cannot reach {pgdata}: {closed} is closed to other users "
            f"(mode {stat.S_IMODE(closed.stat().st_mode):04o}). oncegate does not open "
            "directories it did not create: choose a data directory elsewhere with "
            "ONCEGATE_DATA_DIR (or --data-dir; /var/lib/oncegate is the default as root), or "
            "use your own server with ONCEGATE_DATABASE_URL"
        )
    programs = Path(postgres_server.POSTGRES_BIN_PATH)
    closed = _closed_parent(programs)
    if closed is not None:
        raise errors.ConfigError(
            f"the embedded PostgreSQL runs as the user 'pgserver' when oncegate runs as root, and "
            f"cannot reach its programs in {programs}: {closed} is closed to other users "
            f"(mode {stat.S_IMODE(closed.stat().st_mode):04o}). oncegate does not open "
            "directories it did not create: install oncegate where every user can read it "
            "(for example a virtual environment under /opt), or use your own server with "
            "ONCEGATE_DATABASE_URL"
        )
    socket = pgdata / ".s.PGSQL.5432"
    if len(os.fsencode(socket)) > _SOCKET_PATH_LIMIT:
        runtime = Path(postgres_server.PostgresServer.runtime_path)
        closed = _closed_parent(runtime / "socket")
        if closed is not None:
            raise errors.ConfigError(
                f"the data directory's path is too long for PostgreSQL's socket, which would "
                f"go under {runtime}; {closed} is closed to other users. Choose a shorter "
                "data directory with ONCEGATE_DATA_DIR (or --data-dir)"
            )


def _closed_parent(path: Path) -> Path | None:
    """The first parent of `path` that other users cannot list and traverse."""
    for parent in path.parents:
        if parent.exists() and parent.stat().st_mode & _OPEN_TO_OTHERS != _OPEN_TO_OTHERS:
            return parent
    return None


def _postmaster(pgdata: Path) -> int | None:
    """The PID of the live postmaster of `pgdata`, or None: no lock file, or one naming a
    process that is gone, a zombie, or another program that reuses the PID."""
    import psutil

    try:
        pid = int((pgdata / _PID_FILE).read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        if Path(process.cwd()) != pgdata.resolve():  # PostgreSQL runs in its data directory
            return None
    except psutil.Error:
        return None
    return pid


def _clear_dead_server(pgdata: Path) -> None:
    """Make way for a new server after one died: wait for its last processes to leave (a new
    postmaster refuses shared memory still attached), then remove its lock file."""
    import psutil

    pid_file = pgdata / _PID_FILE
    if not pid_file.exists():
        return
    resolved = pgdata.resolve()
    deadline = time.monotonic() + _LEFTOVER_TIMEOUT
    while time.monotonic() < deadline:
        leftovers = []
        for process in psutil.process_iter(["name"]):
            with contextlib.suppress(psutil.Error):
                if process.info["name"] == "postgres" and Path(process.cwd()) == resolved:
                    leftovers.append(process.pid)
        if not leftovers:
            break
        time.sleep(0.05)
    else:
        raise errors.StoreUnavailable(
            f"processes of a dead embedded PostgreSQL still use {pgdata}: {leftovers}"
        )
    # The lock file of the socket names the dead postmaster too; PostgreSQL would refuse it.
    lines = pid_file.read_text().splitlines()
    with contextlib.suppress(IndexError, ValueError):
        socket_lock = Path(lines[4]) / f".s.PGSQL.{int(lines[3])}.lock"
        if socket_lock.read_text().split("\n", 1)[0].strip() == lines[0].strip():
            socket_lock.unlink()
    with contextlib.suppress(FileNotFoundError):
        pid_file.unlink()
    log.warning("removed the lock files of an embedded PostgreSQL that had died, in %s", pgdata)


def _log_tail(pgdata: Path, lines: int = 5) -> str:
    try:
        return "\n".join((pgdata / "log").read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read it: {exc.strerror})"


def _drop_dead_handles(path: Path) -> None:
    """Keep in pgserver's list of the server's users only the processes still alive. pgserver
    rewrites the list in place (truncate, then write): a process killed in between leaves it
    empty or cut short, and pgserver then fails on it at every start, so such a list is
    rewritten too."""
    if not path.exists():
        return
    try:
        pids = json.loads(path.read_text())
    except ValueError:
        pids = None  # cut short by a kill in the middle of a write
    listed = pids if isinstance(pids, list) else []
    alive = [pid for pid in listed if isinstance(pid, int) and process_alive(pid)]
    if alive != pids:
        # Whole or not at all: written beside it, then renamed over it.
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps(alive))
        os.replace(partial, path)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
