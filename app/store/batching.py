"""Natural batching, as group commit does it: concurrent operations of one kind share one
statement and one commit.

An operation that arrives while no statement of its kind is in flight is sent at once, alone:
no timer, nothing added at low load. Operations that arrive while one is in flight queue, and
go together in the next statement when it returns. A statement carries at most `max_size`
operations and, when the operations say what they weigh (`weight`: the bytes of an answer),
at most `max_weight` of them, or one alone if it weighs more; when a full statement's worth is
queued, another statement starts beside the one in flight, so under heavy load several batches
of one kind share the pool. And when the statement in flight takes longer than `stall` (a row
lock, a slow disk), what waited that long is sent beside it rather than stuck behind it.

A heavy operation (weighing `heavy` or more: a claim keeping a request of several MiB) goes in a
statement of its own, beside whatever is in flight, and no light operation ever waits behind
it: its statement costs PostgreSQL time in proportion to its bytes (about 8 ms a MiB of JSON on
a quiet machine, seconds on a busy one), and the other keys' operations must not pay for it.
The light ones batch among themselves as if it were not there. At most `max_heavy` heavy
statements are in flight at once (the rest wait for one of them, in arrival order), so heavy
ones never take every connection of the pool from the light ones.

Every operation keeps its own result: `send` gets the queued items in arrival order and returns
one outcome per item, in the same order (an exception among them is that item's failure
alone). If `send` fails, every operation of that batch fails
with the same exception, and the next batch is sent as usual; but an error that one row can
cause for all (`isolate` says which: a constraint, a deadlock) sends each operation of the
batch again alone, so it fails only the row that caused it. That is safe because a statement
that failed changed nothing.

A batch runs in a task of its own. A caller that stops waiting (its client hung up) takes its
operation out of the queue if it was not sent yet, and otherwise leaves the statement to finish
for the others; `on_abandoned` is told of the outcome nobody received. One exception: a lone
operation (nothing queued, no statement in flight) of a task out of its client's reach
(`model.reach.SHIELDED`: the service's task of a keyed request) is sent in that task, without a
batch task and a future: no cancellation of the client's can cut its statement short, so no
outcome can go unreceived, and what arrives meanwhile queues behind it as behind any statement
in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Hashable, Sequence
from typing import Any, Generic, TypeVar

from ..model.reach import SHIELDED
from ..telemetry import metrics

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")

# A statement that has not returned after this long is stuck (a row lock, a slow disk): what
# queued behind it is sent beside it (`oncegate_store_stalled_batches_total` counts it). Several
# times a batch's usual round trip (~1 ms), so under normal load it never fires. A database held
# to a CPU quota holds statements past it whenever its cgroup throttles it (at a tenth of a core,
# 90 ms of every 100): there it sent 5-8% of a Citus worker's statements, and without it the
# worker's statements were no larger nor its pairs cheaper (docs/scaling.md, "Scale-out at
# equal CPU per node").
STALL = 0.05


class Batcher(Generic[Item, Outcome]):
    def __init__(
        self,
        operation: str,
        send: Callable[[Sequence[Item]], Awaitable[Sequence[Outcome | Exception]]],
        max_size: int,
        on_abandoned: Callable[[Item, Outcome], None] | None = None,
        *,
        weight: Callable[[Item], int] | None = None,
        max_weight: int = 0,
        heavy: int = 0,
        max_heavy: int = 1,
        stall: float = STALL,
        isolate: Callable[[Exception], bool] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("a batch holds at least one operation")
        self.operation = operation
        self._task_name = f"store {operation} batch"
        self._send = send
        self._max_size = max_size
        self._on_abandoned = on_abandoned
        self._weight = weight
        self._max_weight = max_weight
        self._heavy = heavy if weight is not None else 0
        self._max_heavy = max(1, max_heavy)
        self._stall = stall
        self._isolate = isolate
        self._queued: list[tuple[Item, asyncio.Future[Outcome]]] = []
        self._queued_weight = 0
        self._in_flight: set[asyncio.Task[None]] = set()
        # The tasks sending a lone operation of their own (`_here`): a statement in flight too.
        self._here: set[asyncio.Task[Any]] = set()
        # The statements of heavy operations, each alone: in flight, but nothing light queues
        # behind them; and the heavy operations waiting for one of them to return.
        self._aside: set[asyncio.Task[Any]] = set()
        self._heavy_queued: list[tuple[Item, asyncio.Future[Outcome]]] = []
        self._stall_timer: asyncio.TimerHandle | None = None
        self._sizes = metrics.STORE_BATCH_SIZE.labels(operation)
        self._stalls = metrics.STORE_STALLED_BATCHES.labels(operation)
        self._closed = False
        # The loop of the first operation, kept: a batcher's futures belong to one loop, and
        # asking for it again costs a getpid() system call per call on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, item: Item) -> Outcome:
        """Queue `item`, and return its outcome once the statement that carried it returned."""
        if self._closed:
            raise RuntimeError(f"the {self.operation} batcher is closed")
        heavy = self._heavy > 0 and self._weigh(item) >= self._heavy
        if SHIELDED.get() and (self._room_aside() if heavy else self.idle()):
            return await self._alone_here(item, self._aside if heavy else self._here)
        future: asyncio.Future[Outcome] = self._running_loop().create_future()
        if heavy:
            self._heavy_queued.append((item, future))
            self._send_aside()
        else:
            self._queued.append((item, future))
            self._queued_weight += self._weigh(item)
            self._dispatch()
        try:
            # Not shielded: a caller that stops waiting cancels its own future, and the batch
            # that carries it hands the outcome to `on_abandoned` instead (`_deliver`). A shield
            # cost a second future and a callback hop per operation.
            return await future
        except asyncio.CancelledError:
            self._abandon(item, future)
            raise

    def idle(self) -> bool:
        """Whether an operation now would be sent at once, alone (a heavy one always is: the
        statements of heavy ones in flight hold nothing up)."""
        return not (self._queued or self._in_flight or self._here)

    def unused(self) -> bool:
        """Whether nothing is queued or in flight, heavy operations' statements included."""
        return self.idle() and not (self._aside or self._heavy_queued)

    def _room_aside(self) -> bool:
        """Whether a heavy operation now would be sent at once."""
        return not self._heavy_queued and len(self._aside) < self._max_heavy

    def _send_aside(self) -> None:
        """Send the heavy operations waiting, each alone, up to `max_heavy` in flight."""
        while self._heavy_queued and len(self._aside) < self._max_heavy:
            batch = [self._heavy_queued.pop(0)]
            task = self._running_loop().create_task(self._carry(batch), name=self._task_name)
            self._aside.add(task)
            task.add_done_callback(self._aside_landed)

    def _aside_landed(self, task: asyncio.Task[None]) -> None:
        self._aside.discard(task)
        if not self._closed:
            self._send_aside()

    async def _alone_here(self, item: Item, sending: set[asyncio.Task[Any]]) -> Outcome:
        """Send a lone (or heavy) operation in its caller's task, which no client's
        cancellation reaches (`SHIELDED`): the batch task and the future it spares were about
        13 µs of a lone operation's 40 (docs/performance.md). Only the loop's end could cancel
        it, as it would cancel the forward it is part of. `sending` is the set it is in flight
        in: `_here` (light ones queue behind it) or `_aside` (nothing does)."""
        task = asyncio.current_task()
        assert task is not None
        sending.add(task)
        try:
            self._sizes.observe(1)
            outcomes = await self._send([item])
        finally:
            sending.discard(task)
            if not self._closed:
                self._dispatch()  # what queued behind it
                self._send_aside()
        if len(outcomes) != 1:
            raise AssertionError(f"{self.operation}: {len(outcomes)} outcomes for 1 operation")
        outcome = outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def _abandon(self, item: Item, future: asyncio.Future[Outcome]) -> None:
        for index, (_, queued) in enumerate(self._queued):
            if queued is future:
                del self._queued[index]  # never sent: as if it never came
                self._queued_weight -= self._weigh(item)
                future.cancel()
                return
        for index, (_, queued) in enumerate(self._heavy_queued):
            if queued is future:
                del self._heavy_queued[index]
                future.cancel()
                return
        if future.cancelled():
            return  # in a statement in flight: `_deliver` hands its outcome to `on_abandoned`
        # Delivered already, but its caller was cancelled before it could take the outcome.
        if self._on_abandoned is not None and future.exception() is None:
            self._on_abandoned(item, future.result())

    def _deliver(self, item: Item, future: asyncio.Future[Outcome], outcome: Outcome) -> None:
        if not future.done():
            future.set_result(outcome)
        elif future.cancelled() and self._on_abandoned is not None:
            self._on_abandoned(item, outcome)  # its caller stopped waiting: nobody received it

    def _dispatch(self) -> None:
        while self._queued and (not (self._in_flight or self._here) or self._full()):
            self._send_next()
        if self._queued and self._stall_timer is None:
            self._stall_timer = self._running_loop().call_later(self._stall, self._stalled)
        elif not self._queued and self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _stalled(self) -> None:
        self._stall_timer = None
        if self._queued and not self._closed:
            self._stalls.inc()
            self._send_next()  # what waited `stall` behind a statement that has not returned
        self._dispatch()

    def _weigh(self, item: Item) -> int:
        return 0 if self._weight is None else self._weight(item)

    def _full(self) -> bool:
        if len(self._queued) >= self._max_size:
            return True
        return self._weight is not None and self._queued_weight >= self._max_weight

    def _send_next(self) -> None:
        taken, weight = 0, 0
        for item, _ in self._queued[: self._max_size]:
            if self._weight is not None and taken and weight + self._weigh(item) > self._max_weight:
                break  # full by weight: a heavy operation waits for the next statement
            weight += self._weigh(item)
            taken += 1
        batch = self._queued[:taken]
        del self._queued[:taken]
        self._queued_weight -= weight
        task = self._running_loop().create_task(self._carry(batch), name=self._task_name)
        self._in_flight.add(task)
        task.add_done_callback(self._landed)

    def _landed(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        if not self._closed:
            self._dispatch()

    async def _carry(self, batch: list[tuple[Item, asyncio.Future[Outcome]]]) -> None:
        self._sizes.observe(len(batch))
        try:
            outcomes = await self._send([item for item, _ in batch])
            if len(outcomes) != len(batch):
                raise AssertionError(
                    f"{self.operation}: {len(outcomes)} outcomes for {len(batch)} operations"
                )
        except Exception as exc:
            if len(batch) > 1 and self._isolate is not None and self._isolate(exc):
                log.warning(
                    "a %s batch of %d failed (%s: %s); sending each operation alone",
                    self.operation, len(batch), type(exc).__name__, exc,
                )  # fmt: skip
                for one in batch:
                    await self._carry([one])
                return
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # the loop is shutting down: nobody gets an outcome
            for _, future in batch:
                future.cancel()
            raise
        for (item, future), outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):  # this operation's own failure
                if not future.done():
                    future.set_exception(outcome)
                continue
            self._deliver(item, future, outcome)

    async def close(self) -> None:
        """Wait for the batches in flight; refuse new operations. Queued ones are sent first.
        A close cancelled stops waiting and cancels nothing it waited for (`asyncio.wait`, not
        `gather`): a lone operation's task is its caller's (a keyed request's, out of its
        client's reach), and a batch's outcomes still reach its callers."""
        while not self.unused():
            if self._queued and not (self._in_flight or self._here):
                self._dispatch()
            self._send_aside()
            await asyncio.wait({*self._in_flight, *self._here, *self._aside})
        self._closed = True
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None


