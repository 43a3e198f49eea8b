"""Durations and sizes as settings spell them (`90s`, `15m`, `512KiB`), and the types that
parse and bound them."""

from __future__ import annotations

import re
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
