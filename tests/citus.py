"""A real Citus cluster for the tests and the bench: a coordinator and two workers.

Each node is Debian's PostgreSQL 15 with the Citus extension (installed by CI before the tests),
started with its own `initdb`/`pg_ctl` on a free port of 127.0.0.1, in a temporary directory,
as a user that is not root (`postgres` when the tests run as root). Nothing here pretends:
where Citus is not installed, `unavailable()` says why and the tests that need it are skipped.

What a Citus database needs, learned on this cluster: `shared_preload_libraries = 'citus'` on
every node; `citus.node_conninfo = 'sslmode=disable'` (these servers have no TLS, and Citus asks
for it between nodes by default); the database on every node, with `CREATE EXTENSION citus` in
it, before the coordinator adds the workers (`CREATE DATABASE` is not propagated, and Citus keeps
its metadata per database).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from oncegate.store import embedded
from tests.helpers import free_port

BIN = Path("/usr/lib/postgresql/15/bin")
LIB = Path("/usr/lib/postgresql/15/lib")
USER = "postgres"  # the servers' user when the tests run as root (Debian's package makes it)
WORKERS = 2
# Shards per distributed table: Citus's default is 32, and oncegate's `migrate` chooses two per
# worker where the operator left that default; 8 (set per database, as an operator would: the
# migration honours it) keep a test database's migration to a second while still putting
# several shards on each worker.
SHARD_COUNT = 8
START_TIMEOUT = 60
OWNER = "owner.pid"  # the process that started a cluster, so a later run can stop an orphan


def unavailable() -> str | None:
    """Why no Citus cluster can start here, or None when one can."""
    if not (BIN / "pg_ctl").exists():
        return f"PostgreSQL 15 is not installed ({BIN}); CI installs it with Citus before the tests"
    if not (LIB / "citus.so").exists():
        return f"the Citus extension is not installed in {LIB}; CI installs it before the tests"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            return f"running as root, and there is no user {USER!r} to run PostgreSQL as"
    return None


@dataclass
class Node:
    name: str
    port: int
    data: Path
    log: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"


@dataclass
class Cluster:
    """A coordinator and its workers, each a PostgreSQL server of its own."""

    directory: Path
    coordinator: Node
    workers: list[Node] = field(default_factory=list)
    with_citus: bool = True  # False: one plain PostgreSQL with the same settings (the bench's)

    @property
    def nodes(self) -> list[Node]:
        return [self.coordinator, *self.workers]

    def url(self, database: str = "postgres") -> str:
        """The coordinator: what `ONCEGATE_DATABASE_URL` names."""
        return self.coordinator.url(database)

    @classmethod
    def start(
        cls, directory: Path | None = None, workers: int = WORKERS, with_citus: bool = True
    ) -> Cluster:
        directory = directory or temporary_directory("oncegate-citus-")
        directory.mkdir(parents=True, exist_ok=True)
        (directory / OWNER).write_text(str(os.getpid()))
        _give_to_server_user(directory)
        nodes = [
            Node(name, free_port(), directory / name, directory / f"{name}.log")
            for name in ["coordinator", *(f"worker{number}" for number in range(1, workers + 1))]
        ]
        cluster = cls(directory, nodes[0], nodes[1:], with_citus)
        try:
            for node in nodes:
                cluster.add_node(node)
            if with_citus:
                asyncio.run(cluster._add_nodes("postgres"))
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def add_node(self, node: Node) -> None:
        """Make `node`'s data directory and start it (a worker is added to a database with
        `add_worker`)."""
        _run([BIN / "initdb", "-D", node.data, "-U", USER, "-A", "trust", "--no-sync"])
        citus_settings = (
            "shared_preload_libraries = 'citus'\n"
            "citus.node_conninfo = 'sslmode=disable'\n"
            "citus.enable_stat_counters = on\n"
            # Shards move by logical replication (citus_rebalance_start) without blocking writes.
            "wal_level = logical\n"
        )
        with (node.data / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {node.port}\n"
                "listen_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.directory}'\n"
                + (citus_settings if self.with_citus else "")
                + "max_connections = 200\n"
                "fsync = off\n"
                "full_page_writes = off\n"
            )
        self.start_node(node)

    def postmasters(self) -> list[int]:
        """The pid of every node's postmaster (for the CPU they use)."""
        return [
            int((node.data / "postmaster.pid").read_text().splitlines()[0]) for node in self.nodes
        ]

    def start_node(self, node: Node) -> None:
        _run(
            [
                BIN / "pg_ctl",
                "-D",
                node.data,
                "-l",
                node.log,
                "-w",
                "-t",
                str(START_TIMEOUT),
                "start",
            ]
        )

    def stop_node(self, node: Node, mode: str = "fast") -> None:
        """`mode` as pg_ctl's `-m`: `immediate` is a crash (no shutdown checkpoint)."""
        _run([BIN / "pg_ctl", "-D", node.data, "-m", mode, "-w", "stop"])

    def stop(self) -> None:
        for node in self.nodes:
            if (node.data / "postmaster.pid").exists():
                with contextlib.suppress(subprocess.CalledProcessError):
                    self.stop_node(node, "immediate")
        shutil.rmtree(self.directory, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """A new Citus database `name` on every node, its workers added; its coordinator URL."""
        asyncio.run(self._create_database(name))
        return self.url(name)

    def drop_database(self, name: str) -> None:
        asyncio.run(self._on_every_node("postgres", f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))

    async def _create_database(self, name: str) -> None:
        await self._on_every_node(
            "postgres",
            f"DROP DATABASE IF EXISTS {name} WITH (FORCE)",
            f"CREATE DATABASE {name}",
        )
        if self.with_citus:
            await self._add_nodes(name)
            connection = await asyncpg.connect(self.url("postgres"))
            try:
                await connection.execute(
                    f"ALTER DATABASE {name} SET citus.shard_count = {SHARD_COUNT:d}"
                )
            finally:
                await connection.close()

    async def _add_nodes(self, database: str) -> None:
        await self._on_every_node(database, "CREATE EXTENSION IF NOT EXISTS citus")
        connection = await asyncpg.connect(self.url(database))
        try:
            await connection.execute(
                "SELECT citus_set_coordinator_host('127.0.0.1', $1)", self.coordinator.port
            )
            for worker in self.workers:
                await connection.execute("SELECT citus_add_node('127.0.0.1', $1)", worker.port)
        finally:
            await connection.close()

    async def _on_every_node(self, database: str, *statements: str) -> None:
        for node in self.nodes:
            connection = await asyncpg.connect(node.url(database))
            try:
                for statement in statements:
                    await connection.execute(statement)
            finally:
                await connection.close()


def stop_orphans(prefix: str = "oncegate-citus-") -> None:
    """Stop the clusters of earlier runs that ended without stopping them (a test session killed
    by a timeout runs no finalizer): those whose directory names an owner that is gone."""
    for directory in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            owner = int((directory / OWNER).read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or not started yet
        if embedded.process_alive(owner):
            continue
        for data in directory.iterdir():
            if (data / "postmaster.pid").exists():
                with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
                    _run([BIN / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"])
        shutil.rmtree(directory, ignore_errors=True)


def temporary_directory(prefix: str) -> Path:
    """A new directory the servers' user may enter (not under pytest's private tree)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    directory.chmod(0o755)
    return directory


def _give_to_server_user(directory: Path) -> None:
    """PostgreSQL refuses to run as root: as root, its directory belongs to `postgres`."""
    if os.geteuid() == 0:
        entry = pwd.getpwnam(USER)
        os.chown(directory, entry.pw_uid, entry.pw_gid)


def _run(command: list[object]) -> None:
    arguments = [str(part) for part in command]
    if os.geteuid() == 0:
        arguments = ["runuser", "-u", USER, "--", *arguments]
    result = subprocess.run(arguments, capture_output=True, text=True, timeout=START_TIMEOUT + 30)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(
            result.returncode, arguments, result.stdout, result.stderr
        )
