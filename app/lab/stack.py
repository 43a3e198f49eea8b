"""The lab's own services: an embedded PostgreSQL, a demo upstream and a gateway, each a real
process on a free loopback port, or the ones the caller names instead.

The gateway can be killed with SIGKILL and started again on the same ports (`--kill-gateway`);
its route has a short timeout and lease so a key left in flight by a killed gateway turns
`unknown` within seconds, not the default minute. A second route, `/late`, forwards to the same
upstream but keeps its keys only `LATE_TTL` seconds, so `--late-resume` can resume runs after
their keys expired without waiting a day.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn
from urllib.parse import parse_qsl, unquote, urlsplit

import yaml

from ..settings import database_url

STARTUP_TIMEOUT = 30.0
# The lab's route: actions take milliseconds, so 2 s is a generous upstream timeout, and a lease
# of 3 s bounds how long a retry waits on a claim whose gateway was killed.
GATEWAY_TIMEOUT = "2s"
GATEWAY_LEASE = "3s"
# The `/late` route's key lifetime: longer than the lease (the gateway insists), short enough
# that a run resumed past it waits seconds.
LATE_TTL = 4.0
LATE_PREFIX = "/late"

# `python -m` of the command line, named from this package (installed as `oncegate`).
CLI_MODULE = __name__.split(".")[0] + ".cli"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class NotStarted(Exception):
    """A service of the lab's own did not start; it was stopped. The message is one sentence:
    which service, how it ended, and its last words, without what the lab handed it in secret
    (the admin token, the database's password). `status`: its exit status, or None when the lab
    stopped it (still not listening after `STARTUP_TIMEOUT`)."""

    def __init__(self, message: str, status: int | None) -> None:
        super().__init__(message)
        self.status = status


# What each of the lab's commands is, for its messages.
NAMES = {"serve": "gateway", "demo-upstream": "demo upstream"}


class Service:
    """One `oncegate` subprocess, logging to a file."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], ports: list[int]) -> None:
        self.args, self.log, self.env, self.ports = args, log, env, ports
        self._log_file: IO[bytes] | None = None
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start it and wait until it listens on each of its ports; `NotStarted` (and the
        process stopped) when it ends first or does not listen within `STARTUP_TIMEOUT`."""
        self._log_file = self.log.open("ab")
        # The lab's own `oncegate` commands, with arguments it built itself.
        self.popen = subprocess.Popen(  # noqa: S603
            [sys.executable, "-m", CLI_MODULE, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT
        for port in self.ports:
            while not _listening(port):
                if self.popen.poll() is not None or time.monotonic() > deadline:
                    self._not_started()
                time.sleep(0.02)
        if self.popen.poll() is not None:  # another process listens there: its port was taken
            self._not_started()

    def _not_started(self) -> NoReturn:
        """Stop it (one still starting is terminated), and say why it did not start."""
        assert self.popen is not None
        status = self.popen.poll()
        self.stop()
        name = NAMES.get(self.args[0], f"oncegate {self.args[0]}")
        if status is None:
            ended = f"it was not listening within {STARTUP_TIMEOUT:g} s, and was stopped"
        else:
            ended = f"it exited with status {status}"
        raise NotStarted(f"the lab's {name} did not start ({ended}): {self._last_words()}", status)

    def _last_words(self) -> str:
        """The last line it wrote (a command's error is one line: `oncegate: ...`; a JSON log
        line's message), without the secrets it was handed."""
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line]
        if not lines:
            return "it said nothing"
        said = lines[-1].removeprefix("oncegate: ")
        with contextlib.suppress(ValueError, AttributeError):
            said = str(json.loads(said).get("message", said))
        for secret in _secrets(self.env):
            said = said.replace(secret, "[hidden]")
        return said[:500]

    def kill(self) -> None:
        """SIGKILL, the way a crash or an OOM kill ends a process: nothing runs after it."""
        assert self.popen is not None
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        if self._log_file is not None:
            self._log_file.close()

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self._log_file is not None:
            self._log_file.close()


def _secrets(env: dict[str, str]) -> list[str]:
    """What a service was handed that no message may show: the admin token, and the passwords
    of the database's URL (as written, and percent-decoded)."""
    hidden = [env.get("ONCEGATE_ADMIN_TOKEN", "")]
    url = env.get("ONCEGATE_DATABASE_URL", "")
    if url:
        parts = urlsplit(url)
        passwords = [parts.password or ""] + [
            value
            for name, value in parse_qsl(parts.query)
            if name in database_url.SECRET_PARAMETERS
        ]
        hidden += passwords + [unquote(password) for password in passwords]
    return sorted({secret for secret in hidden if secret}, key=len, reverse=True)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


@dataclass
class Stack:
    database_url: str
    upstream_url: str
    gateway_url: str
    late_gateway_url: str | None  # the `/late` route; None when the gateway is not the lab's own
    admin_url: str | None  # None when the gateway is not the lab's own
    admin_token: str | None
    gateway: Service | None  # the lab's own gateway, which it may kill and restart
    directory: Path
    own_database: bool  # the embedded one, thrown away at the end

    def restart_gateway(self) -> None:
        assert self.gateway is not None
        self.gateway.kill()
        self.gateway.start()


@contextlib.contextmanager
def running(
    database_url: str | None, upstream_url: str | None, gateway_url: str | None
) -> Iterator[Stack]:
    """The services of one lab session, started as needed and stopped at the end."""
    from ..store import embedded

    directory = Path(tempfile.mkdtemp(prefix="oncegate-lab-"))
    # The lab's own directory (mkdtemp makes it private): as root the embedded PostgreSQL runs as
    # pgserver's user, which must reach its data inside.
    directory.chmod(0o755)
    services: list[Service] = []
    server = None
    own_database = database_url is None
    try:
        if database_url is None:
            server = embedded.start_migrated(directory)
            database_url = server.url
        if upstream_url is None:
            port = free_port()
            arguments = ["demo-upstream", "--port", str(port)]
            services.append(Service(arguments, directory / "upstream.log", {}, [port]))
            upstream_url = f"http://127.0.0.1:{port}"
        gateway = None
        admin_url = token = late_gateway_url = None
        if gateway_url is None:
            port, admin_port = free_port(), free_port()
            token = secrets.token_urlsafe(24)
            config = directory / "gateway.yaml"
            route = {"name": "lab", "match": "/", "upstream": upstream_url,
                     "timeout": GATEWAY_TIMEOUT, "lease": GATEWAY_LEASE}  # fmt: skip
            late = {**route, "name": "late", "match": LATE_PREFIX, "strip_prefix": True,
                    "ttl": f"{LATE_TTL:g}s"}  # fmt: skip
            config.write_text(yaml.safe_dump({"routes": [route, late]}))
            gateway = Service(
                ["serve", "--config", str(config), "--port", str(port),
                 "--admin-port", str(admin_port), "--log-level", "warning"],
                directory / "gateway.log",
                {"ONCEGATE_DATABASE_URL": database_url, "ONCEGATE_ADMIN_TOKEN": token},
                [port, admin_port],
            )  # fmt: skip
            services.append(gateway)
            gateway_url = f"http://127.0.0.1:{port}"
            late_gateway_url = gateway_url + LATE_PREFIX
            admin_url = f"http://127.0.0.1:{admin_port}"
        yield Stack(
            database_url, upstream_url, gateway_url, late_gateway_url, admin_url, token, gateway,
            directory, own_database,
        )  # fmt: skip
    finally:
        for service in reversed(services):
            service.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(directory, ignore_errors=True)
