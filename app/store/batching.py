"""Natural batching, as group commit does it: concurrent operations of one kind share one
statement and one commit.

An operation that arrives while no statement of its kind is in flight is sent at once, alone:
no timer, nothing added at low load. Operations that arrive while one is in flight queue, and
go together in the next statement when it returns. A statement carries at most `max_size`
rows; when that many are queued, another statement starts beside the one in flight, so under
heavy load several batches of one kind share the pool.

Every operation keeps its own result: `send` gets the queued items in arrival order and returns
one outcome per item, in the same order. If `send` fails, every operation of that batch fails
with the same exception, and the next batch is sent as usual.

A batch runs in a task of its own. A caller that stops waiting (its client hung up) takes its
operation out of the queue if it was not sent yet, and otherwise leaves the statement to finish
for the others; `on_abandoned` is told of the outcome nobody received.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from .. import metrics

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")


class Batcher(Generic[Item, Outcome]):
    def __init__(
        self,
        operation: str,
        send: Callable[[Sequence[Item]], Awaitable[Sequence[Outcome]]],
        max_size: int,
        on_abandoned: Callable[[Item, Outcome], None] | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError("a batch holds at least one operation")
        self.operation = operation
        self._send = send
        self._max_size = max_size
        self._on_abandoned = on_abandoned
        self._queued: list[tuple[Item, asyncio.Future[Outcome]]] = []
        self._in_flight: set[asyncio.Task[None]] = set()
        self._sizes = metrics.STORE_BATCH_SIZE.labels(operation)
        self._closed = False

    async def run(self, item: Item) -> Outcome:
        """Queue `item`, and return its outcome once the statement that carried it returned."""
        if self._closed:
            raise RuntimeError(f"the {self.operation} batcher is closed")
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._queued.append((item, future))
        self._dispatch()
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self._abandon(item, future)
            raise

    def _abandon(self, item: Item, future: asyncio.Future[Outcome]) -> None:
        for index, (_, queued) in enumerate(self._queued):
            if queued is future:
                del self._queued[index]  # never sent: as if it never came
                future.cancel()
                return
        if self._on_abandoned is None:
            return
        on_abandoned = self._on_abandoned

        def delivered(done: asyncio.Future[Outcome]) -> None:
            if not done.cancelled() and done.exception() is None:
                on_abandoned(item, done.result())

        future.add_done_callback(delivered)

    def _dispatch(self) -> None:
        while self._queued and (not self._in_flight or len(self._queued) >= self._max_size):
            batch = self._queued[: self._max_size]
            del self._queued[: self._max_size]
            task = asyncio.create_task(self._carry(batch), name=f"store {self.operation} batch")
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
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:  # the loop is shutting down: nobody gets an outcome
            for _, future in batch:
                future.cancel()
            raise
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if not future.done():
                future.set_result(outcome)

    async def close(self) -> None:
        """Wait for the batches in flight; refuse new operations. Queued ones are sent first."""
        while self._queued or self._in_flight:
            if self._queued and not self._in_flight:
                self._dispatch()
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        self._closed = True
