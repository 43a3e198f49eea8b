"""Running one named query (queries.sql), and the one mapping between the key table's columns
and the store's values: a row to a `Record`, a stored answer to its columns and back.

A stored answer (`model.answers.StoredAnswer`) lives in six columns: `response_status`;
`response_stored` (false when it was too large to store whole: its body is NULL); its headers as
JSON, in `response_headers` (jsonb) when plaintext or sealed in `sealed_headers`; its body,
sealed or not, in `response_body`; and the name and binding of the key that sealed it in
`sealed_with`. A row with neither kind of headers and `response_stored` false is an answer too
large to store completed by an earlier release, which kept its status alone. Nothing else reads
or writes those columns one by one.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from ...model.answers import SealedAnswer, SealedRequest, StoredAnswer
from ...model.records import KeyRecord, Record
from ..queries import Statements
from .pool import Pool


def claims_and_completes(
    claims: dict[str, object], completes: dict[str, object]
) -> dict[str, object]:
    """The parameters of a statement of claims and completes (a Citus worker's
    `claim_complete`): the claims' arrays as they are, the completes' named `answer_...`."""
    return {**claims, **{f"answer_{name}": value for name, value in completes.items()}}


def claimed_and_completed(
    rows: list[asyncpg.Record],
) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
    """Such a statement's rows: the claims' (`n`, the claim's position, set), the completes'."""
    return [row for row in rows if row["n"] is not None], [row for row in rows if row["n"] is None]


async def fetchrow(
    pool: Pool | asyncpg.Pool, statements: Statements, name: str, **parameters: object
) -> Any:
    """One autocommitted statement, its first row (or None)."""
    query = statements[name]
    return await pool.fetchrow(query.sql, *query.arguments(parameters))


def record_of(row: asyncpg.Record, key: str) -> Record:
    """The row that holds `key` (the statements that find it by its key do not return it)."""
    return Record(
        id=row["id"],
        token=row["fencing_token"],
        key=key,
        fingerprint=row["fingerprint"],
        state=row["state"],
        answer=answer_of(row),
    )


def answer_of(row: asyncpg.Record) -> StoredAnswer | None:
    """The stored answer of a row; None before it has one."""
    status = row["response_status"]
    if status is None:
        return None
    has_headers = row["sealed_with"] is not None or row["response_headers"] is not None
    return StoredAnswer(status, content_of(row) if has_headers else None)


def content_of(row: asyncpg.Record) -> SealedAnswer:
    """The headers and body of a row's stored answer, sealed or in plaintext."""
    sealed_with = row["sealed_with"]
    if sealed_with is not None:
        return SealedAnswer(sealed_with, row["sealed_headers"], row["response_body"])
    # jsonb comes as the text PostgreSQL printed: the bytes `sealing.header_pairs` parses.
    return SealedAnswer(None, row["response_headers"].encode(), row["response_body"])


def key_record_of(row: asyncpg.Record) -> KeyRecord:
    """A row as the operator sees it (admin_find, admin_by_id)."""
    request = row["request"]
    return KeyRecord(
        id=row["id"],
        route=row["route"],
        scope=bytes(row["scope"]),
        key=row["key"],
        state=row["state"],
        answer=answer_of(row),
        created_at=row["created_at"],
        completed_at=row["completed_at"],
        expires_at=row["expires_at"],
        token=row["fencing_token"],
        request=None if request is None else SealedRequest(row["request_sealed_with"], request),
        claimed_by=row["claimed_by"],
        failure=row["failure"],
        fingerprint=bytes(row["fingerprint"]),
    )


def answer_columns(answer: StoredAnswer) -> dict[str, object]:
    """The columns of a stored answer, as the statements that write one name them."""
    content, stored = answer.content, answer.stored
    if content is None:
        return {"status": answer.status, "stored": False, "headers": None, "body": None,
                "sealed_with": None, "sealed_headers": None}  # fmt: skip
    if content.key_name is None:
        return {"status": answer.status, "stored": stored, "headers": content.headers.decode(),
                "body": content.body, "sealed_with": None, "sealed_headers": None}  # fmt: skip
    return {"status": answer.status, "stored": stored, "headers": None, "body": content.body,
            "sealed_with": content.key_name, "sealed_headers": content.headers}  # fmt: skip


def touched(status: str) -> int:
    """The rows a command's status says it touched ("DELETE 3", "UPDATE 1")."""
    return int(status.rsplit(" ", 1)[1])
