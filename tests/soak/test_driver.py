"""The soak driver's own parts that a volume run leans on: the deadline that a request cap ends
early (and the fault injectors with it), and the CPU of every process it reaps, by kind.

Real processes, real timers; no assertion on how long anything took."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import psutil

from tests.soak import usage
from tests.soak.driver import Child, Deadline, progress


async def test_the_request_cap_ends_the_chaos_and_wakes_the_fault_injectors() -> None:
    deadline = Deadline(time.monotonic() + 3600, requests=100)
    assert not deadline.over(99)
    # A fault injector asleep until its next fault (an hour away) is woken by the cap, told to
    # stop, and every later pause returns at once.
    sleeper = asyncio.create_task(deadline.pause(3600))
    await asyncio.sleep(0)
    assert not sleeper.done()
    assert deadline.over(100)
    assert await asyncio.wait_for(sleeper, timeout=60) is False
    assert await deadline.pause(3600) is False
    assert deadline.over(0), "once capped, the chaos stays over"


async def test_without_a_cap_the_time_alone_ends_the_chaos() -> None:
    deadline = Deadline(time.monotonic() + 3600)
    assert not deadline.over(10**9)
    assert await deadline.pause(0.01) is True
    passed = Deadline(time.monotonic() - 1)
    assert passed.over(0)
    # The time being up does not stop a pause early: a fault due before the end still comes.
    assert await passed.pause(0.01) is True


async def test_a_reaped_process_s_cpu_is_counted_under_its_kind(tmp_path: Path) -> None:
    ledger = usage.Ledger()
    busy = Child(
        [sys.executable, "-c", "sum(i * i for i in range(3_000_000))"],
        tmp_path / "busy.log", kind="upstream", ledger=ledger,
    )  # fmt: skip
    assert await busy.wait(120)
    assert busy.popen.returncode == 0
    assert not busy.alive()  # asked again: reaped once, counted once
    busy.end()
    assert ledger.processes == {"upstream": 1}
    assert ledger.seconds["upstream"] > 0.0


async def test_a_killed_process_is_counted_and_reported_as_killed(tmp_path: Path) -> None:
    ledger = usage.Ledger()
    sleeper = Child(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        tmp_path / "sleeper.log", kind="gateways", ledger=ledger,
    )  # fmt: skip
    assert sleeper.alive()
    assert not await sleeper.wait(0.1)
    sleeper.signal(signal.SIGKILL)
    assert await sleeper.wait(60)
    assert sleeper.popen.returncode == -signal.SIGKILL
    sleeper.end()  # ending one already gone is a no-op
    assert ledger.processes == {"gateways": 1}
    assert "gateways" in ledger.seconds


async def test_end_stops_a_frozen_process(tmp_path: Path) -> None:
    ledger = usage.Ledger()
    frozen = Child(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        tmp_path / "frozen.log", kind="gateways", ledger=ledger,
    )  # fmt: skip
    frozen.signal(signal.SIGSTOP)
    await asyncio.to_thread(frozen.end)
    assert not frozen.alive()
    assert frozen.popen.returncode == -signal.SIGTERM
    assert ledger.processes == {"gateways": 1}


async def test_a_process_s_children_are_read_from_the_kernel_s_list(tmp_path: Path) -> None:
    ledger = usage.Ledger()
    sleepers = [
        Child([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / f"{index}.log",
              kind="gateways", ledger=ledger)
        for index in range(2)
    ]  # fmt: skip
    try:
        me = psutil.Process()
        found = {child.pid for child in usage.children_of(me)}
        assert {sleeper.popen.pid for sleeper in sleepers} <= found
        assert found == {child.pid for child in me.children()}
    finally:
        for sleeper in sleepers:
            sleeper.end()


def test_a_long_run_says_how_far_it_is() -> None:
    assert progress(600, 123_456, 3.25) == (
        "soak: 10 min into the chaos, 123,456 requests (206/s), load 3.2"
    )
    assert progress(0, 0, 0.0) == "soak: 0 min into the chaos, 0 requests (0/s), load 0.0"
