"""The chaos soak, 30 seconds of it, inside `make test` (`make soak` runs the long one).

Three gateways SIGKILLed and SIGTERMed at random under 16 clients, PostgreSQL `kill -9`ed once,
an upstream that answers slow, 429/503/500 or resets, and 1,000 fuzzed requests at a fourth
gateway meanwhile; where a standby can be started (tests/faults/replication.py), PostgreSQL is a
primary and a synchronous standby, and one more outage is a failover to it. The assertions are
the checker's: zero violations of any rule, and zero from the fuzzer. The volume is printed
(`pytest -s`), and asserted only as minimums a loaded machine still reaches: the faults were
injected (one PostgreSQL crash, at least one gateway kill) and the fuzzer sent all its requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults import replication
from tests.soak.driver import Options, Summary, run

SEED = 14


def report(summary: Summary) -> str:
    lines = [violation.report() for violation in summary.result.violations[:20]]
    return "\n".join([summary.table, *lines, *summary.fuzz_violations[:20]])


@pytest.mark.timeout(900)
async def test_a_30_second_chaos_soak_breaks_no_promise(tmp_path: Path) -> None:
    summary = await run(
        Options(
            seconds=30,
            seed=SEED,
            out=tmp_path,
            clients=16,
            fuzz_requests=1000,
            kill_interval=3.0,
            postgres_outages=1,
            probes=500,
        )
    )
    print(f"\n{summary.table}\nhistories: {tmp_path}")  # noqa: T201 - the figures (pytest -s)
    assert summary.result.violations == [], report(summary)
    assert summary.fuzz_violations == [], report(summary)
    figures = summary.figures
    assert figures["postgres_outages"]["kill"] == 1 and figures["postgres_restarts"] == 1
    # With a standby (Debian's postgresql-15 installed), one more outage is a failover.
    assert figures["postgres_outages"]["failover"] == (replication.unavailable() is None)
    assert figures["gateway_kills"] + figures["gateway_terms"] >= 1
    assert figures["fuzzed_requests"] >= 1000
    assert figures["requests"] > 0 and figures["upstream_performed"] > 0
