"""`oncegate`: serve | migrate | purge | demo-upstream | lab (contract section 2).

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
from pathlib import Path
from typing import TYPE_CHECKING

from . import database_url, errors, logs, metrics, settings

if TYPE_CHECKING:
    from .lab.crashlab import Runtime

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
    serve.add_argument("--workers", type=int, metavar="N", help="worker processes (default 1)")
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
    rekey.add_argument("--batch-size", type=_positive, default=500, help="rows per batch (500)")
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

    lab = commands.add_parser(
        "lab",
        help="the crash-recovery lab: kill an agent at random, resume it, count duplicates",
        description="Run a 12-step agent task N times under each strategy (A restart, "
        "B checkpoint, C checkpoint + keys through the gateway, D save first then act), kill "
        "each run with SIGKILL at a random point, resume it, and count what the demo upstream "
        "really performed. Starts its own PostgreSQL, gateway and demo upstream unless told "
        "where they are.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    lab.add_argument("-h", "--help", action=_LabHelp, help="show this help message and exit")
    lab.add_argument("--runs", type=_positive, default=1000, help="runs per strategy (1000)")
    lab.add_argument("--seed", type=int, default=24, help="seed of the crash points (24)")
    lab.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    lab.add_argument("--plot", metavar="FILE.svg", type=Path, help="also write an SVG chart")
    lab.add_argument(
        "--strategies", type=_strategies, help="which to run (default ABCD; ABC on LangGraph)"
    )
    lab.add_argument(
        "--runtime",
        choices=["runner", "langgraph"],
        default="runner",
        help="what plays the task: the agent library's runner (default) or a LangGraph graph "
        "checkpointed by PostgresSaver (strategies A, B, C; needs oncegate[langgraph])",
    )
    lab.add_argument(
        "--kill-gateway",
        metavar="SHARE",
        type=float,
        nargs="?",
        const=0.05,
        default=0.0,
        help="also SIGKILL the gateway during this share of the C runs (0.05 without a value)",
    )
    lab.add_argument(
        "--late-resume",
        action="store_true",
        help="also run E (C resumed after its keys expired at the gateway) and F (E with the "
        "client's key-age check: stops for reconciliation instead of resending)",
    )
    lab.add_argument("--jobs", type=_positive, default=4, help="runs at a time (4)")
    lab.add_argument(
        "--database-url",
        metavar="URL",
        type=_database_url,
        help="a migrated PostgreSQL, not embedded (one host or several, as ONCEGATE_DATABASE_URL)",
    )
    lab.add_argument("--upstream", metavar="URL", help="a running demo-upstream")
    lab.add_argument("--gateway", metavar="URL", help="a running gateway in front of it")
    lab.set_defaults(run=_lab)

    from . import operator_cli  # `oncegate keys`: the admin API from a terminal

    operator_cli.add_parser(commands)
    return parser


class _LabHelp(argparse.Action):
    """`oncegate lab --help`, ending with the invented costs the lab prices its waste at: built
    only when asked for, as it imports the lab (every other command would pay for it)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, argparse.SUPPRESS, nargs=0, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        parser.epilog = _lab_costs()
        parser.print_help()
        parser.exit()


def _lab_costs() -> str:
    """`--help`'s account of the invented costs the wasted columns are priced at."""
    from .lab import crashlab, task

    steps = task.support_task("run")
    lines = [
        "The wasted tokens and seconds are priced at invented per-step costs, as the",
        "write-up's are (the steps here take microseconds): every finished step redone, plus",
        "the part of the step the crash interrupted. Checkpoint seconds: each save at "
        f"{task.CHECKPOINT_SAVE_SECONDS * 1000:.0f} ms,",
        "invented too.",
        "",
    ]
    for number, step in enumerate(steps, start=1):
        cost = task.COSTS[number]
        lines.append(
            f"  {number:>2} {step.name:<18} {cost.tokens:>6,} tokens {cost.seconds:>5.1f} s"
        )
    lines += ["", "The model expects, per run (docs/lab.md shows the arithmetic):"]
    for name in "ABD":
        tokens, seconds = crashlab.expectation(crashlab.STRATEGIES[name])
        also = {"B": " (and C, E)", "D": " (and F)"}.get(name, "")
        lines.append(f"  {name} {tokens:>8,.0f} tokens {seconds:>6.2f} s wasted{also}")
    return "\n".join(lines)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("oncegate")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def _database_url(text: str) -> str:
    try:
        database_url.parse(text)
    except database_url.InvalidDatabaseUrl as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _strategies(text: str) -> str:
    letters = text.upper()
    if not letters or not set(letters) <= set("ABCD") or len(set(letters)) != len(letters):
        raise argparse.ArgumentTypeError(f"letters among A, B, C, D, each once, not {text!r}")
    return letters


