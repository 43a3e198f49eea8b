"""The zero-configuration default: `oncegate serve` with no database URL runs its own PostgreSQL,
keeps its data across restarts, survives a crash of the gateway, and stops the server on exit."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import DemoUpstream, Process, free_port


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Outside pytest's private temporary tree: the server runs as pgserver's own user.
    directory = Path(tempfile.mkdtemp(prefix="oncegate-test-embedded-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def serve(data_dir: Path, upstream: DemoUpstream, log: Path) -> tuple[Process, str]:
    port = free_port()
    process = Process(
        [
            "serve",
            "--upstream",
            upstream.url,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
            "--admin-port",
            str(free_port()),
        ],
        log,
        env={"ONCEGATE_DATABASE_URL": ""},  # empty counts as unset
    )
    process.wait_listening(port)
    return process, f"http://127.0.0.1:{port}"


def postgres_running(data_dir: Path) -> bool:
    pid_file = data_dir / "pgdata" / "postmaster.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text().split()[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_runs_its_own_postgres_across_restarts_and_crashes(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    key = str(uuid.uuid4())
    headers = {"Idempotency-Key": key}

    gateway, url = serve(data_dir, upstream, tmp_path / "first.log")
    try:
        assert httpx.post(url + "/emails", json={}, headers=headers).status_code == 201
        assert postgres_running(data_dir)
    finally:
        gateway.stop()
    assert gateway.wait() == 0
    assert "embedded PostgreSQL running, data in" in gateway.output()
    assert not postgres_running(data_dir)  # the last gateway out stops it

    # Restarted on the same data directory: the key is still there.
    gateway, url = serve(data_dir, upstream, tmp_path / "second.log")
    replay = httpx.post(url + "/emails", json={}, headers=headers)
    assert replay.headers["idempotent-replayed"] == "true"
    gateway.signal(signal.SIGKILL)  # a crash: PostgreSQL is left running
    gateway.stop()
    assert postgres_running(data_dir)

    # After the crash: the leftover server is found and used, and stopped on a clean exit.
    gateway, url = serve(data_dir, upstream, tmp_path / "third.log")
    try:
        replay = httpx.post(url + "/emails", json={}, headers=headers)
        assert replay.headers["idempotent-replayed"] == "true"
    finally:
        gateway.stop()
    assert gateway.wait() == 0
    assert not postgres_running(data_dir)
    assert len(upstream.actions(key)) == 1
