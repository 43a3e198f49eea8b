"""`oncegate`: serve | migrate | purge | rekey | demo-upstream | lab | keys (contract section 2).

Flags win over `ONCEGATE_*` variables, which win over the config file (see `oncegate.settings`).
Configuration mistakes end the command with a message naming the field and exit status 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from .. import settings
from ..model import errors
from ..model.records import HeldKeys
from ..settings import database_url
from ..telemetry import logs, metrics
from . import argument_types

log = logging.getLogger("oncegate")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_CONFIG = 2
EXIT_STORE = 3


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    arguments = parser.parse_args(argv)
    try:
        result: int = arguments.run(arguments)
    except errors.ConfigError as exc:
        print(f"oncegate: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except errors.StoreUnavailable as exc:
        print(f"oncegate: {exc.detail}", file=sys.stderr)
        return EXIT_STORE
    return result


_DATABASE_HELP = (
    "The database is ONCEGATE_DATABASE_URL (a postgresql:// URL; several hosts in libpq's syntax, "
    "postgresql://user@db1:5432,db2:5432/oncegate?target_session_attrs=read-write, follow the "
    "primary after a failover); when it is unset, the embedded "
    "PostgreSQL in ONCEGATE_DATA_DIR (default ~/.local/share/oncegate, or "
    "$XDG_DATA_HOME/oncegate; /var/lib/oncegate as root), started and stopped by the command."
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oncegate",
        description="An Idempotency-Key gateway: POST/PATCH calls happen at most once per key.",
    )
    parser.add_argument("--version", action="version", version=f"oncegate {_version()}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the gateway",
        description="Run the gateway. Every flag also has an ONCEGATE_* variable "
        "(--admin-port: ONCEGATE_ADMIN_PORT); flags win over variables, variables over the file. "
        "ONCEGATE_ADMIN_TOKEN enables the admin API on the admin port (Authorization: Bearer "
        "TOKEN); without it the admin API answers 404. " + _DATABASE_HELP,
    )
    serve.add_argument("--upstream", metavar="URL", help="one catch-all route named 'default'")
    serve.add_argument("--config", metavar="FILE", help="YAML file with routes and settings")
    serve.add_argument("--host", metavar="H", help="address of both ports (default 127.0.0.1)")
    serve.add_argument("--port", type=int, metavar="N", help="proxy port (default 8080)")
    serve.add_argument(
        "--admin-port",
        type=int,
        metavar="N",
        help="admin port: /metrics, /healthz, /readyz, the admin API (default 8081)",
    )
    serve.add_argument(
        "--workers",
        metavar="N",
        help="worker processes, or auto: one per core this process may use (default 1)",
    )
    serve.add_argument(
        "--ttl", metavar="DURATION", help="key lifetime for routes that set none (default 24h)"
    )
    serve.add_argument(
        "--data-dir",
        metavar="DIR",
        help="embedded PostgreSQL data (default ~/.local/share/oncegate; root: /var/lib/oncegate)",
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="one JSON object per line, or text for a terminal (default json)",
    )
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="the least severe lines logged; warning drops the per-request lines (default info)",
    )
    serve.set_defaults(run=_serve)

    migrate = commands.add_parser(
        "migrate",
        help="apply the schema migrations (idempotent)",
        description="Apply the schema migrations up to this version's revision, and print it. "
        "Idempotent: run it before each release's gateways start. " + _DATABASE_HELP,
    )
    migrate.set_defaults(run=_migrate)

    purge = commands.add_parser(
        "purge",
        help="delete expired keys once, in batches",
        description="Delete the keys past their TTL once, in bounded batches, and print how many. "
        "A running gateway also does it every ONCEGATE_PURGE_INTERVAL (default 60s). "
        + _DATABASE_HELP,
    )
    purge.set_defaults(run=_purge)

    rekey = commands.add_parser(
        "rekey",
        help="re-seal stored answers under the newest key of ONCEGATE_ENCRYPTION_KEYS",
        description="Re-seal every stored answer (and seal plaintext ones) under the first key "
        "of ONCEGATE_ENCRYPTION_KEYS, in bounded batches, so an older key can be removed. Safe "
        "beside running gateways, and to stop and start again.",
    )
    rekey.add_argument(
        "--batch-size", type=argument_types.positive, default=500, help="rows per batch (500)"
    )
    rekey.set_defaults(run=_rekey)

    demo = commands.add_parser(
        "demo-upstream",
        help="a fake email/ticket/payment service for demos, the lab and tests",
        description="A fake side-effecting API: POST /emails, /tickets, /charges answer 201 with "
        "a JSON receipt, and so do POST /payments (its key in the JSON body's idempotency_key) "
        "and /orders (its key in PayPal-Request-Id); GET /actions lists every action really "
        "performed, with its key; ?delay=SECONDS and ?status=CODE make a call slow or failing.",
    )
    demo.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    demo.add_argument("--port", type=int, default=9000, metavar="N", help="port (9000)")
    demo.set_defaults(run=_demo_upstream)

    from . import lab  # `oncegate lab`: the crash-recovery lab

    lab.add_parser(commands)

    from . import keys  # `oncegate keys`: the admin API from a terminal

    keys.add_parser(commands)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("oncegate")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _serve(arguments: argparse.Namespace) -> int:
    flags = {
        name: getattr(arguments, name)
        for name in (
            "upstream",
            "config",
            "host",
            "port",
            "admin_port",
            "workers",
            "ttl",
            "data_dir",
            "log_format",
            "log_level",
        )
    }
    config = settings.load(flags)
    logs.configure(config.log_format, config.log_level)
    with (
        _held_signals() as received,
        _metrics(config.workers),
        _database(config, supervise=True) as database,
    ):
        from ..http import server

        keys, primary = asyncio.run(_check_schema(database.url, config.store_options(1)))
        for route in config.routes:
            log.info(
                "route %s: %s -> %s (methods %s, key %s, ttl %gs, timeout %gs)",
                route.name,
                route.match,
                route.upstream,
                ",".join(sorted(route.methods)),
                route.key,
                route.ttl,
                route.timeout,
            )
        where = (
            database.description
            if primary is None
            else f"{database.description}, primary {primary}"
        )
        summary = server.Summary(where, keys)
        stopped_by = server.run(config, database.url, summary, received)
    # Stopped by Ctrl-C: the shell's convention for an interrupted command (128 + SIGINT), so a
    # script that ran the gateway learns it was interrupted. SIGTERM is the ordinary way a
    # service is stopped: 0.
    return 128 + signal.SIGINT if stopped_by == signal.SIGINT else 0


def _migrate(arguments: argparse.Namespace) -> int:
    from ..store import citus, migrate

    logs.configure("text", "info")
    where = settings.load_part(settings.DatabaseSettings)
    with _database(where) as database:
        if where.database_url is not None:  # the embedded one was migrated as it started
            migrate.upgrade(database.url)
        distribution = asyncio.run(citus.describe(database.url))
    print(f"database is at schema revision {migrate.head()}")
    if distribution is not None:
        print(distribution)
        warning = citus.crowded(distribution.most)
        if warning is not None:
            citus.log.warning("%s", warning)
    return 0


def _purge(arguments: argparse.Namespace) -> int:
    from .. import service
    from ..store.postgres import PostgresStore

    logs.configure("text", "warning")
    where = settings.load_part(settings.DatabaseSettings)
    options = settings.load_part(settings.StoreSettings).store_options(pool_size=1)

    async def purge(database_url: str) -> int:
        store = await PostgresStore.connect(database_url, options)
        try:
            return await service.purge_expired(store.upkeep)
        finally:
            await store.close()

    with _database(where) as database:
        deleted = asyncio.run(purge(database.url))
    print(f"purged {deleted} expired keys")
    return 0


def _rekey(arguments: argparse.Namespace) -> int:
    from . import rekey

    logs.configure("text", "warning")
    keyring = settings.load_part(settings.SealingSettings).keyring()
    if keyring is None:
        raise errors.ConfigError(
            "rekey needs ONCEGATE_ENCRYPTION_KEYS (name:base64-key,...): the first key seals"
        )
    where = settings.load_part(settings.DatabaseSettings)
    options = settings.load_part(settings.StoreSettings).store_options(pool_size=1)
    with _database(where) as database:
        done, unopenable, left = rekey.run(
            database.url, keyring, sys.stdout, arguments.batch_size, options
        )
    print(f"re-sealed {done} stored answers and kept requests under key {keyring.current!r}")
    if unopenable:
        print(
            f"{len(unopenable)} stored answers or kept requests could not be opened and were "
            "left as they are; "
            "keep their key configured until they expire (releasing them would let a retry be "
            "performed again):",
            file=sys.stderr,
        )
        for record_id, reason in unopenable[:20]:
            print(f"  key id {record_id}: {reason}", file=sys.stderr)
    if left > len(unopenable):
        print(
            f"{left - len(unopenable)} stored answers or kept requests are still under an older "
            "key: a gateway still seals with it. Give every gateway the new key first, then run "
            "rekey again.",
            file=sys.stderr,
        )
    return 1 if left else 0


def _demo_upstream(arguments: argparse.Namespace) -> int:
    import uvicorn

    from ..http import server
    from .demo_upstream import DemoUpstream

    logs.configure("text", "info")
    # Bound here, so a busy port ends the command at once with a message (exit 2), before
    # anything could take it for a running upstream.
    sock = server.bind(arguments.host, arguments.port)
    log.info("demo upstream listening on http://%s:%d", arguments.host, arguments.port)
    config = uvicorn.Config(DemoUpstream(), log_config=None, access_log=False)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


@contextmanager
def _held_signals() -> Iterator[list[int]]:
    """Remember SIGTERM and SIGINT while the gateway starts (the embedded PostgreSQL, the
    migrations, the pool), instead of dying at once without running any `finally` (an embedded
    PostgreSQL would be left running, with no gateway); `server.run` acts on them when it can."""
    received: list[int] = []

    def remember(number: int, frame: object) -> None:
        received.append(number)

    previous = {number: signal.signal(number, remember) for number in _SIGNALS}
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextmanager
def _metrics(workers: int) -> Iterator[None]:
    """Set the metrics up before anything observes one: with several workers, every value is
    kept in files of a directory of this run's, which /metrics adds up (`metrics.setup`)."""
    if workers == 1:
        metrics.setup()
        yield
        return
    directory = tempfile.mkdtemp(prefix="oncegate-metrics-")
    try:
        metrics.setup(multiprocess_dir=directory)
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass(frozen=True)
class _Database:
    url: str
    description: str  # for the log: never the password


