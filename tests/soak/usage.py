"""Each gateway's resident memory and open file descriptors over a soak, per slot.

A slot is one gateway name at fixed ports; the driver starts a new process in it after every
kill. The figures are read from /proc through psutil (`measure`) when the chaos begins, every
few seconds during it, and after the probes, so a slot's readings may span many processes:

- `start` is the first reading of the slot's first process (all gateways up, before any
  client); `end` the last reading of the process running in it after the probes; `minute` the
  first reading a minute or more into the chaos (warmed up: pools filled, code paths run);
  `peak` the highest reading of any of its processes.
- `processes` says how many there were: where it is 1 (the deployments' first gateways, never
  signalled, and the fuzzer's gateway) start, minute and end are one process that lived through
  every store failure and reconnect of the run, which is what a leak check needs; elsewhere
  they are different processes, and only `peak` says that none of them grew out of bounds.
"""

from __future__ import annotations

import contextlib
import os
import resource
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

WARM = 60.0  # seconds into the chaos after which a reading counts as warmed up


@dataclass(frozen=True)
class Sample:
    at: float  # wall clock
    pid: int
    rss: int  # bytes
    fds: int


def measure(pid: int) -> Sample | None:
    """One reading of process `pid`, or None if it is gone."""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        with process.oneshot():
            return Sample(time.time(), pid, process.memory_info().rss, process.num_fds())
    return None


def postgres_cpu_seconds(pid: int) -> float | None:
    """CPU time used so far by PostgreSQL's postmaster `pid`, the backends it reaped and those
    still alive, or None if it is gone (or the PID is no PostgreSQL's any more)."""
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        if not process.name().startswith("postgres"):
            return None
        times = process.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in children_of(process):
            with contextlib.suppress(psutil.Error):
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
        return total
    return None


def children_of(process: psutil.Process) -> list[psutil.Process]:
    """A postmaster's children (its backends and workers: PostgreSQL's processes are all its
    direct children), from the kernel's own list of them, which costs one read; psutil's
    `children()` reads every process of the machine to find them (a tenth of the soak process's
    CPU, read every 15 s for six servers on a busy machine), so it is only the fallback."""
    try:
        listed = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text()
    except OSError:
        return process.children()
    found = []
    for pid in listed.split():
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(int(pid)))
    return found


def report(
    slots: Sequence[tuple[str, int, Sequence[Sample]]], start: float
) -> list[dict[str, Any]]:
    """One row per slot (name, processes started in it, its readings), `start` being the wall
    clock at which the chaos began."""
    rows = []
    for name, processes, samples in slots:
        if not samples:
            rows.append({"gateway": name, "processes": processes})
            continue
        warm = next((sample for sample in samples if sample.at >= start + WARM), None)
        first, last = samples[0], samples[-1]
        rows.append(
            {
                "gateway": name,
                "processes": processes,
                "one_process": first.pid == last.pid and processes == 1,
                "rss_start": first.rss,
                "rss_minute": warm.rss if warm else None,
                "rss_end": last.rss,
                "rss_peak": max(sample.rss for sample in samples),
                "fds_start": first.fds,
                "fds_minute": warm.fds if warm else None,
                "fds_end": last.fds,
                "fds_peak": max(sample.fds for sample in samples),
                "readings": len(samples),
            }
        )
    return rows


def render(rows: Sequence[dict[str, Any]]) -> str:
    def mib(value: int | None) -> str:
        return "-" if value is None else f"{value / 2**20:.1f}"

    def count(value: int | None) -> str:
        return "-" if value is None else str(value)

    lines = [
        "| gateway | processes | RSS MiB start / 1 min / end (peak) "
        "| fds start / 1 min / end (peak) |",
        "|---|---|---|---|",
    ]
    for row in rows:
        if "rss_start" not in row:
            lines.append(f"| {row['gateway']} | {row['processes']} | - | - |")
            continue
        lines.append(
            f"| {row['gateway']} | {row['processes']} | {mib(row['rss_start'])} / "
            f"{mib(row['rss_minute'])} / {mib(row['rss_end'])} ({mib(row['rss_peak'])}) | "
            f"{count(row['fds_start'])} / {count(row['fds_minute'])} / {count(row['fds_end'])} "
            f"({count(row['fds_peak'])}) |"
        )
    return "\n".join(lines)


