"""The container image's health check: `python -m oncegate.healthcheck` (app/healthcheck.py, the
door at the path the Dockerfile names, runs this).

It asks `GET /healthz` of the admin port of the gateway that is the container's first process,
on the port that gateway was given: `--admin-port` on its command line (compose's `command:`),
else `ONCEGATE_ADMIN_PORT`, else 8081. A check that read only the variable would probe the wrong
port whenever the port is given as a flag, and report a healthy gateway unhealthy. Exit status 0
when the gateway answers 200, 1 otherwise (Docker's convention).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

# Addresses that mean "every interface": the gateway is reached on loopback then.
_ANY = {"", "0.0.0.0", "::", "[::]"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oncegate.healthcheck")
    parser.add_argument("--pid", type=int, default=1, help="the gateway's process (1)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (2)")
    arguments = parser.parse_args(argv)
    url = health_url(command_line(arguments.pid), os.environ)
    try:
        # S310: the URL is always http:// (built by health_url), never a file: or custom scheme.
        with urllib.request.urlopen(url, timeout=arguments.timeout) as answer:  # noqa: S310
            healthy = answer.status == 200
    except (OSError, ValueError) as exc:  # refused, timed out, or an HTTP error status
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    return 0 if healthy else 1


def command_line(pid: int) -> list[str]:
    """The arguments process `pid` was started with; none when they cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def health_url(arguments: Sequence[str], environ: Mapping[str, str]) -> str:
    port = _option(arguments, "--admin-port") or environ.get("ONCEGATE_ADMIN_PORT") or "8081"
    host = _option(arguments, "--host") or environ.get("ONCEGATE_HOST") or "127.0.0.1"
    if host in _ANY:
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def _option(arguments: Sequence[str], name: str) -> str | None:
    """The last value of `name` (`--name VALUE` or `--name=VALUE`), as argparse would take it."""
    value = None
    for index, argument in enumerate(arguments):
        if argument == name and index + 1 < len(arguments):
            value = arguments[index + 1]
        elif argument.startswith(name + "="):
            value = argument.split("=", 1)[1]
    return value


if __name__ == "__main__":
    sys.exit(main())
