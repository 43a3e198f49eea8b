"""`oncegate lab` end to end: its own PostgreSQL, gateway and demo upstream, real SIGKILLs.

A small run checks the shape of contract section 8: restarting repeats actions, checkpoints
alone repeat the ones caught in the gap, checkpoints with keys through the gateway repeat and
lose nothing, and saving first loses instead of repeating. Runs with crash points fixed by hand
check the wasted and checkpoint columns, and the late resumes, against figures worked out here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from oncegate.lab import crashlab, model, report, stack
from oncegate.lab.model import Crash

pytestmark = pytest.mark.slow
FIGURES = {
    "redone_avg",
    "duplicate_runs_pct",
    "lost_runs_pct",
    "wasted_tokens_avg",
    "wasted_seconds_avg",
    "checkpoint_seconds_avg",
}


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
        assert set(figures) == FIGURES
    a, b, c, d = (strategies[name] for name in "ABCD")
    assert a["duplicate_runs_pct"] > 20 and a["redone_avg"] > 2
    assert c["duplicate_runs_pct"] == 0 and c["lost_runs_pct"] == 0
    assert b["lost_runs_pct"] == 0 and d["duplicate_runs_pct"] == 0
    # Same crashes for every strategy: what B repeats, D loses and C neither.
    assert b["duplicate_runs_pct"] == d["lost_runs_pct"]
    assert b["redone_avg"] == c["redone_avg"]
    assert b["wasted_tokens_avg"] == c["wasted_tokens_avg"] < a["wasted_tokens_avg"]
    assert a["checkpoint_seconds_avg"] == 0 < d["checkpoint_seconds_avg"]
    assert "runs" in result.stderr  # the progress bar
    assert "oncegate lab: too few runs to measure B's gap" in result.stderr
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
    assert "wasted tokens" in result.stdout and "checkpoint s" in result.stdout


def test_a_run_too_small_for_b_s_gap_says_so_and_how_many_runs_would_do() -> None:
    result = lab("--runs", "4", "--seed", "3", "--strategies", "BC")
    assert result.returncode == 0, result.stderr
    assert "too few runs to measure B's gap" in result.stdout
    assert "show none 86% of the time" in result.stdout  # 0.9625 ** 4
    assert "--runs 121 shows the gap" in result.stdout and "--runs 888 puts" in result.stdout
    # Enough runs for a figure, or no B to measure: nothing to say.
    assert model.too_few_runs(model.runs_for_a_figure()) is None
    assert model.too_few_runs(model.runs_for_a_figure() - 1) is not None
    assert model.too_few_runs(1000) is None
    assert "too few runs" not in lab("--runs", "1", "--strategies", "AC").stdout


def test_a_plot_that_is_not_svg_is_refused_before_anything_runs() -> None:
    result = lab("--runs", "1", "--plot", "chart.png")
    assert result.returncode == 2 and "SVG" in result.stderr


def test_help_states_the_invented_costs_and_what_they_make_the_model_expect() -> None:
    result = lab("--help")
    assert result.returncode == 0, result.stderr
    assert "invented" in result.stdout
    assert re.search(r"5 read-logs +3,400 tokens +4\.6 s", result.stdout)
    assert re.search(r"A +14,352 tokens +18\.26 s wasted", result.stdout)


def test_a_late_resume_needs_the_labs_own_gateway() -> None:
    result = lab("--late-resume", "--gateway", "http://127.0.0.1:9", "--upstream", "http://x:1")
    assert result.returncode == 2 and "--late-resume needs the lab's own gateway" in result.stderr


def fixed_lab(
    database_url: str, crashes: list[Crash], strategies: str = "ABCD", late_resume: bool = False
) -> report.Outcome:
    """The lab on crash points chosen by hand (its own gateway and upstream, this module's
    database)."""
    with stack.running(database_url, None, None) as services:
        lab = crashlab.Lab(
            services,
            runs=len(crashes),
            seed=0,
            strategies=strategies,
            late_resume=late_resume,
            crashes=crashes,
            jobs=2,
        )
        outcome = lab.run()
    assert outcome.failures == []
    return outcome


@pytest.mark.timeout(240)
def test_the_wasted_and_checkpoint_columns_match_the_costs_worked_out_by_hand(
    database_url: str,
) -> None:
    # Run 1 crashes half-way into step 5 (read-logs, 3,400 tokens, 4.6 s); run 2 in the gap
    # after step 7's action (open-ticket, 1,600 tokens, 1.6 s), so step 7 had finished.
    outcome = fixed_lab(database_url, [Crash(5, False, 0.5), Crash(7, True, 0.9)])
    figures = outcome.strategies
    # A redoes steps 1-4 (2,900 + 2,200 + 2,400 + 1,800 = 9,300 tokens; 3.8 + 3.0 + 3.2 + 1.8 =
    # 11.8 s) and half of step 5 (1,700; 2.3 s) in run 1: 11,000 and 14.1 s; steps 1-7 in run 2
    # (9,300 + 3,400 + 2,600 + 1,600 = 16,900; 11.8 + 4.6 + 3.4 + 1.6 = 21.4 s).
    assert figures["A"].wasted_tokens_avg == pytest.approx((11_000 + 16_900) / 2)
    assert figures["A"].wasted_seconds_avg == pytest.approx((14.1 + 21.4) / 2)
    # B and C lose half of step 5 in run 1 and redo step 7 in run 2.
    for name in "BC":
        assert figures[name].wasted_tokens_avg == pytest.approx((1_700 + 1_600) / 2)
        assert figures[name].wasted_seconds_avg == pytest.approx((2.3 + 1.6) / 2)
    # D saved step 7 before its action: nothing redone in run 2 (the ticket is lost instead).
    assert figures["D"].wasted_tokens_avg == pytest.approx(1_700 / 2)
    assert figures["D"].wasted_seconds_avg == pytest.approx(2.3 / 2)
    assert figures["D"].lost_runs_pct == 50.0
    # Checkpoints: none for A; B and C save each of the 12 steps and each of the 3 actions'
    # parameters before sending it, whatever the crash (15 x 40 ms); D saves the 12 steps only.
    assert figures["A"].checkpoint_seconds_avg == 0.0
    assert figures["B"].checkpoint_seconds_avg == figures["C"].checkpoint_seconds_avg == 0.6
    assert figures["D"].checkpoint_seconds_avg == 0.48
    assert (figures["A"].redone_avg, figures["B"].redone_avg) == (5.5, 0.5)


@pytest.mark.timeout(240)
def test_a_late_resume_duplicates_without_the_age_check_and_stops_with_it(
    database_url: str,
) -> None:
    # Run 1: killed in the gap after step 4's email was sent; run 2: killed with step 10's
    # charge saved, not sent; run 3: killed at step 2, nothing pending.
    crashes = [Crash(4, True), Crash(10, False, 0.3), Crash(2, False, 0.5)]
    outcome = fixed_lab(database_url, crashes, strategies="", late_resume=True)
    assert list(outcome.strategies) == ["E", "F"]
    unchecked, checked = outcome.strategies["E"], outcome.strategies["F"]
    # E resends run 1's email after the gateway forgot its key: performed again.
    assert unchecked.duplicate_runs_pct == pytest.approx(100 / 3, abs=0.01)
    assert unchecked.lost_runs_pct == 0
    # F stops runs 1 and 2; the lab marks run 1's email done from the upstream's records and
    # allows run 2's charge, which was never performed, to be sent: nothing twice, nothing lost.
    assert checked.duplicate_runs_pct == 0 and checked.lost_runs_pct == 0
    assert outcome.late is not None
    assert outcome.late["F"] == {
        "runs_left_pending": 2,
        "runs_stopped": 2,
        "marked_done": 1,
        "resent": 1,
    }
    assert outcome.late["E"]["runs_stopped"] == 0
    assert outcome.late["key_ttl_seconds"] < outcome.late["resumed_after_seconds"]


@pytest.mark.timeout(300)
def test_late_resume_adds_its_two_rows_to_the_json_and_the_chart(tmp_path: Path) -> None:
    chart = tmp_path / "late.svg"
    result = lab(
        "--runs", "6", "--seed", "11", "--strategies", "C", "--late-resume", "--json",
        "--plot", str(chart),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert list(document["strategies"]) == ["C", "E", "F"]
    checked = document["strategies"]["F"]
    assert set(checked) == FIGURES
    assert checked["duplicate_runs_pct"] == 0 and checked["lost_runs_pct"] == 0
    late = document["late_resume"]
    assert late["F"]["runs_stopped"] == late["F"]["runs_left_pending"]
    assert late["F"]["marked_done"] + late["F"]["resent"] == late["F"]["runs_stopped"]
    drawing = chart.read_text()
    for title in ("tokens wasted (avg per run", "seconds wasted / saving checkpoints"):
        assert title in drawing
    assert "F: E with the key-age check" in drawing
    assert f">{checked['wasted_tokens_avg']:,.0f}</text>" in drawing
