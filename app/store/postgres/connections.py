"""The store's connections: three pools by job (`Pools`: the request path's two are the store's own
`pool.Pool`, the operator's is asyncpg's), and the one connection per process that listens for
settled keys and for the key count, and holds the key count's lock when it is this process's
(`Listener`).

Design rules:
- The pools do not reset connections on release. Nothing in the store changes session state
  (no SET, no LISTEN, no advisory locks, no open transaction) on a pooled connection, so
  asyncpg's reset query would only add a round trip to every request. The LISTENs and the one
  advisory lock are on a connection of their own (`Listener`).
- asyncpg prepares each statement once per connection and reuses it (its statement cache).
- The pools replace broken connections by themselves, so service resumes when PostgreSQL comes
  back, with no restart. With several hosts in the URL (`target_session_attrs=read-write`) each
  new connection goes to whichever host takes writes: after a failover, the promoted standby.
  `Primary` remembers which host the last new connection reached, for the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import asyncpg

from ...model.records import LISTED_STATES, Listed
from ...settings import StoreOptions, database_url
from ...settings.database_url import Host
from ...telemetry import metrics
from .. import citus
from ..errors import DRIVER_ERRORS, reason, translated
from ..notify import Watch, Watchers
from .pool import Pool

log = logging.getLogger("oncegate.store.postgres")

# `Prefer: wait`: settles of rows someone waits on are announced on this channel (queries.sql),
# and one connection per process listens to it, opened when the first request waits. Waiters
# also poll their row, so a broken listener only slows them until it is back.
CHANNEL = "oncegate_settled"
LISTENER_NAME = "oncegate-listener"  # its application_name, to find it in pg_stat_activity
LISTEN_RETRY = 1.0
# The gauge `oncegate_keys{state}`: one process per database sweeps the key table each interval,
# the one whose listening connection holds this session-level advisory lock (pg_locks shows it
# as locktype 'advisory', classid 1869505381, objid 1734440037, objsubid 1: the bytes of
# "oncegate"). It announces the totals on KEY_COUNT_CHANNEL, and every process listening (itself
# included) sets its gauge from them. The lock goes with its session: when the holder stops or
# loses its connection, the next process to try takes it, with nothing to configure.
KEY_COUNT_LOCK = int.from_bytes(b"oncegate", "big")
KEY_COUNT_CHANNEL = "oncegate_key_count"
# The operator's work (the admin API, the purger, the key count, rekey) runs on a pool of its
# own: it never takes a connection a request waits for, and its statements keep PostgreSQL's
# per-call plans, which its optional filters (`:route IS NULL OR ...`) need to use an index.
OPERATOR_POOL_SIZE = 3


@translated("connect", "cannot connect to PostgreSQL")
async def connect(url: str) -> asyncpg.Connection:
    """One connection of its own, outside the pools (the migrations': `oncegate migrate`): a
    PostgreSQL that cannot be reached is `StoreUnavailable`, said as the store's pools say it."""
    return await asyncpg.connect(url)


async def _no_reset(connection: asyncpg.Connection) -> None:
    """See the module docstring: nothing to reset."""


class Primary:
    """The host of the URL that the store's newest connection reached: the primary, since every
    connection asks for a read-write session when the URL lists several hosts."""

    def __init__(self, url: str) -> None:
        self._url = database_url.parse(url)
        self.host: Host | None = None
        self.on_change: list[Callable[[Host, Host], None]] = []  # (the new host, the one before)
        self.on_same_host: list[Callable[[], None]] = []  # a connection reached the same host

    @property
    def several_hosts(self) -> bool:
        return len(self._url.hosts) > 1

    async def connected(self, connection: asyncpg.Connection) -> None:
        """Every pool's `init`: note the host a new connection reached, and say so when it is
        not the one before (a failover), or that it is the same (after an outage: a restart)."""
        host = self._url.host_at(reached(connection))
        if host is None:
            return
        if host == self.host:
            for same in self.on_same_host:
                same()
            return
        before, self.host = self.host, host
        if before is not None:
            log.warning("PostgreSQL: the primary is now %s (it was %s)", host, before)
            for changed in self.on_change:
                changed(host, before)

    def __str__(self) -> str:
        return str(self.host) if self.host is not None else "not reached yet"


def reached(connection: asyncpg.Connection) -> object:
    """The address a connection reached: asyncpg keeps it in `_addr`, a (host, port) pair or a
    socket path (it has no public accessor; tests/store/test_failover_store.py fails loudly if
    it moves)."""
    return getattr(connection, "_addr", None)


def request_settings(on_citus: bool) -> dict[str, str]:
    """The session settings of the request pools' connections (`Pools`).

    On plain PostgreSQL:
    - `plan_cache_mode = force_generic_plan`: one plan per statement and connection (`Pools`).
    - `enable_seqscan = off`: every request-path statement names its rows by a unique index, and
      a plan made once must stay right while the table grows. Planned on an empty table never
      analysed (a new deployment), a batched statement scans the whole table and hashes it
      against the batch: cheapest at that size, and kept, by a connection that plans once, until
      autovacuum's first ANALYZE of the table a minute or more later, while every statement
      reads every row. On an analysed table of real size PostgreSQL chooses by itself the index
      lookup this setting gives from the start (tests/store/test_plans.py).

    On a Citus coordinator: `plan_cache_mode = force_custom_plan`, a plan per call (`Pools`),
    and `citus_settings`. The coordinator plans no scan of the key table (each worker plans its
    shard's statement itself), so `enable_seqscan` has no reason there, and it made the catalog
    read that `citus_settings` speeds up slower still.

    Both: JIT off. The request path's statements read a few rows by index, which JIT cannot
    speed up, and with `enable_seqscan = off` a plan that must still scan is costed far past
    `jit_above_cost` and would be compiled at every execution.
    """
    if on_citus:
        return {"plan_cache_mode": "force_custom_plan", "jit": "off", **citus_settings()}
    return {"plan_cache_mode": "force_generic_plan", "enable_seqscan": "off", "jit": "off"}


def citus_settings() -> dict[str, str]:
    """Every pool's session setting on a Citus coordinator: `citus.override_table_visibility =
    off`. Citus hides shards from catalog reads by checking each row of every scan of `pg_class`
    with `relation_is_a_known_shard`. asyncpg's look-up of the types a statement uses, which a
    new connection runs for each type it has not met (twice per request-pool connection: the
    claim's arrays and the complete's), scans `pg_class` hundreds of times: with the check it
    cost the coordinator 0.2-0.5 s of CPU each time, 4 ms without. Gateways opening their pools
    under load kept the coordinator busy past the statement timeout: 503s
    (tests/store/test_citus_store.py, tests/faults/test_multi_gateway.py). The store never lists
    tables, so what the setting shows does not concern it."""
    return {"citus.override_table_visibility": "off"}


@dataclass(frozen=True, slots=True)
class Pools:
    """The store's connections, by job. `requests`: claims, releases, take-overs, reads,
    committed with the server's own `synchronous_commit` (the role's, the database's or
    postgresql.conf's: `on` by default); `answers`: completes, committed with
    `synchronous_commit` = the `store_answer_commit` setting (`off` by default: without waiting
    for the WAL flush; `store.postgres.requests`); `operator`: everything else. The request
    pools plan each statement once per connection (`plan_cache_mode = force_generic_plan`):
    left to choose, PostgreSQL re-plans the batched statements on every call (about 0.25 ms of
    its CPU, half a lone claim's round trip). On a Citus coordinator (`citus`) they plan each
    call (`force_custom_plan`): Citus finds the one shard a statement goes to from its values,
    which a generic plan does not have."""

    requests: Pool
    answers: Pool
    operator: asyncpg.Pool
    primary: Primary
    citus: bool = False

    @classmethod
    async def open(cls, url: str, options: StoreOptions, min_size: int) -> Pools:
        primary = Primary(url)
        connection = await asyncpg.connect(url, timeout=options.connect_timeout)
        try:
            on_citus = await citus.has_citus(connection)
        finally:
            await connection.close()
        session = request_settings(on_citus)

        def request_pool(size: int, settings: dict[str, str]) -> Awaitable[Pool]:
            async def connect() -> asyncpg.Connection:
                connection: asyncpg.Connection = await asyncpg.connect(
                    url,
                    timeout=options.connect_timeout,
                    command_timeout=options.command_timeout,
                    server_settings=settings,
                )
                return connection

            return Pool.open(
                connect, primary.connected, size, min(min_size, size), options.acquire_timeout
            )

        requests = await request_pool(options.pool_size, session)
        answers = operator = None
        try:
            answers = await request_pool(
                max(1, options.pool_size // 2),
                {**session, "synchronous_commit": options.answer_commit},
            )
            operator = await asyncpg.create_pool(
                url,
                min_size=min(min_size, OPERATOR_POOL_SIZE),
                max_size=OPERATOR_POOL_SIZE,
                reset=_no_reset,
                init=primary.connected,
                timeout=options.connect_timeout,
                command_timeout=options.command_timeout,
                server_settings=citus_settings() if on_citus else None,
            )
        except BaseException:
            await requests.close()
            if answers is not None:
                await answers.close()
            raise
        return cls(requests, answers, operator, primary, citus=on_citus)

    async def close(self) -> None:
        await self.operator.close()
        await self.answers.close()
        await self.requests.close()


class Listener:
    """The process's connection that LISTENs for settled keys and for the key count's totals,
    opened when the first request waits or the key count starts, and opened again whenever it
    breaks; it wakes the `Watch` of each row announced, sets `oncegate_keys{state}` from each
    count announced, and holds the key count's lock while this process is the one to sweep."""

    def __init__(self, url: str, options: StoreOptions) -> None:
        self._url = url
        self._options = options
        self._watchers = Watchers()
        self._listening: asyncio.Task[None] | None = None
        self._connection: asyncpg.Connection | None = None  # while it listens
        self._connected = asyncio.Event()
        self._counts_keys = False  # this connection holds KEY_COUNT_LOCK
        self._failure: BaseException | None = None  # why the last attempt failed (said once)

    def start(self) -> None:
        if self._listening is None or self._listening.done():
            self._listening = asyncio.create_task(self._listen_forever())

    def watch(self, record_id: int) -> Watch:
        self.start()
        return self._watchers.watch(record_id)

    async def take_key_count(self) -> bool:
        """True while this process holds the key count's lock, which it tries for now if it
        does not: the one process per database to sweep. Raises a driver error when the
        listening connection is not up within the connect timeout."""
        connection = await self._listening_connection()
        if not self._counts_keys:
            taken = await connection.fetchval(
                "SELECT pg_try_advisory_lock($1)",
                KEY_COUNT_LOCK,
                timeout=self._options.connect_timeout,
            )
            self._counts_keys = bool(taken) and connection is self._connection
        return self._counts_keys

    async def publish_key_count(self, totals: dict[Listed, int]) -> None:
        """Announce a sweep's totals to every process listening, on the database the gateways
        LISTEN on (a Citus coordinator: never a worker)."""
        connection = await self._listening_connection()
        await connection.execute(
            "SELECT pg_notify($1, $2)",
            KEY_COUNT_CHANNEL,
            json.dumps(totals, sort_keys=True),
            timeout=self._options.connect_timeout,
        )

    async def close(self) -> None:
        if self._listening is not None:
            self._listening.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listening

    async def _listening_connection(self) -> asyncpg.Connection:
        self.start()
        try:
            await asyncio.wait_for(self._connected.wait(), self._options.connect_timeout)
        except TimeoutError:
            if self._failure is not None:
                raise self._failure from None  # why it is not up: in the store's own words
            raise
        assert self._connection is not None  # set with the event, both in this one task
        return self._connection

    async def _listen_forever(self) -> None:
        while True:
            try:
                await self._listen_once()
            except DRIVER_ERRORS as exc:
                # Said once per outage (the store's own lines say it is down and back): it is
                # tried again every LISTEN_RETRY seconds meanwhile.
                if self._failure is None:
                    log.warning("cannot listen for settled keys and the key count: %s; trying "
                                "again every %gs", reason(exc), LISTEN_RETRY)  # fmt: skip
                self._failure = exc
            except Exception:  # a supervisor: logged, and listening again; waiters still poll
                log.exception("listening for settled keys and the key count failed")
            self._watchers.wake_all()  # what settled while nobody listened: look again now
            await asyncio.sleep(LISTEN_RETRY)

    async def _listen_once(self) -> None:
        connection = await asyncpg.connect(
            self._url,
            timeout=self._options.connect_timeout,
            server_settings={"application_name": LISTENER_NAME},
        )
        closed = asyncio.Event()
        connection.add_termination_listener(lambda _: closed.set())
        try:
            await connection.add_listener(CHANNEL, self._notified)
            await connection.add_listener(KEY_COUNT_CHANNEL, self._counted)
            self._connection = connection
            self._connected.set()
            if self._failure is not None:
                log.info("listening for settled keys and the key count again")
                self._failure = None
            self._watchers.wake_all()
            await closed.wait()
            log.warning("the connection listening for settled keys and the key count was lost; "
                        "reconnecting")  # fmt: skip
        finally:
            # The lock, if held, went (or goes now) with the session.
            self._connected.clear()
            self._connection = None
            self._counts_keys = False
            with contextlib.suppress(*DRIVER_ERRORS):
                await connection.close(timeout=self._options.connect_timeout)

    def _notified(self, connection: object, pid: int, channel: str, payload: str) -> None:
        self._watchers.settled(int(payload))

    def _counted(self, connection: object, pid: int, channel: str, payload: str) -> None:
        try:
            totals = json.loads(payload)
            counts = {state: int(totals[state]) for state in LISTED_STATES}
        except (ValueError, TypeError, KeyError):
            log.warning("ignored a key count announced as %r: not one of oncegate's", payload)
            return
        for state, count in counts.items():
            metrics.KEYS.labels(state).set(count)
