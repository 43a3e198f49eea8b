"""Where a proxy's CPU goes, per request: py-spy's samples sorted into the parts of the request
path (`bench/run.py --profile DIR`, and `python bench/profiling.py FILE...` on saved samples).

py-spy samples each proxy process during the measured runs (`--nonblocking`: the process is
never paused, so the CPU figures of the run stay what they are without it; idle samples, a loop
waiting in epoll, are not recorded). A sample belongs to the part of the code it was in: from the
innermost frame outwards, the first frame whose module one of `PARTS` names decides (a JSON
encoder called by the log formatter is the log line's; a future created by the store's batcher
is the store's). What no part names, the event loop's own work between callbacks, the runner,
is `event loop and the rest`.

A part's share of the samples times the process's CPU per request (measured from /proc in the
same runs) is that part's CPU per request: the µs columns. Shares are steadier than wall time on
a loaded machine; a few hundred samples per row give a part's share to about ±2 points.
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

RATE = 199  # samples per second: not a multiple of anything periodic in the servers
PY_SPY_GRACE = 15.0

# (part, module prefixes), in the order a frame is tested against them.
PARTS: Sequence[tuple[str, tuple[str, ...]]] = (
    (
        "key, scope, fingerprint",
        ("oncegate/kernel/fingerprint.py", "oncegate/kernel/keys.py", "oncegate/model/jsontext.py"),
    ),
    ("request log line", ("logging/", "oncegate/telemetry/logs.py")),
    ("metrics", ("prometheus_client/", "oncegate/telemetry/metrics.py")),
    ("tracing hooks", ("oncegate/telemetry/tracing.py",)),
    ("store: asyncpg", ("asyncpg/",)),
    # The Citus worker path's own code (hashes, the shard map, its statements' arguments).
    ("store: Citus routing", ("oncegate/store/citus.py", "oncegate/store/postgres/workers.py")),
    ("store: batching, rows", ("oncegate/store/",)),
    (
        "upstream client (aiohttp)",
        ("aiohttp/", "yarl/", "multidict/", "aiohappyeyeballs/", "oncegate/upstream/"),
    ),
    ("sealing", ("oncegate/kernel/sealing.py", "cryptography/")),
    (
        "headers, path, route",
        ("oncegate/kernel/headers.py", "oncegate/kernel/paths.py", "oncegate/service/routing.py"),
    ),
    ("service flow", ("oncegate/service/",)),
    ("idemkit", ("idemkit/",)),
    ("proxy edge (ASGI app)", ("oncegate/http/proxy.py", "bare_proxy.py", "idemkit_proxy.py")),
    ("HTTP server (uvicorn)", ("uvicorn/", "httptools/", "h11/", "oncegate/http/protocol.py")),
)
REST = "event loop and the rest"
ORDER = [part for part, _ in PARTS] + [REST]

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*)\)$")
_SITE = re.compile(r".*/(?:site|dist)-packages/")
_STDLIB = re.compile(r".*/lib/python3\.\d+/")
_OWN = re.compile(r".*/(?:app|oncegate)/")


def module_of(path: str) -> str:
    """`.../site-packages/aiohttp/client.py` -> `aiohttp/client.py`; the gateway's own files
    (installed or from a checkout's `app/`) -> `oncegate/...`; bench scripts by name."""
    if "/site-packages/" in path or "/dist-packages/" in path:
        return _SITE.sub("", path)
    if "/bench/" in path:
        return path.rsplit("/", 1)[-1]
    if _STDLIB.match(path):
        return _STDLIB.sub("", path)
    if _OWN.match(path):
        return "oncegate/" + _OWN.sub("", path)
    return path


def part_of(frames: Sequence[str]) -> str:
    """The part a sample's stack (outermost frame first) belongs to."""
    for frame in reversed(frames):
        found = _FRAME.match(frame)
        if found is None:
            continue
        module = module_of(found["file"])
        for part, prefixes in PARTS:
            if module.startswith(prefixes):
                return part
    return REST


def parts(lines: Iterable[str]) -> collections.Counter[str]:
    """Samples per part from py-spy's raw format (`frame;frame;... count` per line)."""
    counted: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [frame for frame in stack.split(";") if not frame.startswith("process ")]
        counted[part_of(frames)] += int(count)
    return counted


def available() -> bool:
    return shutil.which("py-spy") is not None or (Path(sys.executable).parent / "py-spy").exists()


def start(pid: int, seconds: int, output: Path) -> subprocess.Popen[bytes]:
    """py-spy on `pid` and its children for `seconds`, raw stacks to `output`."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return subprocess.Popen(
        [
            *(py_spy, "record", "--pid", str(pid), "--subprocesses", "--nonblocking"),
            *("--full-filenames", "--nolineno", "--rate", str(RATE), "--duration", str(seconds)),
            *("--format", "raw", "--output", str(output)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


def finish(process: subprocess.Popen[bytes], output: Path) -> collections.Counter[str]:
    """Wait for py-spy (bounded) and read what it recorded; empty if it recorded nothing."""
    try:
        process.wait(timeout=PY_SPY_GRACE)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        try:
            process.wait(timeout=PY_SPY_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if not output.exists():
        return collections.Counter()
    with output.open() as raw:
        return parts(raw)


def table(
    rows: Mapping[str, tuple[collections.Counter[str], float]], baseline: str | None = None
) -> str:
    """Per part, each row's CPU µs per request (its share of the row's samples times the row's
    CPU ms per request), and with `baseline` each row's difference to it."""
    labels = list(rows)
    header = "| part | " + " | ".join(f"{label} µs/req" for label in labels)
    if baseline is not None:
        header += " | " + " | ".join(
            f"{label} - {baseline}" for label in labels if label != baseline
        )
    lines = [header + " |", "|---" + "|---:" * (len(labels) * 2 - (baseline is not None)) + "|"]
    if baseline is None:
        lines[1] = "|---" + "|---:" * len(labels) + "|"

    def micros(label: str, part: str | None) -> float:
        counted, cpu_ms = rows[label]
        total = sum(counted.values())
        if not total or cpu_ms != cpu_ms:  # nan: not measured
            return float("nan")
        share = total if part is None else counted[part]
        return share / total * cpu_ms * 1000

    for part in [*ORDER, None]:
        name = "**all (CPU of the proxy process)**" if part is None else part
        cells = [f"{micros(label, part):.0f}" for label in labels]
        if baseline is not None:
            cells += [
                f"{micros(label, part) - micros(baseline, part):+.0f}"
                for label in labels
                if label != baseline
            ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    samples = ", ".join(f"{label} {sum(rows[label][0].values())}" for label in labels)
    lines.append(f"\nsamples: {samples}")
    return "\n".join(lines)


def main(paths: Sequence[str]) -> None:
    """Print each saved raw file's parts as shares."""
    for path in paths:
        with open(path) as raw:
            counted = parts(raw)
        total = sum(counted.values()) or 1
        print(f"{path}: {total} samples")
        for part in ORDER:
            if counted[part]:
                print(f"  {counted[part] / total:6.1%}  {part}")


if __name__ == "__main__":
    main(sys.argv[1:])
