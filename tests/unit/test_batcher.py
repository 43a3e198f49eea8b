"""Natural batching (`store.batching.Batcher`) on its own: when a statement is sent, what it
carries, and what each waiter gets. The store's batches on a real PostgreSQL are in
tests/store/test_batched_store.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from prometheus_client import REGISTRY

from oncegate.model import reach
from oncegate.store.batching import Batcher, PerShard


class Recorder:
    """A `send` that records each batch and holds it until released."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.fail: BaseException | None = None

    async def send(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        await self.gate.wait()
        if self.fail is not None:
            failure, self.fail = self.fail, None
            raise failure
        return [item * 10 for item in items]


def abandoning() -> tuple[Recorder, Batcher[int, int], list[tuple[int, int]]]:
    """A batcher on a `Recorder` that lists the outcomes handed to `on_abandoned`."""
    recorder = Recorder()
    abandoned: list[tuple[int, int]] = []
    batcher = Batcher(
        "test", recorder.send, max_size=8, on_abandoned=lambda i, o: abandoned.append((i, o))
    )
    return recorder, batcher, abandoned


async def settle() -> None:
    """Let every ready task run until each waits on something outside the loop."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_lone_operation_is_sent_at_once_alone() -> None:
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    waiter = asyncio.create_task(batcher.run(1))
    await settle()
    assert recorder.batches == [[1]]  # sent without waiting for company
    recorder.gate.set()
    assert await waiter == 10


class Tasks:
    """The tasks `send` runs in, by item: a lone shielded operation's is its caller's."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.seen: dict[int, asyncio.Task[object] | None] = {}

    async def send(self, items: Sequence[int]) -> list[int]:
        for item in items:
            self.seen[item] = asyncio.current_task()
        return await self.recorder.send(items)


async def shielded(batcher: Batcher[int, int], item: int) -> int:
    """`batcher.run(item)` from a task out of its client's reach, as a keyed request's is."""
    reach.SHIELDED.set(True)  # in this task's own context
    return await batcher.run(item)


async def test_a_lone_operation_of_a_shielded_task_goes_in_that_task_and_others_queue_behind() -> (
    None
):
    recorder = Recorder()
    tasks = Tasks(recorder)
    batcher = Batcher("test", tasks.send, max_size=8)
    first = asyncio.create_task(shielded(batcher, 1))
    await settle()
    assert recorder.batches == [[1]] and tasks.seen[1] is first  # no batch task of its own
    assert not batcher.idle()
    later = [asyncio.create_task(shielded(batcher, 2)), asyncio.create_task(batcher.run(3))]
    await settle()
    assert recorder.batches == [[1]]  # behind the statement in flight, as behind any
    recorder.gate.set()
    assert await first == 10
    assert await asyncio.gather(*later) == [20, 30]
    assert recorder.batches == [[1], [2, 3]]
    assert tasks.seen[2] is not later[0]  # queued: carried by a batch task
    assert batcher.idle()
    assert await asyncio.create_task(shielded(batcher, 4)) == 40  # idle again: alone, in place
    await batcher.close()


async def test_a_batcher_is_idle_only_while_nothing_is_queued_or_in_flight() -> None:
    """`idle`: whether an operation now would be sent at once, alone (a keyed request claims
    from its shielded task only then). False while a statement is in flight, in a batch task or
    in a shielded caller's own task, and while operations wait behind it; true once every
    statement returned, a failed one too."""
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    assert batcher.idle()
    first = asyncio.create_task(batcher.run(1))  # in a batch task of its own
    await settle()
    assert recorder.batches == [[1]]
    assert not batcher.idle()
    behind = asyncio.create_task(batcher.run(2))
    quitter = asyncio.create_task(batcher.run(3))
    await settle()
    assert recorder.batches == [[1]] and not batcher.idle()  # 2 and 3 queued behind it
    quitter.cancel()  # out of the queue: 2 still waits
    await settle()
    assert not batcher.idle()
    recorder.gate.set()
    assert await first == 10
    assert await behind == 20
    await settle()
    assert recorder.batches == [[1], [2]]
    assert batcher.idle()

    recorder.gate.clear()
    recorder.fail = ConnectionError("gone")
    alone = asyncio.create_task(shielded(batcher, 4))  # in its caller's task, no batch task
    await settle()
    assert recorder.batches[-1] == [4]
    assert not batcher.idle()
    recorder.gate.set()
    with pytest.raises(ConnectionError):
        await alone
    await settle()
    assert batcher.idle()
    await batcher.close()


async def test_batchers_per_shard_are_idle_only_when_every_shard_is() -> None:
    """`PerShard.idle`: true with no batcher made yet and once every shard's statements
    returned; false while any one shard has a statement in flight, whatever the others do."""
    recorders: list[Recorder] = []

    def make() -> Batcher[int, int]:
        recorders.append(Recorder())
        return Batcher("test", recorders[-1].send, max_size=8)

    shards: PerShard[int, int] = PerShard(lambda item: item % 2, make)
    assert shards.idle()  # no shard's batcher yet
    even = asyncio.create_task(shards.run(2))
    await settle()
    odd = asyncio.create_task(shards.run(1))
    await settle()
    assert [recorder.batches for recorder in recorders] == [[[2]], [[1]]]  # one batcher each
    assert not shards.idle()
    recorders[1].gate.set()
    assert await odd == 10
    await settle()
    assert not shards.idle()  # the even shard's statement is still in flight
    recorders[0].gate.set()
    assert await even == 20
    await settle()
    assert shards.idle()
    await shards.close()


async def test_a_shard_no_longer_current_loses_its_batcher_only_once_it_is_idle() -> None:
    """`PerShard.forget`: the batcher of a shard (or worker) the map no longer names is dropped
    when nothing of it is queued or in flight, kept while a statement is (its callers get their
    outcomes), and made anew by the shard's next operation."""
    recorders: list[Recorder] = []

    def make() -> Batcher[int, int]:
        recorders.append(Recorder())
        return Batcher("test", recorders[-1].send, max_size=8)

    shards: PerShard[int, int] = PerShard(lambda item: item % 2, make)
    for recorder_index, item in enumerate((2, 1)):
        sent = asyncio.create_task(shards.run(item))
        await settle()
        recorders[recorder_index].gate.set()
        assert await sent == item * 10
    recorders[1].gate.clear()
    in_flight = asyncio.create_task(shards.run(3))  # the odd shard's statement, held
    await settle()
    shards.forget({2})  # neither 0 nor 1 is current: the even one is idle, the odd one busy
    assert list(shards._batchers) == [1]
    recorders[1].gate.set()
    assert await in_flight == 30
    await settle()
    shards.forget({2})
    assert shards._batchers == {}
    again = asyncio.create_task(shards.run(4))
    await settle()
    assert len(recorders) == 3 and recorders[2].batches == [[4]]  # a new batcher for shard 0
    recorders[2].gate.set()
    assert await again == 40
    await shards.close()


async def test_a_lone_shielded_operation_that_fails_raises_in_its_task_and_the_queue_goes_on() -> (
    None
):
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    recorder.fail = ConnectionError("gone")
    first = asyncio.create_task(shielded(batcher, 1))
    await settle()
    queued = asyncio.create_task(batcher.run(2))
    await settle()
    recorder.gate.set()
    with pytest.raises(ConnectionError):
        await first
    assert await queued == 20
    assert recorder.batches == [[1], [2]]


async def test_a_close_cancelled_cancels_neither_a_shielded_callers_task_nor_a_batch() -> None:
    """A close that stops waiting (its caller cancelled) leaves what it waited for running: the
    task of a lone shielded operation (a keyed request's claim, forward and settle) and a batch
    in flight, whose callers still get their outcomes."""
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    request = asyncio.create_task(shielded(batcher, 1))  # sent in its own task
    await settle()
    queued = asyncio.create_task(batcher.run(2))  # behind it; sent once it returns
    await settle()
    closing = asyncio.create_task(batcher.close())
    await settle()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not request.done() and not queued.done()
    recorder.gate.set()
    assert await request == 10
    assert await queued == 20
    assert recorder.batches == [[1], [2]]
    await batcher.close()


async def test_operations_arriving_while_one_is_in_flight_go_together_next() -> None:
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    first = asyncio.create_task(batcher.run(1))
    await settle()
    later = [asyncio.create_task(batcher.run(item)) for item in (2, 3, 4)]
    await settle()
    assert recorder.batches == [[1]]  # the others wait for the statement in flight
    recorder.gate.set()
    assert await first == 10
    assert await asyncio.gather(*later) == [20, 30, 40]  # each its own outcome
    assert recorder.batches == [[1], [2, 3, 4]]


async def test_a_full_batch_starts_beside_the_one_in_flight_and_none_is_larger() -> None:
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=3)
    waiters = [asyncio.create_task(batcher.run(item)) for item in range(1, 9)]
    await settle()
    assert recorder.batches == [[1], [2, 3, 4], [5, 6, 7]]  # 8 waits: its batch is not full
    recorder.gate.set()
    assert await asyncio.gather(*waiters) == [item * 10 for item in range(1, 9)]
    assert recorder.batches[-1] == [8]
    assert max(len(batch) for batch in recorder.batches) == 3


