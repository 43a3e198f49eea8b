"""What the operator's queue costs on a large key table.

Fills `oncegate_keys` with `--rows` rows (one `INSERT ... SELECT generate_series`; 1 KiB bodies,
one key in `--unknown-every` unknown, the rest completed), then times, twice each (the second run
on a warm cache is the one printed):

- the sweep behind the gauge `oncegate_keys{state}` (`service.count_keys`, without its pauses):
  the sum of its statements, how many pages, and one page alone;
- for comparison, one `GROUP BY` over the whole table (what a single count statement would cost);
- the queue listing (`GET /admin/keys?state=unknown`, 100 keys) and one key by id.

Not part of `make test`. PostgreSQL: an embedded one in a temporary directory.

    .venv/bin/python bench/key_count.py [--rows 500000] [--unknown-every 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import warnings
from collections.abc import Awaitable
from pathlib import Path

import asyncpg

from oncegate import service
from oncegate.store import migrate
from oncegate.store.postgres import PostgresStore

FILL = """
INSERT INTO oncegate_keys (route, scope, key, fingerprint, state, fencing_token, response_status,
                           response_headers, response_body, response_stored, expires_at)
SELECT 'bench', sha256(i::text::bytea), 'key-' || i, sha256(i::text::bytea),
       CASE WHEN i % $2 = 0 THEN 'unknown' ELSE 'completed' END, 1,
       CASE WHEN i % $2 = 0 THEN NULL ELSE 201 END,
       CASE WHEN i % $2 = 0 THEN NULL ELSE '[["content-type", "application/json"]]'::jsonb END,
       CASE WHEN i % $2 = 0 THEN NULL ELSE convert_to(repeat('x', 1024), 'UTF8') END,
       i % $2 <> 0, now() + interval '1 day'
FROM generate_series(1, $1) AS i
"""


async def timed(operation: Awaitable[object]) -> float:
    started = time.perf_counter()
    await operation
    return (time.perf_counter() - started) * 1000


async def measure(url: str, rows: int, unknown_every: int) -> None:
    connection = await asyncpg.connect(url)
    store = await PostgresStore.connect(url)
    try:
        await connection.execute(FILL, rows, unknown_every)
        await connection.execute("VACUUM ANALYZE oncegate_keys")
        size = await connection.fetchval(
            "SELECT pg_size_pretty(pg_total_relation_size('oncegate_keys'))"
        )
        group_by = (
            "SELECT oncegate_key_state(state, lease_expires_at, expires_at), count(*)"
            " FROM oncegate_keys GROUP BY 1"
        )
        for _ in range(2):  # the second run, on a warm cache, is the one printed
            sweep = await timed(service.count_keys(store.upkeep, pause=0))
            page = await timed(store.upkeep.count_keys(rows // 2, service.KEY_COUNT_PAGE_SIZE))
            whole = await timed(connection.fetch(group_by))
            queue = await timed(store.operator.queue("unknown", None, None, None, 101))
            describe = await timed(store.operator.describe(rows // 2))
    finally:
        await store.close()
        await connection.close()
    pages = -(-rows // service.KEY_COUNT_PAGE_SIZE)
    print(f"{rows} rows ({size}), one in {unknown_every} unknown")
    print("| what | ms |\n|---|---|")
    print(
        f"| gauge sweep: {pages} pages of {service.KEY_COUNT_PAGE_SIZE}, statements | {sweep:.0f} |"
    )
    print(f"| one page of the sweep | {page:.1f} |")
    print(f"| one GROUP BY over the table (for comparison) | {whole:.0f} |")
    print(f"| the queue: 100 unknown keys, oldest first | {queue:.0f} |")
    print(f"| one key by id | {describe:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--unknown-every", type=int, default=10_000)
    arguments = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from pgserver.postgres_server import get_server
    directory = Path(tempfile.mkdtemp(prefix="oncegate-bench-keys-"))
    server = get_server(directory / "data", cleanup_mode="delete")
    try:
        url = server.get_uri()
        migrate.upgrade(url)
        asyncio.run(measure(url, arguments.rows, arguments.unknown_every))
    finally:
        server.cleanup()


if __name__ == "__main__":
    main()
