"""What a PostgreSQL failover cost this gateway, counted on the new primary and logged once.

A failover is seen when a new connection reaches another host of the URL than the one before
(`connections.Primary`). Answers are stored with `synchronous_commit` = `store_answer_commit`
(`off` by default): the old primary acknowledged them before its standby had them, so the last
ones may be missing on the new primary. Their claims were synchronous and survived, so those keys
are still in flight there, and turn `unknown` when their leases run out: an operator resolves each.

`RecentAnswers` keeps the (row id, fencing token) of every answer this process stored in the
last `WINDOW` seconds, and of every answer it could not store because PostgreSQL was unreachable.
After a failover one statement on the new primary says how many of those rows are not completed
there (`unanswered`: they turn `unknown`) and how many are not there at all (`gone`: their claim
was lost too, which only a standby that was not synchronous can do; a retry of such a key is
forwarded again).

What it does not count: answers stored by other gateway processes (each logs its own), and a
failover behind one address (a virtual IP, a proxy) that never changes the host a connection
reaches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import asyncpg

from ...model.records import Claim
from ...settings import StoreOptions
from ...settings.database_url import Host
from ..errors import DRIVER_ERRORS, reason
from ..queries import Statements
from .rows import fetchrow

log = logging.getLogger("oncegate.store.postgres")

# How far back answers are remembered. A synchronous standby lags by well under a second, an
# asynchronous one under load by what its WAL receiver has not yet written; past 10 s of lag the
# start-up warning about the standby is the problem to fix, not this count.
WINDOW = 10.0
# Answers that could not be stored are kept until a connection reaches PostgreSQL again: on the
# same host (a restart) they are forgotten (their keys are in flight there, no failover lost
# them), on another host they are counted. Only the newest are kept during one long outage: more
# than this many would already be a count to read in the log as "at least".
UNSTORED_KEPT = 10_000


class RecentAnswers:
    def __init__(self, pool: asyncpg.Pool, statements: Statements, options: StoreOptions) -> None:
        self._pool = pool
        self._statements = statements
        self._options = options
        self._stored: collections.deque[tuple[float, int, int]] = collections.deque()
        self._unstored: collections.deque[tuple[int, int]] = collections.deque(maxlen=UNSTORED_KEPT)
        self._checks: set[asyncio.Task[None]] = set()

    def stored(self, claim: Claim) -> None:
        now = time.monotonic()
        self._stored.append((now, claim.id, claim.token))
        while self._stored and self._stored[0][0] < now - WINDOW:
            self._stored.popleft()

    def unstored(self, claim: Claim) -> None:
        self._unstored.append((claim.id, claim.token))  # the oldest go past UNSTORED_KEPT

    def back_on_same_host(self) -> None:
        """PostgreSQL answers again where it did before: what could not be stored meanwhile was
        not lost by a failover, and must not be counted at a later one."""
        self._unstored.clear()

    def failed_over(self, now: Host, before: Host) -> None:
        """Count, on the new primary, what the failover cost (in the background: this runs in
        the pool's connection set-up)."""
        stored = [(record_id, token) for _, record_id, token in self._stored]
        unstored = list(self._unstored)
        self._unstored.clear()
        self._stored.clear()
        check = asyncio.create_task(self._count(now, before, stored, unstored))
        self._checks.add(check)
        check.add_done_callback(self._checks.discard)

    async def _count(
        self,
        now: Host,
        before: Host,
        stored: list[tuple[int, int]],
        unstored: list[tuple[int, int]],
    ) -> None:
        rows = stored + unstored
        try:
            found = await fetchrow(
                self._pool,
                self._statements,
                "answers_after_failover",
                ids=[record_id for record_id, _ in rows],
                tokens=[token for _, token in rows],
            )
        except DRIVER_ERRORS as exc:
            log.warning(
                "PostgreSQL failed over from %s to %s; could not count the answers it lost: %s",
                before, now, reason(exc),
            )  # fmt: skip
            return
        unanswered, gone = found["unanswered"], found["gone"]
        log.log(
            logging.WARNING if unanswered or gone else logging.INFO,
            "PostgreSQL failed over from %s to %s: of the %d answers this gateway stored in the "
            "%gs before (store_answer_commit=%s) and the %d it could not store meanwhile, %d are "
            "not on the new primary and their keys turn unknown when their leases run out "
            "(resolve them: oncegate keys list --state unknown), and %d keys lost their claim "
            "too (a standby that was not synchronous): a retry of one is forwarded again",
            before, now, len(stored), WINDOW, self._options.answer_commit, len(unstored),
            unanswered, gone,
            extra={"fields": {"keys_unknown_after_failover": unanswered,
                              "claims_lost_in_failover": gone}},
        )  # fmt: skip

    async def close(self) -> None:
        for check in list(self._checks):
            check.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await check
