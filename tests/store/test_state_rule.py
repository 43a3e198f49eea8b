"""The state rule as a table: every stored state by lease (past, ending now, live, none) by TTL
(past, ending now, future), run through the SQL function (`oncegate_key_state`, and
`oncegate_key_is` for each state) and its Python twin (`store.memory.key_state`) on one clock:
PostgreSQL's `now()` of the statement, handed to Python. Each cell must be what the table says,
in both, and the condition form must hold for that state alone.

No sleep and no wall clock: the lease and TTL ends are `now()` plus or minus a minute.
"""

from __future__ import annotations

import itertools

import asyncpg
import pytest

from oncegate.store.memory import key_state

STORED = ("in_progress", "completed", "unknown")
# Seconds from now to the lease's end; None: no lease.
LEASES = {"past": -60.0, "now": 0.0, "live": 60.0, "none": None}
TTLS = {"past": -60.0, "now": 0.0, "future": 60.0}

# The rule, in words (migrations/schema.sql): in flight while the lease runs, whatever the TTL;
# else expired past the TTL; else a claim whose lease ran out (or never had one) is unknown;
# else what was stored. A lease that ends now has run out; a TTL that ends now has too.
EXPECTED = {
    (stored, lease, ttl): (
        "in_progress" if stored == "in_progress" and lease == "live"
        else "expired" if ttl in ("past", "now")
        else "unknown" if stored == "in_progress"
        else stored
    )
    for stored, lease, ttl in itertools.product(STORED, LEASES, TTLS)
}  # fmt: skip

CELL = """
SELECT extract(epoch FROM now())::float8 AS at,
       oncegate_key_state($1, lease, expires) AS state,
       ARRAY[oncegate_key_is('in_progress', $1, lease, expires, now()),
             oncegate_key_is('completed', $1, lease, expires, now()),
             oncegate_key_is('unknown', $1, lease, expires, now()),
             oncegate_key_is('expired', $1, lease, expires, now())] AS states_that_hold
FROM (SELECT now() + make_interval(secs => $2) AS lease,
             now() + make_interval(secs => $3) AS expires) AS ends
"""
ORDER = ("in_progress", "completed", "unknown", "expired")


def test_the_table_names_every_state_and_leaves_no_cell_out() -> None:
    assert len(EXPECTED) == 3 * 4 * 3
    assert set(EXPECTED.values()) == set(ORDER)


@pytest.mark.parametrize(("stored", "lease", "ttl"), sorted(EXPECTED))
async def test_sql_and_python_say_the_same_state_in_every_cell(
    db: asyncpg.Connection, stored: str, lease: str, ttl: str
) -> None:
    lease_seconds, ttl_seconds = LEASES[lease], TTLS[ttl]
    row = await db.fetchrow(CELL, stored, lease_seconds, ttl_seconds)
    expected = EXPECTED[stored, lease, ttl]
    assert row["state"] == expected, "SQL"
    holding = [state for state, holds in zip(ORDER, row["states_that_hold"], strict=True) if holds]
    assert holding == [expected], "oncegate_key_is"
    at = row["at"]
    lease_end = None if lease_seconds is None else at + lease_seconds
    assert key_state(stored, lease_end, at + ttl_seconds, at) == expected, "Python"