async def test_a_failed_statement_fails_its_batch_only_and_the_next_one_works() -> None:
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    recorder.fail = ConnectionResetError("lost")
    doomed = [asyncio.create_task(batcher.run(item)) for item in (1, 2)]
    await settle()
    recorder.gate.set()
    results = await asyncio.gather(*doomed, return_exceptions=True)
    assert recorder.batches == [[1], [2]]
    assert isinstance(results[0], ConnectionResetError)  # the statement that failed
    assert results[1] == 20  # the next batch, sent when the failed one returned
    assert await batcher.run(5) == 50  # and every one after: no restart needed


async def test_a_waiter_that_gives_up_before_its_batch_is_sent_is_never_sent() -> None:
    recorder = Recorder()
    batcher = Batcher("test", recorder.send, max_size=8)
    first = asyncio.create_task(batcher.run(1))
    await settle()
    quitter = asyncio.create_task(batcher.run(2))
    stayer = asyncio.create_task(batcher.run(3))
    await settle()
    quitter.cancel()
    await settle()
    recorder.gate.set()
    assert await first == 10
    assert await stayer == 30
    assert recorder.batches == [[1], [3]]
    with pytest.raises(asyncio.CancelledError):
        await quitter


async def test_a_waiter_that_gives_up_in_flight_does_not_cancel_the_others() -> None:
    recorder, batcher, abandoned = abandoning()
    waiters = [asyncio.create_task(batcher.run(item)) for item in (1, 2)]
    await settle()
    waiters[0].cancel()
    await settle()
    recorder.gate.set()
    assert await waiters[1] == 20  # the statement went on for it
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    await settle()
    assert abandoned == [(1, 10)]  # the outcome nobody received is handed over


