"""The bench's floor row sends the gateway's own claim and complete statements (`bench/run.py`
`_floor`): when a statement's parameters change, the row must follow, or `make bench` stops
at that row after minutes of runs (it did once, when the Citus keys were added to `complete`)."""

from __future__ import annotations

import sys
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run as bench


async def test_the_floor_row_claims_and_completes_with_the_gateways_statements(
    database_url: str,
) -> None:
    claim_ms, complete_ms, pairs = await bench._floor(database_url, 0.2, 0.0, "floor-test")

    assert pairs > 0
    assert len(claim_ms) == len(complete_ms) == pairs
    connection = await asyncpg.connect(database_url)
    try:
        states = await connection.fetch(
            "SELECT state, count(*) AS keys FROM oncegate_keys "
            "WHERE key LIKE 'floor-test-%' GROUP BY state"
        )
    finally:
        await connection.close()
    assert [(row["state"], row["keys"]) for row in states] == [("completed", pairs)]