@contextmanager
def _database(where: settings.DatabaseSettings, *, supervise: bool = False) -> Iterator[_Database]:
    """The given database, or the embedded one, migrated, for as long as the block runs.
    `supervise`: restart the embedded server if it dies meanwhile (a gateway, not a one-shot)."""
    if where.database_url is not None:
        yield _Database(where.database_url, database_url.without_password(where.database_url))
        return
    from ..store import embedded

    server = embedded.start_migrated(where.data_dir)
    try:
        if supervise:
            server.supervise()
        yield _Database(server.url, f"embedded PostgreSQL, data in {server.data_dir}")
    finally:
        server.stop()


async def _check_schema(url: str, options: settings.StoreOptions) -> tuple[HeldKeys, str | None]:
    """Refuse to serve a database that was never migrated: every request would fail. Warn, once,
    when a failover of this PostgreSQL could lose claims (contract section 10, "failover").
    Returns how many keys it holds (exact up to a thousand, reading no more rows than that; an
    estimate above) and, when the URL lists several hosts, which one is the primary, for the
    start-up summary."""
    from ..store import migrate
    from ..store.postgres import PostgresStore

    store = await PostgresStore.connect(url, options)
    try:
        revision = await store.upkeep.schema_revision()
        if revision != migrate.head():
            raise errors.ConfigError(
                f"the database is at schema revision {revision or 'none'}, this gateway needs "
                f"{migrate.head()}: run `oncegate migrate` first"
            )
        risk = (await store.upkeep.replication()).risk()
        if risk is not None:
            log.warning("%s; the primary is %s", risk, store.primary)
        several = len(database_url.parse(url).hosts) > 1
        return await store.upkeep.held_keys(), store.primary if several else None
    finally:
        await store.close()


if __name__ == "__main__":
    sys.exit(main())