async def test_a_waiter_cancelled_after_its_outcome_came_hands_it_over() -> None:
    """The outcome is set, but the waiter is cancelled before it runs to take it: the outcome
    (a claim won) must not be lost with it."""
    recorder, batcher, abandoned = abandoning()
    waiter = asyncio.create_task(batcher.run(1))
    deliver = batcher._deliver

    def deliver_then_cancel(item: int, future: asyncio.Future[int], outcome: int) -> None:
        deliver(item, future, outcome)
        waiter.cancel()  # woken to take the outcome, cancelled before it runs

    batcher._deliver = deliver_then_cancel  # type: ignore[method-assign]
    await settle()
    recorder.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert abandoned == [(1, 10)]


async def test_a_waiter_that_gave_up_on_a_failed_statement_gets_nothing() -> None:
    recorder, batcher, abandoned = abandoning()
    waiters = [asyncio.create_task(batcher.run(item)) for item in (1, 2)]
    await settle()
    waiters[0].cancel()
    recorder.fail = ConnectionError("gone")  # the statement carrying 1, alone
    recorder.gate.set()
    assert await waiters[1] == 20  # the next statement
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    assert abandoned == []  # and no "exception never retrieved" (warnings are errors here)


async def test_close_sends_what_is_queued_then_refuses_more() -> None:
    recorder = Recorder()
    recorder.gate.set()
    batcher = Batcher("test", recorder.send, max_size=8)
    waiters = [asyncio.create_task(batcher.run(item)) for item in (1, 2, 3)]
    await asyncio.sleep(0)
    await batcher.close()
    assert await asyncio.gather(*waiters) == [10, 20, 30]
    with pytest.raises(RuntimeError):
        await batcher.run(4)


