"""The stores a soak runs its gateways on, and how each one fails (`--scenarios`).

- `single`: one PostgreSQL (pgserver's binaries, `postgres.Postgres`), stopped `-m fast`, stopped
  `-m immediate` or SIGKILLed (at least once per run), each for 1-3 s, then started again.
- `failover`: a primary and its synchronous standby (Debian's PostgreSQL,
  `tests/faults/replication.py`); every outage is a failover: the primary SIGKILLed with all its
  processes, the standby promoted 1-3 s later, then the old primary rejoined as the new
  standby (`pg_rewind`; every third from a fresh base backup) and the pair synchronous again
  before the next failover. The gateways have the multi-host URL and find the new primary.
- `citus`: a coordinator and two workers (`tests/citus.py`): a worker stopped `-m immediate` for
  1-3 s and started again; a shard of the key table moved to the other worker
  (`citus_move_shard_placement`, by logical replication, so writes go on while it copies).

Design rules:
- Each scenario has its own servers, its own database and (in the driver) its own gateways; the
  driver runs the chosen ones side by side, and every event a scenario writes names it as its
  `target`, so the checker judges each key against the failures of its own store.
- A plan (`plan`) is drawn from the soak's seed; `inflict` carries one fault out and writes its
  events: the failure when it starts, and the recovery the checker pairs it with
  (`checker.STORE_FAULTS`).
- Failures are carried out one at a time per scenario: a failover's rejoin, or a worker's
  restart, is over before the next fault of that store begins.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import asyncpg

from oncegate.store import migrate
from tests import citus
from tests.faults import replication
from tests.soak.history import Event
from tests.soak.postgres import Postgres

SCENARIOS = ("single", "failover", "citus")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds into the chaos
    kind: str  # single: fast, immediate, kill; failover; citus: worker-stop, shard-move
    down: float  # seconds the store (or the worker) stays down
    fresh: bool = False  # failover: rejoin from a fresh base backup, not pg_rewind
    worker: int = 0  # citus: the worker stopped, or the one a shard leaves


@dataclass(frozen=True)
class Sizes:
    """How many faults of each kind a run's plans hold."""

    outages: int = 1  # single: PostgreSQL stopped or killed
    failovers: int = 3
    worker_stops: int = 2
    shard_moves: int = 1

    @classmethod
    def for_seconds(cls, seconds: float) -> Sizes:
        """A run's default: PostgreSQL down every 90 s or so, a failover every 2 minutes (at
        least 3), a worker stopped every 90 s (at least 2), a shard moved every 5 minutes."""
        return cls(
            outages=max(1, round(seconds / 90)),
            failovers=max(3, round(seconds / 120)),
            worker_stops=max(2, round(seconds / 90)),
            shard_moves=max(1, round(seconds / 300)),
        )


def spread(dice: random.Random, seconds: float, faults: list[Fault]) -> list[Fault]:
    """`faults` in a drawn order, one per slot of the chaos, each a little off its slot."""
    dice.shuffle(faults)
    slot = seconds / (len(faults) + 1)
    return [
        Fault(slot * (index + 1) + dice.uniform(-0.2, 0.2) * slot, fault.kind, fault.down,
              fault.fresh, fault.worker)
        for index, fault in enumerate(faults)
    ]  # fmt: skip


