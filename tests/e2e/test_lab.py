"""`oncegate lab` end to end: its own PostgreSQL, gateway and demo upstream, real SIGKILLs.

A small run checks the shape of contract section 8: restarting repeats actions, checkpoints
alone repeat the ones caught in the gap, checkpoints with keys through the gateway repeat and
lose nothing, and saving first loses instead of repeating.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def lab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "lab", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_a_small_lab_run_has_the_contracts_shape(tmp_path: Path) -> None:
    chart = tmp_path / "lab.svg"
    result = lab("--runs", "30", "--seed", "7", "--json", "--plot", str(chart))
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert set(document) == {"runs", "seed", "strategies"}
    assert document["runs"] == 30 and document["seed"] == 7
    strategies = document["strategies"]
    assert set(strategies) == {"A", "B", "C", "D"}
    for figures in strategies.values():
        assert set(figures) == {"redone_avg", "duplicate_runs_pct", "lost_runs_pct"}
    a, b, c, d = (strategies[name] for name in "ABCD")
    assert a["duplicate_runs_pct"] > 20 and a["redone_avg"] > 2
    assert c["duplicate_runs_pct"] == 0 and c["lost_runs_pct"] == 0
    assert b["lost_runs_pct"] == 0 and d["duplicate_runs_pct"] == 0
    # Same crashes for every strategy: what B repeats, D loses and C neither.
    assert b["duplicate_runs_pct"] == d["lost_runs_pct"]
    assert b["redone_avg"] == c["redone_avg"]
    assert "runs" in result.stderr  # the progress bar
    assert chart.read_text().startswith("<svg")
    assert f"oncegate lab: chart written to {chart.resolve()}" in result.stderr


@pytest.mark.timeout(300)
def test_killing_the_gateway_too_repeats_and_loses_nothing_with_keys() -> None:
    result = lab("--runs", "12", "--strategies", "C", "--kill-gateway", "0.5", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["strategies"]["C"]["duplicate_runs_pct"] == 0
    assert document["strategies"]["C"]["lost_runs_pct"] == 0
    kills = document["gateway_kills"]
    assert kills["kills"] >= 1
    # Every key a killed gateway left `unknown` was resolved from the upstream's records (each
    # run may have had more than one), and the run then finished: nothing failed.
    resolved = kills["resolved_completed"] + kills["resolved_released"]
    assert resolved >= kills["runs_with_unknown_key"]


@pytest.mark.timeout(300)
def test_a_short_demo_with_the_default_share_still_kills_the_gateway() -> None:
    # 5% of 8 runs rounds to 0: the lab kills at least once, or the demo shows nothing.
    result = lab("--runs", "8", "--strategies", "C", "--kill-gateway", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["gateway_kills"]["kills"] >= 1


def test_the_table_names_every_strategy_and_its_figures() -> None:
    result = lab("--runs", "4", "--seed", "3", "--strategies", "AC")
    assert result.returncode == 0, result.stderr
    assert "restart from step 1" in result.stdout
    assert "checkpoint + stable keys via oncegate" in result.stdout
    assert "steps redone" in result.stdout and "action twice" in result.stdout


def test_a_plot_that_is_not_svg_is_refused_before_anything_runs() -> None:
    result = lab("--runs", "1", "--plot", "chart.png")
    assert result.returncode == 2 and "SVG" in result.stderr
