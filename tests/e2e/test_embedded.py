"""The zero-configuration default: `oncegate serve` with no database URL runs its own PostgreSQL,
keeps its data across restarts, survives a crash of the gateway or of PostgreSQL itself, stops
the server on exit, and never opens a directory it did not create to other users."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import STARTUP_TIMEOUT, DemoUpstream, Process
from tests.helpers import free_port

RECOVERY_TIMEOUT = 60.0  # a deadline for a restart to be seen, never a measured time


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Outside pytest's private temporary tree, and opened by the test that made it: as root the
    # server runs as pgserver's own user, which must be able to reach it.
    directory = Path(tempfile.mkdtemp(prefix="oncegate-test-embedded-"))
    directory.chmod(0o755)
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


def postmaster(data_dir: Path) -> int | None:
    """The PID of the live postmaster of `data_dir` (a zombie is not alive), or None."""
    pid_file = data_dir / "pgdata" / "postmaster.pid"
    if not pid_file.exists():
        return None
    pid = int(pid_file.read_text().split()[0])
    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    return pid


def flush(url: str) -> None:
    """Make the answers stored so far survive a kill of PostgreSQL. They are committed without
    waiting for the WAL flush (the store's design: a lost one turns `unknown`, never forwarded
    twice); a new key's claim commits synchronously, which flushes the WAL up to it."""
    answer = httpx.post(url + "/emails", json={}, headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 201


def test_migrate_on_the_embedded_database_logs_each_migration_once(data_dir: Path) -> None:
    def migrate() -> str:
        done = subprocess.run(
            [sys.executable, "-m", "oncegate.cli", "migrate"],
            env={**os.environ, "ONCEGATE_DATABASE_URL": "",
                 "ONCEGATE_DATA_DIR": str(data_dir / "data")},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "database is at schema revision" in done.stdout
        return done.stderr

    first = migrate()
    upgrades = re.findall(r"Running upgrade (\S*) ?-> (\S+),", first)
    assert upgrades and len(upgrades) == len(set(upgrades)), first
    assert upgrades[0][1] == "0001"
    assert first.count("Context impl") == 1, first
    again = migrate()
    assert "Running upgrade" not in again and again.count("Context impl") == 1, again


def test_serve_runs_its_own_postgres_across_restarts_and_crashes(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    key = str(uuid.uuid4())
    headers = {"Idempotency-Key": key}

    gateway, url = serve(data_dir, upstream, tmp_path / "first.log")
    try:
        assert httpx.post(url + "/emails", json={}, headers=headers).status_code == 201
        assert postmaster(data_dir) is not None
    finally:
        gateway.stop()
    assert gateway.wait() == 0
    assert "embedded PostgreSQL running, data in" in gateway.output()
    assert postmaster(data_dir) is None  # the last gateway out stops it

    # Restarted on the same data directory: the key is still there, and the summary says so.
    gateway, url = serve(data_dir, upstream, tmp_path / "second.log")
    replay = httpx.post(url + "/emails", json={}, headers=headers)
    assert replay.headers["idempotent-replayed"] == "true"
    assert f"database: embedded PostgreSQL, data in {data_dir}, keys held: 1;" in (gateway.output())
    gateway.signal(signal.SIGKILL)  # a crash: PostgreSQL is left running
    gateway.stop()
    assert postmaster(data_dir) is not None

    # After the crash: the leftover server is found and used, and stopped on a clean exit.
    gateway, url = serve(data_dir, upstream, tmp_path / "third.log")
    try:
        replay = httpx.post(url + "/emails", json={}, headers=headers)
        assert replay.headers["idempotent-replayed"] == "true"
    finally:
        gateway.stop()
    assert gateway.wait() == 0
    assert postmaster(data_dir) is None
    assert len(upstream.actions(key)) == 1


def test_the_start_up_summary_is_one_line_with_ports_database_keys_and_admin_api(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    port, admin_port = free_port(), free_port()
    gateway = Process(
        ["serve", "--upstream", upstream.url, "--port", str(port), "--admin-port",
         str(admin_port), "--data-dir", str(data_dir), "--log-format", "text"],
        tmp_path / "gateway.log",
        env={"ONCEGATE_DATABASE_URL": "", "ONCEGATE_ADMIN_TOKEN": ""},
    )  # fmt: skip
    try:
        gateway.wait_listening(admin_port)
        # Answered once the servers run (the ports are bound, and queue, a moment before).
        assert httpx.get(f"http://127.0.0.1:{admin_port}/healthz").status_code == 200
    finally:
        gateway.stop()
    output = gateway.output()
    summaries = [line for line in output.splitlines() if "oncegate serving:" in line]
    assert len(summaries) == 1, output
    assert summaries[0].endswith(
        f"oncegate serving: proxy on http://127.0.0.1:{port}, admin on "
        f"http://127.0.0.1:{admin_port} (/metrics, /healthz, /readyz); database: embedded "
        f"PostgreSQL, data in {data_dir}, keys held: 0; admin API disabled (set "
        "ONCEGATE_ADMIN_TOKEN to enable it)"
    )
    # uvicorn's own lines, once per server, are not repeated: the summary says it once.
    assert "Started server process" not in output and "Shutting down" not in output
    assert output.count("stopping: no new connections") == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="pgserver opens parent directories only as root")
def test_as_root_a_closed_parent_stays_closed_and_the_message_names_it(
    upstream: DemoUpstream, tmp_path: Path
) -> None:
    parent = Path(tempfile.mkdtemp(prefix="oncegate-test-closed-"))  # mkdtemp makes it 0700
    try:
        result = subprocess.run(
            [sys.executable, "-m", "oncegate.cli", "serve", "--upstream", upstream.url,
             "--port", str(free_port()), "--admin-port", str(free_port())],
            env={**os.environ, "ONCEGATE_DATABASE_URL": "",
                 "ONCEGATE_DATA_DIR": str(parent / "data")},
            capture_output=True, text=True, timeout=STARTUP_TIMEOUT,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr
        assert f"{parent} is closed to other users (mode 0700)" in result.stderr
        assert "ONCEGATE_DATA_DIR" in result.stderr
        assert "Traceback" not in result.stderr
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700
        assert not (parent / "data" / "pgdata").exists()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_the_default_data_directory_is_the_same_whatever_the_working_directory(
    upstream: DemoUpstream, tmp_path: Path
) -> None:
    """The issue's double charge: started from another directory, the gateway must open the same
    store, the user's data directory (root's: /var/lib/oncegate)."""
    home = Path(tempfile.mkdtemp(prefix="oncegate-test-home-"))
    home.chmod(0o755)
    expected = home / ".local" / "share" / "oncegate"
    if os.geteuid() == 0:
        expected = Path("/var/lib/oncegate")
        if expected.exists():
            pytest.skip(f"{expected} holds this machine's own store; the test uses it only new")
    key = str(uuid.uuid4())
    environment = {
        **{name: value for name, value in os.environ.items() if not name.startswith("ONCEGATE")},
        "HOME": str(home),
        "XDG_DATA_HOME": "",
    }
    try:
        for number, workdir in enumerate(["one", "two"]):
            (home / workdir).mkdir()
            port = free_port()
            log = tmp_path / f"{workdir}.log"
            with log.open("wb") as output:
                popen = subprocess.Popen(
                    [sys.executable, "-m", "oncegate.cli", "serve", "--upstream", upstream.url,
                     "--port", str(port), "--admin-port", str(free_port())],
                    cwd=home / workdir, env=environment, stdout=output, stderr=subprocess.STDOUT,
                )  # fmt: skip
            try:
                _wait_listening(popen, port, log)
                answer = httpx.post(
                    f"http://127.0.0.1:{port}/charges", json={}, headers={"Idempotency-Key": key}
                )
                assert answer.status_code == 201
                assert ("idempotent-replayed" in answer.headers) == (number == 1)
            finally:
                popen.terminate()
                popen.wait(30)
            assert f"data in {expected}" in log.read_text()
            assert not (home / workdir / ".oncegate").exists()
        assert len(upstream.actions(key)) == 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
        if os.geteuid() == 0:
            shutil.rmtree(expected, ignore_errors=True)


def _wait_listening(popen: subprocess.Popen[bytes], port: int, log: Path) -> None:
    import socket

    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise AssertionError(f"serve exited early:\n{log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"serve did not listen on {port}:\n{log.read_text()}")


@pytest.mark.slow  # a kill at a bad moment, found under load: `make test-all`
def test_a_restart_right_after_postgres_was_killed_recovers_by_itself(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    """Issue 11.9: SIGKILL of the postmaster, then the gateway restarted at once: its
    `postmaster.pid` is left behind, naming a dead process or a zombie."""
    key = str(uuid.uuid4())
    headers = {"Idempotency-Key": key}
    gateway, url = serve(data_dir, upstream, tmp_path / "first.log")
    assert httpx.post(url + "/emails", json={}, headers=headers).status_code == 201
    flush(url)
    killed = postmaster(data_dir)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    gateway.stop()
    assert gateway.wait() == 0
    assert "Traceback" not in gateway.output()

    gateway, url = serve(data_dir, upstream, tmp_path / "second.log")
    try:
        replay = httpx.post(url + "/emails", json={}, headers=headers)
        assert replay.headers["idempotent-replayed"] == "true"
        assert postmaster(data_dir) not in (None, killed)
    finally:
        gateway.stop()
    assert gateway.wait() == 0
    assert "Traceback" not in gateway.output()
    assert postmaster(data_dir) is None

    # Both killed at once (the machine's OOM killer, a power cut of the container): the same.
    gateway, url = serve(data_dir, upstream, tmp_path / "third.log")
    killed = postmaster(data_dir)
    assert killed is not None
    os.kill(killed, signal.SIGKILL)
    gateway.signal(signal.SIGKILL)
    gateway.stop()
    gateway, url = serve(data_dir, upstream, tmp_path / "fourth.log")
    try:
        replay = httpx.post(url + "/emails", json={}, headers=headers)
        assert replay.headers["idempotent-replayed"] == "true"
    finally:
        gateway.stop()
    assert gateway.wait() == 0
    assert "Traceback" not in gateway.output()
    assert len(upstream.actions(key)) == 1


@pytest.mark.slow  # a kill at a bad moment, found under load: `make test-all`
def test_a_list_of_handles_cut_short_by_a_kill_does_not_stop_the_next_start(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    """pgserver rewrites its list of the server's users in place; a gateway killed in between
    (seen under load in the test above) leaves it empty, and every later start failed on it."""
    key = str(uuid.uuid4())
    gateway, url = serve(data_dir, upstream, tmp_path / "first.log")
    assert httpx.post(url + "/emails", json={}, headers={"Idempotency-Key": key}).status_code == 201
    flush(url)
    gateway.stop()
    assert gateway.wait() == 0
    handles = data_dir / "pgdata" / ".handle_pids.json"
    assert handles.exists()
    for cut_short in ("", "[12"):
        handles.write_text(cut_short)
        gateway, url = serve(data_dir, upstream, tmp_path / f"after-{len(cut_short)}.log")
        try:
            replay = httpx.post(url + "/emails", json={}, headers={"Idempotency-Key": key})
            assert replay.headers["idempotent-replayed"] == "true"
        finally:
            gateway.stop()
        assert gateway.wait() == 0
        assert "Traceback" not in gateway.output()
        assert json.loads(handles.read_text()) == []
        assert postmaster(data_dir) is None  # the last one out still stops the server


@pytest.mark.slow  # a kill at a bad moment, found under load: `make test-all`
def test_a_gateway_whose_handle_was_lost_puts_it_back_and_keeps_its_server(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    """A list of handles cut short is rebuilt from nothing; a gateway that was on it and still
    runs puts itself back, so another gateway leaving last does not stop the server under it."""
    key = str(uuid.uuid4())
    first, first_url = serve(data_dir, upstream, tmp_path / "first.log")
    try:
        assert (
            httpx.post(first_url + "/emails", json={}, headers={"Idempotency-Key": key})
        ).status_code == 201
        handles = data_dir / "pgdata" / ".handle_pids.json"
        handles.write_text("")
        second, _ = serve(data_dir, upstream, tmp_path / "second.log")
        try:
            deadline = time.monotonic() + RECOVERY_TIMEOUT
            while first.pid not in json.loads(handles.read_text() or "[]"):
                assert time.monotonic() < deadline, f"{first.pid} not back: {handles.read_text()}"
                time.sleep(0.1)
            server = postmaster(data_dir)
        finally:
            second.stop()
        assert second.wait() == 0
        assert postmaster(data_dir) == server  # not stopped: the first gateway still uses it
        replay = httpx.post(first_url + "/emails", json={}, headers={"Idempotency-Key": key})
        assert replay.headers["idempotent-replayed"] == "true"
    finally:
        first.stop()
    assert first.wait() == 0
    assert "Traceback" not in first.output()
    assert postmaster(data_dir) is None


@pytest.mark.slow  # the supervisor again, after a kill: `make test-all` (the restart above stays)
def test_a_dead_postgres_is_restarted_while_the_gateway_runs(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    """Issue 11.9: the gateway supervises its embedded PostgreSQL and says what happened."""
    key = str(uuid.uuid4())
    gateway, url = serve(data_dir, upstream, tmp_path / "gateway.log")
    try:
        assert httpx.post(url + "/emails", json={}, headers={"Idempotency-Key": key}).is_success
        flush(url)
        killed = postmaster(data_dir)
        assert killed is not None
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + RECOVERY_TIMEOUT
        statuses = set()
        while time.monotonic() < deadline:
            answer = httpx.post(
                url + "/emails", json={}, headers={"Idempotency-Key": str(uuid.uuid4())}
            )
            statuses.add(answer.status_code)
            if answer.status_code == 201:
                break
            assert answer.status_code == 503, answer.text  # fails closed meanwhile
            time.sleep(0.1)
        assert 201 in statuses, statuses
        replay = httpx.post(url + "/emails", json={}, headers={"Idempotency-Key": key})
        assert replay.headers["idempotent-replayed"] == "true"
        assert postmaster(data_dir) not in (None, killed)
    finally:
        gateway.stop()
    output = gateway.output()
    stopped = r"the embedded PostgreSQL stopped unexpectedly \(data in .*\); restarting it"
    assert re.search(stopped, output)
    assert re.search(r"the embedded PostgreSQL was restarted \(pid \d+\)", output)
    assert "Traceback" not in output
    assert gateway.wait() == 0
    assert postmaster(data_dir) is None


@pytest.mark.slow  # a signal at a bad moment: `make test-all`
def test_a_sigterm_while_the_gateway_starts_stops_it_cleanly(
    data_dir: Path, upstream: DemoUpstream, tmp_path: Path
) -> None:
    """A signal during start-up (embedded PostgreSQL, migrations, pool) is kept until the servers
    can act on it: the gateway exits 0 and stops its PostgreSQL, never dies leaving it running."""
    log = tmp_path / "gateway.log"
    gateway = Process(
        ["serve", "--upstream", upstream.url, "--port", str(free_port()), "--admin-port",
         str(free_port()), "--data-dir", str(data_dir)],
        log,
        env={"ONCEGATE_DATABASE_URL": ""},
    )  # fmt: skip
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while "embedded PostgreSQL running" not in gateway.output():
        assert gateway.popen.poll() is None, gateway.output()
        assert time.monotonic() < deadline, gateway.output()
        time.sleep(0.01)
    gateway.signal(signal.SIGTERM)
    assert gateway.wait() == 0, gateway.output()
    gateway.stop()
    assert postmaster(data_dir) is None
    assert "Traceback" not in gateway.output()
