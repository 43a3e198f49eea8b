"""What a gateway's start costs: the CPU of `oncegate serve` from exec until it answers, per start.

Every restart pays it (a crash, a deploy, a chaos soak's signals), and so does each process of
`serve --workers N` for what it does after the fork. The script starts an embedded PostgreSQL
(migrated) in a temporary directory, then starts `oncegate serve --upstream ... ` on it again
and again, on free loopback ports, and for each start reads:

- the CPU the process used (utime + stime in `/proc/<pid>/stat`) when its admin port first
  answers `GET /healthz`: imports, settings, the schema check, the pools, the applications. The
  request is sent once, right after the exec; the socket is bound early in the start, so the
  request waits in its backlog until the servers serve, and the answer marks the end of the
  start (that one request is counted too: well under a millisecond);
- the wall time from exec to that answer.

Then the process is stopped (SIGTERM) and the next one started. With `--baseline DIR`, the
gateway of another checkout (`DIR/.venv/bin/python -m oncegate.cli serve`, run from `DIR`) is
started in turn with this one, on a database of its own in the same server migrated by its own
`oncegate migrate`: a change measured against what it changes, in one run, the starts
interleaved so a drift of the machine spreads over both.

    .venv/bin/python bench/gateway_start.py [--starts 8] [--baseline DIR] [--keep]

Design rules:
- The figures are CPU seconds, not wall time: on a shared machine a start waits for a core, but
  the CPU it needs is the same. Quote the machine's load beside them anyway (printed).
- Every process is stopped by PID, SIGTERM then SIGKILL (`quick.stop`), whatever happens.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import quick  # bench/, on the path of a script run from it

START_TIMEOUT = 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# One start per gateway before those counted, with bytecode writing allowed whatever the caller's
# PYTHONDONTWRITEBYTECODE says: an installed gateway starts from compiled modules, and a checkout
# whose modules are compiled on every start would count the compiler (about a tenth of a start).
WARM_UP = 1
# Nothing listens there: no request is forwarded during a start.
UPSTREAM = "http://127.0.0.1:9"


@dataclass
class Target:
    name: str
    slug: str  # in its log files' names
    python: Path
    cwd: Path
    database_url: str
    cpu_seconds: list[float] = field(default_factory=list)
    wall_seconds: list[float] = field(default_factory=list)


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` (its own, not its children's: `serve` with one worker has none)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def await_health(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    """Until the admin port answers GET /healthz: one request, sent as soon as the port
    accepts (it is bound early, so the request waits in the backlog until the server serves)."""
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{shlex.join(map(str, process.args))} exited:\n{quick.tail(log)}")
        try:
            with socket.create_connection((quick.HOST, port), timeout=START_TIMEOUT) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                answer = sock.recv(64)
        except OSError:
            time.sleep(0.005)  # not bound yet
            continue
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"/healthz answered {answer!r}:\n{quick.tail(log)}")
        return
    raise RuntimeError(f"no answer on port {port} after {START_TIMEOUT:.0f}s:\n{quick.tail(log)}")


def start_once(target: Target, work: Path, number: int, *, counted: bool = True) -> None:
    port, admin_port = quick.free_port(), quick.free_port()
    environment = quick.server_environment(work / "unused-data")
    environment["ONCEGATE_DATABASE_URL"] = target.database_url
    environment.pop("PYTHONDONTWRITEBYTECODE", None)  # see WARM_UP
    command = [
        str(target.python),
        "-m",
        "oncegate.cli",
        "serve",
        "--upstream",
        UPSTREAM,
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
    ]
    log = work / f"{target.slug}-{number}.log"
    started: list[subprocess.Popen[bytes]] = []
    began = time.monotonic()
    try:
        process = quick.start(command, log, environment, started, cwd=target.cwd)
        await_health(process, admin_port, log)
        wall = time.monotonic() - began
        if counted:
            target.cpu_seconds.append(cpu_seconds(process.pid))
            target.wall_seconds.append(wall)
    finally:
        for process in started:
            quick.stop(process)


@contextmanager
def targets(arguments: argparse.Namespace, work: Path) -> Iterator[list[Target]]:
    with quick.embedded_postgres("oncegate-bench-start-", keep=arguments.keep) as server:
        this = Target("this checkout", "this", Path(sys.executable), quick.ROOT, server.url)
        found = [this]
        if arguments.baseline is not None:
            directory = arguments.baseline.resolve()
            python = directory / ".venv" / "bin" / "python"
            url = quick.checkout_database(server.url, "baseline", directory, work, START_TIMEOUT)
            found.append(Target(f"baseline {directory}", "baseline", python, directory, url))
        yield found


def summary(values: list[float], digits: int = 3) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def report(found: list[Target], arguments: argparse.Namespace, loads: tuple[str, str]) -> str:
    lines = [
        f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}",
        f"machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, kernel {platform.release()}; "
        f"load average before {loads[0]}, after {loads[1]}",
        "",
        "| gateway | starts | CPU s per start, median (min-max) | wall s to /healthz | "
        "CPU / baseline |",
        "|---|---|---|---|---|",
    ]
    baseline = statistics.median(found[-1].cpu_seconds) if len(found) > 1 else None
    for target in found:
        ratio = (
            f"{statistics.median(target.cpu_seconds) / baseline:.2f}x"
            if baseline is not None
            else "-"
        )
        lines.append(
            f"| {target.name} | {len(target.cpu_seconds)} | {summary(target.cpu_seconds)} | "
            f"{summary(target.wall_seconds, 2)} | {ratio} |"
        )
    return "\n".join(lines)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=8, help="starts per gateway (8)")
    parser.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="another checkout with its own .venv, started in turn with this one",
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs and the database")
    arguments = parser.parse_args()
    if arguments.starts < 1:
        parser.error("--starts must be at least 1")
    work = quick.work_directory("oncegate-bench-start-logs-")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop by `finally`, not abruptly
    before = load_average()
    try:
        with targets(arguments, work) as found:
            for target in found:
                for number in range(WARM_UP):
                    start_once(target, work, -1 - number, counted=False)
            for number in range(arguments.starts):
                for target in found:
                    start_once(target, work, number)
                print(f"start {number + 1} of {arguments.starts} done", file=sys.stderr)
    except BaseException:
        print(f"logs kept: {work}", file=sys.stderr)  # what the failed start said
        raise
    print(report(found, arguments, (before, load_average())))
    if not arguments.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"logs kept: {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
