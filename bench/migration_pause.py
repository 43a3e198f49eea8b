"""How long migration 0013 (the column checks as domains) holds the key table, and how many times
it reads it: one plain PostgreSQL 15 (tests/citus.py's settings), a database migrated to 0012
holding `--rows` narrow keys (no bodies), then `--rounds` times `migrate` up to 0013 and down to
0012 again, each timed from the call to its return (the migration runs in one transaction that
holds ACCESS EXCLUSIVE on the key table from its first ALTER TABLE to its commit, so the pause is
at most this) with the key table's reads counted (pg_stat_user_tables.seq_scan).

    .venv/bin/python bench/migration_pause.py [--rows 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.citus: the servers the tests start

from oncegate.store import migrate  # noqa: E402
from tests import citus  # noqa: E402
from tests.helpers import KEY_TABLE_SCANS, key_table_reads_since  # noqa: E402


async def measure(url: str, rows: int, rounds: int) -> None:
    await asyncio.to_thread(migrate.upgrade, url, "0012")
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(
            "INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token,"
            " lease_expires_at, created_at, expires_at)"
            " SELECT 'r', sha256(i::text::bytea), i::text, sha256(''::bytea), 'in_progress', 1,"
            "  now() + interval '1 hour', now(), now() + interval '1 day'"
            f" FROM generate_series(1, {rows}) AS i"
        )
        await connection.execute("VACUUM ANALYZE oncegate_keys")
        size = await connection.fetchval("SELECT pg_size_pretty(pg_table_size('oncegate_keys'))")
        print(f"{rows:,} keys, the table {size}")
        times: dict[str, list[float]] = {"up": [], "down": []}
        for _ in range(rounds):
            for step, target in (("up", "0013"), ("down", "0012")):
                before = await connection.fetchval(KEY_TABLE_SCANS)
                start = time.perf_counter()
                if step == "up":
                    await asyncio.to_thread(migrate.upgrade, url, target)
                else:
                    await asyncio.to_thread(migrate.downgrade, url, target)
                times[step].append(time.perf_counter() - start)
                count = await key_table_reads_since(connection, before)
                print(f"  {step:4} {times[step][-1]:6.2f} s  {count} reads")
        for step, found in times.items():
            low, high = min(found), max(found)
            print(f"{step}: median {statistics.median(found):.2f} s ({low:.2f}-{high:.2f})")
    finally:
        await connection.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    arguments = parser.parse_args()
    why = citus.unavailable()
    if why:
        print(f"needs a PostgreSQL 15 server: {why}")
        return 1
    server = citus.Cluster.start(workers=0, with_citus=False)
    try:
        asyncio.run(measure(server.create_database("pause"), arguments.rows, arguments.rounds))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