def stalls(operation: str) -> float:
    """`oncegate_store_stalled_batches_total` of `operation` so far."""
    labels = {"operation": operation}
    return REGISTRY.get_sample_value("oncegate_store_stalled_batches_total", labels) or 0.0


async def test_what_waits_behind_a_stuck_statement_is_sent_beside_it_and_counted() -> None:
    recorder = Recorder()
    batcher = Batcher("stuck", recorder.send, max_size=8, stall=0.01)
    counted = stalls("stuck")
    stuck = asyncio.create_task(batcher.run(1))
    await settle()
    behind = [asyncio.create_task(batcher.run(item)) for item in (2, 3)]
    await settle()
    assert recorder.batches == [[1]]
    for _ in range(100):  # the stall timer, 10 ms, fires however busy the machine is
        if len(recorder.batches) > 1:
            break
        await asyncio.sleep(0.01)
    assert recorder.batches == [[1], [2, 3]]  # sent while [1] is still in flight
    assert stalls("stuck") == counted + 1
    recorder.gate.set()
    assert await stuck == 10
    assert await asyncio.gather(*behind) == [20, 30]
    assert stalls("stuck") == counted + 1


async def test_a_batch_sent_beside_because_it_is_full_is_no_stall() -> None:
    recorder = Recorder()
    batcher = Batcher("full", recorder.send, max_size=2, stall=60)
    counted = stalls("full")
    first = asyncio.create_task(batcher.run(1))
    await settle()
    behind = [asyncio.create_task(batcher.run(item)) for item in (2, 3, 4)]
    await settle()
    assert recorder.batches == [[1], [2, 3]]  # a full batch beside the one in flight
    recorder.gate.set()
    assert await first == 10
    assert await asyncio.gather(*behind) == [20, 30, 40]
    assert recorder.batches == [[1], [2, 3], [4]]
    assert stalls("full") == counted


async def test_a_batch_holds_at_most_its_weight_and_a_heavy_operation_goes_alone() -> None:
    recorder = Recorder()
    recorder.gate.set()
    batcher = Batcher("test", recorder.send, max_size=8, weight=lambda item: item, max_weight=10)
    results = await asyncio.gather(*(batcher.run(item) for item in (1, 3, 3, 3, 20, 3)))
    assert results == [10, 30, 30, 30, 200, 30]
    assert recorder.batches == [[1], [3, 3, 3], [20], [3]]


