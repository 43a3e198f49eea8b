"""`bench/run.py --sweep mix`: each mix of forwards and replays read against its parts, the
forward and the replay of the same round weighted by the mix's shares (docs/performance.md,
"Why a mix costs more than its parts", quotes the table)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run as bench


def sample(proxy_ms: float, postgres_ms: float) -> bench.Sample:
    return bench.Sample(
        requests=1000, seconds=1.0, p50_ms=1.0, p99_ms=2.0,
        cpu_ms_per_request=proxy_ms + postgres_ms, proxy_ms_per_request=proxy_ms,
        postgres_ms_per_request=postgres_ms, errors={}, new_sent=0, retries_sent=0,
    )  # fmt: skip


def row(table: str, retries: str) -> list[str]:
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0] == retries:
            return cells
    raise AssertionError(f"no row for {retries} in\n{table}")


def test_each_mix_is_read_against_the_forward_and_replay_of_its_own_round() -> None:
    measured = bench.Results()
    rounds = {  # retries -> (proxy ms, PostgreSQL ms) per round
        0: [(0.30, 0.06), (0.40, 0.08), (0.50, 0.10)],
        20: [(0.30, 0.06), (0.34, 0.07), (0.42, 0.08)],
        100: [(0.10, 0.02), (0.20, 0.03), (0.10, 0.02)],
    }
    for percent, figures in rounds.items():
        for proxy, postgres in figures:
            measured.add(bench.MIXED[percent], 64, sample(proxy, postgres))
    table = bench.mix_table(measured, 64)
    # Each round's parts: 0.8 x 0.30 + 0.2 x 0.10 = 0.26, then 0.36 and 0.42; the mix less them
    # +40, -20 and 0 µs, whose median is 0.
    cells = row(table, "20%")
    assert cells[2] == "0.340 (0.300-0.420)"
    assert cells[3] == "0.360 (0.260-0.420)"
    assert cells[4] == "0 (-20-40)"
    assert cells[6] == "0.070 (0.052-0.084)"  # PostgreSQL's: 0.8 x 0.06 + 0.2 x 0.02, ...
    assert row(table, "0%")[4] == "0 (0-0)"
    assert row(table, "100%")[4] == "0 (0-0)"
    assert "50%" not in table  # not measured: no row


def parsed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> argparse.Namespace:
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    return bench.parse_arguments()


def test_all_runs_the_mix_sweep_and_budgets_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "mix" in parsed(monkeypatch, "--all").sweep
    without = bench.budget_seconds(parsed(monkeypatch, "--sweep", "concurrency"))
    with_mix = bench.budget_seconds(parsed(monkeypatch, "--sweep", "concurrency", "--sweep", "mix"))
    per_run = 1 + 5 + 10  # warm-up, duration, wrk's start and the counts
    assert with_mix - without == len(bench.MIX_SWEEP) * 3 * per_run
