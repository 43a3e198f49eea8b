"""Waking the requests that wait for a key to settle (`Prefer: wait`), in one process.

A store's settles become calls to `Watchers.settled(record_id)` (PostgreSQL's NOTIFY, through the
listening connection, or the in-memory store directly), and each request that waits on that row
holds a `Watch`. A lost notification costs a waiter time, never an answer: it also polls the row.
"""

from __future__ import annotations

import asyncio


class Watch:
    """One request waiting for one row to settle."""

    def __init__(self, watchers: Watchers, record_id: int) -> None:
        self._watchers = watchers
        self.record_id = record_id
        self._settled = asyncio.Event()

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109 - a poll interval, by design
        """True when the row was said to settle within `timeout` seconds."""
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def wake(self) -> None:
        self._settled.set()

    def rearm(self) -> None:
        """Wait for the next wake-up: the last one was looked into, and the row had not settled
        (`wake_all` wakes every waiter, whatever its row)."""
        self._settled.clear()

    def close(self) -> None:
        self._watchers.forget(self)


class Watchers:
    def __init__(self) -> None:
        self._watches: dict[int, set[Watch]] = {}

    def watch(self, record_id: int) -> Watch:
        watch = Watch(self, record_id)
        self._watches.setdefault(record_id, set()).add(watch)
        return watch

    def forget(self, watch: Watch) -> None:
        watches = self._watches.get(watch.record_id)
        if watches is not None:
            watches.discard(watch)
            if not watches:
                del self._watches[watch.record_id]

    def settled(self, record_id: int) -> None:
        for watch in self._watches.get(record_id, ()):
            watch.wake()

    def wake_all(self) -> None:
        """Notifications may have been lost (the listening connection broke): every waiter
        looks at its row again now rather than at its next poll."""
        for watches in self._watches.values():
            for watch in watches:
                watch.wake()
