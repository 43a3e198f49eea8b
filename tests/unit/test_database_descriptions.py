"""What the logs say about a database: where it is, never its password."""

from __future__ import annotations

import pytest

from oncegate import cli
from oncegate.store import postgres


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://ana:s3cret@db:5432/oncegate", "postgresql://ana@db:5432/oncegate"),
        ("postgresql://ana@db/oncegate", "postgresql://ana@db/oncegate"),
        ("postgresql://db/oncegate?password=s3cret&sslmode=require",
         "postgresql://db/oncegate?sslmode=require"),
        ("postgres://ana:p%40ss@[::1]:5433/x", "postgres://ana@[::1]:5433/x"),
    ],
)  # fmt: skip
def test_a_url_in_the_log_has_no_password(url: str, shown: str) -> None:
    assert cli.without_password(url) == shown


def test_the_store_names_where_postgres_is_without_credentials() -> None:
    assert postgres.describe("postgresql://ana:s3cret@db:6432/oncegate") == (
        "db:6432, database oncegate"
    )
    assert postgres.describe("postgresql://postgres:@/postgres?host=/srv/pg") == (
        "the Unix socket in /srv/pg, database postgres"
    )
