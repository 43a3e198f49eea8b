"""Durations and sizes as settings spell them (`90s`, `15m`, `512KiB`), and the types that
parse and bound them."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Annotated

from pydantic import BeforeValidator, Field

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}


def parse_duration(value: object) -> float:
    """`90s`, `15m`, `24h`, `7d`, `250ms` or a number of seconds -> seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like 90s, 15m, 24h, 7d")
    if isinstance(value, int | float):
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ValueError(
            f"{value!r} is not a duration: use a number of seconds or 90s, 15m, 24h, 7d"
        )
    return float(match.group(1)) * _DURATION_UNITS[match.group(2)]


def parse_size(value: object) -> int:
    """`512KiB`, `10MiB` or a number of bytes -> bytes."""
    if isinstance(value, bool):
        raise ValueError("a size is a number of bytes or a string like 512KiB, 10MiB")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"{value!r} is not a size: use a number of bytes or 512KiB, 10MiB")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


# The most worker processes one gateway forks (`workers`).
MAX_WORKERS = 64
# Where a container's CPU limit is read: cgroup v2's `cpu.max`, else cgroup v1's quota and period.
CGROUP = Path("/sys/fs/cgroup")


def parse_workers(value: object) -> object:
    """`auto` -> one worker per core this process may use (`usable_cores`); a whole number (or
    its digits) as it is, left to the field's bounds (1 to MAX_WORKERS)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return usable_cores()
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError(
        f"{value!r} is not a number of worker processes: use 1 to {MAX_WORKERS}, or auto"
    )


def usable_cores(cgroup: Path | None = None) -> int:
    """The cores this process may run on: the CPUs it is allowed (affinity, `taskset`, a
    cpuset), fewer when a CPU quota (a container's `cpus` limit) grants less, at least 1 and at
    most MAX_WORKERS. A quota of 2.5 CPUs gives 2: a third worker would be throttled for half of
    each period, and a gateway process throttled mid-request holds every request on its loop."""
    cores = len(os.sched_getaffinity(0))
    quota = cpu_quota(CGROUP if cgroup is None else cgroup)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, min(cores, MAX_WORKERS))


def cpu_quota(cgroup: Path) -> float | None:
    """The CPUs a cgroup quota grants this process (2.5 for `cpu.max` = `250000 100000`), or
    None when there is none (`max`, -1, or no cgroup file to read)."""
    try:
        text = (cgroup / "cpu.max").read_text().split()
    except OSError:
        text = None
    if text is not None and len(text) == 2 and text[0] != "max":
        try:
            quota, period = int(text[0]), int(text[1])
        except ValueError:
            return None
        return quota / period if quota > 0 and period > 0 else None
    if text is not None:
        return None  # cgroup v2 without a quota (`max`)
    try:
        quota_us = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


# `workers`: a whole number, or `auto` for one per usable core.
Workers = Annotated[int, BeforeValidator(parse_workers), Field(ge=1, le=MAX_WORKERS)]

# Ten years: longer than any key should live, and far inside PostgreSQL's interval range.
MAX_DURATION = 3650 * 86400.0
Duration = Annotated[
    float, BeforeValidator(parse_duration), Field(gt=0, le=MAX_DURATION, allow_inf_nan=False)
]
Size = Annotated[int, BeforeValidator(parse_size), Field(gt=0)]
# A wait may be none at all (`0s`).
Wait = Annotated[
    float, BeforeValidator(parse_duration), Field(ge=0, le=MAX_DURATION, allow_inf_nan=False)
]
