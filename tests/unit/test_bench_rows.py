"""`bench/run.py --rows`: the main tables' rows to measure, by name, at every level each has;
without it every row, as before."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import run as bench


def parsed(monkeypatch: pytest.MonkeyPatch, *argv: str) -> argparse.Namespace:
    monkeypatch.setattr(sys, "argv", ["run.py", *argv])
    return bench.parse_arguments()


def test_rows_named_are_measured_at_each_level_they_have(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = bench.main_plan(parsed(monkeypatch, "--rows", "bare-proxy,oncegate-mix-80-20"))
    assert plan == [(bench.BARE, 64), (bench.MIX, 64), (bench.BARE, 1), (bench.MIX, 1)]
    two = bench.main_plan(parsed(monkeypatch, "--rows", "oncegate-replay-2-workers"))
    assert two == [(bench.REPLAY_2, 64)]


def test_without_rows_every_row_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = bench.main_plan(parsed(monkeypatch, "--baseline", "."))
    rows = [*bench.MAIN, *bench.BASELINE, *bench.TWO_WORKERS]
    assert plan == [(row, 64) for row in rows] + [
        (row, 1) for row in (*bench.LATENCY, bench.BASE_FORWARD)
    ]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--rows", "oncegate-replay,no-such-row"], "no row no-such-row"),
        (["--rows", "baseline-forward"], "measured with --baseline DIR"),
    ],
)
def test_a_row_that_cannot_be_measured_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    with pytest.raises(SystemExit):
        parsed(monkeypatch, *argv)
    assert said in capsys.readouterr().err