class PerShard(Generic[Item, Outcome]):
    """A `Batcher` per shard, or per worker, made when its first operation arrives: on Citus, a
    batch whose keys span workers would be one statement on several of them, committed with
    two-phase commit; a batch per worker (or per shard, through the coordinator) is one node's,
    sent to it alone. (On plain PostgreSQL the store uses one `Batcher`: one shard.)"""

    def __init__(
        self, shard_of: Callable[[Item], Hashable], make: Callable[[], Batcher[Item, Outcome]]
    ) -> None:
        self._shard_of = shard_of
        self._make = make
        self._batchers: dict[Hashable, Batcher[Item, Outcome]] = {}
        self._closed = False

    def idle(self) -> bool:
        """Whether no shard's batcher has an operation queued or in flight."""
        return all(batcher.idle() for batcher in self._batchers.values())

    async def run(self, item: Item) -> Outcome:
        shard = self._shard_of(item)
        batcher = self._batchers.get(shard)
        if batcher is None:
            if self._closed:
                raise RuntimeError("the batchers are closed")
            batcher = self._batchers[shard] = self._make()
        return await batcher.run(item)

    def forget(self, current: Collection[Hashable]) -> None:
        """Drop the batcher of each shard (or worker) not among `current` (the shard map no
        longer names it) that has nothing queued or in flight: it would never be used again.
        One still busy is looked at again at the next call; one of a shard or worker named
        again later is made anew by its first operation."""
        for shard, batcher in list(self._batchers.items()):
            if shard not in current and batcher.unused():
                del self._batchers[shard]

    async def close(self) -> None:
        self._closed = True
        for batcher in list(self._batchers.values()):
            await batcher.close()
