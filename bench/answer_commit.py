"""What `store_answer_commit = on` costs against `off` on a primary with a synchronous standby
(docs/operations.md, "PostgreSQL with a standby").

It starts a primary and a synchronous streaming standby from Debian's PostgreSQL server
(`tests/faults/replication.py`, the failover test's own harness: `make test-tools` installs
postgresql-15 as root), migrates a database through the multi-host URL, and runs `bench/quick.py`
against it once per setting, printing each table. What a failover costs under each setting (keys
left `unknown`) is `tests/faults/test_failover.py`'s to count (`pytest -s` prints it).

    .venv/bin/python bench/answer_commit.py [--duration 5] [--connections 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from oncegate import schema  # noqa: E402 - after the checkout is on the path
from tests.faults.replication import running_pair, unavailable  # noqa: E402 - same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", default="5")
    parser.add_argument("--connections", default="64")
    arguments = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(f"answer_commit: {why}", file=sys.stderr)
        return 2
    with running_pair(synchronous=True) as pair:

        async def create() -> None:
            connection = await asyncpg.connect(pair.primary.url())
            try:
                await connection.execute("CREATE DATABASE oncegate")
            finally:
                await connection.close()

        asyncio.run(create())
        schema.upgrade(pair.url("oncegate"))
        for setting in ("off", "on"):
            print(f"\n## store_answer_commit = {setting}, synchronous standby", flush=True)
            environment = {**os.environ, "ONCEGATE_DATABASE_URL": pair.url("oncegate"),
                           "ONCEGATE_STORE_ANSWER_COMMIT": setting}  # fmt: skip
            subprocess.run(
                [sys.executable, str(ROOT / "bench" / "quick.py"), "--duration",
                 arguments.duration, "--connections", arguments.connections],
                env=environment, check=True,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