class Heavy:
    """A `send` that holds every statement carrying a heavy item (100 or more) until released,
    and answers the others at once."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()

    async def send(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        if any(item >= 100 for item in items):
            await self.gate.wait()
        return [item * 10 for item in items]


def heavy_batcher(sender: Heavy) -> Batcher[int, int]:
    # A stall time no test waits for: only the heavy rule may send anything beside.
    return Batcher("heavy", sender.send, max_size=8, weight=lambda item: item, max_weight=1000,
                   heavy=100, max_heavy=2, stall=3600)  # fmt: skip


async def test_nothing_waits_behind_a_heavy_operation_in_flight() -> None:
    """A heavy operation's statement (a claim keeping a request of several MiB) takes PostgreSQL
    time in proportion to its bytes: the light ones that come meanwhile go as if it were not
    there, and another heavy one goes at once beside it."""
    sender = Heavy()
    batcher = heavy_batcher(sender)
    counted = stalls("heavy")
    first = asyncio.create_task(batcher.run(500))
    await settle()
    assert sender.batches == [[500]] and batcher.idle() and not batcher.unused()
    assert await asyncio.gather(batcher.run(1), batcher.run(2)) == [10, 20]
    second = asyncio.create_task(batcher.run(300))
    await settle()
    assert sender.batches == [[500], [1], [2], [300]]  # each heavy one alone, at once
    assert not (first.done() or second.done())
    assert stalls("heavy") == counted  # nothing waited for the stall timer
    sender.gate.set()
    assert (await first, await second) == (5000, 3000)
    assert batcher.unused()


async def test_past_max_heavy_a_heavy_operation_waits_for_one_and_the_light_ones_do_not() -> None:
    sender = Heavy()
    batcher = heavy_batcher(sender)
    heavy = [asyncio.create_task(batcher.run(item)) for item in (500, 400, 300, 200)]
    await settle()
    assert sender.batches == [[500], [400]]  # two in flight at most; 300 and 200 wait
    heavy[3].cancel()  # one that gives up before it is sent is never sent
    assert await batcher.run(1) == 10  # the light ones go as if nothing were in flight
    assert sender.batches == [[500], [400], [1]]
    sender.gate.set()
    assert await asyncio.gather(*heavy[:3]) == [5000, 4000, 3000]
    assert sender.batches == [[500], [400], [1], [300]]
    with pytest.raises(asyncio.CancelledError):
        await heavy[3]
    assert batcher.unused()


async def test_a_failed_heavy_statement_fails_its_operation_alone_and_frees_its_place() -> None:
    """The store down while a claim keeping a large request is in flight: that claim fails (the
    gateway answers 503 and forwards nothing), the heavy one waiting for its place is sent, and
    the light ones never saw it."""
    sent: list[list[int]] = []
    gate = asyncio.Event()

    async def send(items: Sequence[int]) -> list[int]:
        sent.append(list(items))
        if 500 in items:
            await gate.wait()
            raise ConnectionError("the store went away")
        return [item * 10 for item in items]

    batcher = Batcher("heavy", send, max_size=8, weight=lambda item: item, max_weight=1000,
                      heavy=100, max_heavy=1, stall=3600)  # fmt: skip
    failing = asyncio.create_task(batcher.run(500))
    waiting = asyncio.create_task(batcher.run(300))
    await settle()
    assert sent == [[500]]  # one heavy in flight at most: 300 waits
    assert await batcher.run(1) == 10
    gate.set()
    with pytest.raises(ConnectionError):
        await failing
    async with asyncio.timeout(10):  # a place never freed would hold it for ever
        assert await waiting == 3000
    assert sent == [[500], [1], [300]]
    assert batcher.unused()


async def test_a_heavy_operation_of_a_shielded_task_goes_in_that_task_and_holds_nothing_up() -> (
    None
):
    sender = Heavy()
    batcher = heavy_batcher(sender)

    async def shielded(item: int) -> int:
        reach.SHIELDED.set(True)
        return await batcher.run(item)

    heavy = asyncio.create_task(shielded(500))
    await settle()
    assert sender.batches == [[500]] and batcher.idle()
    assert await shielded(1) == 10  # sent alone in its own task, beside the heavy one
    closing = asyncio.create_task(batcher.close())
    await settle()
    assert not closing.done()  # a close waits for the heavy statement too
    sender.gate.set()
    assert await heavy == 5000
    await closing


async def test_an_error_one_operation_causes_fails_only_that_operation() -> None:
    sent: list[list[int]] = []

    async def send(items: Sequence[int]) -> list[int]:
        sent.append(list(items))
        if 13 in items:
            raise ValueError("13 is refused")
        return [item * 10 for item in items]

    batcher = Batcher("test", send, max_size=8, isolate=lambda exc: isinstance(exc, ValueError))
    results = await asyncio.gather(
        *(batcher.run(item) for item in (1, 2, 13, 4)), return_exceptions=True
    )
    assert results[:2] == [10, 20] and results[3] == 40
    assert isinstance(results[2], ValueError)
    assert sent == [[1], [2, 13, 4], [2], [13], [4]]  # the failed batch, then each alone
