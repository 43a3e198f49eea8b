"""What `store_answer_commit = on` costs against `off` on a primary with a synchronous standby
(docs/operations.md, "PostgreSQL with a standby").

It starts a primary and a synchronous streaming standby from Debian's PostgreSQL server
(`tests/faults/replication.py`, the failover test's own harness, here with `fsync = on` so that
a commit that waits for the standby waits for its disk too; `make test-tools` installs
postgresql-15 as root), migrates a database through the multi-host URL, and runs
`bench/quick.py` against it `--repeats` times per setting, the settings interleaved (off, on,
off, on, ...) so that a machine whose speed drifts affects both alike. Each run's forward path
is compared with the direct upstream measured in the same run (the ratio is steadier than req/s
on a shared machine); it prints every run and the median ratio per setting. What a failover
costs under each setting (keys left `unknown`) is `tests/faults/test_failover.py`'s to count
(`pytest -s` prints it).

    .venv/bin/python bench/answer_commit.py [--duration 5] [--connections 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.faults.replication import Pair, running_pair, unavailable  # noqa: E402 - same

SETTINGS = ("off", "on")


def requests_per_second(table: str, row: str) -> float:
    """The req/s column of one row of bench/quick.py's table."""
    match = re.search(rf"^\| {re.escape(row)} \| \d+ \| \d+ \| ([\d,]+) \|", table, re.MULTILINE)
    if match is None:
        raise LookupError(f"no row {row!r} in:\n{table}")
    return float(match.group(1).replace(",", ""))


def one_run(pair: Pair, setting: str, arguments: argparse.Namespace) -> tuple[float, float]:
    environment = {**os.environ, "ONCEGATE_DATABASE_URL": pair.url("oncegate"),
                   "ONCEGATE_STORE_ANSWER_COMMIT": setting}  # fmt: skip
    table = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quick.py"), "--duration", arguments.duration,
         "--connections", arguments.connections],
        env=environment, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return (
        requests_per_second(table, "direct upstream"),
        requests_per_second(table, "gateway, forward (new key)"),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", default="5")
    parser.add_argument("--connections", default="64")
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(f"answer_commit: {why}", file=sys.stderr)
        return 2
    ratios: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    print(f"$ .venv/bin/python bench/answer_commit.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"nproc {os.cpu_count()}; primary, synchronous standby (fsync on), gateway, upstream and "
          f"client share the machine; {arguments.connections} connections, "
          f"{arguments.duration} s per run\n")  # fmt: skip
    print(
        "| run | store_answer_commit | direct upstream req/s | forward req/s | forward / direct |"
    )
    print("|---:|---|---:|---:|---:|")
    with running_pair(synchronous=True, fsync=True) as pair:
        pair.migrated_database()
        for run in range(arguments.repeats):
            for setting in SETTINGS:
                direct, forward = one_run(pair, setting, arguments)
                ratios[setting].append(forward / direct)
                print(f"| {run + 1} | {setting} | {direct:,.0f} | {forward:,.0f} | "
                      f"{forward / direct:.3f} |", flush=True)  # fmt: skip
    medians = {setting: statistics.median(values) for setting, values in ratios.items()}
    print(
        f"\nmedian forward / direct: off {medians['off']:.3f}, on {medians['on']:.3f} "
        f"(on / off = {medians['on'] / medians['off']:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
