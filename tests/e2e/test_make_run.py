"""`make run` (scripts/run.sh), the README's first command: the demo upstream and the gateway,
with an admin token for the run; either one that cannot start stops both, with a message."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import STARTUP_TIMEOUT
from tests.helpers import free_port

SCRIPT = Path(__file__).parents[2] / "scripts" / "run.sh"


@pytest.fixture
def data_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="oncegate-test-run-"))
    directory.chmod(0o755)  # as root the embedded PostgreSQL runs as pgserver's user
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start(
    ports: dict[str, int], data_dir: Path, log: Path, sigint_ignored: bool = False, **env: str
) -> subprocess.Popen[bytes]:
    """`sigint_ignored`: start it as `nohup`, a `&` job of a script or some CI runners do, with
    SIGINT ignored on entry (a shell cannot trap a signal it was started ignoring)."""
    environment = {
        **{name: value for name, value in os.environ.items() if not name.startswith("ONCEGATE")},
        "VENV": sys.prefix,
        "DEMO_PORT": str(ports["demo"]),
        "ONCEGATE_PORT": str(ports["gateway"]),
        "ONCEGATE_ADMIN_PORT": str(ports["admin"]),
        "ONCEGATE_DATA_DIR": str(data_dir),
        **env,
    }
    with log.open("wb") as output:
        return subprocess.Popen(
            ["bash", str(SCRIPT)],
            cwd=SCRIPT.parents[1],
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's job
            preexec_fn=_ignore_sigint if sigint_ignored else None,
        )


def ports() -> dict[str, int]:
    return {"demo": free_port(), "gateway": free_port(), "admin": free_port()}


def accepting(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


def busy(port: int) -> socket.socket:
    sock = socket.create_server(("127.0.0.1", port))
    return sock


def test_a_busy_demo_port_stops_make_run_before_the_gateway_starts(
    data_dir: Path, tmp_path: Path
) -> None:
    chosen = ports()
    with busy(chosen["demo"]):
        process = start(chosen, data_dir, tmp_path / "run.log")
        status = process.wait(STARTUP_TIMEOUT)
    output = (tmp_path / "run.log").read_text()
    assert status == 1, output
    assert (
        f"make run: port {chosen['demo']} is already in use, so the demo upstream cannot start "
        "there." in output
    )
    assert "oncegate serving" not in output
    assert not (data_dir / "pgdata").exists()  # the gateway never started


@pytest.mark.slow  # the busy demo port above is the same stop, sooner: `make test-all`
def test_a_gateway_that_cannot_start_stops_the_demo_too(data_dir: Path, tmp_path: Path) -> None:
    chosen = ports()
    with busy(chosen["gateway"]):
        process = start(chosen, data_dir, tmp_path / "run.log")
        status = process.wait(120)
    output = (tmp_path / "run.log").read_text()
    assert status == 2, output
    assert f"oncegate: cannot listen on 127.0.0.1:{chosen['gateway']}: Address already in use" in (
        output
    )
    assert "make run: the gateway did not start or stopped with status 2 (above)." in output
    assert not accepting(chosen["demo"])  # the demo upstream was stopped with it


@pytest.mark.parametrize(
    "sigint_ignored",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # started as `nohup` does: test-all
    ids=["from-a-terminal", "sigint-ignored"],
)
def test_make_run_gives_an_admin_token_and_honours_the_log_format(
    data_dir: Path, tmp_path: Path, sigint_ignored: bool
) -> None:
    chosen = ports()
    log = tmp_path / "run.log"
    process = start(chosen, data_dir, log, sigint_ignored, ONCEGATE_LOG_FORMAT="json")
    try:
        deadline = time.monotonic() + 120
        while not accepting(chosen["admin"]):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        lines = log.read_text().splitlines()
        told = next(line for line in lines if "the admin API's token for this run is" in line)
        token = told.rsplit(" ", 1)[1]
        admin = f"http://127.0.0.1:{chosen['admin']}/admin/keys"
        answer = httpx.get(admin, params={"key": "x"}, headers={"Authorization": f"Bearer {token}"})
        assert answer.status_code == 200 and answer.json() == {"records": []}
        assert httpx.get(admin, params={"key": "x"}).status_code == 401
        gateway_lines = [line for line in lines if line.startswith("{")]
        summary = [json.loads(line) for line in gateway_lines if "oncegate serving" in line]
        assert summary and summary[0]["admin_api"] is True
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal
        status = process.wait(60)
    assert status == 130, log.read_text()  # interrupted, whatever its parent ignored
    assert not accepting(chosen["demo"]) and not accepting(chosen["gateway"])
