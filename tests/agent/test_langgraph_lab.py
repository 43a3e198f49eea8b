"""`oncegate lab --runtime langgraph` end to end: the 12-step task as a real LangGraph graph,
LangGraph's `PostgresSaver` on the test PostgreSQL (the lab's `--database-url`), the lab's own
gateway and demo upstream, and a real SIGKILL in every run, resumed in a new process.

The lab exits 0 only if every run reached its crash point, was killed there, and its resumed
process finished the task (a worker that ends any other way is a failure, exit 1): so 200 runs
per strategy are 200 killed runs each.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from oncegate.lab.model import draw_crashes
from tests.e2e.test_lab import FIGURES


def lab(
    *args: str, timeout: float = 540, runtime: str = "langgraph"
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "oncegate.cli", "lab", "--runtime", runtime, *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            # Ctrl-C, not a SIGKILL: the lab then stops the gateway and demo upstream it started.
            process.send_signal(signal.SIGINT)
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


# 600 runs, 1,200 agent processes: about half a minute on 2 idle cores; a bound for a busy machine.
# `make test-all`; the table's test below runs the same lab on a few runs in `make test`.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_keys_from_the_task_repeat_nothing_over_200_killed_runs_and_the_saver_alone_does(
    database_url: str,
) -> None:
    runs, seed = 200, 7
    result = lab("--runs", str(runs), "--seed", str(seed), "--json", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    # Contract section 8's shape, as the runner's lab prints it.
    assert set(document) == {"runs", "seed", "strategies"}
    assert (document["runs"], document["seed"]) == (runs, seed)
    assert set(document["strategies"]) == {"A", "B", "C"}
    for figures in document["strategies"].values():
        assert set(figures) == FIGURES
    a, b, c = (document["strategies"][name] for name in "ABC")
    # The crashes that fell in the gap, between an action's answer and LangGraph's write of
    # its step (the same crash points for every strategy).
    gaps = sum(crash.gap for crash in draw_crashes(runs, seed))
    assert gaps > 0
    # C: the resumed task sent its action again with the same key, the gateway replayed it.
    assert c["duplicate_runs_pct"] == 0 and c["lost_runs_pct"] == 0
    # B: LangGraph's saver alone resumes the killed task and performs its action again, once
    # per crash in the gap: the gap exists, so C's zero means something.
    assert b["duplicate_runs_pct"] == 100 * gaps / runs
    assert b["lost_runs_pct"] == 0
    # Both redo exactly the node caught in the gap; A restarts and redoes the most.
    assert b["redone_avg"] == c["redone_avg"] == round(gaps / runs, 3)
    assert a["redone_avg"] > 2 and a["duplicate_runs_pct"] > b["duplicate_runs_pct"]
    assert a["lost_runs_pct"] == 0
    # A saves nothing; B and C save each task's writes and each step's checkpoint.
    assert a["checkpoint_seconds_avg"] == 0 < b["checkpoint_seconds_avg"]


@pytest.mark.timeout(300)
def test_the_table_names_langgraphs_strategies(database_url: str) -> None:
    result = lab("--runs", "3", "--seed", "1", "--database-url", database_url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("crash-recovery lab on LangGraph: 3 runs per strategy, seed 1")
    rows = [line for line in lines if line[:3] in ("A  ", "B  ", "C  ")]
    assert [row.split("  ")[1].strip() for row in rows] == [
        "no checkpointer: start over",
        "PostgresSaver",
        "PostgresSaver + task keys via oncegate",
    ]


def test_what_the_langgraph_runtime_does_not_have_is_refused_before_anything_starts() -> None:
    for args, message in [
        (("--strategies", "BD"), "plays strategies A, B and C, not D"),
        (("--late-resume",), "--kill-gateway and --late-resume are the runner's"),
        (("--kill-gateway",), "--kill-gateway and --late-resume are the runner's"),
    ]:
        result = lab(*args, timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)


def check_tool_calls(runs: int, seed: int, database_url: str) -> None:
    """`--runtime langgraph-tools`: every action a scripted model's tool call, run by a
    `ToolNode`; C keys it by the tool call's id."""
    result = lab("--runs", str(runs), "--seed", str(seed), "--json", "--database-url",
                 database_url, runtime="langgraph-tools")  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert set(document["strategies"]) == {"A", "B", "C"}
    a, b, c = (document["strategies"][name] for name in "ABC")
    gaps = sum(crash.gap for crash in draw_crashes(runs, seed))
    assert gaps > 0
    # The gap is in the tool, between the action's answer and LangGraph's write of the tool
    # step: B performs those actions twice, C replays them.
    assert c["duplicate_runs_pct"] == 0 and c["lost_runs_pct"] == 0
    assert b["duplicate_runs_pct"] == 100 * gaps / runs and b["lost_runs_pct"] == 0
    assert b["redone_avg"] == c["redone_avg"] == round(gaps / runs, 3)
    assert a["duplicate_runs_pct"] > b["duplicate_runs_pct"] and a["lost_runs_pct"] == 0


@pytest.mark.timeout(400)
def test_tool_calls_keyed_by_their_ids_repeat_nothing_over_killed_runs(database_url: str) -> None:
    check_tool_calls(20, 7, database_url)  # 6 of its 20 crashes are in the gap


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tool_calls_keyed_by_their_ids_repeat_nothing_over_200_killed_runs(
    database_url: str,
) -> None:
    check_tool_calls(200, 7, database_url)


@pytest.mark.timeout(300)
def test_the_tool_calling_table_names_its_strategies(database_url: str) -> None:
    result = lab("--runs", "3", "--seed", "1", "--database-url", database_url,
                 runtime="langgraph-tools")  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("crash-recovery lab on LangGraph with tool calls: 3 runs")
    rows = [line for line in lines if line[:3] in ("A  ", "B  ", "C  ")]
    assert rows[-1].startswith("C  PostgresSaver + tool call keys via oncegate ")
    # The columns hold under the longer title.
    header = next(line for line in lines if line.startswith("strategy"))
    assert all(len(row) == len(header) for row in rows), (header, rows)
