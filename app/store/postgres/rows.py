"""Running one named query (queries.sql), and turning the key table's rows into the store's
records and a stored answer into the table's columns."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from ... import sealing
from ...sealing import SealedAnswer
from .. import Headers, Record
from ..queries import QUERIES
from .pool import Pool


async def fetchrow(pool: Pool | asyncpg.Pool, operation: str, **parameters: object) -> Any:
    """One autocommitted statement, its first row (or None)."""
    query = QUERIES[operation]
    return await pool.fetchrow(query.sql, *query.arguments(parameters))


def headers_of(document: str | None) -> Headers | None:
    return [(name, value) for name, value in json.loads(document)] if document else None


def record_of(row: asyncpg.Record, key: str) -> Record:
    """The row that holds `key` (the statements that find it by its key do not return it)."""
    return Record(
        id=row["id"],
        token=row["fencing_token"],
        key=key,
        fingerprint=row["fingerprint"],
        state=row["state"],
        status=row["response_status"],
        headers=headers_of(row["response_headers"]),
        body=row["response_body"],
        stored=row["response_stored"],
        sealed_with=row["sealed_with"],
        sealed_headers=row["sealed_headers"],
    )


def answer_columns(answer: SealedAnswer | None) -> dict[str, object]:
    """The columns of a stored answer: sealed ones in `sealed_headers` and `response_body`,
    plaintext headers as JSON in `response_headers`."""
    if answer is None:
        return {"headers": None, "body": None, "sealed_with": None, "sealed_headers": None}
    if answer.key_name is None:
        return {"headers": answer.headers.decode(), "body": answer.body, "sealed_with": None,
                "sealed_headers": None}  # fmt: skip
    return {"headers": None, "body": answer.body, "sealed_with": answer.key_name,
            "sealed_headers": answer.headers}  # fmt: skip


def stored_answer_of(row: asyncpg.Record) -> SealedAnswer:
    if row["sealed_with"] is not None:
        return SealedAnswer(row["sealed_with"], row["sealed_headers"], row["response_body"])
    return sealing.plaintext(headers_of(row["response_headers"]) or [], row["response_body"])
