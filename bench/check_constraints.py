"""What the key table's CHECK constraints cost a worker-shaped statement, and what the column
checks would cost as domains: one lever for a Citus worker's CPU per pair, measured before any
migration is written.

PostgreSQL compiles a table's CHECK constraints from their stored text for each table a statement
writes (each shard table of a worker's statement), while a domain's checks are cached per type.
This starts one plain PostgreSQL 15 (tests/citus.py's settings), makes three pairs of tables
from `migrations/schema.sql`'s `oncegate_keys`: with its five column checks as table checks, as
before migration 0013 (`checks`), as domains, as schema.sql has them since (`domains`; `key`'s
check and the five checks across columns stay table checks), and without any check (`none`, the
bound of the lever), then sends one statement shaped as a worker's with two shards: claims
inserted into both tables and the previous statement's claims completed in both, `--rows` per
table and kind, four times as many operations a statement (6: 24, about the 26 a worker's
statements carry at 64 in flight over two workers; 21: 84, about 86). The backend's CPU (from
/proc) per statement, after 200 statements and an ANALYZE, over `--statements` statements, in
`--rounds` rounds whose order alternates.

    .venv/bin/python bench/check_constraints.py [--rows 6,21] [--statements 800] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import statistics
import sys
import uuid
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.citus: the servers the tests start

from tests import citus  # noqa: E402

VARIANTS = ("checks", "domains", "none")
SCHEMA = (ROOT / "migrations" / "schema.sql").read_text()
# The domains schema.sql makes (migration 0013), and the columns it gives them.
DOMAINS = "\n".join(re.findall(r"^CREATE DOMAIN [^;]*;", SCHEMA, re.MULTILINE))
_spec = importlib.util.spec_from_file_location(
    "column_domains", ROOT / "migrations" / "versions" / "0013_column_domains.py"
)
assert _spec is not None and _spec.loader is not None
COLUMN_DOMAINS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(COLUMN_DOMAINS)


def table(name: str, variant: str) -> str:
    """`oncegate_keys` of migrations/schema.sql as `name`, its checks as `variant` says: its
    column checks as domains, as schema.sql has them (`domains`); as table checks, as before
    migration 0013 (`checks`); or none at all (`none`)."""
    start = SCHEMA.index("CREATE TABLE oncegate_keys (")
    text = SCHEMA[start : SCHEMA.index("WITH (fillfactor = 70);", start)]
    text = re.sub(r"--[^\n]*\n", "\n", text).replace("oncegate_keys", name)
    if variant in ("checks", "none"):
        for column, domain, check in COLUMN_DOMAINS.COLUMNS:
            typed = re.compile(rf"\b{column} {domain}\b")
            if not typed.search(text):
                raise RuntimeError(f"schema.sql no longer has {column} {domain}")
            base = COLUMN_DOMAINS.BASE[domain]
            text = typed.sub(
                f"{column} {base}" + (f" CHECK ({check})" if variant == "checks" else ""), text
            )
    if variant == "none":
        text = re.sub(r"\s+CHECK \((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)", "", text)
        text = re.sub(r",\s*CONSTRAINT \w+(?=\s*[,)])", "", text)
        if "CHECK" in text:
            raise RuntimeError("a check of schema.sql was not taken out")
    return text + "WITH (fillfactor = 70)"


def statement(prefix: str) -> str:
    """Claims into both tables, and the previous statement's claims completed in both."""
    parts = []
    for index in (0, 1):
        name = f"{prefix}_{index}"
        parts.append(
            f"i{index} AS (INSERT INTO {name} (route, scope, key, fingerprint, state,"
            " fencing_token, lease_expires_at, expires_at) SELECT 'bench', $1, k, $1,"
            " 'in_progress', 1, now() + interval '30 s', now() + interval '1 day'"
            f" FROM unnest(${2 + index}::text[]) AS k RETURNING id)"
        )
        parts.append(
            f"u{index} AS (UPDATE {name} SET state = 'completed', response_status = 201,"
            " response_headers = '[]', response_body = '\\x00', response_stored = true,"
            f" completed_at = now() WHERE scope = $1 AND key = ANY(${4 + index}::text[])"
            " AND state = 'in_progress' RETURNING id)"
        )
    counted = " + ".join(f"(SELECT count(*) FROM {part})" for part in ("i0", "i1", "u0", "u1"))
    return f"WITH {', '.join(parts)} SELECT {counted}"


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_variant(url: str, prefix: str, rows: int, statements: int) -> float:
    """µs of the backend's CPU per statement."""
    connection = await asyncpg.connect(url)
    try:
        pid = await connection.fetchval("SELECT pg_backend_pid()")
        previous: list[list[str]] = [[], []]

        async def send(prepared: asyncpg.prepared_stmt.PreparedStatement) -> None:
            nonlocal previous
            keys = [[str(uuid.uuid4()) for _ in range(rows)] for _ in (0, 1)]
            await prepared.fetchval(bytes(32), *keys, *previous)
            previous = keys

        prepared = await connection.prepare(statement(prefix))
        for _ in range(200):
            await send(prepared)
        await connection.execute(f"ANALYZE {prefix}_0; ANALYZE {prefix}_1")
        prepared = await connection.prepare(statement(prefix))
        before = backend_cpu(pid)
        for _ in range(statements):
            await send(prepared)
        return (backend_cpu(pid) - before) * 1e6 / statements
    finally:
        await connection.close()


async def measure(url: str, arguments: argparse.Namespace) -> None:
    connection = await asyncpg.connect(url)
    try:
        await connection.execute(DOMAINS)
    finally:
        await connection.close()
    print("| operations per statement | variant | backend CPU µs per statement, median (range) |")
    print("|---:|---|---:|")
    for rows in arguments.rows:
        found: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        connection = await asyncpg.connect(url)
        try:
            for variant in VARIANTS:
                for index in (0, 1):
                    await connection.execute(table(f"probe_{variant}_{rows}_{index}", variant))
        finally:
            await connection.close()
        for round_ in range(arguments.rounds):
            order = VARIANTS if round_ % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                found[variant].append(
                    await run_variant(url, f"probe_{variant}_{rows}", rows, arguments.statements)
                )
        for variant, each in found.items():
            print(
                f"| {4 * rows} | {variant} | {statistics.median(each):,.0f}"
                f" ({min(each):,.0f}-{max(each):,.0f}) |"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", type=lambda text: [int(part) for part in text.split(",")], default=[6, 21]
    )
    parser.add_argument("--statements", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=5)
    arguments = parser.parse_args()
    why = citus.unavailable()
    if why is not None:
        print(f"check_constraints: no PostgreSQL 15 here: {why}", file=sys.stderr)
        return 2
    server = citus.Cluster.start(workers=0, with_citus=False)
    try:
        asyncio.run(measure(server.create_database("probe"), arguments))
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
