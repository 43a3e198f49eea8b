"""Maintenance beside the traffic: purging expired keys and counting keys by state, each in
bounded statements with pauses between them."""

from __future__ import annotations

import asyncio

from ..model.records import LISTED_STATES, Listed
from ..telemetry import metrics
from .ports import UpkeepStore

# The purger deletes in bounded batches so each statement's locks and WAL stay small and claims
# on the same table never wait behind it; the pause between batches leaves room for traffic.
PURGE_BATCH_SIZE = 1000
PURGE_PAUSE = 0.05
# The gauge `oncegate_keys` is counted by a sweep over the table in primary-key pages: each
# statement reads at most this many rows (a few milliseconds), and the pause between pages
# leaves the database to the traffic, as the purger does.
KEY_COUNT_PAGE_SIZE = 5000
KEY_COUNT_PAUSE = 0.02


async def purge_expired(
    store: UpkeepStore, batch_size: int = PURGE_BATCH_SIZE, pause: float = PURGE_PAUSE
) -> int:
    """Delete every expired key, one bounded batch at a time; return how many."""
    total = 0
    while True:
        deleted = await store.purge(batch_size)
        total += deleted
        metrics.KEYS_PURGED.inc(deleted)
        if deleted < batch_size:
            return total
        await asyncio.sleep(pause)


async def count_keys(
    store: UpkeepStore,
    page_size: int = KEY_COUNT_PAGE_SIZE,
    pause: float = KEY_COUNT_PAUSE,
) -> dict[Listed, int]:
    """Count every key by state, one bounded page at a time, then set `oncegate_keys{state}`.

    The gauge changes once per sweep, to the sweep's totals, never to a half-counted figure.
    A key that changes state while the sweep runs is counted as it was when its page was read."""
    totals: dict[Listed, int] = dict.fromkeys(LISTED_STATES, 0)
    after = 0
    while True:
        page = await store.count_keys(after, page_size)
        for state, count in page.counts.items():
            totals[state] += count
        if page.last or page.last_id is None:
            break
        after = page.last_id
        await asyncio.sleep(pause)
    for state, count in totals.items():
        metrics.KEYS.labels(state).set(count)
    return totals