@dataclass
class Ledger:
    """The CPU of the processes the soak started and reaped itself, by kind (`gateway`,
    `upstream`, `fuzzer`): each one's own and its children's, read from `wait4` when it is
    reaped, and how many of each kind there were."""

    seconds: dict[str, float] = field(default_factory=dict)
    processes: dict[str, int] = field(default_factory=dict)
    # CPU a gateway used from its start until it listened (imports, pools, routes), summed over
    # the starts read.
    start_seconds: float = 0.0
    starts: int = 0

    def started(self, pid: int) -> None:
        """Gateway `pid` just began to listen: what its start cost."""
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            self.start_seconds += times.user + times.system
            self.starts += 1

    def add(self, kind: str, rusage: resource.struct_rusage) -> None:
        used = rusage.ru_utime + rusage.ru_stime
        self.seconds[kind] = self.seconds.get(kind, 0.0) + used
        self.processes[kind] = self.processes.get(kind, 0) + 1


@dataclass
class Meter:
    """The CPU the soak's processes use during a run, and the machine's load beside it.

    The soak's own process (the clients, the histories) and every process it started and reaped
    (gateways, the upstream, the fuzzer, the PostgreSQL tools) by `getrusage`; the PostgreSQL
    servers, which `pg_ctl` detaches, by their postmasters' readings (`postgres_cpu_seconds`),
    the last one of each: a postmaster SIGKILLed loses what it used after its last reading."""

    ledger: Ledger = field(default_factory=Ledger)
    postgres: dict[int, float] = field(default_factory=dict)
    baseline: dict[int, float] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)
    began: tuple[float, float] = (0.0, 0.0)

    def begin(self, postmasters: Sequence[int]) -> None:
        self.began = (_used(resource.RUSAGE_SELF), _used(resource.RUSAGE_CHILDREN))
        self.read(postmasters)
        self.baseline = dict(self.postgres)

    def read(self, postmasters: Sequence[int]) -> None:
        self.loads.append(os.getloadavg()[0])
        for pid in postmasters:
            seconds = postgres_cpu_seconds(pid)
            if seconds is not None:
                self.postgres[pid] = max(self.postgres.get(pid, 0.0), seconds)

    def figures(self, requests: int) -> dict[str, Any]:
        """After every process the soak started ended (reaped) and the last `read`. `parts`
        splits the reaped processes' CPU by kind; `tools` is the rest of it (`pg_ctl`,
        `pg_rewind`, `pg_basebackup`, `psql`, ...), and of the processes started before the
        chaos began, their CPU before it too (a gateway's start, the upstream's)."""
        driver = _used(resource.RUSAGE_SELF) - self.began[0]
        children = _used(resource.RUSAGE_CHILDREN) - self.began[1]
        postgres = sum(
            seconds - self.baseline.get(pid, 0.0) for pid, seconds in self.postgres.items()
        )
        total = driver + children + postgres
        parts = {kind: seconds for kind, seconds in sorted(self.ledger.seconds.items())}
        return {
            "parts": parts,
            "part_processes": dict(sorted(self.ledger.processes.items())),
            "tools_seconds": max(0.0, children - sum(parts.values())),
            "gateway_start_seconds": self.ledger.start_seconds,
            "gateway_starts": self.ledger.starts,
            "driver_seconds": driver,
            "processes_seconds": children,
            "postgres_seconds": postgres,
            "total_seconds": total,
            "ms_per_request": 1000 * total / requests if requests else 0.0,
            "load_mean": statistics.fmean(self.loads) if self.loads else 0.0,
            "load_max": max(self.loads, default=0.0),
        }


def _used(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime
