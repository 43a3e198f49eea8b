"""A new user's first command, timed: a fresh clone, `make run` (the README's first command), and
the first 201 through the gateway; beside it, the install alone (`make run` until its stamp,
`.venv/.installed-embedded`, appears: the venv and `pip install -e '.[embedded]'`). With
`--then-test`, the second command too: `make test` in the same clone once `make run` is stopped,
its install alone (until `.venv/.installed`), the whole command, its CPU and pytest's last line.
`--busy-core` keeps one core busy the whole time (a Python loop), as the README's figures are
measured.

    .venv/bin/python bench/first_run.py                  # clones this checkout's HEAD
    .venv/bin/python bench/first_run.py --runs 3 --no-pip-cache --repo URL
    .venv/bin/python bench/first_run.py --then-test --busy-core

Everything runs in a temporary directory on free ports of 127.0.0.1, with the embedded
PostgreSQL's data in a fresh directory there; `make run` is started in a process group of its
own and stopped (SIGINT, as Ctrl-C, then SIGKILL) by that group's id. The pip cache is the
machine's own unless `--no-pip-cache` (then every package is downloaded, as on a machine that
never installed them). Prints one Markdown row per run and the machine's load beside it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
STAMP = ".venv/.installed-embedded"
TEST_STAMP = ".venv/.installed"  # `make test`'s: the test toolchain, `.[dev]`
TIMEOUT = 600.0
TEST_TIMEOUT = 3600.0


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def first_201(url: str, key: str) -> bool:
    try:
        answer = httpx.post(url, json={"to": "ana@example.com"},
                            headers={"Idempotency-Key": key}, timeout=5)  # fmt: skip
    except httpx.HTTPError:
        return False
    return answer.status_code == 201


def one_run(repo: str, directory: Path, pip_cache: bool) -> tuple[Path, float, float, float]:
    """The clone; seconds to the install's stamp and to the first 201, from the clone's end, and
    the CPU seconds (user + system) `make run` and every process it waited for took, stop
    included."""
    clone = directory / "oncegate"
    subprocess.run(["git", "clone", "--quiet", repo, str(clone)], check=True)
    data = directory / "data"
    data.mkdir()
    ports = {"DEMO_PORT": free_port(), "ONCEGATE_PORT": free_port(),
             "ONCEGATE_ADMIN_PORT": free_port()}  # fmt: skip
    environment = {
        **{name: value for name, value in os.environ.items()
           if not name.startswith(("ONCEGATE", "VIRTUAL_ENV"))},
        **{name: str(port) for name, port in ports.items()},
        "ONCEGATE_DATA_DIR": str(data),
    }  # fmt: skip
    if not pip_cache:
        environment["PIP_NO_CACHE_DIR"] = "1"
    url = f"http://127.0.0.1:{ports['ONCEGATE_PORT']}/emails"
    key = f"first-run-{uuid.uuid4().hex[:8]}"
    log = (directory / "make-run.log").open("wb")
    started = time.monotonic()
    process = subprocess.Popen(["make", "run"], cwd=clone, env=environment, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    installed = answered = None
    cpu = 0.0
    try:
        while answered is None:
            now = time.monotonic() - started
            if now > TIMEOUT or process.poll() is not None:
                raise RuntimeError(
                    f"make run gave no 201 in {now:.0f} s; its output is in {log.name}:\n"
                    + (directory / "make-run.log").read_text()[-3000:]
                )
            if installed is None and (clone / STAMP).exists():
                installed = now
            if installed is not None and first_201(url, key):
                answered = time.monotonic() - started
            time.sleep(0.1)
    finally:
        if process.returncode is None:  # still running (an early exit was reaped by poll)
            cpu = stop(process)
        log.close()
    assert installed is not None and answered is not None
    return clone, installed, answered, cpu


def second_command(
    clone: Path, directory: Path, pip_cache: bool
) -> tuple[float, float, float, str]:
    """`make test` in `clone` after `make run`: seconds to its install's stamp and to its end,
    the CPU seconds it and every process it waited for took (not the PostgreSQL servers the
    tests start, which detach), and pytest's closing line."""
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("ONCEGATE", "VIRTUAL_ENV"))}  # fmt: skip
    if not pip_cache:
        environment["PIP_NO_CACHE_DIR"] = "1"
    log_path = directory / "make-test.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(["make", "test"], cwd=clone, env=environment, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        installed = None
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if installed is None and (clone / TEST_STAMP).exists():
                installed = time.monotonic() - started
            if pid:
                break
            if time.monotonic() - started > TEST_TIMEOUT:
                os.killpg(process.pid, signal.SIGKILL)
            time.sleep(0.1)
    ended = time.monotonic() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    closing = next((line.strip("= ") for line in reversed(lines) if " in " in line), "")
    if process.returncode != 0:
        raise RuntimeError(f"make test exited {process.returncode}:\n" + "\n".join(lines[-60:]))
    assert installed is not None
    return installed, ended, usage.ru_utime + usage.ru_stime, closing


def stop(process: subprocess.Popen[bytes]) -> float:
    """Ctrl-C to the process group `make run` was started in (its own, and no other), SIGKILL
    after 30 s; the CPU seconds it and the processes it waited for took."""
    os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + 30
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            deadline += 10
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", default=str(ROOT), help="what to clone (this checkout's HEAD)")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--no-pip-cache", action="store_true", help="download every package")
    parser.add_argument(
        "--then-test",
        action="store_true",
        help="then `make test` in the same clone, the README's second command",
    )
    parser.add_argument(
        "--busy-core",
        action="store_true",
        help="keep one core busy throughout (a loop in a process of its own)",
    )
    arguments = parser.parse_args()
    commit = subprocess.run(["git", "-C", arguments.repo, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    print(f"`make run` in a fresh clone of {arguments.repo} ({commit or 'remote'}), "
          f"pip cache {'off' if arguments.no_pip_cache else 'as the machine has it'}, "
          f"{os.cpu_count()} cores\n")  # fmt: skip
    columns = ["run", "install alone (venv + `.[embedded]`)", "to the first 201",
               "CPU of make run (install, start, stop)"]  # fmt: skip
    if arguments.then_test:
        columns += ["make test: install alone (`.[dev]`)", "make test", "CPU of make test",
                    "pytest"]  # fmt: skip
    columns += ["load before", "load after"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    busy = (
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        if arguments.busy_core
        else None
    )
    try:
        for run in range(1, arguments.runs + 1):
            load = os.getloadavg()[0]
            directory = Path(tempfile.mkdtemp(prefix="oncegate-first-run-"))
            directory.chmod(0o755)  # as root the embedded PostgreSQL runs as pgserver's own user
            try:
                clone, installed, answered, cpu = one_run(
                    arguments.repo, directory, not arguments.no_pip_cache
                )
                cells = [str(run), f"{installed:.1f} s", f"{answered:.1f} s", f"{cpu:.1f} s"]
                if arguments.then_test:
                    test_installed, ended, test_cpu, closing = second_command(
                        clone, directory, not arguments.no_pip_cache
                    )
                    cells += [f"{test_installed:.1f} s", f"{minutes(ended)}",
                              f"{test_cpu:.0f} s", closing]  # fmt: skip
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            cells += [f"{load:.1f}", f"{os.getloadavg()[0]:.1f}"]
            print("| " + " | ".join(cells) + " |", flush=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


if __name__ == "__main__":
    sys.exit(main())
