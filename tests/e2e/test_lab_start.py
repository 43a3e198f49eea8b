"""`oncegate lab` whose own services cannot start: one paragraph saying which and why, a
non-zero exit, nothing the lab was handed in secret in it, and every process it started
stopped (a real gateway, a real demo upstream, a real busy port and an unreachable database).
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from oncegate.lab import stack
from tests.helpers import free_port


def started_by_the_lab(marker: str) -> list[int]:
    """The processes alive whose environment holds `marker` (the lab's TMPDIR, which every
    process it starts inherits)."""
    found = []
    for process in psutil.process_iter():
        try:
            if marker in process.environ().values():
                found.append(process.pid)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def oncegate_children() -> list[int]:
    """This process's children that run an `oncegate` command, or ended and were never waited
    for (a zombie: its command line is gone)."""
    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "oncegate" in " ".join(child.cmdline()):
                left.append(child.pid)
        except psutil.ZombieProcess:
            left.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return left


def test_a_database_the_labs_gateway_cannot_reach_ends_in_one_paragraph(tmp_path: Path) -> None:
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    closed = free_port()  # nothing listens there
    url = f"postgresql://postgres:lab-secret-password@127.0.0.1:{closed}/oncegate"
    result = subprocess.run(
        [sys.executable, "-m", "oncegate.cli", "lab", "--runs", "1", "--database-url", url],
        env={**os.environ, "TMPDIR": str(temporary)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr  # the gateway's: PostgreSQL unreachable
    assert "Traceback" not in result.stderr and result.stdout == "", result.stderr
    [said] = result.stderr.splitlines()
    assert said.startswith("oncegate lab: the lab's gateway did not start"), said
    assert "cannot connect to PostgreSQL: no server is listening there" in said, said
    assert said.endswith("everything the lab started is stopped"), said
    assert "lab-secret-password" not in said
    assert started_by_the_lab(str(temporary)) == []  # its demo upstream too
    assert list(temporary.iterdir()) == []  # its directory removed


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process holds (bound, not listening: a connection there is refused, as
    to a port nobody holds, and a bind fails)."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def test_a_port_taken_under_the_labs_gateway_is_said_and_nothing_is_left(
    database_url: str, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ports = itertools.chain([taken_port], iter(free_port, None))
    monkeypatch.setattr(stack, "free_port", lambda: next(ports))
    with (
        pytest.raises(stack.NotStarted) as raised,
        stack.running(database_url, "http://127.0.0.1:9", None),
    ):
        pass
    assert raised.value.status == 2  # the gateway's: a busy port is a configuration mistake
    message = str(raised.value)
    assert message.startswith("the lab's gateway did not start (it exited with status 2)")
    assert f"cannot listen on 127.0.0.1:{taken_port}" in message
    assert oncegate_children() == []


def test_a_gateway_still_starting_at_the_deadline_is_stopped(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stack, "STARTUP_TIMEOUT", 0.0)
    with (
        pytest.raises(stack.NotStarted) as raised,
        stack.running(database_url, "http://127.0.0.1:9", None),
    ):
        pass
    assert raised.value.status is None
    assert "it was not listening within 0 s, and was stopped" in str(raised.value)
    assert oncegate_children() == []
