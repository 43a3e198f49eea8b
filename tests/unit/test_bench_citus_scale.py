"""`bench/citus_scale.py`'s verdict: PASS or FAIL on the median of an odd number of rounds' ratios,
each against the same round's one server, and only where every node was held to the quota and
the nodes that carry the writes were bound at it; a cluster with its coordinator unlimited, or a
round whose one server or a worker fell short of its quota, prints its ratio and `n/a`. docs/
scaling.md quotes these lines, so they must follow the figures."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import citus_scale as bench

TWO = "Citus, 2 workers (4 shards)"
QUOTA = 0.1


def result(
    target: str, round_: int, pairs: float, share: float = 0.95, load: float = 0.3,
    coordinator_quota: float | None = QUOTA,
) -> bench.Result:  # fmt: skip
    """A run whose writing nodes used `share` of their quota (the coordinator 2% of its own)."""
    if target == bench.SINGLE:
        nodes = [("coordinator", QUOTA, share * QUOTA, 0.9)]
    else:
        coordinator = ("coordinator", coordinator_quota, 0.002, 0.0)
        workers = [(f"worker{n}", QUOTA, share * QUOTA, 0.9) for n in (1, 2)]
        nodes = [coordinator, *workers]
    return bench.Result(target, round_, pairs, nodes, load, 0, {})


def rounds(*cluster: float, single: float = 1000.0, **options: float) -> list[bench.Result]:
    found = []
    for round_, pairs in enumerate(cluster, start=1):
        found.append(result(bench.SINGLE, round_, single))
        found.append(result(TWO + bench.AT_QUOTA, round_, pairs, **options))
    return found


def test_the_verdict_is_the_median_rounds_ratio() -> None:
    # A first round at 4.3x (the one server slow on its fresh table) does not carry the verdict.
    assert bench.verdicts(rounds(4300.0, 1690.0, 1600.0)) == [
        f"FAIL {TWO}{bench.AT_QUOTA} >= 1.7x one server: 1.69x (median of 3 rounds)"
    ]
    assert bench.verdicts(rounds(1600.0, 1750.0, 1800.0))[0].startswith("PASS")


def test_each_ratio_is_against_its_own_rounds_one_server() -> None:
    measured = [
        result(bench.SINGLE, 1, 500.0), result(TWO + bench.AT_QUOTA, 1, 1000.0),
        result(bench.SINGLE, 2, 1000.0), result(TWO + bench.AT_QUOTA, 2, 1000.0),
        result(bench.SINGLE, 3, 1000.0), result(TWO + bench.AT_QUOTA, 3, 1800.0),
    ]  # fmt: skip
    assert bench.ratios(measured)[TWO + bench.AT_QUOTA] == [2.0, 1.0, 1.8]
    assert bench.verdicts(measured)[0].startswith("PASS")


def test_a_cluster_with_its_coordinator_unlimited_gets_no_verdict() -> None:
    measured = [
        *rounds(1800.0, 1800.0, 1800.0),
        *(result(TWO + bench.UNLIMITED, n, 4000.0, coordinator_quota=None) for n in (1, 2, 3)),
    ]
    lines = bench.verdicts(measured)
    assert lines[0].startswith(f"PASS {TWO}{bench.AT_QUOTA}")
    assert lines[1] == (
        f"n/a {TWO}{bench.UNLIMITED} >= 1.7x one server: 4.00x (median of 3 rounds);"
        " no verdict: the coordinator unlimited, not every node at the quota"
    )


def test_a_worker_short_of_its_quota_in_any_round_leaves_no_verdict() -> None:
    measured = rounds(1800.0, 1800.0, 1800.0)
    measured[3] = result(TWO + bench.AT_QUOTA, 2, 1800.0, share=0.6)
    line = bench.verdicts(measured)[0]
    assert line.startswith("n/a")
    assert line.endswith("no verdict: round 2: the worker1 at 60% of its quota")


def test_the_one_server_short_of_its_quota_leaves_no_verdict() -> None:
    measured = rounds(1800.0, 1800.0, 1800.0)
    measured[4] = result(bench.SINGLE, 3, 1000.0, share=0.5)
    assert bench.verdicts(measured)[0].endswith("round 3: the coordinator at 50% of its quota")


def test_a_load_side_at_its_limit_leaves_no_verdict() -> None:
    line = bench.verdicts(rounds(1800.0, 1800.0, 1800.0, load=0.9))[0]
    assert line.endswith("no verdict: round 1: the load side bound (0.90 cores)")


@pytest.mark.parametrize("text", ["0", "2", "4", "-1"])
def test_the_rounds_are_an_odd_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        bench.odd_rounds(text)
    assert bench.odd_rounds("3") == 3


def test_each_round_rotates_the_order_of_the_targets() -> None:
    targets = ["one server", "2 workers at quota", "2 workers unlimited"]
    orders = [bench.citus_pairs.in_order(targets, round_) for round_ in (1, 2, 3, 4)]
    assert orders == [
        targets,
        ["2 workers at quota", "2 workers unlimited", "one server"],
        ["2 workers unlimited", "one server", "2 workers at quota"],
        targets,
    ]
    # Over as many rounds as targets, each target runs first once.
    assert sorted(order[0] for order in orders[:3]) == sorted(targets)


def test_a_run_an_autovacuum_fell_in_leaves_no_verdict() -> None:
    # Autovacuum is off on the bench's servers; one that ran anyway took a node's quota inside
    # the run, so that round's comparison is not the one the target names.
    measured = rounds(1800.0, 1800.0, 1800.0)
    measured[2].autovacuums = 2
    line = bench.verdicts(measured)[0]
    assert line.startswith("n/a")
    assert line.endswith("no verdict: round 2: 2 autovacuum runs during the run")


def test_the_vacuum_after_a_run_is_shown_per_pair_it_wrote() -> None:
    measured = rounds(1800.0)
    measured[0].written, measured[0].vacuum = 20_000, 0.2
    row = bench.table(measured).splitlines()[2]
    assert "| 0.010 |" in row
    assert "| - |" in bench.table(measured).splitlines()[3]  # not vacuumed: nothing to show