def _lab(arguments: argparse.Namespace) -> int:
    import json

    from .lab import crashlab, plot, stack

    if arguments.plot is not None and arguments.plot.suffix.lower() != ".svg":
        raise errors.ConfigError(f"--plot writes SVG: name the file *.svg, not {arguments.plot}")
    if arguments.kill_gateway and arguments.gateway:
        raise errors.ConfigError("--kill-gateway needs the lab's own gateway: drop --gateway")
    if not 0 <= arguments.kill_gateway <= 1:
        raise errors.ConfigError("--kill-gateway takes a share between 0 and 1")
    if arguments.late_resume and arguments.gateway:
        raise errors.ConfigError(
            "--late-resume needs the lab's own gateway (its /late route keeps keys seconds, "
            "not a day): drop --gateway"
        )
    runtime: Runtime = crashlab.RUNNER
    if arguments.runtime == "langgraph":
        runtime = _langgraph_runtime(arguments)
    arguments.strategies = arguments.strategies or "".join(
        name for name in "ABCD" if name in runtime.titles
    )
    if arguments.gateway and not arguments.upstream and "C" in arguments.strategies:
        raise errors.ConfigError("--gateway needs --upstream: the one it forwards to")
    logs.configure("text", "warning")
    with stack.running(arguments.database_url, arguments.upstream, arguments.gateway) as services:
        lab = crashlab.Lab(
            services,
            runs=arguments.runs,
            seed=arguments.seed,
            strategies=arguments.strategies,
            jobs=arguments.jobs,
            kill_gateway=arguments.kill_gateway,
            late_resume=arguments.late_resume,
            progress=crashlab.ProgressBar(sys.stderr),
            runtime=runtime,
        )
        outcome = lab.run()
    if arguments.json:
        print(json.dumps(outcome.document()))
        note = crashlab.too_few_runs(outcome.runs) if "B" in outcome.strategies else None
        if note is not None:
            print(f"oncegate lab: {note}", file=sys.stderr)
    else:
        print(crashlab.table(outcome))
    if arguments.plot is not None:
        plot.write(outcome, arguments.plot)
        print(f"oncegate lab: chart written to {arguments.plot.resolve()}", file=sys.stderr)
    for failure in outcome.failures:
        print(f"oncegate lab: {failure}", file=sys.stderr)
    return 1 if outcome.failures else 0


def _langgraph_runtime(arguments: argparse.Namespace) -> Runtime:
    """`lab --runtime langgraph`'s runtime, after refusing what it does not have."""
    unknown = set(arguments.strategies or "") - set("ABC")
    if unknown:
        raise errors.ConfigError(
            f"--runtime langgraph plays strategies A, B and C, not {', '.join(sorted(unknown))}"
        )
    if arguments.kill_gateway or arguments.late_resume:
        raise errors.ConfigError(
            "--kill-gateway and --late-resume are the runner's: drop them or --runtime langgraph"
        )
    try:
        from .lab import langgraph_runtime
    except ImportError as exc:
        raise errors.ConfigError(
            f"--runtime langgraph needs LangGraph: pip install 'oncegate[langgraph]' ({exc})"
        ) from exc
    return langgraph_runtime.RUNTIME


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
        from .http import server

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
    from . import schema
    from .store import citus

    logs.configure("text", "info")
    where = settings.load_part(settings.DatabaseSettings)
    with _database(where) as database:
        if where.database_url is not None:  # the embedded one was migrated as it started
            schema.upgrade(database.url)
        distribution = asyncio.run(citus.describe(database.url))
    print(f"database is at schema revision {schema.head()}")
    if distribution is not None:
        print(distribution)
    return 0


def _purge(arguments: argparse.Namespace) -> int:
    from . import service
    from .store.postgres import PostgresStore

    logs.configure("text", "warning")
    where = settings.load_part(settings.DatabaseSettings)
    options = settings.load_part(settings.StoreSettings).store_options(pool_size=1)

    async def purge(database_url: str) -> int:
        store = await PostgresStore.connect(database_url, options)
        try:
            return await service.purge_expired(store)
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
    print(f"re-sealed {done} stored answers under key {keyring.current!r}")
    if unopenable:
        print(
            f"{len(unopenable)} stored answers could not be opened and were left as they are; "
            "keep their key configured until they expire (releasing them would let a retry be "
            "performed again):",
            file=sys.stderr,
        )
        for record_id, reason in unopenable[:20]:
            print(f"  key id {record_id}: {reason}", file=sys.stderr)
    if left > len(unopenable):
        print(
            f"{left - len(unopenable)} stored answers are still under an older key: a gateway "
            "still seals with it. Give every gateway the new key first, then run rekey again.",
            file=sys.stderr,
        )
    return 1 if left else 0


def _demo_upstream(arguments: argparse.Namespace) -> int:
    import uvicorn

    from .http import server
    from .lab.demo_upstream import DemoUpstream

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
    from . import embedded, schema

    server = embedded.start(where.data_dir)
    try:
        schema.upgrade(server.url)
        log.info("embedded PostgreSQL migrated to revision %s", schema.head())
        if supervise:
            server.supervise()
        yield _Database(server.url, f"embedded PostgreSQL, data in {server.data_dir}")
    finally:
        server.stop()


async def _check_schema(url: str, options: settings.StoreOptions) -> tuple[int, str | None]:
    """Refuse to serve a database that was never migrated: every request would fail. Warn, once,
    when a failover of this PostgreSQL could lose claims (contract section 10, "failover").
    Returns how many keys it holds and, when the URL lists several hosts, which one is the
    primary, for the start-up summary."""
    from . import schema
    from .store.postgres import PostgresStore

    store = await PostgresStore.connect(url, options)
    try:
        revision = await store.schema_revision()
        if revision != schema.head():
            raise errors.ConfigError(
                f"the database is at schema revision {revision or 'none'}, this gateway needs "
                f"{schema.head()}: run `oncegate migrate` first"
            )
        risk = (await store.replication()).risk()
        if risk is not None:
            log.warning("%s; the primary is %s", risk, store.primary)
        several = len(database_url.parse(url).hosts) > 1
        return await store.total_keys(), store.primary if several else None
    finally:
        await store.close()


if __name__ == "__main__":
    sys.exit(main())
