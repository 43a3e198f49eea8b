"""Named queries: `-- name: NAME` starts a query, which runs to the next one.

Parameters are named (`:fingerprint`), not numbered: a call passes each by name and the loader
turns them into asyncpg's `$1, $2, ...` in the order they first appear, so swapping two values
of the same type (a lease and a TTL) cannot pass unnoticed. A call that misses a parameter or
passes one the query does not have fails at once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# `:name`, but not the second colon of a `::type` cast.
_PARAMETER = re.compile(r"(?<![:\w]):([a-z_]+)\b")
_COMMENT = re.compile(r"--[^\n]*")


@dataclass(frozen=True, slots=True)
class Query:
    name: str
    sql: str  # with asyncpg's numbered parameters
    parameters: tuple[str, ...]

    def arguments(self, values: Mapping[str, object]) -> tuple[object, ...]:
        """`values` in the query's parameter order."""
        if len(values) != len(self.parameters) or not all(
            name in values for name in self.parameters
        ):
            raise TypeError(
                f"query {self.name} takes {sorted(self.parameters)}, was given {sorted(values)}"
            )
        return tuple(values[name] for name in self.parameters)


def load(text: str) -> dict[str, Query]:
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {
        name: _numbered(name, body.strip())
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def _numbered(name: str, sql: str) -> Query:
    sql = _COMMENT.sub("", sql).strip()
    parameters: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in parameters:
            parameters.append(match.group(1))
        return f"${parameters.index(match.group(1)) + 1}"

    return Query(name, _PARAMETER.sub(number, sql), tuple(parameters))


QUERIES = load((Path(__file__).parent / "queries.sql").read_text())
