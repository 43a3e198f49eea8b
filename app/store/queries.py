"""Load `queries.sql` once: `-- name: NAME` starts a query, which runs to the next one."""

from __future__ import annotations

import re
from pathlib import Path

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def load(text: str) -> dict[str, str]:
    parts = _NAME.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {name: body.strip() for name, body in zip(parts[1::2], parts[2::2], strict=True)}


QUERIES = load((Path(__file__).parent / "queries.sql").read_text())
