"""On Citus, the request path's claims and completes go to the worker that holds their shards,
as plain PostgreSQL statements on its shard tables, fenced against a shard move.

Why: through the coordinator, each statement is planned twice by Citus (on the coordinator, and
again on the worker, where the claim was a loop of one-row statements), and batched per shard,
so 64 requests in flight over 32 shards made statements of 1-3 operations. A pair cost the
cluster 20-24 times what it costs one server (docs/scaling.md). Here a batch is one worker's
(every shard it holds), sent to that worker in one statement that names its shard tables
(`oncegate_keys_102008`), which the worker plans once per connection as any PostgreSQL would:
Citus's planner never sees it (the statement names no distributed table) and no coordinator
takes part.

Design rules:
- A write never lands on a placement that is being, or has been, moved away. Each statement
  first calls `oncegate_fence(shards)` on the worker (migration 0012): Citus's own shard
  metadata lock in the mode its writers take (a move or split takes it exclusively on every
  node before its last catch-up and holds it until the placement is switched), then, in a
  snapshot taken after the lock, every shard of the batch still placed on this node. If not, the
  worker refuses (SQLSTATE OGM01) before writing anything; a table already dropped after a move
  is refused by PostgreSQL (42P01). Either way `Rerouted`: the store reads the shard map again
  and sends each operation where its shard is now. A claim's unique constraint and every
  write's fencing token keep a resent operation exactly what it was.
- One node per statement, one local transaction: never a distributed transaction, never
  two-phase commit. The statement touches only the batch's shards of that worker (the others'
  parts of the statement find no rows).
- A worker down costs only its keys: its pools fail (503 `store-unavailable` above) while the
  other workers' pools go on; a pool opens connections again as its worker comes back. The log
  says so once, naming the worker, and once when it is back (its own `Outage`); the store's
  (the coordinator's) is not told (`errors.NodeUnavailable`), or each request alternating between
  a worker down and one up would say the whole store went down and came back.
- The coordinator down costs what goes through it; the workers' statements go on, and tell the
  coordinator's `Outage` nothing either way (`errors.translated`'s `routed`): a claim a worker
  took must not say the coordinator is back, nor one it refused that the coordinator is down.
- A worker the map places no shard on any more (moved away, drained, given a new address) has
  its pools closed and forgotten, and the store its batcher, once nothing is in flight there
  (`Workers.forget_gone`, `dialect.OnCitus`, after each read of the map); it gets new ones if
  the map names it again. So a gateway that lives through many failovers or node replacements
  holds pools, connections and batchers only for the workers it routes to.
- A worker's claims and completes share one statement (`fetch_both`; the store batches them together
  per worker): 64 requests in flight over two workers make statements of about 25 operations again,
  with one fence and one commit, instead of two statements of 10-11; such a statement carries up to
  twice `store_batch_size` operations of the two kinds together (`requests`), as the two it replaces
  would, so 256 in flight over two workers make statements of 84-93 operations, not 48-60. It
  commits synchronously, as a claim must; a worker's answers commit with its own
  `synchronous_commit` anyway (`_open`), on by default, so a complete waits for no flush it would
  not have waited for. A pair cost the cluster 0.061-0.062 ms of PostgreSQL CPU at one shard per
  worker against 0.103-0.113 in statements of their own (docs/scaling.md).
- The statements are written here, not in queries.sql: they name shard tables that exist only at
  run time, one part per shard the worker holds. Each part is the plain shape of queries.sql's
  `claim` or `complete` on one shard table (the columns a complete writes are queries.sql's
  fragment `completed`, for both); tests/store/test_citus_shard_moves.py runs them.
- Other request-path statements stay on the coordinator: take-overs (`reclaim_expired` too),
  releases and `mark_unknown` batched per shard, `get`, `mark_waited` and `renew` one key a
  statement. Citus routes and fences those itself, and they are the rare ones. One that Citus
  refuses because the shard it was planned for is gone (`split_away`: a split under way) is sent
  again once the map has changed: a batch operation by operation, as a worker's refusal is
  (`dialect.OnCitus.fetch`), a statement of one key once (`dialect.OnCitus.fetchrow`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from ...settings import StoreOptions
from ..citus import Node, ShardMap
from ..errors import DRIVER_ERRORS, NodeUnavailable, Outage, isolable, refused_value
from ..queries import FRAGMENTS, Query, compose
from .connections import citus_settings, request_settings
from .pool import Pool
from .rows import claimed_and_completed, claims_and_completes

log = logging.getLogger("oncegate.store.postgres")

# The operations sent to the workers: the two every forwarded request makes, alone or together.
ON_WORKERS = frozenset({"claim", "complete", "claim_complete"})

# What the fence raises when a shard of the batch is not on the worker any more (migration 0012).
MOVED = "OGM01"

# While a worker cannot be reached, the shard map is read again at most this often (at its
# first failure at once), in case the worker answers at another address now: a failover moves a
# worker with `citus_update_node`, and its keys would be refused until the map's next periodic
# read (`citus.REFRESH_INTERVAL`) although Citus serves them. One catalog read a second
# while a worker is down, not one per statement refused.
UNREACHABLE_REREAD = 1.0

# Before a worker's pool opens a connection, the map is read again if it is older than this
# (`Workers._still_placed`): a worker's pools keep their connections (`pool.IDLE_LIFETIME`), so
# a read is paid only where a connection broke or the pool grows.
CONNECT_REREAD = 1.0


class Elsewhere(OSError):
    """A connection to a worker not opened: the map, read again, places no shard there (it
    moved to another address). Nothing was sent; the batch is `Rerouted` (`_unavailable`)."""


class Rerouted(Exception):
    """A worker refused a batch because a shard of it is not there any more; the shard map was
    read again. Nothing was written: send each operation again."""


@dataclass(frozen=True, slots=True)
class _Pools:
    requests: Pool
    answers: Pool
    # Whether the worker is down, said once in the log when it goes and once when it is back:
    # its own, not the store's (a worker down is not the store down: `errors.NodeUnavailable`).
    outage: Outage

    def unused(self) -> bool:
        return self.requests.unused() and self.answers.unused()

    async def close(self) -> None:
        await self.answers.close()
        await self.requests.close()


class Workers:
    """A pool pair per worker (claims, answers), opened when the worker is first needed, and the
    statements of each worker's shards."""

    def __init__(self, url: str, options: StoreOptions, shards: ShardMap) -> None:
        self._url = url
        self._options = options
        self._shards = shards
        self._pools: dict[Node, _Pools] = {}
        self._statements: dict[tuple[str, tuple[int, ...]], Query] = {}
        self._closing: set[asyncio.Task[None]] = set()  # pools of workers forgotten, closing

    def route(self, key: str) -> Node | None:
        """The worker a key's claim and complete go to, or None: through the coordinator."""
        return self._shards.node_of(self._shards.shard_of(key))

    async def fetch(
        self, operation: str, node: Node, values: dict[str, object]
    ) -> list[asyncpg.Record]:
        """`operation`'s batch on `node`, whose keys are `values["keys"]`. Raises `Rerouted`
        when the batch is not all that node's any more."""
        shards = self._shards_of(node, values)
        arguments = {**values, "shards": shards, "fence": sorted(set(shards))}
        pools = self._pools_of(node)
        pool = pools.answers if operation == "complete" else pools.requests
        return await self._send(operation, node, pools, pool, arguments, shards)

    async def fetch_both(
        self, node: Node, claims: dict[str, object], completes: dict[str, object]
    ) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
        """A batch of claims and one of completes on `node` in one statement (one fence, one
        commit, synchronous as a claim's must be): the claims' rows and the completes'."""
        claimed, completed = self._shards_of(node, claims), self._shards_of(node, completes)
        arguments = {
            **claims_and_completes(claims, completes),
            "shards": claimed,
            "answer_shards": completed,
            "fence": sorted({*claimed, *completed}),
        }
        pools = self._pools_of(node)
        rows = await self._send(
            "claim_complete", node, pools, pools.requests, arguments, claimed + completed
        )
        return claimed_and_completed(rows)

    def _shards_of(self, node: Node, values: dict[str, object]) -> list[int]:
        """The shard of each key of the batch, all of them `node`'s, or `Rerouted`."""
        keys: Sequence[str] = values["keys"]  # type: ignore[assignment]  # the batch's keys
        shards = [self._shards.shard_of(key) for key in keys]
        if any(self._shards.node_of(shard) != node for shard in shards):
            raise Rerouted(f"the map changed since the batch for {node} was made")
        return shards

    async def _send(
        self, operation: str, node: Node, pools: _Pools, pool: Pool,
        arguments: dict[str, object], shards: list[int],
    ) -> list[asyncpg.Record]:  # fmt: skip
        named = tuple(self._shards.shards_on(node))  # every shard table the statement names
        query = self._statement(operation, node)
        reached = False  # whether a connection to the worker was had: the statement then sent
        try:
            async with pool.acquire() as connection:
                reached = True
                wanted = {name: arguments[name] for name in query.parameters}
                rows: list[asyncpg.Record] = await connection.fetch(
                    query.sql, *query.arguments(wanted)
                )
        except asyncpg.PostgresError as exc:
            if not _moved_away(exc):
                if refused_value(exc) or isolable(exc):
                    raise  # a statement's refusal (a row's doing): the worker answers
                # Shutting down, starting up, out of connections, or a standby now (a failover
                # demoted it): the worker refused the statement, nothing was written.
                raise await self._unavailable(operation, node, pools, exc, False, shards) from exc
            # Read the map again (or take the read another refusal started: it may have begun
            # before the move ended, so once more if nothing seems to have moved). Sent again
            # when a shard of the batch moved, or one the statement names (it names every shard
            # table of the node: a table dropped after a move refuses a batch of other shards
            # too). Otherwise the refusal stands (an outage to the caller) rather than a loop.
            for _ in range(2):
                await self._shards.refresh()
                if tuple(self._shards.shards_on(node)) != named or any(
                    self._shards.node_of(shard) != node for shard in shards
                ):
                    raise Rerouted(f"{node}: {exc}") from exc
            raise
        except DRIVER_ERRORS as exc:
            if refused_value(exc):
                raise  # the driver's refusal of a value (errors.refused_value): not the worker's
            # Down, unreachable, or no answer in time: nothing was written if no connection was
            # had; a statement whose connection broke may have committed.
            raise await self._unavailable(operation, node, pools, exc, reached, shards) from exc
        if pools.outage.down:
            pools.outage.recovered()
        return rows

    async def _unavailable(
        self, operation: str, node: Node, pools: _Pools, exc: BaseException,
        maybe_written: bool, shards: list[int],
    ) -> Rerouted | NodeUnavailable:  # fmt: skip
        """What a batch the worker could not take raises. Where nothing was written (no
        connection was had, or the worker refused the statement), the worker may have moved to
        another address (a failover to its standby, a new host: `citus_update_node`), which
        Citus follows at once through the coordinator: the map is read again (at the worker's
        first failure, then at most every `UNREACHABLE_REREAD` while it fails) and the batch
        `Rerouted` when its shards' worker is elsewhere now. Otherwise the worker is down, said
        once (its `Outage`)."""
        if not maybe_written:
            # At the worker's first failure at once, then at most every UNREACHABLE_REREAD.
            await self._shards.refresh_if_older(UNREACHABLE_REREAD if pools.outage.down else 0)
            if any(self._shards.node_of(shard) != node for shard in shards):
                return Rerouted(f"{node} cannot be reached, and its shards are elsewhere now")
        pools.outage.failed(operation, exc)
        return NodeUnavailable(f"the Citus worker {node}", exc)

    def forget_gone(self) -> None:
        """Close and forget the pools of every worker the map (just read) places no shard on
        any more: its shards all moved away (a rebalance, a drain before `citus_remove_node`),
        or it answers at a new address (`citus_update_node`: a new `Node`). Otherwise a gateway
        that lives through many failovers or node replacements would keep a pool pair per
        worker it ever used, and connections to a node Citus dropped until they idled out. Only
        pools with nothing lent, being opened or waited for are closed: one a statement is in
        flight on is looked at again after the next read (`citus.REFRESH_INTERVAL`), so every
        statement sent there ends as it would have (a batch for shards gone from it is refused
        by its fence and rerouted, as ever). Nothing new is sent there meanwhile: a batch is made
        for a worker the map names (`_shards_of`). A worker the map names again gets new pools
        when first needed (`_pools_of`). The statements composed for shard sets no worker holds
        any more are forgotten too."""
        placed = {node for node in self._shards.placements().values() if node is not None}
        for node, pools in list(self._pools.items()):
            if node in placed or not pools.unused():
                continue
            del self._pools[node]
            log.info("the Citus worker %s holds no shard of oncegate_keys now: its connections"
                     " are closed", node)  # fmt: skip
            closing = asyncio.create_task(pools.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        held = {tuple(self._shards.shards_on(node)) for node in placed}
        for gone in [key for key in self._statements if key[1] not in held]:
            del self._statements[gone]

    async def close(self) -> None:
        for pools in self._pools.values():
            await pools.close()
        if self._closing:
            await asyncio.gather(*self._closing)

    def _statement(self, operation: str, node: Node) -> Query:
        shards = tuple(self._shards.shards_on(node))
        query = self._statements.get((operation, shards))
        if query is None:
            query = self._statements[operation, shards] = statement_of(operation, shards)
        return query

    def _pools_of(self, node: Node) -> _Pools:
        """The node's pools, made when it is first needed; they open connections as statements
        need them, so a worker that is down fails only the statements sent to it."""
        pools = self._pools.get(node)
        if pools is None:
            pools = self._pools[node] = self._open(node)
        return pools

    async def _still_placed(self, node: Node) -> None:
        """Before a new connection to `node`: the map read again if older than
        `CONNECT_REREAD`, and `Elsewhere` raised (as a connection refused) when it places no
        shard there any more. A worker failed over to another address (`citus_update_node`)
        whose old primary came back writable would otherwise take the store's writes at its
        old address, where Citus reads nothing, until the map's next periodic read; the pools
        of a worker that answers keep their connections, so this costs a read only when one
        is opened."""
        await self._shards.refresh_if_older(CONNECT_REREAD)
        if not self._shards.shards_on(node):
            raise Elsewhere(f"the shard map places no shard on {node} any more")

    def _open(self, node: Node) -> _Pools:
        options = self._options
        # Planned once per connection, as on plain PostgreSQL: the statements name their shard
        # tables, so the worker plans them as plain PostgreSQL (no Citus planner to feed values).
        session = {**request_settings(False), **citus_settings()}

        def pool(size: int, settings: dict[str, str]) -> Pool:
            async def connect() -> asyncpg.Connection:
                await self._still_placed(node)
                connection: asyncpg.Connection = await asyncpg.connect(
                    self._url,
                    host=node.host,
                    port=node.port,
                    timeout=options.connect_timeout,
                    command_timeout=options.command_timeout,
                    server_settings=settings,
                    # Kept prepared whatever their size: asyncpg's default keeps none above 15
                    # KiB, and a worker's statement names every shard table it holds (a claim
                    # on 16 shards is 19 KB): one not kept is planned at every call, which made
                    # a pair cost five to ten times more at 32 shards than at 2.
                    max_cacheable_statement_size=0,
                )
                return connection

            return Pool(connect, _nothing, size, 0, options.acquire_timeout)

        # Answers commit with the worker's own `synchronous_commit`, as they did when Citus sent
        # them: `store_answer_commit = off` would let a worker that crashes lose answers it
        # acknowledged, and the store counts such losses only for a failover of its primary.
        answers = max(1, options.pool_size // 2)
        outage = Outage(
            f"{node} (a Citus worker)",
            consequence="answering 503 store-unavailable for the keys of its shards, and"
            " forwarding none of them until it is back; the other workers' keys are served",
        )
        return _Pools(pool(options.pool_size, session), pool(answers, session), outage)


# Citus's words when the fence asks it to lock a shard that no longer exists (split, or dropped
# after a move: `LoadShardInterval`, SQLSTATE XX000, raised before anything is written).
# tests/store/test_citus_shard_moves.py splits shards under load: it fails if these words change.
GONE = "could not find valid entry for shard "


# Citus's words when a statement through the coordinator is planned for a shard a split has
# just replaced (SQLSTATE 40001, "A concurrent shard split may have moved the data into a new set
# of shards. Retry the query."), raised before anything is written.
SPLIT = "shard for the given value does not exist"


def split_away(exc: asyncpg.PostgresError) -> bool:
    """Citus refused a statement through the coordinator because the shard it was planned for
    is gone (split, or its metadata dropped after a move): nothing was written."""
    return (exc.sqlstate == "40001" and str(exc).startswith(SPLIT)) or (
        exc.sqlstate == "XX000" and str(exc).startswith(GONE)
    )


def _moved_away(exc: asyncpg.PostgresError) -> bool:
    """The worker's fence refused the batch, or a shard it named is gone: its table dropped
    after a move (PostgreSQL refuses the statement before the fence runs), or its metadata
    (split: Citus refuses to lock it)."""
    return (
        exc.sqlstate == MOVED
        or isinstance(exc, asyncpg.UndefinedTableError | asyncpg.InvalidCachedStatementError)
        or (exc.sqlstate == "XX000" and str(exc).startswith(GONE))
    )


async def _nothing(connection: asyncpg.Connection) -> None:
    pass


def statement_of(operation: str, shards: Sequence[int]) -> Query:
    """`operation`'s statement (`claim`, `complete`, `claim_complete`) on a worker holding
    `shards`: a part per shard table, fenced."""
    return compose(operation, _BUILDERS[operation](shards))


def _claim(shards: Sequence[int]) -> str:
    """queries.sql's `claim` on the worker's shard tables."""
    return f"""WITH {_FENCE},
{_claiming(shards)}
{_CLAIMS}
FROM {_CLAIMED}"""


def _complete(shards: Sequence[int]) -> str:
    """queries.sql's `complete` on the worker's shard tables."""
    completed = "\nUNION ALL ".join(f"SELECT * FROM completed_{shard}" for shard in shards)
    return f"""WITH {_FENCE},
{_completing(shards, "")}
{completed}"""


def _claim_complete(shards: Sequence[int]) -> str:
    """Both in one statement: the claims' rows (`n`, the claim's position, set), then the
    completes' (`n` NULL; their arrays are named `answer_...`). One fence, one commit.

    The claims are written first, the completes after: the first branch of the UNION reads
    `claimed` to its end before the second reads `completed`, and a part of a WITH that writes
    runs as it is read. So a claim that waits on another transaction (the same new key claimed
    there, or a row it holds) holds no row of this statement's completes meanwhile; a claim's
    insert never locks a row that exists, so nothing waits on the claims of a statement in its
    completes; and the completes lock their rows by id as every settle does: two such
    statements, or one and a settle or take-over, wait for each other and never deadlock. A
    claim reads the rows that hold its key on the statement's snapshot, before its completes: a
    key whose complete is in the same statement reads in flight here, and the store reads it
    again once committed (postgres/requests.py)."""
    completed = "\n    UNION ALL ".join(f"SELECT * FROM completed_{shard}" for shard in shards)
    return f"""WITH {_FENCE},
{_claiming(shards)},
{_completing(shards, "answer_")},
completed AS (
    {completed}
)
{_CLAIMS}, NULL::boolean AS waited
FROM {_CLAIMED}
UNION ALL
SELECT NULL, NULL, id, fencing_token, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, waited
FROM completed"""


# Taken once per statement, before anything is written: every part that writes reads `wanted`
# or `given`, which read this first (the function's lock and its look at the placements).
_FENCE = "fence(passed) AS (SELECT oncegate_fence(:fence::bigint[]))"

_CLAIMED = """wanted
LEFT JOIN claimed ON claimed.scope = wanted.scope AND claimed.key = wanted.key
LEFT JOIN held ON held.n = wanted.n"""

_CLAIMS = f"SELECT {FRAGMENTS['citus']['claim_outcome']}"  # queries.sql's, as `claim` returns it


def _claiming(shards: Sequence[int]) -> str:
    """The claim's parts (`wanted`, a part per shard, `claimed`, `held`): each shard's keys
    inserted into its table (the id from the key table's sequence, as Citus itself takes it on
    a worker: each node draws from its own range), the rows that already hold the others read.
    Each kept request is taken from its array by position as its row is inserted, never
    carried through `wanted` or the sort (queries.sql's `claim` says why)."""
    inserted = ",\n".join(
        f"""claimed_{shard} AS (
    INSERT INTO oncegate_keys_{shard}
        (id, route, scope, key, fingerprint, state, fencing_token, lease_expires_at, expires_at,
         request, request_sealed_with, claimed_by)
    SELECT nextval('oncegate_keys_id_seq'), route, scope, key, fingerprint, 'in_progress', 1,
           oncegate_after(now(), lease), oncegate_after(now(), ttl),
           (:requests::bytea[])[n], request_sealed_with, :claimant
    FROM (SELECT * FROM wanted WHERE shard = {shard} ORDER BY scope, key OFFSET 0) AS ordered
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING id, fencing_token, scope, key
)"""
        for shard in shards
    )
    claimed = "\n    UNION ALL ".join(f"SELECT * FROM claimed_{shard}" for shard in shards)
    held = "\n    UNION ALL\n".join(
        f"""    SELECT wanted.n, h.id, h.fencing_token, h.fingerprint, h.state, h.lease_expires_at,
           h.expires_at, h.response_status, h.response_headers, h.response_body,
           h.response_stored, h.sealed_with, h.sealed_headers
    FROM wanted JOIN oncegate_keys_{shard} AS h ON h.scope = wanted.scope AND h.key = wanted.key
    WHERE wanted.shard = {shard}
      AND NOT EXISTS (SELECT FROM claimed
                      WHERE claimed.scope = wanted.scope AND claimed.key = wanted.key)"""
        for shard in shards
    )
    return f"""wanted AS (
    SELECT *
    FROM unnest(:shards::bigint[], :routes::text[], :scopes::bytea[], :keys::text[],
                :fingerprints::bytea[], :leases::float8[], :ttls::float8[],
                :requests_sealed_with::text[])
         WITH ORDINALITY
         AS wanted(shard, route, scope, key, fingerprint, lease, ttl, request_sealed_with, n)
    WHERE (SELECT passed FROM fence)
),
{inserted},
claimed AS (
    {claimed}
),
held AS (
{held}
)"""


def _completing(shards: Sequence[int], prefix: str) -> str:
    """The complete's parts (`given`, a part `completed_<shard>` per shard), its arrays named
    with `prefix`: queries.sql's `complete`, the same columns written (its fragment)."""
    updated = ",\n".join(
        f"""completed_{shard} AS (
    UPDATE oncegate_keys_{shard} AS k
    SET {FRAGMENTS["citus"]["completed"]}
    FROM given
    WHERE given.shard = {shard}
      AND k.id = given.id AND k.key = given.key AND k.fencing_token = given.token
      AND k.state IN ('in_progress', 'unknown')
    RETURNING k.id, k.fencing_token, k.waited
)"""
        for shard in shards
    )
    arrays = ", ".join(
        f":{prefix}{name}::{kind}[]"
        for name, kind in (
            ("shards", "bigint"), ("keys", "text"), ("ids", "bigint"), ("tokens", "bigint"),
            ("statuses", "smallint"), ("headers", "text"), ("bodies", "bytea"),
            ("stored", "boolean"), ("sealed_with", "text"), ("sealed_headers", "bytea"),
        )
    )  # fmt: skip
    return f"""given AS (
    SELECT *
    FROM unnest({arrays})
         AS given(shard, key, id, token, status, headers, body, stored, sealed_with,
                  sealed_headers)
    WHERE (SELECT passed FROM fence)
),
{updated}"""


_BUILDERS = {"claim": _claim, "complete": _complete, "claim_complete": _claim_complete}
