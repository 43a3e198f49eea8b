"""`bench/run.py`'s targets: each a ratio of two rows of one run on the proxy's CPU per request,
printed as PASS/FAIL (never asserted by the bench itself), then what a core carries. The lines
are what docs/performance.md quotes, so their verdicts must follow the figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run as bench


def sample(
    proxy_ms: float, postgres_ms: float = 0.05, p50: float = 1.0, p99: float = 2.0
) -> bench.Sample:
    return bench.Sample(
        requests=1000, seconds=1.0, p50_ms=p50, p99_ms=p99,
        cpu_ms_per_request=proxy_ms + postgres_ms, proxy_ms_per_request=proxy_ms,
        postgres_ms_per_request=postgres_ms, errors={}, new_sent=0, retries_sent=0,
    )  # fmt: skip


def results(
    forward: float, replay: float, forward_p99: float, postgres: float = 0.05
) -> bench.Results:
    """A run whose bare proxy costs 0.2 ms a request, with the oncegate rows as given."""
    measured = bench.Results()
    rows = {
        bench.BARE: 0.2, bench.FORWARD: forward, bench.IN_MEMORY: 0.35, bench.REPLAY: replay,
        bench.MIX: forward, bench.IDEMKIT_FORWARD: 1.1, bench.IDEMKIT_MIX: 1.1,
    }  # fmt: skip
    for configuration, proxy in rows.items():
        measured.add(configuration, 64, sample(proxy, postgres))
    measured.add(bench.BARE, 1, sample(0.5, p50=0.5, p99=2.0))
    measured.add(bench.FORWARD, 1, sample(1.0, p50=1.2, p99=forward_p99))
    measured.add(bench.FLOOR, 1, sample(0.3, p50=0.4, p99=1.0))
    return measured


def verdicts(lines: list[str]) -> list[str]:
    return [line.split()[0] for line in lines if line.startswith(("PASS", "FAIL", "n/a"))]


def test_targets_pass_when_every_ratio_is_within_its_bound() -> None:
    lines = bench.targets(results(forward=0.36, replay=0.15, forward_p99=5.9), 64)
    # forward 1.8x, store 1.03x, replay 0.75x, idemkit 3.06x twice, p99 2.95x, p50 +0.7 <= 0.75
    assert verdicts(lines) == ["PASS"] * 7


def test_each_target_fails_past_its_bound() -> None:
    lines = bench.targets(results(forward=0.40, replay=0.17, forward_p99=6.2), 64)
    # forward 2.0x > 1.8, store 1.14x > 1.1, replay 0.85x > 0.8, idemkit 2.75x (met), p99 3.1x > 3
    assert verdicts(lines) == ["FAIL", "FAIL", "FAIL", "PASS", "PASS", "FAIL", "PASS"]
    assert "2.00x (0.400 vs 0.200 ms" in lines[0]


def test_a_row_not_measured_is_neither_pass_nor_fail() -> None:
    measured = results(forward=0.36, replay=0.15, forward_p99=5.9)
    del measured.samples[bench.IN_MEMORY, 64]
    assert verdicts(bench.targets(measured, 64))[1] == "n/a"


def test_what_a_core_carries_is_one_second_over_each_cpu_per_forward() -> None:
    line = bench.targets(results(forward=0.4, replay=0.15, forward_p99=5.9, postgres=0.1), 64)[-1]
    assert line.startswith("what a core carries")
    assert "2,500 forwards/s per gateway core (0.400 ms each)" in line
    assert "10,000 per PostgreSQL core (0.100 ms each)" in line
    assert "keeps up with 4.0 gateway cores" in line


@pytest.mark.parametrize("postgres", [float("nan"), 0.0])
def test_what_a_core_carries_needs_both_figures(postgres: float) -> None:
    line = bench.capacity_line(results(0.4, 0.15, 5.9, postgres=postgres), 64)
    assert line == "what a core carries: not measured"


def test_every_other_round_runs_the_plan_in_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    # What one row leaves behind (the key table's autovacuum after a forward row's inserts) must
    # not always fall on the row after it: the route-wait row, after the forward's, read dearer.
    measured: list[bench.Configuration] = []

    def measure(
        servers: object, configuration: bench.Configuration, connections: int, *rest: object
    ) -> bench.Sample:
        measured.append(configuration)
        return sample(0.3)

    monkeypatch.setattr(bench, "measure", measure)
    monkeypatch.setattr(bench, "progress", lambda message: None)
    forward, waited, replay = bench.FORWARD, bench.WAIT_FORWARD, bench.REPLAY
    plan = [(forward, 64), (waited, 64), (replay, 64)]
    results = bench.Results()
    no_servers: Any = None  # `measure` is replaced: nothing is started
    bench.run_plan(no_servers, plan, argparse.Namespace(repeats=3), results)
    assert measured == [forward, waited, replay, replay, waited, forward, forward, waited, replay]
    assert len(results.get(waited, 64)) == 3