class Scenario:
    name: ClassVar[str]

    @staticmethod
    def unavailable() -> str | None:
        return None

    def start(self) -> None:
        raise NotImplementedError

    def create_database(self, name: str) -> str:
        """A new database `name`, migrated; the URL the gateways get."""
        raise NotImplementedError

    def plan(self, dice: random.Random, seconds: float, sizes: Sizes) -> list[Fault]:
        raise NotImplementedError

    async def inflict(self, fault: Fault, events: list[Event]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def postmasters(self) -> list[int]:
        """The PIDs of its servers' postmasters that run now (for the CPU they use)."""
        raise NotImplementedError

    def event(self, events: list[Event], what: str) -> None:
        events.append(Event(time.time(), what, self.name))


async def _execute(url: str, statement: str) -> None:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


class Single(Scenario):
    name = "single"

    def __init__(self) -> None:
        # Not under the run's `out`, which may be pytest's temporary tree: pytest makes its
        # directories private as it goes, and PostgreSQL runs as pgserver's own user when we
        # are root.
        self.directory = Path(tempfile.mkdtemp(prefix="oncegate-soak-pg-"))
        self.postgres: Postgres | None = None

    def start(self) -> None:
        self.postgres = Postgres(self.directory / "data")

    def create_database(self, name: str) -> str:
        assert self.postgres is not None
        asyncio.run(_execute(self.postgres.url(), f"CREATE DATABASE {name}"))
        url = self.postgres.url(name)
        migrate.upgrade(url)
        return url

    def plan(self, dice: random.Random, seconds: float, sizes: Sizes) -> list[Fault]:
        if sizes.outages <= 0:
            return []
        kinds = ["kill"] + [
            dice.choice(["fast", "immediate", "kill"]) for _ in range(sizes.outages - 1)
        ]
        return spread(dice, seconds, [Fault(0, kind, dice.uniform(1.0, 3.0)) for kind in kinds])

    async def inflict(self, fault: Fault, events: list[Event]) -> None:
        postgres = self.postgres
        assert postgres is not None
        self.event(events, f"postgres-{fault.kind}")
        if fault.kind == "kill":
            await asyncio.to_thread(postgres.kill)
        else:
            await asyncio.to_thread(postgres.stop, fault.kind)
        await asyncio.sleep(fault.down)
        await asyncio.to_thread(postgres.start)
        self.event(events, "postgres-start")

    def postmasters(self) -> list[int]:
        found = self.postgres.postmaster() if self.postgres is not None else None
        return [found.pid] if found is not None else []

    def close(self) -> None:
        if self.postgres is not None:
            self.postgres.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class Failover(Scenario):
    name = "failover"

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.pair: replication.Pair | None = None

    @staticmethod
    def unavailable() -> str | None:
        return replication.unavailable()

    def start(self) -> None:
        self.pair = self._stack.enter_context(replication.running_pair(synchronous=True))

    def create_database(self, name: str) -> str:
        assert self.pair is not None
        return self.pair.migrated_database(name)

    def plan(self, dice: random.Random, seconds: float, sizes: Sizes) -> list[Fault]:
        # Every third rejoin from a fresh base backup, so both ways back are taken in a run of 3.
        faults = [
            Fault(0, "failover", dice.uniform(1.0, 3.0), fresh=index % 3 == 1)
            for index in range(sizes.failovers)
        ]
        return spread(dice, seconds, faults)

    async def inflict(self, fault: Fault, events: list[Event]) -> None:
        pair = self.pair
        assert pair is not None
        self.event(events, "postgres-failover")
        await asyncio.to_thread(pair.primary.kill)
        await asyncio.sleep(fault.down)
        await asyncio.to_thread(pair.promote)
        self.event(events, "postgres-promoted")
        how = await asyncio.to_thread(pair.rejoin, fresh=fault.fresh)
        self.event(events, f"postgres-rejoined-{how.replace(' ', '-')}")

    def postmasters(self) -> list[int]:
        if self.pair is None:
            return []
        servers = (self.pair.primary, self.pair.standby)
        return [found.pid for server in servers if (found := server.postmaster()) is not None]

    def close(self) -> None:
        self._stack.close()


class Citus(Scenario):
    name = "citus"

    def __init__(self) -> None:
        self.cluster: citus.Cluster | None = None
        self.database = ""

    @staticmethod
    def unavailable() -> str | None:
        return citus.unavailable()

    def start(self) -> None:
        citus.stop_orphans()
        self.cluster = citus.Cluster.start()

    def create_database(self, name: str) -> str:
        assert self.cluster is not None
        url = self.cluster.create_database(name)
        migrate.upgrade(url)
        self.database = self.database or url
        return url

    def plan(self, dice: random.Random, seconds: float, sizes: Sizes) -> list[Fault]:
        stops = [
            Fault(0, "worker-stop", dice.uniform(1.0, 3.0), worker=index % citus.WORKERS)
            for index in range(sizes.worker_stops)
        ]
        moves = [
            Fault(0, "shard-move", 0.0, worker=dice.randrange(citus.WORKERS))
            for _ in range(sizes.shard_moves)
        ]
        return spread(dice, seconds, stops + moves)

    async def inflict(self, fault: Fault, events: list[Event]) -> None:
        cluster = self.cluster
        assert cluster is not None
        if fault.kind == "worker-stop":
            worker = cluster.workers[fault.worker]
            self.event(events, "citus-worker-stop")
            await asyncio.to_thread(cluster.stop_node, worker, "immediate")
            await asyncio.sleep(fault.down)
            await asyncio.to_thread(cluster.start_node, worker)
            self.event(events, "citus-worker-start")
            return
        self.event(events, "citus-shard-move")
        try:
            await self.move_shard(cluster, fault.worker)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as error:
            # Counted, and the soak goes on: a move Citus refuses is no promise of the gateway's.
            self.event(events, f"citus-shard-move-failed: {error}")
        self.event(events, "citus-shard-moved")

    async def move_shard(self, cluster: citus.Cluster, source: int) -> None:
        """One shard of the key table (with the shards colocated with it) from worker `source`
        to the next one, under load."""
        origin = cluster.workers[source]
        target = cluster.workers[(source + 1) % len(cluster.workers)]
        connection = await asyncpg.connect(self.database)
        try:
            shard = await connection.fetchval(
                "SELECT shardid FROM citus_shards WHERE table_name = 'oncegate_keys'::regclass"
                " AND nodeport = $1 ORDER BY shardid LIMIT 1",
                origin.port,
            )
            if shard is None:  # every shard already left it: take one from the other side
                origin, target = target, origin
                shard = await connection.fetchval(
                    "SELECT shardid FROM citus_shards"
                    " WHERE table_name = 'oncegate_keys'::regclass AND nodeport = $1"
                    " ORDER BY shardid LIMIT 1",
                    origin.port,
                )
            await connection.execute(
                "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3)",
                shard, origin.port, target.port,
            )  # fmt: skip
        finally:
            await connection.close()

    def postmasters(self) -> list[int]:
        if self.cluster is None:
            return []
        found = []
        for node in self.cluster.nodes:
            with contextlib.suppress(OSError, ValueError, IndexError):
                found.append(int((node.data / "postmaster.pid").read_text().splitlines()[0]))
        return found

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()


KINDS: dict[str, type[Scenario]] = {"single": Single, "failover": Failover, "citus": Citus}


def choose(asked: list[str] | None) -> tuple[list[str], dict[str, str]]:
    """The scenarios to run, and those left out with why: `asked` (all must be able to run here),
    or every one that can when None."""
    skipped = {name: why for name in SCENARIOS if (why := KINDS[name].unavailable()) is not None}
    if asked is None:
        return [name for name in SCENARIOS if name not in skipped], skipped
    unknown = [name for name in asked if name not in KINDS]
    if unknown:
        raise ValueError(f"no scenario {', '.join(unknown)} (there are {', '.join(SCENARIOS)})")
    missing = {name: skipped[name] for name in asked if name in skipped}
    if missing:
        raise ValueError(
            "; ".join(f"{name} cannot run here: {why}" for name, why in missing.items())
        )
    return asked, {name: "not asked for" for name in SCENARIOS if name not in asked}
